"""On-device accumulation of step metrics between log points.

Inside the jitted step, the loss and every scalar leaf of ``aux`` are added to
running sums; the host reads the sums only at log points (one transfer) and turns
them into means. Non-finite losses are counted on device too, with the first step
that produced one, so a NaN check needs no host sync per step.
"""

from __future__ import annotations

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
    """Running sums on device, packed into two arrays (few jit arguments).

    Attributes:
      names: The metric names, in the order of ``sums`` (static).
      sums: float32 ``[len(names)]``: sums over the steps since the last read.
      counts: int32 ``[3]``: steps summed, steps whose loss was NaN or
        infinite, and the first such step (-1 if none).
    """

    names: tuple[str, ...]
    sums: jax.Array
    counts: jax.Array


jax.tree_util.register_pytree_node(
    MetricSums,
    lambda m: ((m.sums, m.counts), m.names),
    lambda names, children: MetricSums(names, *children),
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
    """Empty sums for the metrics ``names``."""
    return MetricSums(
        tuple(names),
        jnp.zeros(len(names), jnp.float32),
        jnp.array([0, 0, -1], jnp.int32),
    )


def add(acc: MetricSums, loss: jax.Array, aux: Any, step: jax.Array) -> MetricSums:
    """Adds one step's metrics (device-side, inside jit)."""
    values = metric_values(loss, aux)
    bad = ~jnp.isfinite(loss)
    count, nonfinite, first = acc.counts[0], acc.counts[1], acc.counts[2]
    first = jnp.where(bad & (first < 0), step, first)
    return MetricSums(
        acc.names,
        acc.sums + jnp.stack([values[k] for k in acc.names]),
        jnp.stack([count + 1, nonfinite + bad.astype(jnp.int32), first]).astype(
            jnp.int32
        ),
    )


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

    Costs two small transfers and (with ``reset``) one jitted call, whatever the
    number of metrics.
    """
    sums, counts = jax.device_get((acc.sums, acc.counts))
    fresh = _zeros_like(acc) if reset else None
    count, nonfinite, first = (int(v) for v in counts)
    means = {k: float(v) / max(count, 1) for k, v in zip(acc.names, sums, strict=True)}
    return Summary(means, count, nonfinite, first), fresh
