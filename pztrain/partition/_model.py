"""The pieces of a split model: slots, the Flax-style wrapper, and merging back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
from penzai.core import variables as pz_vars

__all__ = [
    "ApplyFnModel",
    "ParamSlot",
    "PartitionError",
    "Trainable",
    "freeze_state_vars",
    "has_state_vars",
    "merge",
    "thaw_state_vars",
    "to_user_model",
]

Trainable = Callable[[str, Any], bool] | str | None
"""A trainable filter: ``None`` (every float array), a regex searched in each
parameter name, or a predicate ``(name, value) -> bool``."""


class PartitionError(ValueError):
    """A model cannot be split into named parameters as asked."""


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Marks where a trainable array was taken out of a model.

    A slot is a pytree node with no children, so flattening a model without its
    params yields only the arrays that stay behind.

    Attributes:
      name: The parameter name; the key of the array in ``TrainState.params``.
    """

    name: str


jax.tree_util.register_static(ParamSlot)


@dataclasses.dataclass(frozen=True)
class ApplyFnModel:
    """A Flax-style model: an ``apply_fn`` and its params, callable like a model.

    ``ApplyFnModel(apply_fn, params)(*args, **kwargs)`` calls
    ``apply_fn({"params": params}, *args, **kwargs)``, so a loss function written
    as ``model(x)`` works for Flax-style states too. ``apply_fn`` is static;
    ``params`` is the pytree child.

    Attributes:
      apply_fn: The function that applies the model, e.g. ``module.apply``.
      params: The parameter pytree (``None`` in ``model_without_params``).

    Example:
      >>> import jax.numpy as jnp
      >>> m = ApplyFnModel(lambda v, x: v["params"]["w"] * x, {"w": jnp.array(2.0)})
      >>> m(3.0)
      Array(6., dtype=float32, weak_type=True)
    """

    apply_fn: Callable[..., Any]
    params: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply_fn({"params": self.params}, *args, **kwargs)


jax.tree_util.register_dataclass(
    ApplyFnModel, data_fields=["params"], meta_fields=["apply_fn"]
)


# ----------------------------------------------------------------------------
# merge


def _is_slot(x: Any) -> bool:
    return isinstance(x, ParamSlot)


def merge(params: Mapping[str, Any] | Any, rest: Any) -> Any:
    """Puts ``params`` back into the slots of ``rest``.

    For penzai v2 the result holds frozen ``pz.ParameterValue`` s, as penzai's own
    trainer passes to a loss function; `to_user_model` turns them back into
    ``pz.Parameter`` variables.

    Args:
      params: The dict from `split` (or, for an `ApplyFnModel`, its params).
      rest: The model without params from `split`.

    Returns:
      The model with every slot filled.

    Raises:
      PartitionError: if a slot's name is missing from ``params``.
    """
    if isinstance(rest, ApplyFnModel):
        return dataclasses.replace(rest, params=params)

    def fill(x):
        if _is_slot(x):
            try:
                return params[x.name]
            except KeyError:
                raise PartitionError(
                    f"Parameter {x.name!r} is missing from params (it has "
                    f"{len(params)} entries). Keep every name that split() made."
                ) from None
        return x

    return jax.tree.map(fill, rest, is_leaf=_is_slot)


def _is_var_value(x: Any) -> bool:
    return isinstance(x, pz_vars.AbstractVariableValue)


def _thaw(tree: Any, is_value: Callable[[Any], bool]) -> Any:
    """Unfreezes matching variable values; one new variable object per label."""
    made: dict[Hashable, Any] = {}

    def thaw(x):
        if not is_value(x):
            return x
        slot = x.get_slot()
        if slot not in made:
            made[slot] = x.unfreeze_as_copy()
        return made[slot]

    return jax.tree.map(thaw, tree, is_leaf=is_value)


def to_user_model(model: Any) -> Any:
    """Turns frozen penzai v2 variable values back into mutable variables.

    Each label becomes one new variable object, so shared parameters stay shared.
    Models of other families are returned unchanged.
    """
    return _thaw(model, _is_var_value)


def _is_state_value(x: Any) -> bool:
    return isinstance(x, pz_vars.StateVariableValue)


def has_state_vars(rest: Any) -> bool:
    """Whether ``rest`` holds penzai v2 state variables (their updates persist)."""
    return any(
        _is_state_value(x) for x in jax.tree.leaves(rest, is_leaf=_is_state_value)
    )


def thaw_state_vars(rest: Any) -> Any:
    """Replaces frozen state-variable values by mutable ``pz.StateVariable`` s."""
    return _thaw(rest, _is_state_value)


def freeze_state_vars(rest: Any) -> Any:
    """The inverse of `thaw_state_vars`: freezes the (possibly updated) variables."""
    is_var = lambda x: isinstance(x, pz_vars.StateVariable)  # noqa: E731
    return jax.tree.map(lambda x: x.freeze() if is_var(x) else x, rest, is_leaf=is_var)
