"""Warm starts: stored params loaded under other names (``rename``), and the
`LoadReport` of a load: which target params came from which stored ones, which
were left as they were, which stored ones were not used.

A rename is a mapping or a list of rules. A mapping ``{"encoder": "backbone"}``
renames a stored name, or every name under it (``"encoder/w"`` becomes
``"backbone/w"``); when several keys fit a name, the longest wins. A list of
``(pattern, replacement)`` pairs renames each stored name by the first pattern
that matches all of it (``re.fullmatch``), its replacement expanded with the
match's groups (``(r"encoder/(.*)", r"backbone/\\1")``). Names no rule fits keep
their own. A rule that renames no stored name is an error, not a warning: it is
most likely a typo, and with ``partial=True`` it would leave the params it meant
to load at their fresh values without a word.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from pztrain._members import member_shape_note
from pztrain._table import text_table
from pztrain._tree import describe_shape, named_leaves
from pztrain.checkpoint._metadata import (
    CheckpointMismatchError,
    check_params,
    stored_params,
)

__all__ = ["LoadReport", "Rename", "plan_load"]

Rename: TypeAlias = Mapping[str, str] | Sequence[tuple[str | re.Pattern, str]]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What `load_params` took from where (``return_report=True``).

    ``print(report)`` shows it as a table: a fine-tuning run states what came
    from the checkpoint and what it trains from scratch.

    Attributes:
      directory: The checkpoint read.
      loaded: Each loaded target name, mapped to the stored name its value came
        from (the same name unless renamed), in the target's order.
      left: The target's names the checkpoint did not fill: they keep the
        target's values (``partial=True``).
      ignored: The stored names nothing was loaded from, in stored order.
      stored: Every stored name, mapped to its dtype and shape
        (``"float32[3, 4]"``).
      target: Every target name, mapped to its dtype and shape.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from pztrain.checkpoint import load_params, save_params
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = save_params(d + "/c", {"encoder": {"w": jnp.ones(2)},
      ...                                   "decoder": jnp.ones(4)})
      ...     like = {"backbone": {"w": jnp.zeros(2)}, "head": jnp.zeros(3)}
      ...     model, report = load_params(path, like, rename={"encoder": "backbone"},
      ...                                 partial=True, return_report=True)
      ...
      >>> report.loaded, report.left, report.ignored
      ({'backbone/w': 'encoder/w'}, ('head',), ('decoder',))
      >>> print(report)  # doctest: +ELLIPSIS
      From ...: 1 param loaded, 1 left as it was, 1 stored param ignored.
               target      stored     shape
      -------  ----------  ---------  ----------
      loaded   backbone/w  encoder/w  float32[2]
      left     head        -          float32[3]
      ignored  -           decoder    float32[4]
    """

    directory: Path
    loaded: dict[str, str]
    left: tuple[str, ...]
    ignored: tuple[str, ...]
    stored: dict[str, str]
    target: dict[str, str]

    def __str__(self) -> str:
        rows = [("loaded", t, s, self.target[t]) for t, s in self.loaded.items()]
        rows += [("left", t, "-", self.target[t]) for t in self.left]
        rows += [("ignored", "-", s, self.stored[s]) for s in self.ignored]
        table = text_table(("", "target", "stored", "shape"), rows, "target")
        return f"From {self.directory}: {self._counts()}.\n{table}"

    def _counts(self) -> str:
        n, left, ignored = len(self.loaded), len(self.left), len(self.ignored)
        return (
            f"{n} param{'s' * (n != 1)} loaded, {left} left as "
            f"{'they were' if left != 1 else 'it was'}, {ignored} stored "
            f"param{'s' * (ignored != 1)} ignored"
        )


def plan_load(
    path: Path,
    meta: dict[str, Any],
    params: Any,
    *,
    rename: Rename | None,
    partial: bool,
    ema: bool,
) -> LoadReport:
    """Which stored param (in the JSON ``meta`` of checkpoint ``path``) goes to
    which leaf of ``params`` (the target's), checked before any array is read.

    Raises:
      TypeError: ``rename`` is neither a mapping of names nor a list of
        ``(pattern, replacement)`` pairs.
      ValueError: a bad pattern or replacement (named), or ``rename`` with
        ``ema=True``.
      CheckpointMismatchError: a rule that renames no stored name; two stored
        names renamed onto one target name; a renamed param whose shape or dtype
        differs from the target's (both names and shapes); without ``partial``,
        names only one side has (after renaming).
    """
    stored, targets = stored_params(meta), dict(named_leaves(params))
    if rename is None:
        wanted = check_params(path, stored, targets, partial, meta.get("members"))
        pairs = {n: n for n in targets if n in wanted}
    else:
        if ema:
            raise ValueError(
                "load_params(..., ema=True) cannot rename: save the EMA params as "
                "params first (save_params(dir, state, ema=True)), then load those "
                "with rename=."
            )
        pairs = _renamed_pairs(path, stored, targets, _new_names(path, stored, rename))
        _check_pairs(path, stored, targets, pairs, partial, meta.get("members"))
    used = set(pairs.values())
    return LoadReport(
        directory=path,
        loaded=pairs,
        left=tuple(t for t in targets if t not in pairs),
        ignored=tuple(s for s in stored if s not in used),
        stored={s: describe_shape(*shape_dtype) for s, shape_dtype in stored.items()},
        target={t: describe_shape(*_shape_dtype(x)) for t, x in targets.items()},
    )


def _new_names(path: Path, stored: dict[str, Any], rename: Rename) -> dict[str, str]:
    """Each stored name's new name (its own if no rule fits it).

    Raises:
      CheckpointMismatchError: naming a rule that renames no stored name.
    """
    if isinstance(rename, Mapping):
        rules, apply = _mapping_rules(rename), _by_mapping
    else:
        rules, apply = _pattern_rules(rename), _by_pattern
    names, used = {}, set()
    for name in stored:
        rule = next((r for r in rules if apply(r, name) is not None), None)
        names[name] = name if rule is None else apply(rule, name)
        used.add(rule)
    unused = [rule[0] for rule in rules if rule not in used]
    if unused:
        key = unused[0] if isinstance(unused[0], str) else unused[0].pattern
        shown = ", ".join(map(repr, list(stored)[:5]))
        more = f" and {len(stored) - 5} more" if len(stored) > 5 else ""
        raise CheckpointMismatchError(
            f"rename: {key!r} renames no param of {path} (its names: {shown}{more}). "
            "Fix it or leave it out: a mapping's key is a stored name or the "
            "names under it (up to a '/'); a pattern matches a whole stored name "
            "that no earlier pattern matched."
        )
    return names


def _mapping_rules(rename: Mapping[str, str]) -> list[tuple[str, str]]:
    """The mapping's ``(key, new)`` pairs, the longest key first."""
    for key, new in rename.items():
        if not (_is_name(key) and _is_name(new)):
            raise TypeError(
                "rename maps stored names to new ones (non-empty strings); got "
                f"{key!r}: {new!r}."
            )
    return sorted(rename.items(), key=lambda kv: len(kv[0]), reverse=True)


def _by_mapping(rule: tuple[str, str], name: str) -> str | None:
    """``name`` renamed by a mapping's ``(key, new)``, if the key is the name
    or the names under it."""
    key, new = rule[0].rstrip("/"), rule[1].rstrip("/")
    if name == key or name.startswith(key + "/"):
        return new + name[len(key) :]
    return None


def _pattern_rules(rename: Any) -> list[tuple[re.Pattern, str]]:
    """The ``(compiled pattern, replacement)`` rules of a list of pairs."""
    if isinstance(rename, str | bytes) or not isinstance(rename, Sequence):
        raise TypeError(
            "rename is a mapping of stored names to new ones ({'encoder': "
            "'backbone'}) or a list of (pattern, replacement) pairs ([(r'encoder/"
            f"(.*)', r'backbone/\\1')]); got {type(rename).__name__}."
        )
    rules = []
    for i, rule in enumerate(rename):
        pair = isinstance(rule, tuple | list) and len(rule) == 2
        if (
            not pair
            or not isinstance(rule[0], str | re.Pattern)
            or not isinstance(rule[1], str)
        ):
            raise TypeError(
                f"rename[{i}] is {rule!r}; each rule is a (pattern, replacement) "
                "pair of strings (or a compiled pattern and a string)."
            )
        try:
            rules.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise ValueError(
                f"rename[{i}]: {rule[0]!r} is not a regular expression ({e})."
            ) from None
    return rules


def _by_pattern(rule: tuple[re.Pattern, str], name: str) -> str | None:
    """``name`` renamed by a ``(pattern, replacement)`` rule, if it matches."""
    pattern, replacement = rule
    match = pattern.fullmatch(name)
    if match is None:
        return None
    try:
        return match.expand(replacement)
    except (re.error, IndexError) as e:
        raise ValueError(
            f"rename: the replacement {replacement!r} of {pattern.pattern!r} does "
            f"not apply to {name!r} ({e})."
        ) from None


def _renamed_pairs(
    path: Path, stored: dict[str, Any], targets: dict[str, Any], new: dict[str, str]
) -> dict[str, str]:
    """Target name → stored name, for the targets a stored name is renamed to.

    Raises:
      CheckpointMismatchError: naming stored names renamed onto one target
        name (onto a name the target lacks, they are all ignored).
    """
    sources: dict[str, list[str]] = {}
    for name, renamed in new.items():
        sources.setdefault(renamed, []).append(name)
    for renamed, names in sources.items():
        if len(names) > 1 and renamed in targets:
            raise CheckpointMismatchError(
                f"rename: the params {names} of {path} are all loaded as "
                f"{renamed!r}; a target param takes one stored param. Rename them "
                "apart (or leave the unwanted ones under names the target lacks, "
                "with partial=True)."
            )
    return {t: sources[t][0] for t in targets if t in sources}


def _check_pairs(
    path: Path,
    stored: dict[str, tuple[tuple[int, ...], str]],
    targets: dict[str, Any],
    pairs: dict[str, str],
    partial: bool,
    members: int | None = None,
) -> None:
    """Checks shapes and dtypes of the pairs, and, unless ``partial``, that
    every name is used.

    Raises:
      CheckpointMismatchError: naming both names and both shapes, or the
        names only one side has.
    """
    for t, s in pairs.items():
        want = _shape_dtype(targets[t])
        if stored[s] != want:
            loaded_as = "" if s == t else f", loaded as {t!r},"
            raise CheckpointMismatchError(
                f"Parameter {s!r} in {path}{loaded_as} is "
                f"{describe_shape(*stored[s])}, but the target's {t!r} is "
                f"{describe_shape(*want)}. "
                + (
                    member_shape_note(stored[s][0], want[0], members)
                    or "Rename it to a param of that shape, or build the model "
                    "with the configuration it was trained with."
                )
            )
    left = [t for t in targets if t not in pairs]
    used = set(pairs.values())
    ignored = [s for s in stored if s not in used]
    if (left or ignored) and not partial:
        raise CheckpointMismatchError(
            f"Checkpoint {path} does not match the target after rename: target "
            f"names it does not fill {left}, stored names not used {ignored}. Pass "
            "partial=True to load only the names both have (e.g. a new head)."
        )


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    """A target leaf's (shape, dtype name), as the JSON describes stored ones."""
    return tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__))


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and bool(x)
