"""What pztrain asks of optax: one update, finding states in an optimizer state,
and reading or setting injected hyperparameters.

An optimizer state is a pytree of optax state objects (``ScaleByAdamState``,
``InjectHyperparamsState``, ``ApplyIfFiniteState`` …), nested inside
``optax.chain``, ``optax.masked``, ``optax.MultiSteps`` and the like.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "HyperparamsView",
    "check_optimizer",
    "injected_hyperparams",
    "optimizer_update",
    "states_of",
    "set_hyperparams",
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


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


class HyperparamsView(Mapping):
    """A read-only mapping name → value of the injected hyperparameters.

    Reading works as for a dict; writing raises a `TypeError` that points to
    ``TrainState.with_hyperparams`` (a write into a copy would do nothing).

    Example:
      >>> view = HyperparamsView({"learning_rate": 0.1})
      >>> view["learning_rate"], list(view)
      (0.1, ['learning_rate'])
      >>> view["learning_rate"] = 0.01
      Traceback (most recent call last):
      ...
      TypeError: state.hyperparams is read-only (a TrainState is immutable); ...
    """

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]):
        self._values = dict(values)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"HyperparamsView({self._values!r})"

    def _refuse(self, name: str = "learning_rate", *_: Any) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            name = "learning_rate"
        raise TypeError(
            "state.hyperparams is read-only (a TrainState is immutable); set a "
            f"hyperparameter with state = state.with_hyperparams({name}=0.01), "
            "which returns a new state."
        )

    __setitem__ = __delitem__ = _refuse

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Refused, as item assignment: use ``TrainState.with_hyperparams``."""
        self._refuse(next(iter(kwargs), "learning_rate"))


def _injected(opt_state: Any) -> list[tuple[Any, Any]]:
    """Each injected state with the label of the ``optax.partition`` group that
    holds it (``None`` outside a partition), in order."""

    def is_kind(x: Any) -> bool:
        return isinstance(x, _INJECTED)

    flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_kind)[0]
    return [(_group_of(path), x) for path, x in flat if is_kind(x)]


def _group_of(path: tuple[Any, ...]) -> Any:
    label = None
    for before, key in zip(path, path[1:], strict=False):
        if getattr(before, "name", None) == "inner_states" and hasattr(key, "key"):
            label = key.key
    return label


def _named(opt_state: Any) -> dict[str, tuple[Any, str]]:
    """Public name → (injected state, its own name for the value).

    A name injected by several ``optax.partition`` groups reads as
    ``"<label>/<name>"``; any other name as itself.
    """
    found = _injected(opt_state)
    if not found:
        raise ValueError(
            "The optimizer state holds no injected hyperparameters. Wrap the "
            "optimizer to read them, e.g. "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
        )
    holders: dict[str, list[tuple[Any, Any]]] = {}
    for group, inject_state in found:
        for name in inject_state.hyperparams:
            holders.setdefault(name, []).append((group, inject_state))
    named: dict[str, tuple[Any, str]] = {}
    for name, where in holders.items():
        groups = [group for group, _ in where]
        if len(where) == 1:
            named[name] = (where[0][1], name)
        elif None in groups or len(set(groups)) < len(groups):
            raise ValueError(
                f"Hyperparameter {name!r} is injected by more than one "
                "transformation; read each from its own optimizer state "
                "(state.opt_state[i].hyperparams)."
            )
        else:
            for group, inject_state in where:
                named[f"{group}/{name}"] = (inject_state, name)
    return named


def injected_hyperparams(opt_state: Any) -> HyperparamsView:
    """The hyperparameters ``optax.inject_hyperparams`` keeps, merged (read-only).

    A name injected in several groups of an ``optax.partition`` (one learning
    rate per group) is qualified by the group's label: ``"embed/learning_rate"``.

    Raises:
      ValueError: if there are none, or two injected transformations outside
        distinct partition groups use the same name.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> lr = optax.inject_hyperparams(optax.sgd)
      >>> tx = optax.partition({"a": lr(learning_rate=0.1), "b": lr(learning_rate=0.2)},
      ...                      {"w": "a", "v": "b"})
      >>> sorted(injected_hyperparams(tx.init({"w": jnp.ones(1), "v": jnp.ones(1)})))
      ['a/learning_rate', 'b/learning_rate']
    """
    named = _named(opt_state)
    return HyperparamsView({k: s.hyperparams[n] for k, (s, n) in named.items()})


def _settable(named: dict[str, tuple[Any, str]], name: str) -> tuple[Any, str]:
    """The injected state that holds ``name`` (as a number, not a schedule)."""
    holder, own = named[name]
    scheduled = getattr(holder, "hyperparams_states", {})
    if own in scheduled:
        raise ValueError(
            f"Hyperparameter {name!r} follows a schedule: optax recomputes it at "
            "every update, so setting it would do nothing. Inject a number instead "
            f"(optax.inject_hyperparams(...)({own}=1e-3)) to set it during a run."
        )
    return holder, own


def _new_value(name: str, old: Any, value: Any) -> jax.Array:
    """``value`` as a fresh array of ``old``'s dtype and shape (a copy: the
    state's buffers are donated by the train step)."""
    old = jnp.asarray(old)
    try:
        new = jnp.array(value, dtype=old.dtype, copy=True)
    except TypeError as e:
        raise TypeError(
            f"Hyperparameter {name!r} must be a number or an array; got "
            f"{type(value).__name__} ({e})."
        ) from None
    if new.shape != old.shape:
        raise ValueError(
            f"Hyperparameter {name!r} has shape {old.shape}; got a value of shape "
            f"{new.shape}."
        )
    return new


def set_hyperparams(opt_state: Any, values: dict[str, Any]) -> Any:
    """``opt_state`` with the injected hyperparameters ``values`` set.

    Only the injected states that change are rebuilt; every other leaf is kept.

    Raises:
      ValueError: naming unknown names (and listing the known ones), a name
        injected twice, or one that follows a schedule.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = optax.chain(optax.clip(1.0),
      ...                  optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
      >>> s = set_hyperparams(tx.init(jnp.zeros(2)), {"learning_rate": 0.5})
      >>> injected_hyperparams(s)["learning_rate"]
      Array(0.5, dtype=float32)
    """
    named = _named(opt_state) if values else {}
    unknown = sorted(set(values) - set(named))
    if unknown:
        raise ValueError(
            f"Unknown hyperparameter(s) {unknown}; the injected ones are "
            f"{sorted(named)}."
        )
    changes: dict[int, dict[str, Any]] = {}
    for name, value in values.items():
        holder, own = _settable(named, name)
        new = _new_value(name, holder.hyperparams[own], value)
        changes.setdefault(id(holder), {})[own] = new

    def rebuild(x: Any) -> Any:
        if isinstance(x, _INJECTED) and id(x) in changes:
            return x._replace(hyperparams={**x.hyperparams, **changes[id(x)]})
        return x

    return jax.tree.map(rebuild, opt_state, is_leaf=lambda x: isinstance(x, _INJECTED))
