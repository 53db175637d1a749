"""`LearningRateMonitor`: a plain schedule's learning rate in the log records."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from pztrain._tree import describe
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

    Raises:
      TypeError: if ``schedule`` is neither a number nor callable; at a log
        point, if the schedule returns anything but a real number (a float, an
        int or a scalar array), naming the step and what it returned.

    Example:
      >>> import optax
      >>> from pztrain import LearningRateMonitor
      >>> record = {"step": 3, "metrics": {}}  # a log point after 3 updates
      >>> LearningRateMonitor(optax.linear_schedule(1.0, 0.0, 8)).on_log(None, record)
      >>> record["metrics"]
      {'learning_rate': 0.75}
    """

    train_metrics = ("learning_rate",)

    def __init__(self, schedule: optax.Schedule | float):
        if not callable(schedule) and not _is_real(schedule):
            raise TypeError(
                f"LearningRateMonitor(schedule={schedule!r}): a schedule is an "
                "optax schedule (step -> learning rate) or a number."
            )
        self.schedule = schedule

    @record_only
    def on_log(self, state, record):
        last_update = max(record["step"] - 1, 0)
        if not callable(self.schedule):
            lr = self.schedule
        else:
            lr = self.schedule(last_update)
            if not _is_real(lr):
                raise TypeError(
                    f"LearningRateMonitor: its schedule returned {_shown(lr)} for "
                    f"step {last_update}; a schedule returns the learning rate: a "
                    "real number (a float, an int or a scalar array)."
                )
        record["metrics"]["learning_rate"] = float(lr)


def _is_real(x: Any) -> bool:
    """A real number: a Python or NumPy one, or a real scalar array."""
    if isinstance(x, bool | np.bool_) or np.ndim(x) != 0:
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    return isinstance(x, int | float)


def _shown(x: Any) -> str:
    """``x`` as an error shows it: a short repr and its type or shape."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {describe(x)}"
    text = repr(x)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(x).__name__})"
