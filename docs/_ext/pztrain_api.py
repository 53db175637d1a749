"""The API reference's Sphinx extension: each object documented once, on the page of
its home module, every reference to a public pztrain name a link, and a summary table
atop each page.

* The *home* of a public object is the public module that defines it: the module of
  its ``__module__`` up to the first private part (`pztrain.TrainState` is
  ``pztrain.state._state.TrainState``: its home is ``pztrain.state``). Its entry (an
  autodoc directive) is on ``docs/api/<home>.md``; every other public name of it (the
  top-level ``pztrain.TrainState``) is a link to that entry. So the "[docs]" links of
  the source pages (viewcode) land on entries that exist.
* A reference that does not resolve as written (``pztrain.TrainState``, or a bare
  `TrainState`, `fit` or ``TrainState.apply_gradients`` in a docstring, whose
  default role is ``py:obj``) goes to the home entry of the public object it names;
  an attribute without an entry of its own (a NamedTuple field) to its class's entry.
  A bare name that starts as a public pztrain name but names nothing there fails the
  build (``-W``), as an unresolved ``pztrain.`` reference does (``nitpicky``).
* A package docstring's map of its private modules is left out of its page.
* ``.. pztrain-summary:: pztrain.data`` (inside an ``{eval-rst}`` block) is a table of
  the module's ``__all__``: each name a link to its entry, with the first sentence of
  its docstring; ``.. pztrain-summary::`` with no argument, of the public modules.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
import sys
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


@functools.cache
def public_modules() -> tuple[str, ...]:
    """``pztrain`` and each of its modules with no ``_`` part in its dotted name."""
    import pztrain

    found = pkgutil.walk_packages(pztrain.__path__, "pztrain.")
    return ("pztrain", *sorted(m.name for m in found if "._" not in m.name))


def _public(obj: Any) -> bool:
    return not inspect.ismodule(obj)


@functools.cache
def _exports() -> dict[int, list[tuple[str, str, Any]]]:
    """Every public object (by id): its ``(module, name, object)`` exports."""
    found: dict[int, list[tuple[str, str, Any]]] = {}
    for module in public_modules():
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name, None)
            if obj is not None and _public(obj):
                found.setdefault(id(obj), []).append((module, name, obj))
    return found


def home_name(obj: Any) -> str | None:
    """The full name of ``obj`` 's entry: its home module and its name there
    (``pztrain.state.TrainState``); ``None`` for an object no public module exports."""
    exports = _exports().get(id(obj))
    if not exports:
        return None
    defined = getattr(obj, "__module__", None) or ""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        home = defined.split("._")[0]
        for module, name, _ in exports:
            if module == home:
                return f"{module}.{name}"
    # a constant (or an object exported elsewhere than its home): the most specific
    # module that exports it
    module, name, _ = max(exports, key=lambda e: (e[0] != "pztrain", e[0].count(".")))
    return f"{module}.{name}"


@functools.cache
def _bare_names() -> dict[str, tuple[int, ...]]:
    """Each public name (``TrainState``, ``fit``) and the objects it names."""
    names: dict[str, set[int]] = {}
    for key, exports in _exports().items():
        for _, name, _ in exports:
            names.setdefault(name, set()).add(key)
    return {name: tuple(ids) for name, ids in names.items()}


def _by_id(key: int) -> Any:
    return _exports()[key][0][2]


def public_target(target: str) -> tuple[str, str] | None:
    """``(home, rest)`` for a name of a public pztrain object, written in full
    (``pztrain.TrainState.apply_gradients``, ``pztrain.data``) or bare
    (``TrainState.apply_gradients``, ``fit``): the object's entry and the
    attributes after it (``".apply_gradients"`` or ``""``); a public module's
    name is its own home. ``None`` for anything else (a bare module name, a
    private name, another library's)."""
    parts = target.split(".")
    if parts[0] == "pztrain":
        for k in range(len(parts), 0, -1):
            module = ".".join(parts[:k])
            if module in public_modules():
                break
        else:
            return None
        if k == len(parts):
            return module, ""
        obj = getattr(sys.modules[module], parts[k], None)
        if parts[k] not in getattr(sys.modules[module], "__all__", ()):
            return _by_private_path(parts)
        if inspect.ismodule(obj):
            return None
        rest = parts[k + 1 :]
    else:
        ids = _bare_names().get(parts[0], ())
        if len(ids) != 1:
            return None
        obj, rest = _by_id(ids[0]), parts[1:]
    home = home_name(obj)
    if home is None:
        return None
    return home, "".join(f".{part}" for part in rest)


def _by_private_path(parts: list[str]) -> tuple[str, str] | None:
    """A public object named by the module that defines it (an annotation's
    ``pztrain.state._state.TrainState``): its home entry. A private object: none."""
    for k in range(len(parts) - 1, 1, -1):
        module = sys.modules.get(".".join(parts[:k]))
        if module is None:
            continue
        obj = getattr(module, parts[k], None)
        home = home_name(obj) if obj is not None and _public(obj) else None
        if home is not None:
            return home, "".join(f".{part}" for part in parts[k + 1 :])
        return None
    return None


def _has_attributes(obj: Any, rest: str) -> bool:
    for part in filter(None, rest.split(".")):
        fields = getattr(obj, "__dataclass_fields__", None) or {}
        annotations = getattr(obj, "__annotations__", None) or {}
        if not hasattr(obj, part) and part not in fields and part not in annotations:
            return False
        obj = getattr(obj, part, None)
    return True


def _object(full: str) -> Any:
    module, _, name = full.rpartition(".")
    return getattr(sys.modules.get(module) or importlib.import_module(module), name)


def resolve_public(app, env, node, contnode):
    """``missing-reference``: a reference to a public pztrain name that did not
    resolve as written goes to the home entry of the object it names."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    found = public_target(target)
    auto = node.get("pztrain_autolink", False)
    if found is None:
        return contnode if auto else None
    home, rest = found
    domain = env.get_domain("py")
    candidates = [home + rest] if rest else [home]
    if rest and _has_attributes(_object(home), rest):
        candidates.append(home)  # an attribute without its own entry: its class
    for candidate in candidates:
        if candidate in domain.objects or candidate in domain.modules:
            ref = node.deepcopy()
            ref["reftarget"] = candidate
            ref["reftype"] = "obj"
            return domain.resolve_xref(
                env, node.get("refdoc"), app.builder, "obj", candidate, ref, contnode
            )
    if auto:
        return contnode
    if not target.startswith("pztrain."):  # nitpicky reports the others
        logger.warning(
            f"`{target}` names {home}, which has no entry{' ' + rest if rest else ''} "
            "in the API reference: fix the name, or write it as ``code``",
            location=node,
            type="pztrain",
            subtype="reference",
        )
    return None


class PublicPaths(SphinxPostTransform):
    """A reference to a public object by the private module that defines it (an
    annotation's ``pztrain.step._cost.StepMemory``, which autodoc's canonical
    names would resolve) names it, and shows it, by its home name instead."""

    default_priority = 5  # before the references are resolved (10)

    def run(self, **kwargs) -> None:
        for node in self.document.findall(addnodes.pending_xref):
            target = node.get("reftarget", "")
            if node.get("refdomain") != "py" or "._" not in target:
                continue
            found = public_target(target) if target.startswith("pztrain.") else None
            if found is None:
                continue
            node["reftarget"] = found[0] + found[1]
            if node.astext() == target and len(node.children) == 1:
                shown = node.children[0]
                shown.children = [nodes.Text(found[0] + found[1])]


# the summary tables

_SENTENCE = re.compile(r"(?<!\be\.g)(?<!\bi\.e)\.(?=\s|$)")


def summary_of(obj: Any, name: str, module: str) -> str:
    """The first sentence of ``obj`` 's docstring (a constant's, from its module's
    source)."""
    if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj):
        doc = inspect.getdoc(obj) or ""
    else:
        doc = "\n".join(constant_doc(name, getattr(sys.modules[module], name)))
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    match = _SENTENCE.search(paragraph)
    return paragraph[: match.end()] if match else paragraph


def constant_doc(name: str, obj: Any) -> list[str]:
    """The docstring lines of a constant ``obj`` named ``name``, read from the
    source of the pztrain module that assigns it (``[]`` if none has one)."""
    from sphinx.pycode import ModuleAnalyzer

    for modname in sorted(m for m in sys.modules if m.startswith("pztrain")):
        if getattr(sys.modules[modname], name, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:  # a module without source  # noqa: BLE001
            continue
        if ("", name) in docs:
            return list(docs[("", name)])
    return []


def constant_docstrings(app, what, name, obj, options, lines):
    """A re-exported constant gets its own docstring, not its type's."""
    if what == "data" and lines and type(obj).__doc__ and lines[0] in type(obj).__doc__:
        lines[:] = constant_doc(name.rsplit(".", 1)[-1], obj)


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) and not isinstance(obj, type) else "data"


class PztrainSummary(SphinxDirective):
    """A table of a module's public names (or of the public modules), each a link
    to its entry with the first sentence of its docstring."""

    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        if self.arguments:
            module = self.arguments[0]
            mod = importlib.import_module(module)
            rows = [
                (name, getattr(mod, name), module) for name in mod.__all__
            ]  # in __all__ 's order
        else:
            rows = [(m, importlib.import_module(m), m) for m in public_modules()]
        table = nodes.table(
            classes=["autosummary", "longtable", "pztrain-summary", "colwidths-given"]
        )
        group = nodes.tgroup(cols=2)
        table += group
        group += nodes.colspec(colwidth=30)
        group += nodes.colspec(colwidth=70)
        body = nodes.tbody()
        group += body
        for name, obj, module in rows:
            body += self._row(name, obj, module)
        return [table]

    def _row(self, name: str, obj: Any, module: str) -> nodes.row:
        if inspect.ismodule(obj):
            target, label = obj.__name__, obj.__name__ if not self.arguments else name
        else:
            target, label = home_name(obj) or f"{module}.{name}", name
        ref = addnodes.pending_xref(
            "",
            refdomain="py",
            reftype="mod" if inspect.ismodule(obj) else "obj",
            reftarget=target,
            refexplicit=True,
            refwarn=True,
            refdoc=self.env.docname,
        )
        ref += nodes.literal(label, label, classes=["xref", "py", "py-obj"])
        first = nodes.paragraph()
        first += ref
        kind = _kind(obj)
        if kind not in ("function", "module"):
            first += nodes.Text(f" ({kind})")
        text, messages = self.state.inline_text(
            summary_of(obj, name, module), self.lineno
        )
        second = nodes.paragraph("", "", *text)
        row = nodes.row()
        for cell in (first, second):
            entry = nodes.entry()
            entry += cell
            row += entry
        return row


_MAP_ITEM = re.compile(r"^\* `pztrain(\.\w+)*\._\w+")


def drop_module_map(app, what, name, obj, options, lines):
    """``autodoc-process-docstring``: a package docstring's map of its private
    modules (``* `pztrain.step._build`: ...`` items) is for who reads the source;
    the reference shows the package's public names instead (its summary table)."""
    if what != "module":
        return
    kept, in_item = [], False
    for line in lines:
        if _MAP_ITEM.match(line):
            in_item = True
        elif in_item and line.startswith("  "):
            continue
        else:
            in_item = False
        if not in_item:
            kept.append(line)
    lines[:] = kept


def setup(app):
    app.add_directive("pztrain-summary", PztrainSummary)
    app.connect("autodoc-process-docstring", drop_module_map)
    app.connect("autodoc-process-docstring", constant_docstrings)
    app.add_post_transform(PublicPaths)
    app.connect("missing-reference", resolve_public, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
