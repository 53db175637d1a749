"""Every public name has an entry in the API reference (``docs/api/``).

Each public module (the modules of ``tests/public_api.json``) has a page
``docs/api/<module>.md`` in the reference's table of contents. Every name in the
module's ``__all__`` is there: rendered by an autodoc directive
(``.. autoclass:: pztrain.step.TrainStep``: signature, docstring, example), or,
for an object already rendered under another public name, listed under "Also
here" with a reference to that entry; a submodule links to its page. The site's
build (``tests/test_docs_build.py``) then fails on any reference that does not
resolve, and on any public name without an entry (``docs/conf.py``).

Every public function and class has an example in its docstring: a ``>>>`` line,
run as a doctest (``pytest --doctest-modules pztrain``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
MODULES = list(json.loads((ROOT / "tests" / "public_api.json").read_text()))

DIRECTIVE = re.compile(r"^\.\. auto(?:class|exception|function|data)::\s+(\S+)", re.M)
ALSO = re.compile(r"^- `(\w+)`: \{py:obj\}`([\w.]+)`", re.M)
LINK = re.compile(r"^- `(\w+)`: the module \[`([\w.]+)`\]\(([\w.]+)\.md\)", re.M)


def _object(full: str):
    module, _, name = full.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _rendered(api: Path) -> dict[str, object]:
    """Every name rendered by an autodoc directive, over all pages."""
    names = {}
    for page in api.glob("*.md"):
        for full in DIRECTIVE.findall(page.read_text()):
            names[full] = _object(full)
    return names


def missing_entries(module: str, api: Path = API) -> list[str]:
    """The names of ``module.__all__`` without an entry on its page."""
    page = api / f"{module}.md"
    if not page.exists():
        return [f"the page docs/api/{module}.md"]
    text = page.read_text()
    rendered = _rendered(api)
    direct = set(DIRECTIVE.findall(text))
    also = dict(ALSO.findall(text))
    links = {name: target for name, target, _ in LINK.findall(text)}
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        full = f"{module}.{name}"
        if inspect.ismodule(obj):
            ok = (
                links.get(name) == obj.__name__
                and (api / f"{obj.__name__}.md").exists()
            )
        elif full in direct:
            ok = True
        else:
            target = also.get(name)
            ok = target in rendered and rendered[target] is obj
        if not ok:
            missing.append(full)
    return missing


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_an_entry(module):
    missing = missing_entries(module)
    assert not missing, (
        f"no entry in docs/api/{module}.md for {', '.join(missing)}: add "
        f"'.. autoclass:: NAME' (or autofunction / autoexception / autodata) inside "
        f"its eval-rst block, or, for an object rendered under another public name, "
        f"a line '- `name`: {{py:obj}}`that.name`' under 'Also here'"
    )


def test_every_module_page_is_in_the_table_of_contents():
    index = (API / "index.md").read_text()
    listed = set(re.findall(r"^(pztrain[\w.]*)$", index, re.M))
    assert listed == set(MODULES), set(MODULES) ^ listed


def test_a_name_without_an_entry_is_reported(tmp_path):
    shutil.copytree(API, tmp_path / "api")
    page = tmp_path / "api" / "pztrain.callbacks.md"
    text = page.read_text()
    page.write_text(text.replace(".. autofunction:: pztrain.callbacks.record_only", ""))
    assert missing_entries("pztrain.callbacks", tmp_path / "api") == [
        "pztrain.callbacks.record_only"
    ]
    also = tmp_path / "api" / "pztrain.state.md"  # an "Also here" line pointing wrong
    also.write_text(also.read_text().replace("`pztrain.TrainState`", "`pztrain.Stop`"))
    assert missing_entries("pztrain.state", tmp_path / "api") == [
        "pztrain.state.TrainState"
    ]


# Public names whose docstring has no example yet, and why. Each must still lack
# one: once it has, the test below says to take it off this list.
NO_EXAMPLE_YET = {
    "pztrain.fit": (
        "at house.py's 60-line limit for a function (signature and Args): its "
        "example is under its entry in docs/api/pztrain.md (run below)"
    ),
}


def _entry(full: str) -> str:
    """The text of ``full`` 's entry on its module's API page: from its
    directive to the next one."""
    text = (API / f"{full.rpartition('.')[0]}.md").read_text()
    starts = list(DIRECTIVE.finditer(text))
    (i,) = [i for i, m in enumerate(starts) if m.group(1) == full]
    end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
    return text[starts[i].start() : end]


def test_the_names_left_without_an_example_have_one_in_their_api_entry():
    missing = [name for name in NO_EXAMPLE_YET if ">>>" not in _entry(name)]
    assert not missing, f"{missing}: write their example under their API entry"


PAGES_WITH_EXAMPLES = sorted(p.name for p in API.glob("*.md") if ">>>" in p.read_text())


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES)
def test_the_examples_written_in_the_api_pages_run(page):
    import doctest

    text = (API / page).read_text()
    test = doctest.DocTestParser().get_doctest(text, {}, page, page, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test)
    assert result.attempted and not result.failed, f"{page}: {result}"


def _has_example(obj: object) -> bool:
    """Whether the object's own docstring has a doctest line (``>>>``)."""
    doc = obj.__doc__ or ""  # a class's own: not inherited, as inspect.getdoc's is
    return any(line.lstrip().startswith(">>>") for line in doc.splitlines())


def public_without_example() -> list[str]:
    """The public functions and classes (of every public module's ``__all__``)
    whose docstring has no example, each by its first public name."""
    seen, missing = set(), []
    for module in MODULES:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if not _has_example(obj):
                missing.append(f"{module}.{name}")
    return missing


def test_every_public_function_and_class_has_an_example():
    exempt = {id(_object(name)) for name in NO_EXAMPLE_YET}
    missing = [
        name for name in public_without_example() if id(_object(name)) not in exempt
    ]
    assert not missing, (
        f"{len(missing)} public functions and classes have no example in their "
        f"docstring: {', '.join(missing)}. Add an 'Example:' section whose '>>>' "
        "lines show the typical use and print something to check (it runs as a "
        "doctest: python -m pytest pztrain/)."
    )


def test_the_names_left_without_an_example_still_lack_one():
    done = [name for name in NO_EXAMPLE_YET if _has_example(_object(name))]
    assert not done, f"{done} now have an example: take them off NO_EXAMPLE_YET"


def test_a_docstring_without_an_example_is_reported(monkeypatch):
    from pztrain.callbacks import LearningRateMonitor

    monkeypatch.setattr(LearningRateMonitor, "__doc__", "Adds the learning rate.")
    assert "pztrain.LearningRateMonitor" in public_without_example()
