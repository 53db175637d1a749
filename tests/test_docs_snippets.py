"""Every code block of README.md and of the guides runs, as a reader would.

A page's code runs in order, in one namespace, in a fresh temporary working
directory (files a page writes land there): README's ```python blocks, and a
guide's ```{code-cell} cells (MyST-NB text notebooks, which the docs build
executes to show their outputs) or ```python blocks. Blocks fenced as ``text``,
``console`` or ``bash`` are shown, not run.

The checks are not on the pages: a guide shows its code and outputs, and a
figure it states is checked by an entry of ``CHECKS`` in ``tests/docs_checks.py``
(code run right after the cell that holds the entry's anchor, in the page's
namespace), so a claim that becomes false fails here. A cell tagged
``raises-exception`` must raise (the page shows the error); its checks read it as
``sys.last_value``. ``docs/_tools/to_mystnb.py`` moves a page's asserts into
entries of this form.

README's page is in the fast subset; the guides, which train small models, are
marked slow.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import docs_checks
import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted(
    p
    for p in (ROOT / "docs").rglob("*.md")
    if not {"_build", "notebooks", "jupyter_execute"} & set(p.relative_to(ROOT).parts)
)
RUN = {"python", "{code-cell}"}

# page name -> (anchor, check): tests/docs_checks.py
CHECKS = docs_checks.CHECKS


def _cell_code(content: str) -> tuple[int, str]:
    """A code cell's code without its options (``:tags: [...]`` lines or a
    ``---`` YAML block at its top), and the number of option lines."""
    lines = content.splitlines(keepends=True)
    if lines and lines[0].strip() == "---":
        end = next(i for i, line in enumerate(lines[1:], 1) if line.strip() == "---")
        return end + 1, "".join(lines[end + 1 :])
    n = 0
    while n < len(lines) and re.match(r":\w[\w-]*:", lines[n]):
        n += 1
    return n, "".join(lines[n:])


def _cells(path: Path) -> list[tuple[int, str, bool]]:
    """(first line of the code, 1-based; code; tagged ``raises-exception``)."""
    tokens = MarkdownIt("commonmark").parse(path.read_text())
    cells = []
    for tok in tokens:
        if tok.type == "fence" and tok.info.strip().split(" ")[0] in RUN:
            skipped, code = _cell_code(tok.content)
            options = "".join(tok.content.splitlines(keepends=True)[:skipped])
            raises = "raises-exception" in options
            cells.append((tok.map[0] + 2 + skipped, code, raises))
    return cells


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """The code a page runs: (first line of the code, 1-based; code)."""
    return [(line, code) for line, code, _ in _cells(path)]


def _checks_after(path: Path, blocks: list[tuple[int, str]], checks) -> dict:
    """Each block's index -> the checks that follow it; an anchor must be in
    exactly one block."""
    after: dict[int, list[str]] = {}
    for anchor, check in checks:
        found = [i for i, (_, code) in enumerate(blocks) if anchor in code]
        assert len(found) == 1, (
            f"CHECKS[{path.name!r}]: the anchor {anchor!r} is in {len(found)} code "
            "cells of the page, not 1: update the anchor"
        )
        after.setdefault(found[0], []).append(check)
    return after


def run_page(path: Path, workdir: Path, monkeypatch, checks=()) -> None:
    monkeypatch.chdir(workdir)
    page = types.ModuleType(f"docs_page_{path.stem}")  # dataclasses look it up
    monkeypatch.setitem(sys.modules, page.__name__, page)
    namespace = page.__dict__
    cells = _cells(path)
    after = _checks_after(path, [(line, code) for line, code, _ in cells], checks)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for i, (line, code, raises) in enumerate(cells):
        if raises:  # the page shows the error; the checks read sys.last_value
            _run_raising(code, f"{shown}:{line}", namespace, monkeypatch)
            code = "pass"
        runs = [(f"{shown}:{line}", code, "block")]
        runs += [(f"CHECKS[{path.name!r}]", c, "check") for c in after.get(i, [])]
        for where, source, kind in runs:
            try:
                exec(compile(source, where, "exec"), namespace)  # noqa: S102
            except BaseException as err:
                note = f"in the python {kind} of {where}"
                if kind == "check":
                    note += f", after the cell at {shown}:{line}"
                err.add_note(note)
                raise


def _run_raising(code: str, where: str, namespace: dict, monkeypatch) -> None:
    """A cell tagged ``raises-exception`` (myst-nb shows its error and goes on)
    must raise an Exception; as in IPython, ``sys.last_value`` is the error."""
    try:
        exec(compile(code, where, "exec"), namespace)  # noqa: S102
    except Exception as err:  # noqa: BLE001
        monkeypatch.setattr(sys, "last_value", err, raising=False)
        return
    raise AssertionError(f"{where}: tagged raises-exception, but raised nothing")


def test_blocks_are_found_in_nested_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# T\n\n```python\nx = 1\n```\n\n````markdown\n```python\nnot run\n```\n````\n"
        "\n```text\nnot run\n```\n\n```python\ny = x + 1\n```\n"
    )
    assert python_blocks(page) == [(4, "x = 1\n"), (18, "y = x + 1\n")]


def test_a_failing_block_is_named(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```python\nx = 1\n```\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(AssertionError) as info:
        run_page(page, tmp_path, monkeypatch)
    assert f"in the python block of {page}:8" in info.value.__notes__


def test_code_cells_run_without_their_options(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "---\nfile_format: mystnb\n---\n# T\n\n```{code-cell} ipython3\n"
        ":tags: [hide-output]\nx = 1\n```\n\n```{code-cell} ipython3\n---\n"
        "tags: [remove-input]\n---\ny = 2\n```\n"
    )
    assert python_blocks(page) == [(8, "x = 1\n"), (15, "y = 2\n")]


def test_a_failing_check_is_named_with_its_cell(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```{code-cell}\nx = 1\n```\n\n```python\nx = 2\n```\n")
    run_page(page, tmp_path, monkeypatch, [("x = 2", "assert x == 2")])
    with pytest.raises(AssertionError) as info:
        run_page(page, tmp_path, monkeypatch, [("x = 1", "assert x == 2")])
    assert info.value.__notes__ == [
        f"in the python check of CHECKS['page.md'], after the cell at {page}:4"
    ]
    with pytest.raises(AssertionError, match="the anchor 'x = 3' is in 0 code cells"):
        run_page(page, tmp_path, monkeypatch, [("x = 3", "pass")])


def _converter():
    path = ROOT / "docs" / "_tools" / "to_mystnb.py"
    spec = importlib.util.spec_from_file_location("to_mystnb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_converter_moves_asserts_into_checks(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "# T\n\n```python\nx = 1\nassert x == 1\nys = [x, x]\n"
        "for y in ys:\n    assert y == 1\n```\n\n"
        "````markdown\n```python\nnot run\n```\n````\n\n"
        "```text\nshown\n```\n\n```python\nassert x + 1 == 2\n```\n"
    )
    text, checks = _converter().convert(page.read_text())
    assert text.startswith("---\nfile_format: mystnb\nkernelspec:\n")
    assert "```{code-cell} ipython3\nx = 1\nys = [x, x]\n```" in text
    assert "```python\nnot run\n```" in text and "```text\nshown" in text
    assert "assert" not in text  # the last cell held only an assert: gone
    assert checks == [
        ("ys = [x, x]", "assert x == 1"),
        ("ys = [x, x]", "for y in ys:\n    assert y == 1"),
        ("ys = [x, x]", "assert x + 1 == 2"),  # after the cell before it
    ]
    page.write_text(text)
    run_page(page, tmp_path, monkeypatch, checks)
    assert python_blocks(page) == [(11, "x = 1\nys = [x, x]\n")]


def test_a_cell_that_shows_an_error(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    cell = "```{code-cell} ipython3\n:tags: [raises-exception]\n"
    page.write_text(f"# T\n\n{cell}int('x')\n```\n")
    run_page(
        page,
        tmp_path,
        monkeypatch,
        [("int('x')", "import sys\nassert 'x' in str(sys.last_value)")],
    )
    page.write_text(f"# T\n\n{cell}int('1')\n```\n")
    with pytest.raises(AssertionError, match="tagged raises-exception, but raised"):
        run_page(page, tmp_path, monkeypatch)


def test_readme_blocks_run(tmp_path, monkeypatch):
    assert python_blocks(ROOT / "README.md"), "README.md has no python block"
    run_page(ROOT / "README.md", tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", GUIDES, ids=[str(p.relative_to(ROOT / "docs")) for p in GUIDES]
)
def test_guide_blocks_run(page, tmp_path, monkeypatch):
    run_page(page, tmp_path, monkeypatch, CHECKS.get(page.name, ()))


def test_every_guide_has_a_title():
    for page in GUIDES:
        text = page.read_text().lstrip()
        if text.startswith("---\n"):  # a MyST-NB page's front matter
            text = text.split("\n---\n", 1)[1].lstrip()
        first = text.splitlines()[0]
        assert re.match(r"# \S", first), f"{page}: the first line is not a # title"


def test_every_check_names_a_page():
    names = {page.name for page in GUIDES}
    assert not set(CHECKS) - names, set(CHECKS) - names


# Guides other authors are editing; docs/_tools/to_mystnb.py converts each, and its
# name then leaves this set.
NOT_YET_CELLS: set[str] = set()


@pytest.mark.parametrize(
    "page", GUIDES, ids=[str(p.relative_to(ROOT / "docs")) for p in GUIDES]
)
def test_guides_are_executed_notebooks_without_asserts(page):
    """A guide's code runs at build time (its outputs shown), and holds no
    test scaffolding: its checks live in ``tests/docs_checks.py``."""
    if page.parent.name != "guides" or page.name in NOT_YET_CELLS:
        return
    text = page.read_text()
    if not python_blocks(page):  # prose only
        return
    assert text.startswith("---\nfile_format: mystnb\n"), (
        f"{page.name} is not executed at build time: run docs/_tools/to_mystnb.py"
    )
    tokens = MarkdownIt("commonmark").parse(text)
    assert not [t for t in tokens if t.type == "fence" and t.info == "python"], (
        f"{page.name}: a ```python block runs in this test but not in the build: "
        "make it a ```{code-cell} ipython3, or ```{code-block} python to show code "
        "that runs nowhere"
    )
    for line, code in python_blocks(page):
        scaffolding = re.search(
            r"^\s*assert\b|np\.testing\.|AssertionError", code, re.M
        )
        assert not scaffolding, (
            f"{page.name}:{line}: a check; move it to tests/docs_checks.py"
        )


@pytest.mark.parametrize(
    "page", GUIDES, ids=[str(p.relative_to(ROOT / "docs")) for p in GUIDES]
)
def test_guides_end_with_where_next(page):
    """A guide's last paragraph says where to read next, with a link."""
    if page.parent.name != "guides" or page.name in NOT_YET_CELLS:
        return
    last = page.read_text().rstrip().split("\n\n")[-1]
    assert last.startswith("Next:") and "](" in last, (
        f"{page.name} does not end with a 'Next: [...](...)' paragraph: {last[:80]!r}"
    )
