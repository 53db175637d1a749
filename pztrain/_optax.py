"""What pztrain asks of optax: one update, and finding states in an optimizer state.

An optimizer state is a pytree of optax state objects (``ScaleByAdamState``,
``InjectHyperparamsState``, ``ApplyIfFiniteState`` …), nested inside
``optax.chain``, ``optax.masked``, ``optax.MultiSteps`` and the like.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

__all__ = [
    "check_optimizer",
    "injected_hyperparams",
    "optimizer_update",
    "states_of",
]


def optimizer_update(
    optimizer_def: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any
) -> tuple[Any, Any]:
    """One optax update: ``(new_params, new_opt_state)``."""
    updates, new_opt_state = optimizer_def.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state


def check_optimizer(optimizer_def: Any) -> None:
    """Raises a `TypeError` unless ``optimizer_def`` has ``init`` and ``update``."""
    if not (hasattr(optimizer_def, "init") and hasattr(optimizer_def, "update")):
        raise TypeError(
            "optimizer_def must be an optax GradientTransformation (with init and "
            f"update), e.g. optax.adam(1e-3); got {type(optimizer_def).__name__}."
        )


def states_of(opt_state: Any, *kinds: type) -> list[Any]:
    """The optax states of the given types anywhere in ``opt_state``, in order.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = optax.chain(optax.clip(1.0), optax.adam(0.1))
      >>> [type(s).__name__ for s in states_of(tx.init(jnp.zeros(2)),
      ...                                      optax.ScaleByAdamState)]
      ['ScaleByAdamState']
    """

    def is_kind(x: Any) -> bool:
        return isinstance(x, kinds)

    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_kind) if is_kind(x)]


def injected_hyperparams(opt_state: Any) -> dict[str, Any]:
    """The hyperparameters ``optax.inject_hyperparams`` keeps, merged into one dict.

    Raises:
      ValueError: if there are none, or two injected transformations use the
        same name.
    """
    found = states_of(
        opt_state, optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState
    )
    if not found:
        raise ValueError(
            "The optimizer state holds no injected hyperparameters. Wrap the "
            "optimizer to read them, e.g. "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
        )
    merged: dict[str, Any] = {}
    for inject_state in found:
        for name, value in inject_state.hyperparams.items():
            if name in merged:
                raise ValueError(
                    f"Hyperparameter {name!r} is injected by more than one "
                    "transformation; read each from its own optimizer state "
                    "(state.opt_state[i].hyperparams)."
                )
            merged[name] = value
    return merged
