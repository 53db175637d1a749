"""Every public name has an entry in the API reference (``docs/api/``).

Each public module (the modules of ``tests/public_api.json``) has a page
``docs/api/<module>.md`` in the reference's table of contents, with a summary
table of its ``__all__`` at the top (``.. pztrain-summary:: <module>``: each name a
link to its entry, docs/_ext/pztrain_api.py). Each public object is rendered once,
by an autodoc directive under its home name (``.. autoclass::
pztrain.step.TrainStep``: signature, docstring, example) on the page of its home
module, the public module that defines it; its other public names
(``pztrain.TrainStep``) are links to that entry. The site's build
(``tests/test_docs_build.py``) then fails on any reference that does not resolve,
and on any public name without an entry (``docs/conf.py``).

Every public function and class has an example in its docstring: a ``>>>`` line,
run as a doctest (``pytest --doctest-modules pztrain``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
MODULES = list(json.loads((ROOT / "tests" / "public_api.json").read_text()))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
from pztrain_api import home_name  # noqa: E402

DIRECTIVE = re.compile(r"^\.\. auto(?:class|exception|function|data)::\s+(\S+)", re.M)
SUMMARY = re.compile(r"^\.\. pztrain-summary::\s+(\S+)", re.M)


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
    """The names of ``module.__all__`` without their entry: the module's page
    and its summary table, a submodule's page, an object's directive under its
    home name on its home module's page."""
    page = api / f"{module}.md"
    if not page.exists():
        return [f"the page docs/api/{module}.md"]
    if module not in SUMMARY.findall(page.read_text()):
        return [f"the summary table of docs/api/{module}.md"]
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if inspect.ismodule(obj):
            ok = (api / f"{obj.__name__}.md").exists()
        else:
            home = home_name(obj)
            home_page = api / f"{home.rpartition('.')[0]}.md"
            ok = home_page.exists() and home in DIRECTIVE.findall(home_page.read_text())
        if not ok:
            missing.append(f"{module}.{name}")
    return missing


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_an_entry(module):
    missing = missing_entries(module)
    fixes = []
    for name in missing:
        if name.startswith("the "):  # a page or its table
            fixes.append(f"add {name} ('.. pztrain-summary:: {module}')")
        else:
            home = home_name(_object(name))
            fixes.append(
                f"add '.. autoclass:: {home}' (or autofunction / autoexception / "
                f"autodata) to the eval-rst block of docs/api/"
                f"{home.rpartition('.')[0]}.md"
            )
    assert not missing, f"no entry for {', '.join(missing)}: " + "; ".join(fixes)


def test_each_object_is_rendered_once_under_its_home_name():
    """No duplicate entries; none under a re-export's name (the source pages'
    "[docs]" links go to the home name's anchor)."""
    rendered: dict[int, list[str]] = {}
    for page in sorted(API.glob("*.md")):
        for full in DIRECTIVE.findall(page.read_text()):
            rendered.setdefault(id(_object(full)), []).append(f"{page.name}: {full}")
            home = home_name(_object(full))
            assert full == home, f"{page.name}: '{full}' is rendered under '{home}'"
    twice = [names for names in rendered.values() if len(names) > 1]
    assert not twice, f"rendered more than once: {twice}"


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
    state = tmp_path / "api" / "pztrain.state.md"  # rendered under a re-export
    state.write_text(state.read_text().replace(".. autoclass:: pztrain.state.", ".. x"))
    top = tmp_path / "api" / "pztrain.md"
    top.write_text(top.read_text() + "\n.. autoclass:: pztrain.TrainState\n")
    assert missing_entries("pztrain", tmp_path / "api") == ["pztrain.TrainState"]
    assert missing_entries("pztrain.state", tmp_path / "api") == [
        "pztrain.state.TrainState"
    ]
    ema = tmp_path / "api" / "pztrain.ema.md"  # no summary table
    ema.write_text(ema.read_text().replace(".. pztrain-summary:: pztrain.ema", ""))
    assert missing_entries("pztrain.ema", tmp_path / "api") == [
        "the summary table of docs/api/pztrain.ema.md"
    ]


# Public names whose docstring has no example yet, and why. Each must still lack
# one: once it has, the test below says to take it off this list.
NO_EXAMPLE_YET = {
    "pztrain.loop.fit": (
        "at house.py's 60-line limit for a function (signature and Args): its "
        "example is under its entry in docs/api/pztrain.loop.md (run below)"
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


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    from pztrain_links import broken_links

    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "b.html").write_text('<dt id="pztrain.x">x</dt>')
    (tmp_path / "a.html").write_text(
        '<a href="api/b.html#pztrain.x">ok</a> <a href="#top" id="top">ok</a> '
        '<a href="api/b.html#pztrain.Policy">no anchor</a> '
        '<a href="missing.html">no page</a> <a href="https://jax.dev/#x">other site</a>'
    )
    assert broken_links(tmp_path) == [
        "a.html: api/b.html#pztrain.Policy (no such anchor)",
        "a.html: missing.html (no such file)",
    ]


def test_a_guide_literal_naming_a_public_object_becomes_a_link_to_its_entry():
    from pztrain_autolink import link_target

    assert link_target("pztrain.fit") == "pztrain.loop.fit"
    assert link_target("fit()") == "pztrain.loop.fit"
    assert link_target("pztrain.data.GrainLoader") == "pztrain.data.GrainLoader"
    assert link_target("TrainState.apply_gradients") == (
        "pztrain.state.TrainState.apply_gradients"
    )
    assert link_target("pztrain.data") == "pztrain.data"  # a module's page
    for literal in ["state", "data", "loss_fn(x)", "fit(state, step)", "jax.jit"]:
        assert link_target(literal) is None, literal
    assert link_target("pztrain.data._device.DeviceCopy") is None  # private
    assert link_target("Summary") is None  # two modules' names: which one?
    # an annotation's name of a public object, by the module that defines it
    assert link_target("pztrain.state._state.TrainState") == "pztrain.state.TrainState"
