"""Grad norms as step metrics (``build_train_step(grad_norms=...)``): computed
on device inside the step, added to the loss function's aux, and so summed and
logged like any other metric."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from pztrain._tree import named_leaves

__all__ = ["GRAD_NORMS", "checked_grad_norms", "with_grad_norms"]

GRAD_NORMS = (None, "global", "per_param")


def checked_grad_norms(value: Any) -> str | None:
    """``value`` if it is one of `GRAD_NORMS`."""
    if value not in GRAD_NORMS or isinstance(value, bool):
        raise ValueError(
            "grad_norms must be None (off), 'global' (the norm of all grads) or "
            f"'per_param' (that and one per parameter); got {value!r}."
        )
    return value


def with_grad_norms(aux: Any, grads: Any, kind: str | None) -> Any:
    """``aux`` with the grad norms added: ``"grad_norm"`` (all grads), and with
    ``kind="per_param"`` ``"grad_norm/<param name>"`` for each (float32, L2).

    Example:
      >>> import jax.numpy as jnp
      >>> out = with_grad_norms({"acc": 1.0}, {"w": jnp.array([3.0, 4.0])}, "per_param")
      >>> {k: float(v) for k, v in out.items()}
      {'acc': 1.0, 'grad_norm': 5.0, 'grad_norm/w': 5.0}
    """
    if kind is None:
        return aux
    if aux is None or aux == ():
        aux = {}
    if not isinstance(aux, Mapping):
        raise TypeError(
            "build_train_step(grad_norms=...) adds the norms to the loss "
            "function's aux, which must then be a dict (or None); got "
            f"{type(aux).__name__}. Return (loss, state, {{...}})."
        )
    clash = sorted(str(k) for k in aux if str(k).split("/")[0] == "grad_norm")
    if clash:
        raise ValueError(
            f"The loss function's aux has {clash}, names that grad_norms "
            f"{kind!r} uses; rename them."
        )
    squares = {
        name: jnp.sum(jnp.square(g.astype(jnp.float32)))
        for name, g in named_leaves(grads)
    }
    norms = {"grad_norm": jnp.sqrt(sum(squares.values(), jnp.float32(0.0)))}
    if kind == "per_param":
        norms.update({f"grad_norm/{n}": jnp.sqrt(s) for n, s in squares.items()})
    return {**aux, **norms}
