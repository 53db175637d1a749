"""Metric states that merge: metrics that are not means of scalars.

A metric state is a pytree with two methods: ``merge(other)``, the state of two
stretches of data together (traceable: it runs inside the jitted step), and
``compute()``, the metric's value (on the host, at log and eval points). Put one
in a loss function's ``aux`` or an eval step's output; between two log points
the states of the steps are merged on device, in the step's carry, so no step
waits for the host. A state's arrays keep their shapes from batch to batch.

The states here are built with ``of`` from one batch's values: `Ratio`,
`Mean`, `Perplexity`, `Sum`, `Max`, `Min`, `Last`, `Histogram` and
`Confusion` (accuracy, macro precision, recall and F1). Any object with
``merge`` and ``compute`` that is a pytree works too (`MetricState`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._members import spread
from pztrain._tree import describe

__all__ = [
    "Confusion",
    "Histogram",
    "Last",
    "Max",
    "Mean",
    "MetricState",
    "MetricStateError",
    "Min",
    "Perplexity",
    "Ratio",
    "Sum",
    "is_metric_state",
    "merge_stacked",
    "merge_states",
    "metric_entries",
]


@runtime_checkable
class MetricState(Protocol):
    """A metric state: a pytree of arrays with ``merge`` and ``compute``.
    ``merge(other)`` returns the state of both stretches of data, with the same
    structure and shapes (it runs inside the jitted step); ``compute()``
    returns a number, a 1-D array (entries ``name/bin_i``) or a mapping of
    names to numbers (entries ``name/key``), on the host.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import MetricState, Sum
      >>> isinstance(Sum.of(jnp.ones(3)), MetricState)
      True
    """

    def merge(self, other: Any) -> Any: ...

    def compute(self) -> Any: ...


class MetricStateError(ValueError):
    """A metric state whose structure or shapes changed between batches, or
    whose ``compute`` returned something that is not a number.

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain.metric_states import Max, MetricStateError, merge_states
      >>> try:  # a state whose shape changed
      ...     merge_states("top", Max.of(1.0), Max(jnp.ones(2)))
      ... except MetricStateError as e:
      ...     print(str(e)[:44])
      Metric 'top': this batch's state cannot be m
    """


def is_metric_state(x: Any) -> bool:
    """Whether ``x`` is a metric state (an object with ``merge`` and
    ``compute``; not a class).

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain.metric_states import Max, is_metric_state
      >>> is_metric_state(Max.of(jnp.arange(3.0))), is_metric_state(1.0)
      (True, False)
    """
    return (
        not isinstance(x, type)
        and callable(getattr(x, "merge", None))
        and callable(getattr(x, "compute", None))
    )


def _state(*meta: str):
    def wrap(cls):  # a frozen dataclass, a pytree (``meta`` fields static)
        cls = dataclasses.dataclass(frozen=True)(cls)
        data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        return jax.tree_util.register_dataclass(cls, data, list(meta))

    return wrap


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


@_state()
class Ratio:
    """A ratio of sums: ``sum(numerator) / sum(denominator)`` over all batches
    (e.g. correct / total, or a loss summed over tokens / tokens); float32 sums.

    Example:
      >>> from pztrain.metric_states import Ratio
      >>> Ratio.of(3, 4).merge(Ratio.of(1, 4)).compute()
      0.5
    """

    numerator: jax.Array
    denominator: jax.Array

    @classmethod
    def of(cls, numerator: Any, denominator: Any):
        """A batch's state: the sums of ``numerator`` and ``denominator``."""
        return cls(jnp.sum(_f32(numerator)), jnp.sum(_f32(denominator)))

    def merge(self, other: Ratio) -> Ratio:
        num, den = (
            self.numerator + other.numerator,
            self.denominator + other.denominator,
        )
        return type(self)(num, den)

    def compute(self) -> float:
        num, den = float(self.numerator), float(self.denominator)
        return num / den if den else float("nan")


@_state()
class Mean(Ratio):
    """A mean over all values of all batches, optionally weighted (a batch's
    mean counts as much as its values, whatever the batch sizes).

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Mean
      >>> Mean.of(jnp.array([1.0, 2.0])).merge(Mean.of(jnp.array([6.0]))).compute()
      3.0
    """

    @classmethod
    def of(cls, values: Any, weights: Any = None) -> Mean:
        """A batch's state from its ``values`` (and per-value ``weights``)."""
        values = _f32(values)
        w = jnp.ones_like(values) if weights is None else _f32(weights)
        return cls(jnp.sum(values * w), jnp.sum(jnp.broadcast_to(w, values.shape)))


@_state()
class Perplexity(Mean):
    """``exp(total loss / total tokens)`` over all batches: token-weighted, so
    batches with different token counts count as their tokens. ``of`` takes
    per-token losses (natural log) and ``weights`` (a mask of real tokens).

    Example:
      >>> import math, jax.numpy as jnp; from pztrain.metric_states import Perplexity
      >>> p = Perplexity.of(jnp.array([1.0, 3.0])).merge(Perplexity.of(2.0))
      >>> math.isclose(p.compute(), math.exp(2.0), rel_tol=1e-6)
      True
    """

    def compute(self) -> float:
        return float(np.exp(Ratio.compute(self)))


@_state()
class Sum:
    """A sum over all batches.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Sum
      >>> Sum.of(jnp.ones(3)).merge(Sum.of(2.0)).compute()
      5.0
    """

    total: jax.Array

    @classmethod
    def of(cls, values: Any) -> Sum:
        return cls(jnp.sum(_f32(values)))

    def merge(self, other: Sum) -> Sum:
        return Sum(self.total + other.total)

    def compute(self) -> float:
        return float(self.total)


@_state()
class Max:
    """The largest value over all batches.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Max
      >>> Max.of(jnp.array([1.0, 5.0])).merge(Max.of(3.0)).compute()
      5.0
    """

    value: jax.Array

    @classmethod
    def of(cls, values: Any) -> Max:
        return cls(jnp.max(_f32(values)))

    def merge(self, other: Max) -> Max:
        return Max(jnp.maximum(self.value, other.value))

    def compute(self) -> float:
        return float(self.value)


@_state()
class Min:
    """The smallest value over all batches.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Min
      >>> Min.of(jnp.array([1.0, 5.0])).merge(Min.of(3.0)).compute()
      1.0
    """

    value: jax.Array

    @classmethod
    def of(cls, values: Any) -> Min:
        return cls(jnp.min(_f32(values)))

    def merge(self, other: Min) -> Min:
        return Min(jnp.minimum(self.value, other.value))

    def compute(self) -> float:
        return float(self.value)


@_state()
class Last:
    """The value of the last batch (e.g. a schedule's value, a buffer's size).

    Example:
      >>> from pztrain.metric_states import Last
      >>> Last.of(1.0).merge(Last.of(2.0)).compute()
      2.0
    """

    value: jax.Array

    @classmethod
    def of(cls, value: Any) -> Last:
        return cls(_f32(value))

    def merge(self, other: Last) -> Last:
        return other

    def compute(self) -> Any:
        value = np.asarray(self.value, np.float64)
        return float(value) if value.ndim == 0 else value


@_state("edges")
class Histogram:
    """Counts (int32) of values in fixed bins over all batches; values outside
    ``[edges[0], edges[-1]]`` are not counted; ``edges`` (increasing) is static.
    Its entries are ``name/bin_i``, the counts of bin ``i`` (``edges[i]`` to
    ``edges[i + 1]``).

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Histogram
      >>> h = Histogram.of(jnp.array([0.1, 0.2, 0.7]), edges=(0.0, 0.5, 1.0))
      >>> h.merge(h).compute()
      array([4., 2.])
    """

    counts: jax.Array
    edges: tuple[float, ...]

    @classmethod
    def of(cls, values: Any, edges: Any) -> Histogram:
        edges = tuple(float(e) for e in edges)
        counts, _ = jnp.histogram(_f32(values), bins=jnp.asarray(edges))
        return cls(counts.astype(jnp.int32), edges)

    def merge(self, other: Histogram) -> Histogram:
        return Histogram(self.counts + other.counts, self.edges)

    def compute(self) -> np.ndarray:
        return np.asarray(self.counts, np.float64)


@_state()
class Confusion:
    """A confusion matrix (``[true class, predicted class]`` int32 counts) over
    all batches, from which come accuracy and the macro (unweighted mean over
    classes) precision, recall and F1; a class never predicted has precision 0,
    one never present recall 0, as scikit-learn's ``zero_division=0``.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Confusion
      >>> c = Confusion.of(jnp.array([0, 0, 1]), jnp.array([0, 1, 1]), 2)
      >>> c.matrix.tolist()
      [[1, 1], [0, 1]]
      >>> {k: round(v, 3) for k, v in c.compute().items()}
      {'accuracy': 0.667, 'precision': 0.75, 'recall': 0.75, 'f1': 0.667}
    """

    matrix: jax.Array

    @classmethod
    def of(cls, labels: Any, predictions: Any, num_classes: int) -> Confusion:
        """A batch's state from integer labels and predicted classes (or
        logits / scores with a last class axis, argmax-ed)."""
        labels, predictions = jnp.asarray(labels), jnp.asarray(predictions)
        if predictions.ndim == labels.ndim + 1:
            predictions = jnp.argmax(predictions, axis=-1)
        pairs = labels.reshape(-1) * num_classes + predictions.reshape(-1)
        counts = jnp.bincount(pairs, length=num_classes * num_classes)
        return cls(counts.reshape(num_classes, num_classes).astype(jnp.int32))

    def merge(self, other: Confusion) -> Confusion:
        return Confusion(self.matrix + other.matrix)

    def compute(self) -> dict[str, float]:
        m = np.asarray(self.matrix, np.float64)
        tp = np.diag(m)
        predicted, present = m.sum(0), m.sum(1)
        precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
        recall = np.divide(tp, present, out=np.zeros_like(tp), where=present > 0)
        twice = 2 * tp + (predicted - tp) + (present - tp)
        f1 = np.divide(2 * tp, twice, out=np.zeros_like(tp), where=twice > 0)
        accuracy = float(tp.sum() / max(m.sum(), 1.0))
        macro = [float(v.mean()) for v in (precision, recall, f1)]
        names = ("accuracy", "precision", "recall", "f1")
        return dict(zip(names, [accuracy, *macro], strict=True))


# merging in a carry, and reading on the host


def merge_states(name: str, old: Any, new: Any, first: Any = False) -> Any:
    """``old.merge(new)``, or ``new`` where ``first`` (traceable): a carried
    state merged with a step's, checked to keep its structure. A carry starts
    as zeros that ``first`` (no step yet) replaces: a state needs no ``empty()``.

    Raises:
      MetricStateError: naming ``name``, if ``new`` or the merge differs from
        ``old`` in structure or shapes.

    Example:
      >>> from pztrain.metric_states import Max, merge_states
      >>> merge_states("m", Max.of(2.0), Max.of(1.0)).compute()
      2.0
    """
    _check_like(name, old, new, "this batch's state")
    new = jax.tree.map(lambda o, n: jnp.asarray(n, jnp.result_type(o)), old, new)
    merged = old.merge(new)
    _check_like(name, old, merged, "its merge")
    if first is False:
        return merged
    return jax.tree.map(lambda m, n: jnp.where(first, n, m), merged, new)


def _check_like(name: str, old: Any, new: Any, what: str) -> None:
    want, got = jax.tree.structure(old), jax.tree.structure(new)
    shapes, new_shapes = ([np.shape(x) for x in jax.tree.leaves(t)] for t in (old, new))
    if want == got and shapes == new_shapes:
        return
    change = f"its structure changed from {want} to {got}"
    if want == got:
        change = f"its shapes changed from {shapes} to {new_shapes}"
    raise MetricStateError(
        f"Metric {name!r}: {what} cannot be merged with the state of the batches "
        f"before, because {change}. A metric state keeps its structure and shapes "
        "from batch to batch (the merged state lives in the step's carry): "
        "make its arrays' shapes independent of the batch (e.g. sums or counts "
        "over the batch, a fixed number of bins or classes)."
    )


def metric_entries(name: str, state: Any, members: int | None = None) -> dict:
    """A state's record entries, computed on the host: ``name`` for a number,
    ``name/key`` for a mapping, ``name/bin_i`` for a 1-D array. For a
    population (``members``, a leading member axis on every array) each
    member's state is computed and the entries spread over the members
    (the mean, ``/min``, ``/max``, ``/member_i``).

    Example:
      >>> from pztrain.metric_states import Ratio, metric_entries
      >>> metric_entries("acc", Ratio.of(3, 4))
      {'acc': 0.75}
    """
    host = jax.device_get(state)
    if members is None:
        return _entries(name, host.compute())
    rows = [
        _entries(name, jax.tree.map(functools.partial(_row, i), host).compute())
        for i in range(members)
    ]
    out: dict[str, float] = {}
    for key in rows[0]:
        out.update(spread(key, np.array([r[key] for r in rows])))
    return out


def merge_stacked(state: Any) -> Any:
    """One state from states stacked on a leading axis (e.g. micro-batches'
    or devices'), merged in order (traceable).

    Example:
      >>> import jax.numpy as jnp; from pztrain.metric_states import Sum, merge_stacked
      >>> merge_stacked(Sum(jnp.array([1.0, 2.0]))).compute()
      3.0
    """
    count = jax.tree.leaves(state)[0].shape[0]
    parts = [jax.tree.map(functools.partial(_row, i), state) for i in range(count)]
    return functools.reduce(lambda a, b: a.merge(b), parts)


def _row(i: int, x: Any) -> Any:
    return x[i]  # member or micro-batch i's array


def _entries(name: str, value: Any) -> dict[str, float]:
    if isinstance(value, Mapping):
        out: dict[str, float] = {}
        for key, v in value.items():
            out.update(_entries(f"{name}/{key}", v))
        return out
    array = np.asarray(value)
    if array.ndim == 0 and np.issubdtype(array.dtype, np.number):
        return {name: float(array)}
    if array.ndim == 1 and np.issubdtype(array.dtype, np.number):
        return {f"{name}/bin_{i}": float(v) for i, v in enumerate(array)}
    raise MetricStateError(
        f"Metric {name!r}: compute() returned {describe(value)}; a metric state's "
        "compute returns a number, a 1-D array or a mapping of names to those."
    )
