"""Gradient accumulation inside the step: one batch as ``m`` micro-batches.

`accumulate` splits each batch leaf's example axis into ``m`` micro-batches
(strided: micro-batch ``i`` holds examples ``i, i + m, i + 2m, …``, so a batch
sharded along its example axis gives micro-batches sharded the same way, with no
data movement), runs a ``lax.scan`` over them that threads the loss-function
state and the model's state variables in order, and returns the mean loss and
gradient and the combined aux (`combine_aux`). The optimizer then runs once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._tree import named_leaves
from pztrain.data._batch import BatchError
from pztrain.metric_states import is_metric_state, merge_stacked

__all__ = [
    "accumulate",
    "check_microbatches",
    "combine_aux",
    "first_microbatch",
    "split_batch",
]

# (loss_fn_state, rest, rng, batch) -> (loss, loss_fn_state, aux, new_rest, grads)
GradFn = Callable[[Any, Any, jax.Array, dict[str, Any]], tuple[Any, ...]]


def split_batch(batch: dict[str, Any], m: int) -> tuple[dict[str, Any], Any]:
    """``(split, whole)``: leaves with an example axis as ``[m, n // m, …]``.

    Leaves without one (scalars) go to ``whole``, given to every micro-batch;
    ``split`` has ``None`` in their place (and ``whole`` in the others').

    Raises:
      BatchError: naming the first leaf whose example axis ``m`` does not divide.
    """
    check_microbatches(batch, m)
    split = jax.tree.map(lambda x: _split(x, m) if np.shape(x) else None, batch)
    whole = jax.tree.map(lambda x: None if np.shape(x) else x, batch)
    return split, whole


def check_microbatches(batch: dict[str, Any], m: int, shards: int = 1) -> None:
    """Refuses a batch whose example axes do not split into ``m`` micro-batches
    on each of ``shards`` devices (the data shards of a mesh).

    Args:
      batch: The batch, in its global shapes.
      m: The micro-batches of a step.
      shards: The devices each leaf's examples are split over first.

    Raises:
      BatchError: naming the first leaf that does not split, its global shape
        and the batch sizes that would.
    """
    for name, leaf in named_leaves(batch):
        shape = np.shape(leaf)
        if shape and shape[0] % (m * shards):
            raise BatchError(_not_split(name, shape, m, shards))


def _not_split(name: str, shape: tuple[int, ...], m: int, shards: int) -> str:
    n = shape[0]
    if shards == 1:
        return (
            f"microbatches={m} splits every batch leaf's example axis into "
            f"{m} equal micro-batches, but batch[{name!r}] has shape "
            f"{list(shape)} ({n} examples, not a multiple of {m}). "
            f"Use a batch size divisible by {m} (e.g. drop_remainder=True)."
        )
    return (
        f"microbatches={m} splits each device's share of every batch leaf into "
        f"{m} equal micro-batches, but batch[{name!r}] has shape {list(shape)}: "
        f"{n} examples over {shards} data shards = {n / shards:g} per device, "
        f"not a multiple of {m}. Use a batch size divisible by {m * shards} "
        f"({shards} data shards x {m} micro-batches)."
    )


def _split(x: Any, m: int) -> jax.Array:
    """``[n, …] -> [m, n // m, …]``, row ``j`` of micro-batch ``i`` = ``x[j*m + i]``."""
    x = jnp.asarray(x)
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _merge(split: Any, whole: Any) -> dict[str, Any]:
    return jax.tree.map(
        lambda s, w: w if s is None else s, split, whole, is_leaf=_is_none
    )


def _is_none(x: Any) -> bool:
    return x is None


def first_microbatch(batch: dict[str, Any], m: int) -> dict[str, Any]:
    """Micro-batch 0 of ``batch`` (what the loss function sees in the step)."""
    split, whole = split_batch(batch, m)
    split = jax.tree.map(lambda x: x[0], split)
    return _merge(split, whole)


def accumulate(
    grad_fn: GradFn, lfs, rest, rng, batch, m: int, zeros: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """``(loss, loss_fn_state, aux, new_rest, grads)`` over ``m`` micro-batches.

    Micro-batch ``i`` gets key ``fold_in(rng, i)``; ``new_rest`` is ``None`` when
    no micro-batch updated state variables. Loss and grads are means (grads are
    summed in at least float32, starting from ``zeros(shape of a grad)``: on a
    mesh, unreduced partial sums, reduced once after); aux leaves are combined
    by `combine_aux`.
    """
    split, whole = split_batch(batch, m)
    shapes = jax.eval_shape(grad_fn, lfs, rest, rng, first_microbatch(batch, m))
    stateful = shapes[3] is not None
    grads0 = jax.tree.map(zeros, shapes[4])

    def body(acc, xs):
        lfs, rest, total = acc
        i, micro = xs
        key = jax.random.fold_in(rng, i)
        loss, lfs, aux, new_rest, grads = grad_fn(lfs, rest, key, _merge(micro, whole))
        total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
        return (lfs, new_rest if stateful else rest, total), (loss, aux)

    (lfs, rest, total), (losses, auxes) = jax.lax.scan(
        body, (lfs, rest, grads0), (jnp.arange(m), split)
    )
    grads = jax.tree.map(lambda t, g: (t / m).astype(g.dtype), total, shapes[4])
    return jnp.mean(losses), lfs, combine_aux(auxes), rest if stateful else None, grads


def combine_aux(stacked: Any) -> Any:
    """One aux from the micro-batches' aux, stacked along a leading axis ``m``.

    Scalar leaves: floating-point ones averaged, integer ones summed, booleans
    any-ed. Array leaves: concatenated back along the example axis in the
    batch's order (a per-example output comes back as on the whole batch).
    """
    return jax.tree.map(_combine_leaf, stacked, is_leaf=is_metric_state)


def _combine_leaf(x: Any) -> Any:
    if is_metric_state(x):  # the micro-batches' states merged, in order
        return merge_stacked(x)
    if x.ndim > 1:  # [m, n // m, …] -> [n, …], undoing the strided split
        return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.mean(x, axis=0)
    if x.dtype == jnp.bool_:
        return jnp.any(x, axis=0)
    return jnp.sum(x, axis=0, dtype=x.dtype)
