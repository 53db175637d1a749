"""The totals of a `Summary`: per part of the state (params, the rest, the
optimizer state with its types and EMA, the loss-function state, a subclass's
fields), and the key's text."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pztrain._optax import states_of
from pztrain._tree import describe, is_array
from pztrain.ema import EmaState

__all__ = ["human", "key_text", "optimizer_state_types", "totals"]

# The fields of TrainState itself; any other dataclass field is a subclass's.
BASE_FIELDS = (
    "step",
    "root_rng",
    "params",
    "model_without_params",
    "opt_state",
    "loss_fn_state",
    "optimizer_def",
)
# Leaves of an optimizer state that are not states (MaskedNode: a masked param).
_NOT_STATES = (int, float, complex, str, optax.MaskedNode)


def optimizer_state_types(opt_state: Any) -> str:
    """The type names of an optax state, nested as the state is.

    Example:
      >>> from pztrain.summary import optimizer_state_types
      >>> import jax.numpy as jnp, optax
      >>> optimizer_state_types(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
      '(ScaleByAdamState, EmptyState)'
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> optimizer_state_types(tx.init(jnp.zeros(2)))
      'InjectStatefulHyperparamsState((EmptyState, EmptyState))'
    """
    return _types(opt_state) or type(opt_state).__name__


def _types(x: Any) -> str | None:
    if x is None or is_array(x) or isinstance(x, _NOT_STATES):
        return None
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # an optax NamedTuple state
        inner = [t for t in map(_types, x) if t]
        name = type(x).__name__
        return f"{name}({', '.join(inner)})" if inner else name
    if isinstance(x, list | tuple):
        return f"({', '.join(t or '-' for t in map(_types, x))})"
    if isinstance(x, dict):
        inner = {k: t for k, t in ((k, _types(v)) for k, v in x.items()) if t}
        if not inner:
            return None
        return "{" + ", ".join(f"{k}: {t}" for k, t in inner.items()) + "}"
    return type(x).__name__


def human(nbytes: int) -> str:
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"


def key_text(key: Any) -> str:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return f"{jax.random.key_impl(key)} key, shape {tuple(key.shape)}"
    return f"legacy raw key {describe(key)} (jax.random.PRNGKey)"


def total(part: str, tree: Any, detail: str) -> tuple[str, ...]:
    arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")]
    count = sum(int(np.prod(np.shape(x))) for x in arrays)
    nbytes = sum(int(x.nbytes) for x in arrays)
    per_device = human(_per_device(arrays))
    return (part, f"{len(arrays):,}", f"{count:,}", human(nbytes), per_device, detail)


def _per_device(arrays: Sequence[Any]) -> int:
    """Bytes of ``arrays`` on the most loaded device (a host array: all of it)."""
    load: dict[Any, int] = {}
    host = 0
    for x in arrays:
        sharding = getattr(x, "sharding", None)
        if sharding is None or not np.size(x):
            host += int(x.nbytes)
            continue
        shard = int(np.prod(sharding.shard_shape(x.shape))) * x.nbytes // np.size(x)
        for device in sharding.device_set:
            load[device] = load.get(device, 0) + shard
    return host + max(load.values(), default=0)


def _field_detail(value: Any) -> str:
    if (
        is_array(value)
        and np.shape(value) == ()
        and not jnp.issubdtype(value.dtype, jax.dtypes.prng_key)
    ):
        return f"{describe(value)} = {np.asarray(value).item()!r}"
    if is_array(value):
        return describe(value)
    text = repr(value) if not jax.tree.leaves(value) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _ema_total(opt_state: Any) -> list[tuple[str, ...]]:
    """The row of the EMA params (part of ``opt_state``), if it keeps them."""
    found = states_of(opt_state, EmaState)
    if len(found) != 1:
        return []
    updates = int(np.asarray(found[0].count))
    detail = f"in opt_state (with_ema), {updates:,} updates"
    return [total("  ema_params", found[0].ema_params, detail)]


def totals(state: Any) -> list[tuple[str, ...]]:
    lfs = state.loss_fn_state
    totals = [
        total("params", state.params, ""),
        total("model_without_params", state.model_without_params, ""),
        total("opt_state", state.opt_state, optimizer_state_types(state.opt_state)),
        *_ema_total(state.opt_state),
        total("loss_fn_state", lfs, _field_detail(lfs)),
    ]
    for field in dataclasses.fields(state):
        if field.name not in BASE_FIELDS:
            value = getattr(state, field.name)
            totals.append(total(field.name, value, _field_detail(value)))
    return totals
