"""Every ```python block of README.md and of the guides runs, as a reader would.

A page's blocks run in order, in one namespace, in a fresh temporary working
directory (files a page writes land there). Blocks fenced as ``text``,
``console`` or ``bash`` are shown, not run. A guide states a figure only where
one of its blocks asserts it, so a claim that becomes false fails here.

README's page is in the fast subset; the guides, which train small models, are
marked slow.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted(
    p
    for p in (ROOT / "docs").rglob("*.md")
    if not {"_build", "notebooks", "jupyter_execute"} & set(p.relative_to(ROOT).parts)
)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """The ```python fences of a page: (first line of the code, 1-based; code)."""
    tokens = MarkdownIt("commonmark").parse(path.read_text())
    return [
        (tok.map[0] + 2, tok.content)
        for tok in tokens
        if tok.type == "fence" and tok.info.strip().split(" ")[0] == "python"
    ]


def run_page(path: Path, workdir: Path, monkeypatch) -> None:
    monkeypatch.chdir(workdir)
    page = types.ModuleType(f"docs_page_{path.stem}")  # dataclasses look it up
    monkeypatch.setitem(sys.modules, page.__name__, page)
    namespace = page.__dict__
    for line, code in python_blocks(path):
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        where = f"{shown}:{line}"
        try:
            exec(compile(code, where, "exec"), namespace)  # noqa: S102
        except BaseException as err:
            err.add_note(f"in the python block of {where}")
            raise


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


def test_readme_blocks_run(tmp_path, monkeypatch):
    assert python_blocks(ROOT / "README.md"), "README.md has no python block"
    run_page(ROOT / "README.md", tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", GUIDES, ids=[str(p.relative_to(ROOT / "docs")) for p in GUIDES]
)
def test_guide_blocks_run(page, tmp_path, monkeypatch):
    run_page(page, tmp_path, monkeypatch)


def test_every_guide_has_a_title():
    for page in GUIDES:
        first = page.read_text().lstrip().splitlines()[0]
        assert re.match(r"# \S", first), f"{page}: the first line is not a # title"
