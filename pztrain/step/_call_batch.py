"""The batch of a train step's call: keyword arrays or one positional batch
(a dict, or batches on device), on the step's mesh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pztrain.data._placement import put_batch

__all__ = ["on_mesh", "one_batch", "two_batches"]


def on_mesh(batch: Mapping[str, Any], sharding: NamedSharding) -> Any:
    """A batch on the step's mesh, split along its data axes: as it is if every
    leaf has the step's batch ``sharding`` already (what `pztrain.fit` passes:
    one comparison per leaf), else put there (`put_batch`, or resharded if the
    leaves are global arrays across processes)."""
    for x in jax.tree.leaves(batch):
        if not (isinstance(x, jax.Array) and x.sharding == sharding):
            return _placed(batch, sharding)
    return batch


def _placed(batch: Mapping[str, Any], sharding: NamedSharding) -> Any:
    """``batch`` on ``sharding``: leaves with fewer axes than its spec (a
    scalar) replicated, as `put_batch` places them."""
    leaves = jax.tree.leaves(batch)
    arrays = all(isinstance(x, jax.Array) for x in leaves)
    if arrays and all(_fits(x, sharding) for x in leaves):
        return batch  # already so, in an equivalent spelling
    if sharding.is_fully_addressable or not arrays:
        return put_batch(batch, sharding)
    return jax.device_put(batch, jax.tree.map(lambda x: _wanted(x, sharding), batch))


def _wanted(x: jax.Array, sharding: NamedSharding) -> NamedSharding:
    if x.ndim < len(sharding.spec):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


def _fits(x: jax.Array, sharding: NamedSharding) -> bool:
    return x.sharding.is_equivalent_to(_wanted(x, sharding), x.ndim)


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
