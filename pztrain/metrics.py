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
    "summarize",
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
        16-bit halves, high then low (-1 and -1 if none).
    """

    names: tuple[str, ...]
    sums: jax.Array


jax.tree_util.register_dataclass(
    MetricSums, data_fields=["sums"], meta_fields=["names"]
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


def add(acc: MetricSums, loss: jax.Array, aux: Any, step: jax.Array) -> MetricSums:
    """Adds one step's metrics (device-side, inside jit)."""
    values = metric_values(loss, aux)
    bad = ~jnp.isfinite(loss)
    n = len(acc.names)
    added = acc.sums[: n + 2] + jnp.stack(
        [*(values[k] for k in acc.names), 1.0, bad.astype(jnp.float32)]
    )
    # The first non-finite step, as two halves that float32 holds exactly.
    step = jnp.asarray(step, jnp.int32)
    halves = jnp.stack([step >> 16, step & 0xFFFF]).astype(jnp.float32)
    first = acc.sums[n + 2 :]
    first = jnp.where(bad & (first[0] < 0), halves, first)
    return MetricSums(acc.names, jnp.concatenate([added, first]))


def summarize(acc: MetricSums) -> Summary:
    """Reads the sums (one device→host transfer) and returns their means."""
    return read_and_reset(acc, reset=False)[0]


@jax.jit
def _zeros_like(acc: MetricSums) -> MetricSums:
    return zeros(acc.names)


def read_and_reset(
    acc: MetricSums, reset: bool = True
) -> tuple[Summary, MetricSums | None]:
    """Reads the sums and, with ``reset``, returns fresh zero sums as well.

    Costs one small transfer and (with ``reset``) one jitted call, whatever the
    number of metrics.
    """
    # np.asarray rather than jax.device_get: the same explicit read of one
    # array, without device_get's pytree machinery (~60 µs less per log point
    # on CPU, where the read is otherwise zero-copy).
    sums = np.asarray(acc.sums)
    fresh = _zeros_like(acc) if reset else None
    n = len(acc.names)
    count, nonfinite, hi, lo = (int(v) for v in sums[n:])
    first = -1 if hi < 0 else hi * 65536 + lo
    means = {
        k: float(v) / max(count, 1) for k, v in zip(acc.names, sums[:n], strict=True)
    }
    return Summary(means, count, nonfinite, first), fresh
