"""On-device sums of step metrics between log points.

Inside the jitted train step, the loss and every scalar leaf of ``aux`` are added to
running sums, and every metric state in ``aux`` (`pztrain.metric_states`) is
merged with the states before it; the host reads the sums only at log points
(one transfer) and turns them into means, and the states into their computed
values. Non-finite losses are counted on device too, with the first step that
produced one, so a NaN check needs no host sync per step. `EvalSums` does the
same over an evaluation's batches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._members import spread
from pztrain._tree import describe, named_leaves, path_repr
from pztrain.metric_states import (
    MetricStateError,
    is_metric_state,
    merge_states,
    metric_entries,
)

__all__ = [
    "EvalSums",
    "MetricSums",
    "Summary",
    "check_metric_leaves",
    "metric_names",
    "metric_state_shapes",
]


class Summary(NamedTuple):
    """What the host reads from `MetricSums`: means over the steps summed.

    Attributes:
      means: Metric name → mean over the steps; and each metric state's
        entries, computed (`pztrain.metric_states.metric_entries`).
      count: The number of steps summed.
      nonfinite: How many of them had a NaN or infinite loss.
      first_nonfinite_step: The first such step, or -1.
      nonfinite_members: A population's members with such a step, in order.

    Example:
      >>> import jax, jax.numpy as jnp; from pztrain.metrics import MetricSums
      >>> sums, add = MetricSums.zeros(["loss"]), jax.jit(MetricSums.add)
      >>> for step, loss in enumerate([1.0, 3.0]):  # as a step adds them, jitted
      ...     sums = add(sums, jnp.float32(loss), {}, jnp.int32(step))
      ...
      >>> sums.read()  # doctest: +NORMALIZE_WHITESPACE
      Summary(means={'loss': 2.0}, count=2, nonfinite=0, first_nonfinite_step=-1,
              nonfinite_members=())
    """

    means: dict[str, float]
    count: int
    nonfinite: int
    first_nonfinite_step: int
    nonfinite_members: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class MetricSums:
    """Running sums of a step's metrics, on device, between two reads.

    A pytree with one leaf when the aux holds no metric states, so that the
    metrics of a step cross ``jax.jit`` as one buffer (each one costs about a
    microsecond of dispatch on CPU) and are updated by one fused add; each
    metric state adds its own arrays. Only this class's methods know how the
    array is laid out.

    Attributes:
      names: The scalar metric names (static): ``"loss"`` first, then the
        scalar leaves of the step's aux (see `metric_names`).
      packed: One float32 array holding, after the sum of each metric, the
        number of steps summed, the number of non-finite losses (float32 counts
        are exact up to 2**24 steps between reads) and the first non-finite
        step as two exact 16-bit halves.
      states: Metric name → the merged metric state of the steps summed
        (`pztrain.metric_states`); zeros before the first step.

    Example:
      >>> import jax, jax.numpy as jnp; from pztrain.metrics import MetricSums
      >>> sums = MetricSums.zeros(["loss", "acc"])
      >>> add = jax.jit(MetricSums.add)
      >>> sums = add(sums, jnp.float32(2.0), {"acc": 0.5}, jnp.int32(0))
      >>> sums = add(sums, jnp.float32(jnp.inf), {"acc": 1.0}, jnp.int32(1))
      >>> summary = sums.read()
      >>> summary.means, summary.count, summary.nonfinite
      ({'loss': inf, 'acc': 0.75}, 2, 1)
      >>> summary.first_nonfinite_step
      1
    """

    names: tuple[str, ...]
    packed: jax.Array
    states: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def zeros(
        cls,
        names: Sequence[str],
        members: int | None = None,
        states: dict[str, Any] | None = None,
    ) -> MetricSums:
        """Empty sums for the metrics ``names``; for a population of ``members``,
        one row of sums per member (a step maps over the rows). ``states``:
        metric name → the shapes of its state (`metric_state_shapes`; with the
        member axis for a population), made zeros."""
        with jax.transfer_guard_host_to_device("allow"):  # asked for: fresh states
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), states or {})
        return cls(tuple(names), _empty_on_device(tuple(names), members), zeros)

    def add(self, loss: jax.Array, aux: Any, step: jax.Array) -> MetricSums:
        """The sums with one step's loss and aux metrics added (traceable).

        Raises:
          MetricStateError: if the step's metrics are not those of the sums
            (by name), or a metric state changed its structure or shapes.
        """
        values = _metric_values(loss, aux)
        _check_names("scalar metric", self.names, values)
        states = _states(aux)
        _check_names("metric state", self.states, states)
        bad = ~jnp.isfinite(loss)
        n = len(self.names)
        first = self.packed[n] == 0  # no step summed yet: a state is the new one
        merged = {
            k: merge_states(k, self.states[k], states[k], first) for k in self.states
        }
        added = self.packed[: n + 2] + jnp.stack(
            [*(values[k] for k in self.names), 1.0, bad.astype(jnp.float32)]
        )
        first = self.packed[n + 2 :]
        first = jnp.where(bad & (first[0] < 0), _halves(step), first)
        return MetricSums(self.names, jnp.concatenate([added, first]), merged)

    def reset(self) -> MetricSums:
        """Fresh zero sums for the same names, placed as these are (no wait)."""
        return _fresh(self)

    def is_ready(self) -> bool:
        """Whether the device has computed the sums (reading them will not wait)."""
        return self.packed.is_ready()

    def read(self) -> Summary:
        """Reads the sums (one small device→host transfer) as means, and the
        metric states as their computed values."""
        # np.asarray rather than jax.device_get: the same explicit read of one
        # array without device_get's pytree machinery (~60 µs less on CPU).
        packed = np.asarray(self.packed)
        if packed.ndim == 2:
            summary = _read_members(self.names, packed)
        else:
            summary = _read_one(self.names, packed)
        if self.states and summary.count:
            members = packed.shape[0] if packed.ndim == 2 else None
            for name, state in self.states.items():
                summary.means.update(metric_entries(name, state, members))
        return summary


jax.tree_util.register_dataclass(
    MetricSums, data_fields=["packed", "states"], meta_fields=["names"]
)


def _read_one(names: tuple[str, ...], packed: np.ndarray) -> Summary:
    n = len(names)
    count, nonfinite, hi, lo = (int(v) for v in packed[n : n + 4])
    first = -1 if hi < 0 else hi * 65536 + lo
    means = {
        k: float(v) / max(count, 1) for k, v in zip(names, packed[:n], strict=True)
    }
    return Summary(means, count, nonfinite, first)


def _read_members(names: tuple[str, ...], packed: np.ndarray) -> Summary:
    """A population's sums (one row per member): each metric's mean over the
    members, its min, max and per-member means (`pztrain._members.spread`);
    the steps with a non-finite loss in any member, and those members."""
    n = len(names)
    count = int(packed[0, n])
    nonfinite = int(packed[:, n + 1].max())
    firsts = [int(hi) * 65536 + int(lo) for hi, lo in packed[:, n + 2 :] if hi >= 0]
    means: dict[str, float] = {}
    for i, name in enumerate(names):
        means.update(spread(name, packed[:, i] / max(count, 1)))
    lost = tuple(int(i) for i in np.flatnonzero(packed[:, n + 1] > 0))
    return Summary(means, count, nonfinite, min(firsts, default=-1), lost)


def _empty(names: Sequence[str], members: int | None) -> np.ndarray:
    """The packed sums of no step (host)."""
    shape = (len(names) + 4,) if members is None else (members, len(names) + 4)
    empty = np.zeros(shape, np.float32)
    empty[..., -2:] = -1.0  # no non-finite step yet
    return empty


def _fresh(sums: MetricSums) -> MetricSums:
    """Zero sums placed as ``sums`` are: on the devices of its rows (a
    population split over them with its members), committed to a device only
    if ``sums`` were, so that the step sees the same inputs as on its first
    call (a committed input where there was none is a new compilation).
    Uncommitted sums (one device) get theirs from a program: no transfer, and
    no wait for the steps still running (a host transfer waits behind them)."""
    if not sums.packed.committed:
        return _fresh_on_device(sums)
    members = None if sums.packed.ndim == 1 else sums.packed.shape[0]
    packed = _placed_as(_empty(sums.names, members), sums.packed)  # one transfer
    zeros = jax.tree.map(
        lambda x: _placed_as(np.zeros(x.shape, x.dtype), x), sums.states
    )
    return MetricSums(sums.names, packed, zeros)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _empty_on_device(names: tuple[str, ...], members: int | None) -> jax.Array:
    """`_empty` made by a program: no host transfer, no wait."""
    return jnp.asarray(_empty(names, members))


@jax.jit
def _fresh_on_device(sums: MetricSums) -> MetricSums:
    members = None if sums.packed.ndim == 1 else sums.packed.shape[0]
    packed = jnp.asarray(_empty(sums.names, members))  # a constant of the program
    return MetricSums(sums.names, packed, jax.tree.map(jnp.zeros_like, sums.states))


def _placed_as(x: Any, like: jax.Array) -> jax.Array:
    """``x`` (host values) placed as ``like``; across processes, each
    process's shards of it."""
    if not like.committed:  # made at a host point: an asked-for transfer
        with jax.transfer_guard_host_to_device("allow"):
            return jnp.asarray(x)
    if like.sharding.is_fully_addressable:
        return jax.device_put(x, like.sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, like.sharding, lambda i: x[i])


@dataclasses.dataclass(frozen=True)
class EvalSums:
    """An evaluation's metrics over its batches, on device until `read`.

    Each batch's scalar metrics are taken as means over that batch and summed
    weighted by its size, so a last partial batch counts exactly as much as its
    examples; each metric state (`pztrain.metric_states`) is merged with the
    batches' before it. Immutable: `add` returns new sums.

    Attributes:
      members: A population's size (values with a leading member axis), or
        ``None``.
      sums: Scalar metric name → its weighted sum (float32, on device).
      states: Metric name → the merged state of the batches added.
      total: The examples added.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metrics import EvalSums
      >>> from pztrain.metric_states import Max
      >>> sums = EvalSums()
      >>> for x in (jnp.arange(4.0), jnp.arange(4.0, 6.0)):  # batches of 4 and 2
      ...     sums = sums.add({"mean": x.mean(), "top": Max.of(x)}, len(x))
      ...
      >>> sums.read()
      {'mean': 2.5, 'top': 5.0}
    """

    members: int | None = None
    sums: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    states: dict[str, Any] = dataclasses.field(default_factory=dict)
    total: int = 0

    def add(self, values: Any, n: int) -> EvalSums:
        """The sums with a batch of ``n`` examples and metrics ``values`` added.

        Raises:
          TypeError: a leaf that is neither a number, an array nor a state.
          MetricStateError: the metrics (by name) or a state's structure or
            shapes are not those of the batches before.
        """
        leaves = named_leaves(values, is_leaf=is_metric_state)
        scalars = {k: v for k, v in leaves if not is_metric_state(v)}
        states = {k: v for k, v in leaves if is_metric_state(v)}
        if self.total == 0:
            check_metric_leaves(values, "the eval step's metrics")
            sums = {k: jnp.zeros(jnp.shape(v), jnp.float32) for k, v in scalars.items()}
            old = states
        else:
            _check_names("metric", [*self.sums, *self.states], {**scalars, **states})
            sums, old = self.sums, self.states
        first = np.bool_(self.total == 0)
        sums, states = _eval_add(sums, old, scalars, states, np.float32(n), first)
        return EvalSums(self.members, sums, states, self.total + int(n))

    def read(self) -> dict[str, float]:
        """Reads the sums (one transfer) as means over the examples, and the
        states as their computed values; a population's spread per member
        (the mean, ``/min``, ``/max``, ``/member_i``)."""
        out: dict[str, float] = {}
        for name, v in jax.device_get(self.sums).items():
            out.update(spread(name, np.asarray(v, np.float64) / max(self.total, 1)))
        for name, state in self.states.items():
            out.update(metric_entries(name, state, self.members))
        return out


@jax.jit
def _eval_add(sums, states, values, new_states, n, first):
    weighted = {k: s + jnp.asarray(values[k], jnp.float32) * n for k, s in sums.items()}
    merged = {k: merge_states(k, s, new_states[k], first) for k, s in states.items()}
    return weighted, merged


def _halves(step: jax.Array) -> jax.Array:
    """A step as two 16-bit halves, high then low, that float32 holds exactly."""
    step = jnp.asarray(step, jnp.int32)
    return jnp.stack([step >> 16, step & 0xFFFF]).astype(jnp.float32)


def _scalar_leaves(aux: Any) -> dict[str, Any]:
    found = {}
    for name, leaf in named_leaves(aux, is_leaf=is_metric_state):
        if is_metric_state(leaf):
            continue
        dtype = getattr(leaf, "dtype", None) or np.result_type(leaf)
        if np.shape(leaf) == () and jnp.issubdtype(dtype, jnp.number):
            found[name or "aux"] = leaf
    return found


def _states(aux: Any) -> dict[str, Any]:
    """The metric states in ``aux``, by name."""
    leaves = named_leaves(aux, is_leaf=is_metric_state)
    return {name or "aux": x for name, x in leaves if is_metric_state(x)}


def metric_names(aux: Any) -> list[str]:
    """Names of the scalar metrics of a step: ``"loss"`` and the scalar leaves
    of aux (metric states are left out: see `metric_state_shapes`).

    Works on shapes alone (``jax.ShapeDtypeStruct`` leaves), so the names can be
    known before anything runs.

    Example:
      >>> import jax.numpy as jnp; from pztrain.metrics import metric_names
      >>> metric_names({"acc": jnp.array(0.5), "logits": jnp.zeros(3)})
      ['loss', 'acc']
    """
    return ["loss", *(k for k in _scalar_leaves(aux) if k != "loss")]


def metric_state_shapes(aux: Any) -> dict[str, Any]:
    """The metric states of a step's aux (`pztrain.metric_states`) by name, as
    given: from ``jax.eval_shape``, their shapes (the zeros of `MetricSums`).

    Example:
      >>> import jax, jax.numpy as jnp; from pztrain.metrics import metric_state_shapes
      >>> from pztrain.metric_states import Max
      >>> aux = jax.eval_shape(lambda: {"top": Max.of(jnp.ones(3))})
      >>> metric_state_shapes(aux)
      {'top': Max(value=ShapeDtypeStruct(shape=(), dtype=float32))}
    """
    return _states(aux)


def check_metric_leaves(tree: Any, where: str) -> None:
    """Refuses a leaf of a step's metrics (``where``: ``"aux"`` or an eval
    step's output) that is neither a number, an array nor a metric state.

    Raises:
      TypeError: naming the leaf (``aux['name']``) and what it is.

    Example:
      >>> from pztrain.metrics import check_metric_leaves
      >>> check_metric_leaves({"acc": 0.5}, "aux")
      >>> check_metric_leaves({"note": "hi"}, "aux")
      Traceback (most recent call last):
      ...
      TypeError: aux['note'] is a str ('hi'); ...
    """
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_metric_state)[0]
    for path, leaf in flat:
        if is_metric_state(leaf) and jax.tree.leaves(leaf) != [leaf]:
            continue
        if is_metric_state(leaf):
            raise TypeError(
                f"{where}{path_repr(path)} is a metric state ({type(leaf).__name__}) "
                "that is not a pytree, so it cannot cross jax.jit: register its "
                "class (e.g. jax.tree_util.register_dataclass, flax.struct.dataclass)."
            )
        if _is_numeric(leaf):
            continue
        shown = repr(leaf) if len(repr(leaf)) <= 40 else repr(leaf)[:37] + "..."
        raise TypeError(
            f"{where}{path_repr(path)} is a {describe(leaf)} ({shown}); {_LEAVES}"
        )


_LEAVES = (
    "every leaf of a step's metrics must be a number or an array (scalars are "
    "averaged over steps and batches; other arrays are left out) or a metric "
    "state with merge and compute (pztrain.metric_states). Take it out, or "
    "compute it outside the step (e.g. an evaluation in Python)."
)


def _is_numeric(x: Any) -> bool:
    """A number or an array JAX can carry (keys too; not text or objects)."""
    if isinstance(x, bool | int | float | complex):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        return False
    return getattr(dtype, "kind", "") not in ("O", "U", "S", "V")


def _check_names(what: str, want: Any, got: dict[str, Any]) -> None:
    if set(want) == set(got):
        return
    new, gone = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    raise MetricStateError(
        f"The step's {what}s changed between batches: new {new}, missing {gone} "
        f"(the sums hold {sorted(want)}). A step returns the same metrics, with "
        "the same structure and shapes, on every batch."
    )


def _metric_values(loss: jax.Array, aux: Any) -> dict[str, jax.Array]:
    """The loss and every scalar numeric leaf of ``aux``, named by key path.

    Non-scalar aux leaves (e.g. logits) are not metrics and are left out. An aux
    entry named ``"loss"`` takes the place of the loss.
    """
    values = {"loss": loss, **_scalar_leaves(aux)}
    return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
