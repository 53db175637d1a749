"""The parts a `TrainState` is built from, checked and owned."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._tree import describe

__all__ = [
    "check_grads",
    "check_key",
    "check_opt_state",
    "is_key",
    "owned_copy",
    "placed_like",
]


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
    value set on a state on a mesh keeps the sharding of the one it replaces,
    and one set on a state committed to its device is committed too (a train
    step compiles again for arrays placed otherwise)."""

    def place(x, old):
        if _concrete(x) and _concrete(old):  # a tracer has no placement
            # committed as the old one was too: another placement, another compile
            if x.sharding != old.sharding or old.committed > x.committed:
                return jax.device_put(x, old.sharding)
        return x

    return jax.tree.map(place, tree, like)


def _concrete(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


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


@functools.lru_cache(maxsize=16)
def _expected_state(optimizer_def: Any, params_key: Any) -> tuple[Any, tuple]:
    """The structure and leaf shapes of ``optimizer_def.init`` for params of
    ``params_key`` (a treedef and leaf shapes and dtypes)."""
    treedef, leaves = params_key
    params = jax.tree.unflatten(
        treedef, [jax.ShapeDtypeStruct(s, d) for s, d in leaves]
    )
    abstract = jax.eval_shape(optimizer_def.init, params)
    flat, state_def = jax.tree.flatten(abstract)
    return state_def, tuple(np.shape(x) for x in flat)


def _shapes_key(params: Any) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves)


def check_opt_state(
    optimizer_def: Any, opt_state: Any, params: Any, members: int | None = None
) -> None:
    """Refuses an ``opt_state`` that ``optimizer_def.init(params)`` would not
    make, naming the fields that differ. For a population of ``members``, each
    member's: params and optimizer state carry a leading member axis."""
    if members is not None:
        params = jax.tree.map(_member_shape, params)
    try:
        hash(optimizer_def)
        key = _shapes_key(params)
        state_def, shapes = _expected_state(optimizer_def, key)
    except Exception:  # an optimizer or params this check cannot judge
        return
    if members is not None:
        shapes = tuple((members, *shape) for shape in shapes)
    leaves, got_def = jax.tree.flatten(opt_state)
    if got_def == state_def and tuple(np.shape(x) for x in leaves) == shapes:
        return
    expected = jax.eval_shape(optimizer_def.init, params)
    if members is not None:
        expected = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((members, *x.shape), x.dtype), expected
        )
    raise ValueError(_opt_state_message(expected, opt_state))


def _member_shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)


def _described(tree: Any) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): describe(x) for p, x in flat}


def _state_types(tree: Any) -> list[str]:
    def is_state(x: Any) -> bool:
        return isinstance(x, tuple) and hasattr(x, "_fields")

    found = jax.tree.leaves(tree, is_leaf=is_state)
    return [type(x).__name__ for x in found if is_state(x)]


def _few(items: list[str], most: int = 4) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _opt_state_message(expected: Any, got: Any) -> str:
    want, have = _described(expected), _described(got)
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in want]
    reshaped = [
        f"{k} ({have[k]}, expected {want[k]})"
        for k in want
        if k in have and want[k] != have[k]
    ]
    parts = []
    if missing:
        parts.append(f"it lacks {_few(missing)}")
    if unexpected:
        parts.append(f"it has {_few(unexpected)}, which the optimizer does not make")
    if reshaped:
        parts.append(f"{_few(reshaped)} differ in shape or dtype")
    types_want, types_have = _state_types(expected), _state_types(got)
    if types_want != types_have:
        parts.append(f"its states are {types_have}; the optimizer's are {types_want}")
    return (
        "opt_state is not a state of this optimizer (optimizer_def) for these "
        f"params: {'; '.join(parts) or 'its structure differs'}. Build it with "
        "optimizer_def.init(params), or replace optimizer_def= and opt_state= "
        "together."
    )
