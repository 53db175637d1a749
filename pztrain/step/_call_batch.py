"""The batch of a train step's call: keyword arrays or one positional batch
(a dict, or batches on device), on the step's mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from pztrain.data._placement import put_batch

__all__ = ["on_mesh", "one_batch", "two_batches"]


def on_mesh(batch: Mapping[str, Any], sharding: Any) -> Any:
    """A batch on the step's mesh: as it is if every leaf is there already (what
    `pztrain.fit` passes), else put there (`put_batch`)."""
    devices = sharding.device_set
    leaves = jax.tree.leaves(batch)
    if all(
        isinstance(x, jax.Array) and x.sharding.device_set == devices for x in leaves
    ):
        return batch
    return put_batch(batch, sharding)


def one_batch(batch: Any, arrays: dict[str, Any]) -> Any:
    """The batch of a call: keyword arrays or one positional batch, not both."""
    if batch is None:
        return arrays
    if arrays:
        two_batches(batch, arrays)
    return batch


def two_batches(batch: Any, arrays: dict[str, Any]) -> None:
    raise TypeError(
        "Pass the batch as keyword arguments (train_step(state, x=..., y=...)) "
        "or as one positional batch (a dict, or batches on device such as "
        f"pztrain.data.IndexedBatches), not both; got {type(batch).__name__} "
        f"and keys {sorted(arrays)}."
    )
