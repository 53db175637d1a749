"""`LearningRateMonitor`: a plain schedule's learning rate in the log records."""

from __future__ import annotations

import optax

from pztrain.callbacks._base import Callback, record_only

__all__ = ["LearningRateMonitor"]


class LearningRateMonitor(Callback):
    """Adds the learning rate to each train log record.

    ``fit`` already logs a learning rate injected with ``optax.inject_hyperparams``.
    This callback covers a plain schedule: it evaluates the schedule on the host at log
    points (no device work) and logs it as ``learning_rate``. Like the injected value,
    it is the rate the last update used: ``schedule(step - 1)`` after ``step`` updates.

    Args:
      schedule: An optax schedule (``step -> lr``) or a constant.

    Example:
      >>> record = {"step": 3, "metrics": {}}  # a log point after 3 updates
      >>> LearningRateMonitor(optax.linear_schedule(1.0, 0.0, 8)).on_log(None, record)
      >>> record["metrics"]
      {'learning_rate': 0.75}
    """

    def __init__(self, schedule: optax.Schedule | float):
        self.schedule = schedule

    @record_only
    def on_log(self, state, record):
        last_update = max(record["step"] - 1, 0)
        lr = self.schedule(last_update) if callable(self.schedule) else self.schedule
        record["metrics"]["learning_rate"] = float(lr)
