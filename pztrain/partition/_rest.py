"""The model without its params: its static spec and its arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pztrain._tree import is_array
from pztrain.partition._model import (
    freeze_state_vars,
    has_state_vars,
    merge,
    thaw_state_vars,
)

__all__ = ["RestSpec", "split_rest"]


@dataclasses.dataclass(frozen=True)
class RestSpec:
    """The static part of a model without its params (hashable).

    `split_rest` cuts ``model_without_params`` into this spec and its arrays. A
    jitted step takes only the arrays and rebuilds the rest inside with
    `build`, so a model's Python-level structure is flattened once, not on every
    call.

    Attributes:
      treedef: The rest's tree structure.
      static: ``(position, value)`` of each leaf that is not an array.
      stateful: Whether the rest holds penzai v2 state variables, whose values a
        loss function may change.
    """

    treedef: Any
    static: tuple[tuple[int, Any], ...]
    stateful: bool

    def build(self, arrays: list[Any]) -> Any:
        """The rest, from the arrays that `split_rest` gave (or new ones)."""
        leaves = list(arrays)
        for i, value in self.static:
            leaves.insert(i, value)
        return self.treedef.unflatten(leaves)

    def bind(self, params: Any, arrays: list[Any]) -> tuple[Any, Callable[[], Any]]:
        """The model to give a loss function, and a reader of the rest's new arrays.

        Returns:
          ``(model, new_arrays)``: the rest rebuilt from ``arrays`` with
          ``params`` merged in (state variables thawed, so the loss function can
          update them), and a function to call after the loss ran; it returns
          the rest's arrays with the updated state variables, or ``None`` when
          the rest has none.
        """
        rest = self.build(arrays)
        if not self.stateful:
            return merge(params, rest), lambda: None
        rest = thaw_state_vars(rest)
        return merge(params, rest), lambda: split_rest(freeze_state_vars(rest))[1]


def split_rest(rest: Any) -> tuple[RestSpec, list[Any]]:
    """Splits ``model_without_params`` into its `RestSpec` and its arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain.partition import split
      >>> _, rest = split({"w": jnp.ones(2), "n": jnp.arange(3), "act": "relu"})
      >>> spec, arrays = split_rest(rest)
      >>> arrays
      [Array([0, 1, 2], dtype=int32)]
      >>> spec.build(arrays)["act"]
      'relu'
    """
    leaves, treedef = jax.tree.flatten(rest)
    static, arrays = [], []
    for i, leaf in enumerate(leaves):
        if is_array(leaf):
            arrays.append(leaf)
        else:
            static.append((i, leaf))
    return RestSpec(treedef, tuple(static), has_state_vars(rest)), arrays
