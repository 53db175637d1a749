"""The package's shape: no import circles, no reaching into another module's
private names, and an ARCHITECTURE.md that names every module."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pztrain"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The syntax tree of a module, parsed once for all the tests."""
    return ast.parse(path.read_text())


@functools.cache
def _imports(path: Path) -> tuple[frozenset[str], dict[str, str]]:
    """Modules of the package that ``path`` imports (anywhere in the file, type
    checking blocks included), and the local aliases of imported modules."""
    edges, aliases = set(), {}
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "pztrain"
        ):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    edges.add(sub)
                    aliases[alias.asname or alias.name] = sub
                else:
                    edges.add(node.module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    edges.add(alias.name)
    return frozenset(edges), aliases


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges, _ = _imports(path)
        # A package's __init__ re-exports its modules; importing a sibling of
        # one's own package goes through it, so only module -> module counts.
        graph[name] = {e for e in edges if e != name and e != "pztrain"}
    return graph


def test_no_import_circles():
    graph = _graph()
    parents = {name: name.rpartition(".")[0] for name in graph}
    done, path = set(), []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in path:
            cycle = path[path.index(name) :] + [name]
            pytest.fail("import circle: " + " -> ".join(cycle))
        path.append(name)
        for target in graph.get(name, ()):
            if parents.get(name) != target:  # a module may import its package
                visit(target)
        path.pop()
        done.add(name)

    for name in graph:
        visit(name)


def test_no_module_reads_another_modules_private_names():
    found = []
    for name, path in MODULES.items():
        tree = _tree(path)
        _, aliases = _imports(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "pztrain"
            ):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith(
                        "__"
                    )
                    if private and f"{node.module}.{alias.name}" not in MODULES:
                        found.append(f"{name} imports {node.module}.{alias.name}")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != name
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name} uses {aliases[node.value.id]}.{node.attr}")
    assert found == []


def _package_of(module: str) -> str:
    """The room of a module: its capability folder, or the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_leaf_modules_import_nothing_above_them():
    graph = _graph()
    assert graph["pztrain.records"] <= {"pztrain._plot"}  # History.plot's drawing
    assert graph["pztrain._plot"] == set()
    assert graph["pztrain._tree"] == set()
    assert graph["pztrain.data._batch"] <= {"pztrain._tree"}
    step_modules = [m for m in graph if m.startswith("pztrain.step.")]
    for m in step_modules:  # a protocol is enough: the step knows no loader
        assert "pztrain.data._loader" not in graph[m], m
    for low in ("pztrain.state", "pztrain.step", "pztrain.metrics", "pztrain.data"):
        for m in [m for m in graph if m == low or m.startswith(low + ".")]:
            above = {
                t for t in graph[m] if t.startswith(("pztrain.loop", "pztrain.call"))
            }
            assert above == set(), m


# The rooms in the order they may import each other: a room imports only rooms
# before it (its own folder aside). ARCHITECTURE.md draws the same order.
ROOMS = [
    "pztrain._version",
    "pztrain._tree",
    "pztrain._plot",
    "pztrain.records",
    "pztrain._members",
    "pztrain._optax",
    "pztrain._table",
    "pztrain.ema",
    "pztrain.partition",
    "pztrain.groups",
    "pztrain.data",
    "pztrain.metric_states",
    "pztrain.metrics",
    "pztrain.summary",
    "pztrain.state",
    "pztrain.population",
    "pztrain.sharding",
    "pztrain.step",
    "pztrain.precision",
    "pztrain.callbacks",
    "pztrain.loggers",
    "pztrain.monitors",
    "pztrain.checkpoint",
    "pztrain.finetune",
    "pztrain.loop",
    "pztrain.integrations",
]


def test_rooms_import_only_the_rooms_below_them():
    graph = _graph()
    rank = {room: i for i, room in enumerate(ROOMS)}
    unknown = sorted({_package_of(m) for m in graph} - set(rank) - {"pztrain"})
    assert unknown == [], "rooms missing from ROOMS (and ARCHITECTURE.md)"
    upward = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m != "pztrain"
        for t in targets
        if _package_of(t) != _package_of(m)
        and rank[_package_of(t)] > rank[_package_of(m)]
    ]
    assert upward == []


def test_architecture_md_names_every_module():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    for name in MODULES:
        if name == "pztrain" or name.endswith("__init__"):
            continue
        short = name.split(".")[-1]
        assert f"{short}.py" in text or f"{short}/" in text, name
