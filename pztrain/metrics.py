"""On-device accumulation of step metrics between log points.

Inside the jitted step, the loss and every scalar leaf of ``aux`` are added to
running sums; the host reads the sums only at log points (one transfer) and turns
them into means. Non-finite losses are counted on device too, with the first step
that produced one, so a NaN check needs no host sync per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MetricSums",
    "Summary",
    "add",
    "metric_names",
    "metric_values",
    "read_and_reset",
    "split_step",
    "summarize",
    "with_step",
    "zeros",
]


@dataclasses.dataclass(frozen=True)
class MetricSums:
    """Running sums on device, packed into one float32 array.

    A pytree with one leaf, ``sums``; ``names`` is static. Each array a jitted
    call takes or returns costs the dispatch of a buffer (about 1 µs on CPU), so
    the metrics of a step travel as one array, updated by one fused add.

    Attributes:
      names: The metric names, in the order of ``sums`` (static).
      sums: float32 ``[len(names) + 4]``: the sum of each metric over the steps
        since the last read; then the number of steps summed, the number of
        those whose loss was NaN or infinite (float32 counts are exact up to
        2**24 steps between reads), and the first such step as two exact
        16-bit halves, high then low (-1 and -1 if none). With
        ``carries_step``, two more slots hold the train step the same way.
      carries_step: Whether the sums carry the train step (static). `pztrain.fit`
        passes the step this way between its host points, which spares the
        jitted step one buffer in and one out per call.
    """

    names: tuple[str, ...]
    sums: jax.Array
    carries_step: bool = False


jax.tree_util.register_dataclass(
    MetricSums, data_fields=["sums"], meta_fields=["names", "carries_step"]
)


class Summary(NamedTuple):
    """Host-side view of `MetricSums`: means over the steps summed."""

    means: dict[str, float]
    count: int
    nonfinite: int
    first_nonfinite_step: int


def _scalar_leaves(aux: Any) -> dict[str, Any]:
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
        dtype = getattr(leaf, "dtype", None) or np.result_type(leaf)
        if np.shape(leaf) != () or not jnp.issubdtype(dtype, jnp.number):
            continue
        found[jax.tree_util.keystr(path, simple=True, separator="/") or "aux"] = leaf
    return found


def metric_names(aux: Any) -> list[str]:
    """Names of the metrics of a step: ``"loss"`` and the scalar leaves of aux.

    Works on shapes alone (``jax.ShapeDtypeStruct`` leaves), so the names can be
    known before anything runs.

    Example:
      >>> import jax.numpy as jnp
      >>> metric_names({"acc": jnp.array(0.5), "logits": jnp.zeros(3)})
      ['loss', 'acc']
    """
    return ["loss", *(k for k in _scalar_leaves(aux) if k != "loss")]


def metric_values(loss: jax.Array, aux: Any) -> dict[str, jax.Array]:
    """The loss and every scalar numeric leaf of ``aux``, named by key path.

    Non-scalar aux leaves (e.g. logits) are not metrics and are left out. An aux
    entry named ``"loss"`` takes the place of the loss.
    """
    values = {"loss": loss, **_scalar_leaves(aux)}
    return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}


def zeros(names: list[str] | tuple[str, ...]) -> MetricSums:
    """Empty sums for the metrics ``names``.

    Example:
      >>> summarize(zeros(["loss"]))
      Summary(means={'loss': 0.0}, count=0, nonfinite=0, first_nonfinite_step=-1)
    """
    empty = np.zeros(len(names) + 4, np.float32)
    empty[-2:] = -1.0
    return MetricSums(tuple(names), jnp.asarray(empty))


def _halves(step: jax.Array) -> jax.Array:
    """A step as two 16-bit halves, high then low, that float32 holds exactly."""
    step = jnp.asarray(step, jnp.int32)
    return jnp.stack([step >> 16, step & 0xFFFF]).astype(jnp.float32)


def _from_halves(halves: jax.Array) -> jax.Array:
    return (halves[0].astype(jnp.int32) << 16) | halves[1].astype(jnp.int32)


def add(acc: MetricSums, loss: jax.Array, aux: Any, step: jax.Array) -> MetricSums:
    """Adds one step's metrics (device-side, inside jit)."""
    if acc.carries_step:
        raise ValueError("add() takes sums without the step; see split_step().")
    values = metric_values(loss, aux)
    bad = ~jnp.isfinite(loss)
    n = len(acc.names)
    added = acc.sums[: n + 2] + jnp.stack(
        [*(values[k] for k in acc.names), 1.0, bad.astype(jnp.float32)]
    )
    first = acc.sums[n + 2 :]
    first = jnp.where(bad & (first[0] < 0), _halves(step), first)
    return MetricSums(acc.names, jnp.concatenate([added, first]))


def with_step(acc: MetricSums, step: jax.Array) -> MetricSums:
    """``acc`` carrying the train step ``step`` (traceable).

    Example:
      >>> import jax.numpy as jnp
      >>> carried = with_step(zeros(["loss"]), jnp.int32(70_000))
      >>> int(split_step(carried)[1])
      70000
    """
    if acc.carries_step:
        acc = split_step(acc)[0]
    sums = jnp.concatenate([acc.sums, _halves(step)])
    return MetricSums(acc.names, sums, carries_step=True)


def split_step(acc: MetricSums) -> tuple[MetricSums, jax.Array]:
    """The sums without the step, and the step (int32) that they carried."""
    if not acc.carries_step:
        raise ValueError("These sums carry no step; see with_step().")
    return MetricSums(acc.names, acc.sums[:-2]), _from_halves(acc.sums[-2:])


_with_step = jax.jit(with_step)
_split_step = jax.jit(split_step)
_step_of = jax.jit(lambda acc: split_step(acc)[1])


def summarize(acc: MetricSums) -> Summary:
    """Reads the sums (one device→host transfer) and returns their means."""
    return read_and_reset(acc, reset=False)[0]


@jax.jit
def _zeros_like(acc: MetricSums) -> MetricSums:
    fresh = zeros(acc.names)
    return with_step(fresh, split_step(acc)[1]) if acc.carries_step else fresh


def read_and_reset(
    acc: MetricSums, reset: bool = True
) -> tuple[Summary, MetricSums | None]:
    """Reads the sums and, with ``reset``, returns fresh zero sums as well.

    Costs one small transfer and (with ``reset``) one jitted call, whatever the
    number of metrics. Sums that carry the step keep it.
    """
    # np.asarray rather than jax.device_get: the same explicit read of one
    # array, without device_get's pytree machinery (~60 µs less per log point
    # on CPU, where the read is otherwise zero-copy).
    sums = np.asarray(acc.sums)
    fresh = _zeros_like(acc) if reset else None
    n = len(acc.names)
    count, nonfinite, hi, lo = (int(v) for v in sums[n : n + 4])
    first = -1 if hi < 0 else hi * 65536 + lo
    means = {
        k: float(v) / max(count, 1) for k, v in zip(acc.names, sums[:n], strict=True)
    }
    return Summary(means, count, nonfinite, first), fresh
