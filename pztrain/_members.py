"""The vocabulary of populations (many runs in one program) that every room
shares: how many members a state's root key says it has, and how a value with a
member axis becomes record entries.

A population is a `pztrain.TrainState` whose root key has a leading member axis
``K`` (one key per member), as have its params, optimizer and loss-function
states and the arrays of ``model_without_params``; its ``step`` stays one scalar,
since members step together. See `pztrain.population`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["member_count", "member_key", "shared_batch_sharding", "spread"]


def member_count(root_rng: Any) -> int | None:
    """Members of a state whose root key is ``root_rng``: ``None`` for one run
    (a scalar typed key, or a legacy ``uint32[2]`` key; or anything that is not
    an array), else its leading axis.

    Example:
      >>> import jax
      >>> keys = jax.random.split(jax.random.key(0), 3)
      >>> member_count(jax.random.key(0)), member_count(keys)
      (None, 3)
    """
    dtype = getattr(root_rng, "dtype", None)
    if dtype is None:  # not a key (e.g. a tree of shardings shaped as a state)
        return None
    shape = np.shape(root_rng)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return shape[0] if len(shape) == 1 else None
    return shape[0] if len(shape) == 2 else None


def member_key(name: str, i: int) -> str:
    """The record entry of member ``i``'s value of ``name``: ``"loss/member_3"``."""
    return f"{name}/member_{i}"


def spread(name: str, value: Any) -> dict[str, float]:
    """Record entries of one metric: itself if a scalar; for a value per member
    (a 1-D array), the mean under ``name``, then ``name/min``, ``name/max`` and
    one entry per member (`member_key`).

    Example:
      >>> import numpy as np
      >>> spread("loss", np.array([1.0, 3.0]))  # doctest: +NORMALIZE_WHITESPACE
      {'loss': 2.0, 'loss/min': 1.0, 'loss/max': 3.0,
       'loss/member_0': 1.0, 'loss/member_1': 3.0}
    """
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        return {name: float(array)}
    out = {
        name: float(array.mean()),
        f"{name}/min": float(array.min()),
        f"{name}/max": float(array.max()),
    }
    out.update({member_key(name, i): float(v) for i, v in enumerate(array)})
    return out  # every entry but the mean matches pztrain.records.SPREAD


def shared_batch_sharding(state: Any, member_batches: bool) -> Any:
    """Where ``fit`` puts a population's shared host batches: replicated on
    the mesh its members are split over (`pztrain.population.shard_members`),
    so that the step gets them there rather than moving them from the default
    device each call; ``None`` otherwise (one run, one device, or a batch per
    member)."""
    sharding = getattr(state.root_rng, "sharding", None)
    if member_batches or not isinstance(sharding, NamedSharding):
        return None
    if not sharding.spec or member_count(state.root_rng) is None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec())
