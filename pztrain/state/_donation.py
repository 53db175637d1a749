"""Donation: a train step consumes the arrays of the state it is given.

States share arrays: ``state.replace(...)`` keeps every array it does not
replace, so the new state and the old one hold the same buffers, and a step
that consumes one consumes both. `note_consumer` remembers which call (`fit`,
at a line of the user's code) was given a state's arrays, so that the error of
a later use names it.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import jax

__all__ = ["DonatedStateError", "check_alive", "note_consumer", "raise_if_donated"]

_PACKAGE = str(Path(__file__).resolve().parents[1])
# id(array) -> (a weak reference to it, the call it was given to)
_CONSUMERS: dict[int, tuple[weakref.ref, str]] = {}


class DonatedStateError(RuntimeError):
    """A state whose arrays were donated to a train step was used again.

    Example:
      >>> import jax.numpy as jnp, optax, jax; from pztrain import DonatedStateError
      >>> from pztrain import TrainState, build_train_step
      >>> def loss_fn(*, model, state, rng):
      ...     return jnp.sum(model["w"] ** 2), state, {}
      ...
      >>> state = TrainState.initial_state({"w": jnp.ones(2)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> new_state, aux = build_train_step(loss_fn)(state)  # consumes state
      >>> try:
      ...     state.summary()
      ... except DonatedStateError as e:
      ...     print(e)  # doctest: +ELLIPSIS
      ...
      state.summary(): the params of this TrainState were donated to a train step...
      >>> int(new_state.step)  # the state the step returned is the one to use
      1
    """


def _forget(key: int) -> Any:
    return lambda _: _CONSUMERS.pop(key, None)


def _inside(frame: Any) -> bool:
    """A frame of pztrain's code (a generated ``__init__`` of its classes too)."""
    module = frame.f_globals.get("__name__") or ""
    return module.partition(".")[0] == "pztrain" or frame.f_code.co_filename.startswith(
        _PACKAGE
    )


def caller() -> str:
    """``file:line`` of the innermost frame outside pztrain (the user's call)."""
    frame = sys._getframe(1)
    while frame is not None and _inside(frame):
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def note_consumer(tree: Any, call: str) -> None:
    """Remembers that ``call`` (e.g. ``"pztrain.fit(...)"``) will donate the
    arrays of ``tree``, with the place in the user's code it was called from."""
    where = f"{call} called at {caller()}"
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            key = id(leaf)
            _CONSUMERS[key] = (weakref.ref(leaf, _forget(key)), where)


def _consumer(leaves: list[Any]) -> str | None:
    for leaf in leaves:
        ref, where = _CONSUMERS.get(id(leaf), (None, None))
        if ref is not None and ref() is leaf:
            return where
    return None


def check_alive(tree: Any, where: str, what: str = "these arrays") -> None:
    """Raises `DonatedStateError` if an array of ``tree`` was donated (deleted).

    Args:
      tree: The arrays to check.
      where: The call that found them, for the message.
      what: What they are, for the message.
    """
    leaves = jax.tree.leaves(tree)
    deleted = [x for x in leaves if _deleted(x)]
    if not deleted:
        return
    consumer = _consumer(deleted)
    given = "" if consumer is None else f" ({consumer} was given them)"
    raise DonatedStateError(
        f"{where}: {what} were donated to a train step{given} and no longer "
        "exist. A state made with state.replace(...) shares the arrays it does "
        "not replace with the state it came from: when a step consumes one, the "
        "other's are gone too. Use the state that the step (or fit) returned: "
        "state, aux = train_step(state, **batch), state, history = fit(state, "
        "...). To start several runs from one state, give each its own copy: "
        "state0.with_hyperparams() copies every array a step donates. In a "
        "notebook, re-run the cell that builds the state before "
        "re-running a training cell, or build the step with donate=False to keep "
        "old states."
    )


def _deleted(x: Any) -> bool:
    """Whether ``x`` is a concrete array that was donated. A tracer (under the
    user's ``jax.jit``, ``lax.scan`` or ``jax.vmap``) owns no buffer, so it
    never was; asking it ``is_deleted()`` raises."""
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and x.is_deleted()
    )


def raise_if_donated(state: Any, err: Exception, where: str) -> None:
    """Raises `DonatedStateError` (from ``err``) if ``state`` was donated: the
    error a call on a consumed state gets instead of XLA's "Array has been
    deleted"; returns otherwise."""
    try:
        state.check_not_donated(where)
    except DonatedStateError as donated:
        raise donated from err
