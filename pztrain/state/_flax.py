"""Flax's habits on pztrain's `TrainState`, without importing flax.

* ``state.replace(apply_fn=..., tx=...)``: Flax's field names, which are views
  here (`flax_fields` turns them into pztrain's fields);
* ``flax.serialization.to_state_dict(state)`` / ``from_state_dict``: a state
  class is registered with flax's serialization when a state is built and
  flax is already imported (`adopt`); flax is never imported from here;
* Flax's fp8 ``_overwrite_with_gradient`` collection is refused by name: its
  values are replaced by their gradients, not trained, which pztrain's update
  does not do.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp

from pztrain._tree import named_leaves
from pztrain.partition import ApplyFnModel

__all__ = ["OVERWRITE_WITH_GRADIENT", "adopt", "flax_fields"]

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"
"""The collection Flax's fp8 layers keep (``flax.linen.fp8_ops``)."""


def flax_fields(rest: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``replace`` keywords with Flax's names made pztrain's fields.

    ``tx`` is ``optimizer_def``; ``apply_fn`` (of a state from
    ``TrainState.create``) becomes a new ``model_without_params`` around it.

    Raises:
      TypeError: for ``apply_fn`` on a state that holds a model, or a field
        given under both names.
    """
    if "apply_fn" not in fields and "tx" not in fields:
        return fields
    fields = dict(fields)
    for flax_name, name in (
        ("tx", "optimizer_def"),
        ("apply_fn", "model_without_params"),
    ):
        if flax_name in fields and name in fields:
            raise TypeError(f"replace got both {flax_name}= and {name}=; pass one.")
    if "tx" in fields:
        fields["optimizer_def"] = fields.pop("tx")
    if "apply_fn" in fields:
        if not isinstance(rest, ApplyFnModel):
            raise TypeError(
                "replace(apply_fn=...) needs a state built with TrainState.create("
                f"apply_fn=..., params=..., tx=...); this state holds a "
                f"{type(rest).__name__} model: replace model_without_params instead."
            )
        apply_fn = fields.pop("apply_fn")
        fields["model_without_params"] = dataclasses.replace(rest, apply_fn=apply_fn)
    return fields


def adopt(cls: type, params: Any) -> None:
    """Checks a new state's params for Flax habits pztrain does not follow, and
    registers ``cls`` with ``flax.serialization`` if flax is imported.

    Raises:
      ValueError: if the params hold Flax's fp8 ``_overwrite_with_gradient``
        collection.
    """
    for name, _ in named_leaves(params):
        if OVERWRITE_WITH_GRADIENT in name.split("/"):
            raise ValueError(
                f"The params hold {name!r}, in Flax's fp8 "
                f"{OVERWRITE_WITH_GRADIENT!r} collection, whose values are replaced "
                "by their gradients instead of trained; pztrain trains every "
                "param. Pass variables['params'] as params and keep the fp8 "
                f"variables['{OVERWRITE_WITH_GRADIENT}'] out of the state (e.g. "
                "flax.linen.Dense instead of fp8 dot-general layers)."
            )
    serialization = sys.modules.get("flax.serialization")
    if serialization is not None and not serialization.is_serializable(cls):
        serialization.register_serialization_state(cls, _to_dict, _from_dict)


def _data_fields(state: Any) -> list[str]:
    """The pytree fields a state dict holds: all but ``model_without_params``
    (structure from code, as in a checkpoint) and static ones."""
    return [
        f.name
        for f in dataclasses.fields(state)
        if f.metadata.get("pytree_node", True) and f.name != "model_without_params"
    ]


def _to_dict(state: Any) -> dict[str, Any]:
    to_state_dict = sys.modules["flax.serialization"].to_state_dict
    out = {name: to_state_dict(getattr(state, name)) for name in _data_fields(state)}
    if jnp.issubdtype(state.root_rng.dtype, jax.dtypes.prng_key):
        out["root_rng"] = jax.random.key_data(state.root_rng)  # msgpack-able
    return out


def _from_dict(target: Any, state_dict: dict[str, Any]) -> Any:
    from_state_dict = sys.modules["flax.serialization"].from_state_dict
    names = _data_fields(target)
    missing = sorted(set(names) - set(state_dict))
    if missing:
        raise ValueError(
            f"The state dict has no {missing} for {type(target).__name__} "
            f"(it has {sorted(state_dict)})."
        )
    values = {}
    for name in names:
        if name == "root_rng" and jnp.issubdtype(
            target.root_rng.dtype, jax.dtypes.prng_key
        ):
            impl = jax.random.key_impl(target.root_rng)
            values[name] = jax.random.wrap_key_data(state_dict[name], impl=impl)
        else:
            values[name] = from_state_dict(getattr(target, name), state_dict[name])
    return target.replace(**values)
