"""A declared mapping between a checkpoint's tensor names and a model's param
names: `Rule` s of two name templates and the transforms between the layouts.

A template names its variable parts as fields, ``"model.layers.{i}.mlp.up_proj
.weight"`` ↔ ``"transformer/block_{i}/mlp/value_linear.weights"``: a field
matches one name segment (no ``.`` or ``/``), and the same fields fill the other
side. Unlike ``load_params(rename=...)``'s ``(pattern, replacement)`` pairs,
which rename one way, a pair of templates reads both ways, so exporting runs the
same mapping backwards. Every rule applies to every name it matches (several
rules may read one fused tensor, each its `Slice`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pztrain._tree import describe_shape
from pztrain.finetune._transforms import (
    Slice,
    Transform,
    TransformError,
    shapes_along,
)

__all__ = ["Entry", "MappingError", "Rule", "WeightMapping", "plan_import"]

_FIELD = re.compile(r"\{([A-Za-z_]\w*)\}")


class MappingError(ValueError):
    """A mapping that does not fit a checkpoint or a model: the rule, tensor or
    name is named, and nothing has been read or written.

    Example:
      >>> from pztrain.finetune import MappingError, Rule
      >>> try:
      ...     Rule("layers.{i}.weight", "w")
      ... except MappingError as e:
      ...     print(str(e)[:56])
      Rule 'layers.{i}.weight' -> 'w': both templates need the
    """


@functools.cache
def _compile(template: str) -> re.Pattern:
    parts, last = [], 0
    for m in _FIELD.finditer(template):
        parts.append(re.escape(template[last : m.start()]))
        parts.append(f"(?P<{m.group(1)}>[^./]+)")
        last = m.end()
    parts.append(re.escape(template[last:]))
    try:
        return re.compile("".join(parts))
    except re.error as e:  # a field used twice
        raise MappingError(f"Rule template {template!r}: {e}.") from None


@dataclasses.dataclass(frozen=True)
class Rule:
    """Stored tensors named like ``source`` are the params named like
    ``target``, through ``transforms`` (source layout → target layout).

    Attributes:
      source: The checkpoint's name template (``"model.layers.{i}.mlp.up_proj
        .weight"``).
      target: The param name template with the same fields.
      transforms: `Transpose`, `SplitAxis`, `MergeAxes`, `Slice`, applied in order.

    Example:
      >>> from pztrain.finetune import Rule, Transpose
      >>> rule = Rule("model.layers.{i}.mlp.up_proj.weight", "block_{i}/up",
      ...             (Transpose((1, 0)),))
      >>> rule.to_target("model.layers.7.mlp.up_proj.weight")
      'block_7/up'
      >>> rule.to_source("block_2/up")
      'model.layers.2.mlp.up_proj.weight'
    """

    source: str
    target: str
    transforms: tuple[Transform, ...] = ()

    def __post_init__(self) -> None:
        a, b = _compile(self.source), _compile(self.target)
        if set(a.groupindex) != set(b.groupindex):
            raise MappingError(
                f"Rule {self.source!r} -> {self.target!r}: both templates need the "
                f"same fields (got {sorted(a.groupindex)} and "
                f"{sorted(b.groupindex)})."
            )
        object.__setattr__(self, "transforms", tuple(self.transforms))

    def to_target(self, name: str) -> str | None:
        """``name``'s param name if this rule matches it."""
        return _convert(_compile(self.source), self.target, name)

    def to_source(self, name: str) -> str | None:
        """A param name's stored name if this rule matches it."""
        return _convert(_compile(self.target), self.source, name)


def _convert(pattern: re.Pattern, template: str, name: str) -> str | None:
    m = pattern.fullmatch(name)
    if m is None:
        return None
    return _FIELD.sub(lambda f: m.group(f.group(1)), template)


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """The rules of one architecture: how its checkpoints' names and layouts
    become a model's params, and back.

    Example:
      >>> from pztrain.finetune import Rule, Transpose, WeightMapping
      >>> mapping = WeightMapping([
      ...     Rule("layers.{i}.weight", "layers/{i}/w", (Transpose((1, 0)),)),
      ... ])
      >>> mapping.rules[0].to_target("layers.3.weight")
      'layers/3/w'
    """

    rules: Sequence[Rule]
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"WeightMapping takes Rule objects; got {r!r}.")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored tensor read into one param."""

    source: str
    target: str
    transforms: tuple[Transform, ...]
    shapes: tuple[tuple[int, ...], ...]  # before and after each transform
    source_dtype: str


def plan_import(
    mapping: WeightMapping,
    stored: Mapping[str, tuple[tuple[int, ...], str]],
    targets: Mapping[str, tuple[tuple[int, ...], Any]],
    where: str,
) -> tuple[list[Entry], tuple[str, ...], tuple[str, ...]]:
    """Pairs stored tensors with target params, checked before any is read.

    Returns:
      ``(entries, missing, unexpected)``: the pairs in the target's order, the
      targets nothing fills, the stored names no rule matched.

    Raises:
      MappingError: a rule that matches no stored name; two stored names (or
        two rules) mapped onto one param; a mapped name the model lacks; a
        shape no declared transform fits (naming the tensor and both shapes);
        a float tensor into an integer param or the reverse.
    """
    found: dict[str, Entry] = {}
    matched = set()
    for rule in mapping.rules:
        hits = [(s, rule.to_target(s)) for s in stored]
        hits = [(s, t) for s, t in hits if t is not None]
        if not hits:
            raise MappingError(_no_match(rule, mapping, stored, where))
        for s, t in hits:
            matched.add(s)
            if t in found:
                raise MappingError(
                    f"{mapping.name} mapping: {found[t].source!r} and {s!r} of "
                    f"{where} are both mapped onto {t!r}; a param takes one tensor."
                )
            if t not in targets:
                raise MappingError(
                    f"{mapping.name} mapping: {s!r} of {where} is mapped onto {t!r}, "
                    f"which the model does not have (its names start "
                    f"{list(targets)[:3]}). Fix the rule {rule.target!r} or build the "
                    "model from the checkpoint's configuration."
                )
            found[t] = _entry(rule, s, t, stored[s], targets[t], where)
    entries = [found[t] for t in targets if t in found]
    missing = tuple(t for t in targets if t not in found)
    return entries, missing, tuple(s for s in stored if s not in matched)


def _no_match(rule: Rule, mapping: WeightMapping, stored: Any, where: str) -> str:
    shown = ", ".join(map(repr, list(stored)[:4]))
    return (
        f"{mapping.name} mapping: the rule {rule.source!r} -> {rule.target!r} "
        f"matches no tensor of {where} (its names: {shown}"
        f"{' …' if len(stored) > 4 else ''}). Fix or drop the rule: a template "
        "matches a whole name, each {field} one segment without '.' or '/'."
    )


def _entry(rule: Rule, s: str, t: str, stored: Any, target: Any, where: str) -> Entry:
    (shape, dtype), (want, want_dtype) = stored, target
    try:
        shapes = shapes_along(rule.transforms, shape)
    except TransformError as e:
        shapes = None
        reason = f" ({e})"
    else:
        reason = ""
    if shapes is None or shapes[-1] != tuple(want):
        got = rule.transforms and shapes and describe_shape(shapes[-1], dtype)
        got = f"{got} after the transforms" if got else ""
        raise MappingError(
            f"Tensor {s!r} of {where} is {describe_shape(shape, dtype)}"
            f"{', ' + got if got else ''}{reason}, but the param {t!r} is "
            f"{describe_shape(want, want_dtype)}: no declared transform of rule "
            f"{rule.source!r} fits. Build the model from the checkpoint's "
            "configuration, or fix the rule's transforms."
        )
    if _is_float(dtype) != _is_float(want_dtype):
        raise MappingError(
            f"Tensor {s!r} of {where} is {dtype} and the param {t!r} is "
            f"{np.dtype(want_dtype).name}: a float cannot be loaded into an integer "
            "array or back."
        )
    return Entry(s, t, rule.transforms, tuple(shapes), dtype)


def _is_float(dtype: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(np.dtype(dtype), jnp.inexact))


def export_names(
    mapping: WeightMapping, names: Sequence[str]
) -> dict[str, tuple[str, Rule]]:
    """Each param's stored name and rule (the first rule whose target matches).

    Raises:
      MappingError: a param no rule maps back.
    """
    out = {}
    for n in names:
        rule = next((r for r in mapping.rules if r.to_source(n) is not None), None)
        if rule is None:
            raise MappingError(
                f"{mapping.name} mapping: no rule maps the param {n!r} to a stored "
                "name; add one, or export only the mapped params."
            )
        out[n] = (rule.to_source(n), rule)
    return out


def is_part(rule: Rule) -> bool:
    """A rule that reads one part of a fused tensor."""
    return bool(rule.transforms) and isinstance(rule.transforms[0], Slice)
