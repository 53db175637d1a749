"""Callbacks that watch a run: a live plot of its records, a profiler trace.

Both work from what the loop already has on the host: `LivePlot` draws the
records (a record-only ``on_log``, so log points still overlap with training),
`Profile` acts at the steps it asks the loop to stop at.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from pztrain.callbacks import Callback, record_only
from pztrain.records import History

__all__ = ["LivePlot", "Profile"]


class LivePlot(Callback):
    """Redraws `pztrain.History.plot` at each log and eval point.

    In a notebook (IPython with a kernel) the figure is shown once, below the
    cell, and replaced in place at each point; elsewhere `figure` is kept up to
    date (save it, or show it with an interactive matplotlib backend). It draws
    the records alone: no device read, and log points still need not wait for
    the device (its ``on_log`` is `pztrain.callbacks.record_only`).

    Args:
      names: Metrics to draw (see `pztrain.History.plot`; default: all).
      split: ``"train"`` or ``"eval"`` alone (default: both).

    Attributes:
      history: The records drawn so far.
      figure: The matplotlib figure (after the start).
      draws: How many times it was drawn.

    Example:
      >>> from pztrain.monitors import LivePlot
      >>> import matplotlib; matplotlib.use("Agg")
      >>> live = LivePlot(names=["loss"])
      >>> live.on_train_start(None, None)
      >>> live.on_log(None, {"step": 1, "split": "train", "metrics": {"loss": 1.0}})
      >>> [ax.get_title() for ax in live.figure.axes], live.draws
      (['loss'], 1)
      >>> import matplotlib.pyplot as plt; plt.close(live.figure)
    """

    def __init__(self, names: Sequence[str] | None = None, split: str | None = None):
        self.names, self.split = names, split
        self.history = History()
        self.figure: Any = None
        self.draws = 0
        self._handle: Any = None  # the notebook's display handle

    def on_train_start(self, state, info):
        try:
            import matplotlib.figure
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "LivePlot needs matplotlib: pip install 'pztrain[plot]'."
            ) from None
        self.history, self.draws, self._handle = History(), 0, None
        display = _notebook_display()
        if display is None:
            self.figure = plt.figure()
            return
        # Not a pyplot figure: the notebook would show it again at the cell's end.
        self.figure = matplotlib.figure.Figure()
        self._handle = display(self.figure, display_id=True)

    @record_only
    def on_log(self, state, record):
        self._add(record)

    def on_eval_end(self, state, record):
        self._add(record)

    def _add(self, record: dict[str, Any]) -> None:
        self.history.records.append({**record, "metrics": dict(record["metrics"])})
        names = self._logged_names()
        if not names:
            return  # nothing asked for was logged yet (e.g. before an eval)
        self.history.plot(names, self.split, fig=self.figure)
        self.draws += 1
        if self._handle is not None:
            self._handle.update(self.figure)
        else:
            self.figure.canvas.draw_idle()
            self.figure.canvas.flush_events()

    def _logged_names(self) -> list[str]:
        """The names asked for that the records drawn so far hold."""
        logged = {
            s: self.history.metric_names(s)
            for s in ("train", "eval")
            if self.split in (None, s)
        }
        if self.names is None:
            return sorted(set().union(*logged.values()))
        found = []
        for entry in self.names:
            split, _, rest = entry.partition("/")
            if rest and split in logged and rest in logged[split]:
                found.append(entry)
            elif any(entry in names for names in logged.values()):
                found.append(entry)
        return found


def _notebook_display() -> Any:
    """IPython's ``display`` when running in a notebook kernel, else ``None``."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    shell = get_ipython()
    return display if shell is not None and hasattr(shell, "kernel") else None


class Profile(Callback):
    """Records a `jax.profiler` trace of steps ``[start_step, start_step +
    num_steps)``, for TensorBoard's profile tab or Perfetto.

    It asks the loop to stop at those two steps (rounded up to a multiple of
    ``steps_per_call``), starting the trace at the first and stopping it at the
    second, or at the end of the run; it reads nothing from the device.

    Args:
      start_step: The first step traced (a run starting past it traces from
        its start).
      num_steps: How many steps to trace.
      log_dir: Where the trace goes (``plugins/profile/<run>/`` below it).

    Attributes:
      traced: ``(first step, step after the last)`` once the trace is written.

    Example:
      Give it to ``fit(..., callbacks=[profile])``; here driven as `fit` does:

      >>> import pathlib, tempfile; from pztrain.monitors import Profile
      >>> with tempfile.TemporaryDirectory() as d:
      ...     profile = Profile(start_step=2, num_steps=3, log_dir=d)
      ...     print(profile.on_advance(0, t=0.0))  # stop me at step 2
      ...     print(profile.on_advance(2, t=0.1))  # tracing; stop me at 5
      ...     _ = profile.on_advance(5, t=0.2)
      ...     print(profile.traced, len(list(pathlib.Path(d).rglob("*.xplane.pb"))))
      2
      5
      (2, 5) 1
    """

    def __init__(self, start_step: int, num_steps: int, log_dir: str | os.PathLike):
        if start_step < 0 or num_steps < 1:
            raise ValueError(
                "Profile needs start_step >= 0 and num_steps >= 1; got "
                f"start_step={start_step!r}, num_steps={num_steps!r}."
            )
        self.start_step, self.num_steps = start_step, num_steps
        self.log_dir = Path(log_dir)
        self.traced: tuple[int, int] | None = None
        self._started: int | None = None

    def on_advance(self, step: int, t: float) -> int | None:
        end = self.start_step + self.num_steps
        if self._started is None and self.traced is None and step < end:
            if step < self.start_step:
                return self.start_step
            jax.profiler.start_trace(str(self.log_dir))
            self._started = step
            return end
        if self._started is not None and step >= end:
            self._stop(step)
        return None if self._started is None else end

    def on_train_end(self, state, history):
        if self._started is not None:
            self._stop(int(history.records[-1]["step"]) if history.records else -1)

    def _stop(self, step: int) -> None:
        jax.profiler.stop_trace()
        self.traced, self._started = (self._started, step), None
