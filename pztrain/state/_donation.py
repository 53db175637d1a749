"""Donation: a train step consumes the arrays of the state it is given."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["DonatedStateError", "check_alive", "raise_if_donated"]


class DonatedStateError(RuntimeError):
    """A state whose arrays were donated to a train step was used again."""


def check_alive(tree: Any, where: str, what: str = "these arrays") -> None:
    """Raises `DonatedStateError` if an array of ``tree`` was donated (deleted).

    Args:
      tree: The arrays to check.
      where: The call that found them, for the message.
      what: What they are, for the message.
    """
    leaves = jax.tree.leaves(tree)
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        raise DonatedStateError(
            f"{where}: {what} were donated to a train step and no longer exist. "
            "Use the state that the step (or fit) returned: state, aux = "
            "train_step(state, **batch), state, history = fit(state, ...). In a "
            "notebook, re-run the cell that builds the state before re-running a "
            "training cell, or build the step with donate=False to keep old states."
        )


def raise_if_donated(state: Any, err: Exception, where: str) -> None:
    """Raises `DonatedStateError` (from ``err``) if ``state`` was donated: the
    error a call on a consumed state gets instead of XLA's "Array has been
    deleted"; returns otherwise."""
    try:
        state.check_not_donated(where)
    except DonatedStateError as donated:
        raise donated from err
