"""The parts a `TrainState` is built from, checked and owned."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._tree import describe

__all__ = ["check_grads", "check_key", "is_key", "owned_copy", "placed_like"]


def is_key(x: Any) -> bool:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.shape == ()
    return (
        isinstance(x, jax.Array | np.ndarray)
        and x.shape == (2,)
        and x.dtype == np.uint32
    )


def check_key(root_rng: Any) -> Any:
    if not is_key(root_rng):
        raise TypeError(
            "root_rng must be a single PRNG key, jax.random.key(seed) or the legacy "
            f"jax.random.PRNGKey(seed); got {describe(root_rng)}."
        )
    return root_rng


def owned_copy(tree: Any, avoid: set[int], always: bool = False) -> Any:
    """Copies the arrays of ``tree`` (all, or those in ``avoid`` by id).

    The state owns its buffers, so that donating them in a train step cannot
    delete the arrays of the model the user passed in, and no buffer is donated
    twice (optax states such as ``lookahead`` alias the params).
    """

    def own(x):
        if isinstance(x, np.ndarray | np.generic):
            return jnp.asarray(x)
        if isinstance(x, jax.Array):
            if always or id(x) in avoid:
                x = jnp.copy(x)
            avoid.add(id(x))
        return x

    return jax.tree.map(own, tree)


def placed_like(tree: Any, like: Any) -> Any:
    """``tree``'s arrays placed as those of ``like`` (same structure) are: a
    value set on a state on a mesh keeps the sharding of the one it replaces."""

    def place(x, old):
        if isinstance(x, jax.Array) and isinstance(old, jax.Array):
            if x.sharding != old.sharding:
                return jax.device_put(x, old.sharding)
        return x

    return jax.tree.map(place, tree, like)


def check_grads(grads: Any, params: Any) -> None:
    g_def, p_def = jax.tree.structure(grads), jax.tree.structure(params)
    if g_def == p_def:
        return
    if isinstance(grads, dict) and isinstance(params, dict):
        missing = sorted(set(params) - set(grads))
        extra = sorted(set(grads) - set(params))
        raise ValueError(
            "grads must have the structure of state.params: missing names "
            f"{missing}, unexpected names {extra}."
        )
    raise ValueError(
        f"grads must have the structure of state.params; got {g_def}, expected {p_def}."
    )
