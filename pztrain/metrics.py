"""On-device accumulation of step metrics between log points.

Inside the jitted step, the loss and every scalar leaf of ``aux`` are added to
running sums; the host reads the sums only at log points (one transfer) and turns
them into means. Non-finite losses are counted on device too, with the first step
that produced one, so a NaN check needs no host sync per step.
"""

from __future__ import annotations

import functools
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


class MetricSums(NamedTuple):
    """Running sums on device.

    Attributes:
      sums: Metric name → float32 sum over the steps since the last read.
      count: Steps summed.
      nonfinite: Steps whose loss was NaN or infinite.
      first_nonfinite_step: The first such step, or -1.
    """

    sums: dict[str, jax.Array]
    count: jax.Array
    nonfinite: jax.Array
    first_nonfinite_step: jax.Array


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


def zeros(names: list[str]) -> MetricSums:
    """Empty sums for the metrics ``names``."""
    return MetricSums(
        sums={k: jnp.zeros((), jnp.float32) for k in names},
        count=jnp.zeros((), jnp.int32),
        nonfinite=jnp.zeros((), jnp.int32),
        first_nonfinite_step=jnp.full((), -1, jnp.int32),
    )


def add(acc: MetricSums, loss: jax.Array, aux: Any, step: jax.Array) -> MetricSums:
    """Adds one step's metrics (device-side, inside jit)."""
    values = metric_values(loss, aux)
    bad = ~jnp.isfinite(loss)
    first = jnp.where(
        bad & (acc.first_nonfinite_step < 0), step, acc.first_nonfinite_step
    )
    return MetricSums(
        sums={k: acc.sums[k] + values[k] for k in acc.sums},
        count=acc.count + 1,
        nonfinite=acc.nonfinite + bad.astype(jnp.int32),
        first_nonfinite_step=first.astype(jnp.int32),
    )


def summarize(acc: MetricSums) -> Summary:
    """Reads the sums (one device→host transfer) and returns their means."""
    return read_and_reset(acc, reset=False)[0]


@functools.partial(jax.jit, static_argnames="reset")
def _pack(acc: MetricSums, reset: bool):
    names = sorted(acc.sums)
    floats = jnp.stack([acc.sums[k] for k in names]) if names else jnp.zeros(0)
    ints = jnp.stack([acc.count, acc.nonfinite, acc.first_nonfinite_step])
    return floats, ints, (zeros(names) if reset else None)


def read_and_reset(
    acc: MetricSums, reset: bool = True
) -> tuple[Summary, MetricSums | None]:
    """Reads the sums and, with ``reset``, returns fresh zero sums as well.

    One jitted call packs the sums into two small vectors (and makes the zeros),
    so a log point costs one dispatch and two transfers whatever the number of
    metrics.
    """
    names = sorted(acc.sums)
    floats, ints, fresh = _pack(acc, reset)
    floats, ints = jax.device_get((floats, ints))
    count, nonfinite, first = (int(v) for v in ints)
    means = {k: float(v) / max(count, 1) for k, v in zip(names, floats, strict=True)}
    return Summary(means, count, nonfinite, first), fresh
