"""`EarlyStopping`: stop when a monitored metric stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from pztrain.callbacks._base import Callback
from pztrain.callbacks._monitored import (
    check_eval_monitor,
    check_train_monitor,
    eval_value,
)
from pztrain.records import Stop

if TYPE_CHECKING:
    from pztrain.state import TrainState

__all__ = ["EarlyStopping"]


def _split_monitor(monitor: str) -> tuple[str, str]:
    split, _, name = monitor.partition("/")
    return (split, name) if split == "eval" and name else ("train", monitor)


def _metric(record: dict[str, Any], monitor: str, evaluations) -> float | None:
    """Reads ``monitor`` (``"loss"``, ``"eval/loss"`` or ``"eval/<name>/loss"``)
    from a record of its split (a KeyError if the record is of the monitored
    split, or its evaluation's, but lacks the metric)."""
    split, name = _split_monitor(monitor)
    if split == "eval":
        return eval_value(record, monitor, evaluations)
    if record["split"] != split:
        return None
    if name not in record["metrics"]:
        raise KeyError(
            f"Monitored metric {monitor!r} is not among the {split} metrics "
            f"{sorted(record['metrics'])}; prefix eval metrics with 'eval/'."
        )
    return record["metrics"][name]


class EarlyStopping(Callback):
    """Stops when a monitored metric has not improved for ``patience`` checks.

    Args:
      monitor: ``"eval/<name>"`` for an eval metric (``"eval/<evaluation>/
        <name>"`` for a named `pztrain.Evaluation`'s), ``"<name>"`` for a
        train metric (checked at every log point).
      mode: ``"min"`` or ``"max"``.
      patience: Checks without improvement before stopping.
      min_delta: The least change that counts as an improvement.
      restore_best: Finish with the params of the best check (kept as a copy on device,
        so donation cannot delete them). Only the params go back: ``state.step``, the
        optimizer state and the history's last records stay those of the stopping point
        (``step`` counts the updates made: the data position, keys and schedules follow
        it), so ``state.step`` is not `best_step`; the best check's record is the one of
        `best_step` in the history.

    Attributes:
      best: The best value seen.
      best_step: The step it was seen at.
      wait: Checks since the last improvement.

    Example:
      >>> from pztrain import EarlyStopping
      >>> stopper = EarlyStopping("eval/loss", patience=2)
      >>> r = lambda step, loss: {"step": step, "split": "eval",
      ...                         "metrics": {"loss": loss}}
      >>> [stopper.on_eval_end(None, r(s, v)) for s, v in [(1, 1.0), (2, 1.1)]]
      [None, None]
      >>> stopper.on_eval_end(None, r(3, 1.2)).reason
      'eval/loss did not improve on 1 (step 1) for 2 checks'
    """

    def __init__(
        self,
        monitor: str = "eval/loss",
        *,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        restore_best: bool = False,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}.")
        if patience < 1:
            raise ValueError(f"patience must be >= 1; got {patience}.")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta, self.restore_best = abs(min_delta), restore_best
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self.wait = 0
        self._best_params: Any = None
        self._evaluations: tuple[str, ...] = ("",)  # the run's (on_train_start)

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, state: TrainState | None, record: dict[str, Any]) -> Any:
        value = _metric(record, self.monitor, self._evaluations)
        if value is None:
            return None
        if self._improved(value):
            self.best, self.best_step, self.wait = value, record["step"], 0
            if self.restore_best and state is not None:
                self._best_params = jax.tree.map(jnp.copy, state.params)
            return None
        self.wait += 1
        if self.wait < self.patience:
            return None
        reason = (
            f"{self.monitor} did not improve on {self.best:.6g} (step "
            f"{self.best_step}) for {self.wait} checks"
        )
        if self.restore_best and self._best_params is not None and state is not None:
            return Stop(reason, state.replace(params=self._best_params))
        return Stop(reason)

    def on_log(self, state, record):
        return self._check(state, record)

    def on_eval_end(self, state, record):
        return self._check(state, record)

    def state_dict(self) -> dict[str, Any]:
        """The counters, for checkpoints (JSON-able)."""
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores the counters saved by `state_dict` (on resume).

        With ``restore_best``, the best params are not in the checkpoint: after a
        resume they are those of the best check made since.
        """
        self.best, self.best_step, self.wait = (
            saved["best"],
            saved["best_step"],
            saved["wait"],
        )

    def check(self, state, info):
        """Refuses a monitor the run does not record: a train metric no train
        record holds, or an eval one (no evaluation, an evaluation it names
        not, a metric its evaluation does not record)."""
        if _split_monitor(self.monitor)[0] != "eval":
            return check_train_monitor("EarlyStopping", self.monitor, info)
        if not info.evaluates:
            raise ValueError(
                f"EarlyStopping monitors {self.monitor!r} but fit runs no "
                "evaluation: pass eval_step and eval_data, or monitor a train "
                "metric such as 'loss'."
            )
        check_eval_monitor("EarlyStopping", self.monitor, info)

    def on_train_start(self, state, info):
        self._evaluations = info.evaluation_names
