"""`NanPolicy`: stop at, or skip, non-finite updates, and name the arrays at fault."""

from __future__ import annotations

from typing import Any

import optax

from pztrain._optax import states_of
from pztrain._tree import all_finite
from pztrain.callbacks._base import Callback
from pztrain.records import Stop
from pztrain.step import explain_in_run

__all__ = ["NanPolicy"]


class NanPolicy(Callback):
    """What to do about a NaN or infinite loss, checked without per-step syncs.

    The train step counts non-finite losses on device; the loop reads the count
    with the metrics at each log point.

    Args:
      mode: ``"stop"`` ends training at the next log point, naming the first non-finite
        step. ``"skip"`` requires the optimizer to be wrapped in
        ``optax.apply_if_finite``, which drops non-finite updates on device; the number
        skipped is logged as ``skipped_updates``. If it gives up (more consecutive
        non-finite updates than its ``max_consecutive_errors``: it then applies them),
        training stops at the next log point.

    Either way `pztrain.Checkpoints` never saves params that are not finite (a
    population's: while one member's are finite, the whole population), and the
    arrays at fault are named (`pztrain.step.explain_in_run`) in the stop message, or in
    the record's ``"nonfinite"`` when updates are skipped; on a stop, by replaying the
    steps from the run's newest checkpoint before the first non-finite one (only once
    the run has gone wrong).

    Example:
      >>> import jax, jax.numpy as jnp, optax; from pztrain import NanPolicy
      >>> from pztrain import TrainState
      >>> tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=10)
      >>> state = TrainState.initial_state({"w": jnp.ones(2)}, tx, jax.random.key(0))
      >>> state = state.apply_gradients({"w": jnp.full(2, jnp.nan)})  # skipped
      >>> record = {"step": 1, "metrics": {}}  # as fit gives it at a log point
      >>> NanPolicy("skip").on_log(state, record), record["metrics"], state.params["w"]
      (None, {'skipped_updates': 1.0}, Array([1., 1.], dtype=float32))
    """

    train_metrics = ("skipped_updates",)

    def __init__(self, mode: str = "stop"):
        if mode not in ("stop", "skip"):
            raise ValueError(f"mode must be 'stop' or 'skip'; got {mode!r}.")
        self.mode, self.info = mode, None

    def check(self, state, info):
        """Refuses ``"skip"`` with an optimizer that does not skip."""
        if self.mode == "skip" and _apply_if_finite_state(state.opt_state) is None:
            raise ValueError(
                "NanPolicy('skip') needs the optimizer wrapped to skip non-finite "
                "updates: optimizer_def=optax.apply_if_finite(tx, "
                "max_consecutive_errors=10)."
            )

    def on_train_start(self, state, info):
        self.info = info

    def on_log(self, state, record):
        first = record.get("first_nonfinite_step", -1)
        if self.mode == "skip":
            return self._skip(state, record, first)
        return Stop(explain_in_run(self.info, state, first)) if first >= 0 else None

    def _skip(self, state, record, first):
        found = _apply_if_finite_state(state.opt_state)
        if record.get("nonfinite_steps") and not all_finite(state.params):
            return Stop(
                "optax.apply_if_finite gave up (more consecutive non-finite updates "
                f"than its max_consecutive_errors; {int(found.notfinite_count)} in a "
                f"row from step {first}): the params are not "
                "finite. Raise max_consecutive_errors or find the source of the NaN."
            )
        record["metrics"]["skipped_updates"] = float(found.total_notfinite)
        if first >= 0:
            record["nonfinite"] = explain_in_run(self.info, state, first)
        return None


def _apply_if_finite_state(opt_state: Any) -> Any:
    found = states_of(opt_state, optax.ApplyIfFiniteState)
    return found[0] if found else None
