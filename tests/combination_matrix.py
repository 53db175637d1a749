"""The combination matrix's rows: every pair of values of every two axes in
at least one run (all-pairs, not the full product), honouring the constraints.

A small greedy all-pairs generator written for the suite (deterministic for a
seed), the axes of pztrain's capabilities, and each row's readable id, e.g.
``nnx-pop-grain-named2-early-keepbest-spc2-1dev``. `tests/matrix_runs.py`
builds and checks a row; `tests/test_combination_matrix.py` runs them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence

Row = dict[str, str]

AXES: dict[str, tuple[str, ...]] = {
    # penzai v2, penzai v1, eqx.nn.MLP, equinox BatchNorm + eqx.nn.State,
    # Flax NNX (BatchNorm, Dropout), Flax-style apply_fn + params
    "family": ("pzv2", "pzv1", "eqx", "eqxstate", "nnx", "flax"),
    "members": ("solo", "pop"),
    # ArrayLoader on host / on device, GrainLoader, one batch per member
    "data": ("host", "device", "grain", "permember"),
    # eval_step=; two named on two cadences; a host function; at_end only
    "evals": ("unnamed", "named2", "hostfn", "atend"),
    # refuse: a bad monitor (nothing may be written); badbatch: a batch the
    # loss cannot take (the same error and notes in and out of fit)
    "stop": (
        "end",
        "early",
        "nan",
        "sigint",
        "sigterm",
        "raise",
        "refuse",
        "badbatch",
    ),  # fmt: skip
    "ckpt": ("none", "keep1", "keepbest", "ema"),
    "step": ("plain", "spc2", "micro2", "norms"),
    "devices": ("1dev", "8dev"),
}

# The evaluation job's rows: a run with checkpoints, then the job on them.
JOB_AXES: dict[str, tuple[str, ...]] = {
    "family": AXES["family"],
    "members": AXES["members"],
    "data": ("host", "grain"),
    "ckpt": ("keep1", "keepbest", "ema"),
}


def allowed(row: Mapping[str, str]) -> bool:
    """Whether a (partial) row honours the constraints."""
    if row.get("data") == "permember" and row.get("members") == "solo":
        return False  # per-member batches only with a population
    return True


def all_pairs(
    axes: Mapping[str, Sequence[str]],
    ok: Callable[[Mapping[str, str]], bool] = allowed,
    seed: int = 0,
) -> list[Row]:
    """Rows covering every allowed pair of values of every two axes.

    Greedy: each row starts from an uncovered pair (picked with ``seed``),
    then each other axis takes the allowed value that covers the most
    uncovered pairs with the values already chosen (ties: the first value).

    Example:
      >>> rows = all_pairs({"a": "xy", "b": "xy", "c": "xy"})
      >>> len(rows), sorted(pairs_of(rows, ["a", "b"]))
      (4, [(('a', 'x'), ('b', 'x')), (('a', 'x'), ('b', 'y')), (('a', 'y'), ('b', 'x')), (('a', 'y'), ('b', 'y'))])
    """  # noqa: E501
    names = list(axes)
    uncovered = required_pairs(axes, ok)
    pick = random.Random(seed)
    rows: list[Row] = []
    while uncovered:
        first = pick.choice(sorted(uncovered))
        row = dict(first)
        for name in names:
            if name in row:
                continue
            row[name] = _best_value(row, name, axes[name], uncovered, ok)
        rows.append({name: row[name] for name in names})
        uncovered -= set(pairs_of([row], names))
    return rows


def _best_value(row, name, values, uncovered, ok) -> str:
    best, gain = None, -1
    for value in values:
        if not ok({**row, name: value}):
            continue
        new = sum(
            tuple(sorted([(name, value), (other, v)])) in uncovered
            for other, v in row.items()
        )
        if new > gain:
            best, gain = value, new
    if best is None:
        raise ValueError(f"No allowed value of {name!r} for the row {row}.")
    return best


def required_pairs(axes: Mapping[str, Sequence[str]], ok=allowed) -> set:
    """Every pair ``((axis, value), (axis, value))`` that a row may hold."""
    out = set()
    for a, b in itertools.combinations(sorted(axes), 2):
        for va, vb in itertools.product(axes[a], axes[b]):
            if ok({a: va, b: vb}):
                out.add(((a, va), (b, vb)))
    return out


def pairs_of(rows: Sequence[Mapping[str, str]], names: Sequence[str]) -> set:
    """The pairs of values the rows hold, over the axes ``names``."""
    return {
        ((a, row[a]), (b, row[b]))
        for row in rows
        for a, b in itertools.combinations(sorted(names), 2)
    }


def row_id(row: Mapping[str, str]) -> str:
    """A row's readable id: its values in the axes' order."""
    return "-".join(row.values())


ROWS = all_pairs(AXES)
JOB_ROWS = all_pairs(JOB_AXES)

# The fast subset: six rows of a second or two (warm) that hold every value of
# the data, evaluation, checkpoint and step axes, one run and a population,
# four families and four stops; every row runs in the full set (slow).
FAST = {
    "eqx-solo-host-hostfn-early-keep1-norms-1dev",
    "pzv1-solo-device-atend-sigint-none-spc2-1dev",
    "flax-solo-host-unnamed-early-keepbest-plain-1dev",
    "eqx-solo-device-atend-end-none-micro2-1dev",
    "pzv2-pop-permember-unnamed-early-none-plain-1dev",
    "pzv2-solo-grain-named2-badbatch-ema-plain-1dev",
}
