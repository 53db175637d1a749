"""Each docstring example of the public API runs pasted alone into a fresh Python.

The reference shows every public module's and object's example (``docs/api/``); a
reader copies one into a new interpreter. So each example imports what it uses
(``import jax, jax.numpy as jnp, optax``, ``from pztrain import TrainState``) and
runs in an empty namespace: not the namespace of the module that defines it, where
pytest's ``--doctest-modules`` runs it. The imports it needs come with ``pip
install ".[docs]"``. (That each block of an example also pastes alone into the
REPL, which reads it line by line: ``tests/test_repl_paste.py``.)

A fast check reads each example: every name it uses is imported, assigned or a
builtin, and every library it imports is in the ``docs`` extra. The slow one runs
them all, each with ``globs={}``, in one fresh interpreter.
"""

from __future__ import annotations

import ast
import builtins
import doctest
import importlib
import importlib.metadata
import inspect
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = list(json.loads((ROOT / "tests" / "public_api.json").read_text()))


def public_objects() -> dict[str, object]:
    """Each public function and class once, by its first public name."""
    seen, found = set(), {}
    for module in MODULES:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and id(
                obj
            ) not in seen:
                seen.add(id(obj))
                found[f"{module}.{name}"] = obj
    return found


def examples() -> list[doctest.DocTest]:
    """The doctests of the public modules' own docstrings (each module's page
    shows its docstring), of the public objects and of their own methods."""
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests = []
    for module in MODULES:
        mod = importlib.import_module(module)
        only_its_own = doctest.DocTestFinder(recurse=False, exclude_empty=True)
        found = only_its_own.find(mod, module, globs={}, module=False)
        tests += [test for test in found if test.examples]
    for full, obj in public_objects().items():
        for test in finder.find(obj, full, globs={}, module=False):
            if test.examples and test.name.startswith(full):
                tests.append(test)
    return tests


def unbound_names(source: str) -> list[str]:
    """The names an example reads that nothing in it binds (nor builtins)."""
    tree = ast.parse(source)
    bound, read = set(dir(builtins)), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                read.append(node.id)
            else:
                bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted({name for name in read if name not in bound})


def imported_modules(source: str) -> set[str]:
    """The top-level packages an example imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def docs_extra() -> set[str]:
    """The distributions ``pip install ".[docs]"`` brings, normalised names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["docs"]
    return {_normal(re.match(r"[\w.-]+", spec).group()) for spec in specs}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def source_of(test: doctest.DocTest) -> str:
    return "\n".join(example.source for example in test.examples)


def test_every_example_imports_what_it_uses():
    missing = {}
    for test in examples():
        names = unbound_names(source_of(test))
        if names:
            missing[test.name] = names
    assert not missing, (
        "these docstring examples use names they do not import, so they fail when "
        "pasted into a fresh Python (NameError); add the imports as the example's "
        "first '>>>' line(s), e.g. '>>> import jax, jax.numpy as jnp, optax' and "
        "'>>> from pztrain import TrainState':\n"
        + "\n".join(f"  {name}: {', '.join(names)}" for name, names in missing.items())
    )


def test_every_library_an_example_imports_comes_with_the_docs_extra():
    extra = docs_extra()
    distributions = importlib.metadata.packages_distributions()
    stdlib = sys.stdlib_module_names
    missing = {}
    for test in examples():
        for module in imported_modules(source_of(test)) - {"pztrain"} - stdlib:
            dists = {_normal(d) for d in distributions.get(module, [module])}
            if not dists & extra:
                missing.setdefault(", ".join(sorted(dists)), []).append(test.name)
    assert not missing, (
        "docstring examples import libraries that pip install '.[docs]' does not "
        "bring: add them to the docs extra of pyproject.toml: "
        + "; ".join(
            f"{dist} (for {', '.join(names)})" for dist, names in missing.items()
        )
    )


def test_the_static_checks_catch_a_bare_name_and_a_missing_library():
    source = "import scipy\nx = TrainState.initial_state(jnp.ones(2))\n"
    assert unbound_names(source) == ["TrainState", "jnp"]
    assert imported_modules(source) == {"scipy"}
    assert "scipy" not in docs_extra()


# The slow check: every example run with ``globs={}`` in one fresh interpreter,
# each reporting what doctest printed for a failure.
RUN_ALL = """
import contextlib, doctest, io, json, sys
sys.path.insert(0, sys.argv[1])
import matplotlib
matplotlib.use("Agg")
sys.path.insert(0, sys.argv[1] + "/tests")
from test_docstring_examples_paste import examples
failed = {}
for test in examples():
    test.globs = {}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        runner.run(test, out=report.write)
    if runner.failures:
        failed[test.name] = report.getvalue()[-3000:]
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_example_runs_pasted_alone_into_a_fresh_python(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", RUN_ALL, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failed, f"{len(failed)} examples fail pasted alone:\n" + "\n".join(
        f"--- {name}\n{report}" for name, report in failed.items()
    )
