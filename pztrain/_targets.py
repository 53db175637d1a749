"""Where loaded params go: into a `TrainState`, a model or a params pytree."""

from __future__ import annotations

from typing import Any

import jax

from pztrain import partition
from pztrain._tree import is_array, named_leaves
from pztrain.state import TrainState

__all__ = ["filled", "params_of", "params_target"]


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
    params, rest = partition.split(like)
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
        is_array(x) for x in jax.tree.leaves(like)
    )
