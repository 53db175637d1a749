"""Every public name has an entry in the API reference (``docs/api/``).

Each public module (the modules of ``tests/public_api.json``) has a page
``docs/api/<module>.md`` in the reference's table of contents. Every name in the
module's ``__all__`` is there: rendered by an autodoc directive
(``.. autoclass:: pztrain.step.TrainStep``: signature, docstring, example), or,
for an object already rendered under another public name, listed under "Also
here" with a reference to that entry; a submodule links to its page. The site's
build (``tests/test_docs_build.py``) then fails on any reference that does not
resolve.
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
