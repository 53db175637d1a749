"""An exponential moving average (EMA) of the params, kept in the optimizer state.

`with_ema` wraps an optax transformation: its state is an `EmaState` holding
the wrapped optimizer's state, an update count and the EMA params, updated in
the same jitted call as the params. Being part of ``opt_state``, the EMA is
donated, sharded like its params (``optax.tree_map_params`` finds it) and
checkpointed with the state, with nothing to add to a step or a checkpoint;
without `with_ema` there is nothing at all. After each update::

    ema = decay_t * ema + (1 - decay_t) * new_params

where ``decay_t = decay``, or with ``warmup=True``
``decay_t = min(decay, (1 + t) / (10 + t))`` at the ``t``-th update (``t = 0``
first), so that early EMA weights are not dominated by the initial params. The
EMA starts as a copy of the initial params (no bias correction is needed).

`ema_params_of` finds the EMA in an optimizer state (what
``TrainState.ema_params`` returns).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pztrain._optax import check_optimizer, states_of

__all__ = [
    "EmaState",
    "NoEmaError",
    "ema_decay",
    "ema_params_of",
    "has_ema",
    "with_ema",
]


class NoEmaError(ValueError):
    """An EMA of the params was asked of a state (or checkpoint) that has none.

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain.ema import ema_params_of, NoEmaError
      >>> import optax
      >>> try:
      ...     ema_params_of(optax.sgd(0.1).init({"w": jnp.zeros(2)}))
      ... except NoEmaError as e:
      ...     print(e)  # doctest: +ELLIPSIS
      This state has no EMA of its params: build its optimizer with pztrain.with_ema...
    """


class EmaState(NamedTuple):
    """The state of `with_ema`.

    Attributes:
      inner: The wrapped optimizer's state.
      count: The number of updates so far (int32 scalar).
      ema_params: The EMA of the params, with the params' structure and dtypes.

    Example:
      >>> import optax, jax.numpy as jnp; from pztrain import with_ema
      >>> opt_state = with_ema(optax.sgd(0.1), decay=0.9).init({"w": jnp.ones(2)})
      >>> type(opt_state).__name__, int(opt_state.count), opt_state.ema_params
      ('EmaState', 0, {'w': Array([1., 1.], dtype=float32)})
    """

    inner: Any
    count: jax.Array
    ema_params: Any


def ema_decay(decay: float, count: jax.Array, warmup: bool) -> jax.Array:
    """The decay of the update after ``count`` updates (float32, traceable).

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain.ema import ema_decay
      >>> round(float(ema_decay(0.999, jnp.int32(0), warmup=True)), 6)
      0.1
      >>> round(float(ema_decay(0.999, jnp.int32(10**6), warmup=True)), 6)
      0.999
    """
    decay = jnp.float32(decay)
    if not warmup:
        return decay
    t = jnp.asarray(count, jnp.float32)
    return jnp.minimum(decay, (1.0 + t) / (10.0 + t))


def with_ema(
    optimizer: optax.GradientTransformation, decay: float, *, warmup: bool = False
) -> optax.GradientTransformationExtraArgs:
    """``optimizer``, with an EMA of the params kept in its state.

    Wrap the whole optimizer (outermost, e.g. around an ``optax.chain``): the
    EMA follows the params after the updates it returns are applied.

    Args:
      optimizer: An optax transformation (the updates it returns are applied
        to the params as usual).
      decay: The EMA's decay, in (0, 1), e.g. ``0.999``. To give each member
        of a population its own, inject it: ``optax.inject_hyperparams(
        with_ema, static_args=("optimizer", "warmup"))(optimizer=tx,
        decay=0.999)``, then ``make_population(..., decay=[...])``.
      warmup: Use ``min(decay, (1 + t) / (10 + t))`` at the ``t``-th update.

    Returns:
      A transformation whose state is an `EmaState`. Read the EMA with
      ``state.ema_params`` (or ``state.using_ema()``: the state with the EMA as
      its params, for `pztrain.evaluate`, `pztrain.save_params`, …).

    Raises:
      ValueError: if ``decay`` is not a number in (0, 1).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from pztrain import TrainState, with_ema
      >>> tx = with_ema(optax.sgd(1.0), decay=0.5)
      >>> state = TrainState.initial_state({"w": jnp.zeros(2)}, tx, jax.random.key(0))
      >>> state = state.apply_gradients({"w": -jnp.ones(2)})  # params now 1.0
      >>> state.params["w"], state.ema_params["w"]
      (Array([1., 1.], dtype=float32), Array([0.5, 0.5], dtype=float32))
    """
    check_optimizer(optimizer)
    decay = _checked_decay(decay)
    inner = optax.with_extra_args_support(optimizer)

    def init(params: Any) -> EmaState:
        ema = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
        return EmaState(inner.init(params), jnp.zeros((), jnp.int32), ema)

    def update(updates: Any, state: EmaState, params: Any = None, **extra: Any):
        if params is None:
            raise ValueError(
                "with_ema needs the params in update(updates, state, params)."
            )
        updates, inner_state = inner.update(updates, state.inner, params, **extra)
        new_params = optax.apply_updates(params, updates)
        step_size = 1.0 - ema_decay(decay, state.count, warmup)
        ema = jax.tree.map(
            lambda new, old: optax.incremental_update(new, old, step_size).astype(
                old.dtype
            ),
            new_params,
            state.ema_params,
        )
        return updates, EmaState(inner_state, state.count + 1, ema)

    return optax.GradientTransformationExtraArgs(init, update)


def ema_params_of(opt_state: Any) -> Any:
    """The EMA params an optimizer state holds (see `with_ema`).

    Raises:
      NoEmaError: if it holds none, saying how to keep one.
      ValueError: if it holds more than one.

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain import with_ema
      >>> from pztrain.ema import ema_params_of
      >>> import optax
      >>> tx = optax.chain(optax.clip(1.0), with_ema(optax.sgd(0.1), decay=0.9))
      >>> ema_params_of(tx.init({"w": jnp.ones(2)}))
      {'w': Array([1., 1.], dtype=float32)}
    """
    found = states_of(opt_state, EmaState)
    if not found:
        raise NoEmaError(
            "This state has no EMA of its params: build its optimizer with "
            "pztrain.with_ema(optimizer, decay=0.999) to keep one."
        )
    if len(found) > 1:
        raise ValueError(
            f"The optimizer state holds {len(found)} EMAs (with_ema nested); "
            "wrap the optimizer in with_ema once."
        )
    return found[0].ema_params


def has_ema(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds an `EmaState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from pztrain import with_ema
      >>> from pztrain.ema import has_ema
      >>> import optax
      >>> params = {"w": jnp.ones(2)}
      >>> has_ema(with_ema(optax.sgd(0.1), 0.9).init(params))
      True
      >>> has_ema(optax.sgd(0.1).init(params))
      False
    """
    return bool(states_of(opt_state, EmaState))


def _checked_decay(decay: Any) -> Any:
    """``decay`` as a float; a scalar array as it is (injected with
    ``optax.inject_hyperparams``: one value per member of a population), its
    value checked unless it is traced."""
    if isinstance(decay, jax.Array | np.ndarray) and np.ndim(decay) == 0:
        if isinstance(decay, jax.core.Tracer) or 0.0 < float(decay) < 1.0:
            return decay
    if (
        isinstance(decay, bool)
        or not isinstance(decay, numbers.Real)
        or not 0.0 < float(decay) < 1.0
    ):
        raise ValueError(
            f"with_ema(decay=...) must be a number in (0, 1), e.g. 0.999; got "
            f"{decay!r}."
        )
    return float(decay)
