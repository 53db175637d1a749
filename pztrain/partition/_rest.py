"""The model without its params: its static spec and its arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pztrain._tree import is_array
from pztrain.partition._model import (
    NnxModel,
    freeze_state_vars,
    has_state_vars,
    merge,
    thaw_state_vars,
)
from pztrain.partition._nnx import bind_nnx

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
      stateful: Whether the rest holds state a loss function may change:
        penzai v2 state variables, or a Flax NNX model's variables that are not
        params (batch statistics, rng state …).

    Example:
      >>> import jax.numpy as jnp; from pztrain.partition import split_rest
      >>> from pztrain.partition import split
      >>> params, rest = split({"w": jnp.ones(2), "n": jnp.arange(3)})
      >>> spec, arrays = split_rest(rest)
      >>> model, new_arrays = spec.bind(params, arrays)  # what a loss function gets
      >>> model["w"], new_arrays(), spec == split_rest(rest)[0]  # one compile
      (Array([1., 1.], dtype=float32), None, True)
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

    def bind(
        self,
        params: Any,
        arrays: list[Any],
        rng: jax.Array | None = None,
        mode: str | None = None,
    ) -> tuple[Any, Callable[[], Any]]:
        """The model to give a loss function, and a reader of the rest's new arrays.

        Args:
          params: The params to merge in.
          arrays: The rest's arrays (from `split_rest`, or new ones).
          rng: The step's key. A Flax NNX model's rng streams are reseeded from
            it (see `pztrain.partition.reseed_streams`); other families ignore it.
          mode: ``"train"`` or ``"eval"``: a Flax NNX model is switched to that
            mode (``model.train()`` / ``model.eval()``); ``None`` leaves its
            modes as built. Other families ignore it.

        Returns:
          ``(model, new_arrays)``: the rest rebuilt from ``arrays`` with
          ``params`` merged in (state variables thawed, so the loss function can
          update them), and a function to call after the loss ran; it returns
          the rest's arrays with the updated state, or ``None`` when the rest
          has none.
        """
        rest = self.build(arrays)
        if isinstance(rest, NnxModel):
            model, after = bind_nnx(rest, params, rng, mode)
            return model, lambda: self._arrays_of(after())
        if not self.stateful:
            return merge(params, rest), lambda: None
        rest = thaw_state_vars(rest)
        return merge(params, rest), lambda: split_rest(freeze_state_vars(rest))[1]

    def _arrays_of(self, rest: Any) -> list[Any] | None:
        """The arrays of an updated rest, or ``None`` if the rest is stateless."""
        return split_rest(rest)[1] if self.stateful else None


def split_rest(rest: Any) -> tuple[RestSpec, list[Any]]:
    """Splits ``model_without_params`` into its `RestSpec` and its arrays.

    Example:
      >>> import jax.numpy as jnp; from pztrain.partition import split_rest
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
    stateful = rest.stateful if isinstance(rest, NnxModel) else has_state_vars(rest)
    return RestSpec(treedef, tuple(static), stateful), arrays
