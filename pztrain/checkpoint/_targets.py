"""Where loaded arrays go: params into a `TrainState`, a model or a params
pytree (concrete or abstract: ``jax.ShapeDtypeStruct`` leaves), each array onto
its target's sharding."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pztrain import partition
from pztrain._tree import is_array_like, named_leaves, path_repr
from pztrain.checkpoint._metadata import CheckpointMismatchError
from pztrain.state import TrainState

__all__ = [
    "concrete",
    "filled",
    "key_impl",
    "param_target",
    "params_of",
    "params_target",
    "target_of",
]


def params_of(state_or_params: Any) -> Any:
    """The params of a `TrainState`, or the argument itself (a params pytree)."""
    if isinstance(state_or_params, TrainState):
        return state_or_params.params
    return state_or_params


def params_target(like: Any) -> tuple[Any, Any]:
    """The params of ``like`` and a function that puts new ones back into it."""
    if isinstance(like, TrainState):
        return like.params, lambda p: like.replace(params=p)
    if _is_params_tree(like):
        return like, lambda p: p
    params, rest = partition.split(like, frozen=True)
    return params, lambda p: partition.to_user_model(partition.merge(p, rest))


def filled(params: Any, loaded: dict[str, Any]) -> Any:
    """``params`` with the leaves named in ``loaded`` replaced."""
    named = named_leaves(params)
    treedef = jax.tree.structure(params)
    return treedef.unflatten([loaded.get(n, leaf) for n, leaf in named])


def _is_params_tree(like: Any) -> bool:
    """A dict (or nested dicts/lists) of arrays only: a params pytree."""
    if not isinstance(like, dict):
        return False
    return partition.family_of(like) == "pytree" and all(
        is_array_like(x) for x in jax.tree.leaves(like)
    )


def concrete(loaded: Any) -> Any:
    """``loaded`` if no leaf is left abstract (a ``jax.ShapeDtypeStruct``).

    Raises:
      CheckpointMismatchError: naming the abstract leaves a params checkpoint
        cannot fill (arrays that are not trainable params, or params that
        ``partial`` left out), and what to do.
    """
    flat = jax.tree_util.tree_flatten_with_path(loaded)[0]
    left = [path_repr(p) for p, x in flat if isinstance(x, jax.ShapeDtypeStruct)]
    if left:
        shown = ", ".join(left[:5]) + (
            f" and {len(left) - 5} more" if len(left) > 5 else ""
        )
        raise CheckpointMismatchError(
            f"The abstract target has leaves the checkpoint's params do not fill: "
            f"{shown}. Load a whole state with load_state, or give those leaves "
            "values (an abstract target is filled only where the params go)."
        )
    return loaded


def param_target(dtype: str, like: Any) -> jax.ShapeDtypeStruct:
    """Where a stored param goes: the place of the target's (`target_of`; the
    first device for a NumPy array), or the host for a 64-bit dtype JAX would
    narrow (checked at its stored width, then narrowed on the first device)."""
    dtype = np.dtype(dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return jax.ShapeDtypeStruct(np.shape(like), dtype)
    return target_of(like, host=False)


def target_of(x: Any, *, host: bool) -> jax.ShapeDtypeStruct:
    """Where an array restored in place of ``x`` goes: the sharding of ``x`` (a
    JAX array, or a ``jax.ShapeDtypeStruct`` given ``sharding=``), else the
    default device (a ``ShapeDtypeStruct`` without one), or the host for a
    NumPy array if ``host``.

    Example:
      >>> import jax, numpy as np
      >>> target_of(np.zeros(2, np.float32), host=True).sharding is None
      True
      >>> target_of(jax.ShapeDtypeStruct((2,), np.float32), host=True).sharding
      SingleDeviceSharding(device=CpuDevice(id=0), memory_kind=device)
    """
    sharding = getattr(x, "sharding", None)
    if sharding is None and not (host and isinstance(x, np.ndarray)):
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def key_impl(x: Any) -> Any:
    """The implementation of a PRNG key array, or of a ``ShapeDtypeStruct`` of one."""
    if isinstance(x, jax.Array):
        return jax.random.key_impl(x)
    found = []  # an abstract key: ask a traced one
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), x)
    return found[0]
