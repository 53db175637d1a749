"""The public API does not shrink: every name and parameter of the snapshot stays.

``tests/public_api.json`` lists the public modules (those README, the examples
and the notebooks import), every name in their ``__all__``, and the parameters
of every public function, class constructor and method. A name or a parameter
that disappears, or a module that no longer imports, fails here. New names are
welcome; refresh the snapshot with ``python tests/test_public_api.py --write``
after adding some (it keeps what the file lists and adds what is new).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).with_name("public_api.json")

MODULES = [
    "pztrain",
    "pztrain.callbacks",
    "pztrain.checkpoint",
    "pztrain.data",
    "pztrain.ema",
    "pztrain.finetune",
    "pztrain.groups",
    "pztrain.integrations",
    "pztrain.integrations.optuna",
    "pztrain.integrations.optuna_population",
    "pztrain.loggers",
    "pztrain.loop",
    "pztrain.metric_states",
    "pztrain.metrics",
    "pztrain.monitors",
    "pztrain.partition",
    "pztrain.population",
    "pztrain.precision",
    "pztrain.records",
    "pztrain.sharding",
    "pztrain.state",
    "pztrain.step",
    "pztrain.summary",
]


def _parameters(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def _describe(obj: Any) -> dict[str, Any]:
    """A public name: its kind, its parameters, and a class's public methods."""
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if inspect.isclass(obj):
        methods = {}
        for name, member in inspect.getmembers(obj):
            if name.startswith("_") or not callable(member):
                continue
            params = _parameters(member)
            if params is not None:
                methods[name] = params
        return {"kind": "class", "init": _parameters(obj), "methods": methods}
    if callable(obj):
        return {"kind": "function", "params": _parameters(obj)}
    return {"kind": "value"}


def current() -> dict[str, dict[str, Any]]:
    """Every public module's ``__all__`` names, described."""
    out = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", [])
        out[module_name] = {n: _describe(getattr(module, n)) for n in names}
    return out


def _missing(old: dict, new: dict, where: str) -> list[str]:
    """What ``old`` has and ``new`` lacks (names, parameters, methods)."""
    lost = []
    for name, desc in old.items():
        if name not in new:
            lost.append(f"{where}.{name} is gone")
            continue
        now = new[name]
        for key in ("init", "params"):
            before, after = desc.get(key), now.get(key)
            if before and after is not None:
                lost += [
                    f"{where}.{name}({p}=) is gone" for p in before if p not in after
                ]
        for method, params in desc.get("methods", {}).items():
            after = now.get("methods", {}).get(method)
            if after is None:
                lost.append(f"{where}.{name}.{method} is gone")
            else:
                lost += [
                    f"{where}.{name}.{method}({p}=) is gone"
                    for p in params
                    if p not in after
                ]
    return lost


def test_no_public_name_or_parameter_is_lost():
    snapshot = json.loads(SNAPSHOT.read_text())
    now = current()
    lost = []
    for module_name, names in snapshot.items():
        if module_name not in now:
            lost.append(f"module {module_name} is gone")
            continue
        lost += _missing(names, now[module_name], module_name)
    assert not lost, "\n".join(lost)


@pytest.mark.parametrize("module_name", MODULES)
def test_public_module_imports_and_exports_what_it_says(module_name):
    module = importlib.import_module(module_name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{module_name}.__all__ names missing attributes: {missing}"


def _write() -> None:
    old = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    now = current()
    for module_name, names in old.items():  # keep what was promised
        merged = dict(names)
        merged.update(now.get(module_name, {}))
        now[module_name] = merged
    SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        _write()
    else:
        sys.exit("usage: python tests/test_public_api.py --write")
