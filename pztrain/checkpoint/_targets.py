"""Where loaded arrays go: params into a `TrainState`, a model or a params
pytree (concrete or abstract: ``jax.ShapeDtypeStruct`` leaves), each array onto
its target's sharding.

The params a checkpoint holds are the trainable arrays and, for a model with
state of its own (`pztrain.partition.model_state`: a Flax NNX model's batch
statistics, rng keys and counts), that state by name, PRNG keys as their key
data; a full-state checkpoint then leaves the model's state out of its
``state`` item (`state_skeleton`), so nothing is stored twice."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain import partition
from pztrain._tree import is_array_like, named_leaves, path_repr
from pztrain.checkpoint._metadata import CheckpointMismatchError
from pztrain.state import TrainState

__all__ = [
    "checkpoint_params",
    "concrete",
    "filled",
    "key_impl",
    "param_target",
    "params_of",
    "params_target",
    "state_skeleton",
    "state_with_params",
    "target_of",
]


def params_of(state_or_params: Any) -> Any:
    """What a checkpoint's params hold: a `TrainState`'s params and its model's
    own state (`checkpoint_params`), or the argument itself (a params pytree)."""
    if isinstance(state_or_params, TrainState):
        return checkpoint_params(state_or_params.params, state_or_params)
    return state_or_params


def checkpoint_params(params: Any, state: TrainState) -> Any:
    """``params`` and the model's own state, PRNG keys as their key data."""
    own = partition.model_state(state.model_without_params)
    if not own:
        return params
    return {**params, **{name: _key_data(x) for name, x in own.items()}}


def params_target(like: Any) -> tuple[Any, Any]:
    """The params of ``like`` (with its model's own state, as `params_of`) and a
    function that puts new ones back into it."""
    if isinstance(like, TrainState):
        return params_of(like), lambda p: state_with_params(like, like, p)
    if _is_params_tree(like):
        return like, lambda p: p
    params, rest = partition.split(like, frozen=True)
    own = partition.model_state(rest)
    stored = {**params, **{name: _key_data(x) for name, x in own.items()}}

    def rebuild(p: dict[str, Any]) -> Any:
        params, rest_now = _split_stored(p, rest)
        return partition.to_user_model(partition.merge(params, rest_now))

    return stored, rebuild


def state_with_params(like: TrainState, base: TrainState, p: Any) -> TrainState:
    """``base`` with the params and model state of ``p`` (named as
    ``params_of(like)``)."""
    params, rest = _split_stored(p, like.model_without_params)
    own = partition.model_state(rest)
    return base.replace(
        params=params,
        model_without_params=partition.with_model_state(base.model_without_params, own),
    )


def state_skeleton(state: TrainState) -> TrainState:
    """``state`` without what its params checkpoint item holds: no params, and
    ``None`` for each array of the model's own state."""
    rest = state.model_without_params
    own = partition.model_state(rest)
    return state.replace(
        params=None,
        model_without_params=partition.with_model_state(rest, dict.fromkeys(own)),
    )


def _split_stored(p: Any, rest: Any) -> tuple[Any, Any]:
    """``(params, rest)`` from stored params: the model's own state put into
    ``rest`` (key data wrapped as the keys ``rest`` holds)."""
    own = partition.model_state(rest)
    if not own:
        return p, rest
    values = {name: _as_key_like(p[name], x) for name, x in own.items()}
    params = {name: x for name, x in p.items() if name not in own}
    return params, partition.with_model_state(rest, values)


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(x: Any) -> Any:
    """A PRNG key array's key data (abstract for an abstract key); else ``x``."""
    if not _is_key(x):
        return x
    if isinstance(x, jax.Array):
        return jax.random.key_data(x)
    data = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)


def _as_key_like(data: Any, like: Any) -> Any:
    """``data`` as a key of ``like``'s implementation if ``like`` is a key."""
    if not _is_key(like) or _is_key(data) or isinstance(data, jax.ShapeDtypeStruct):
        return data
    return jax.random.wrap_key_data(data, impl=key_impl(like))


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
