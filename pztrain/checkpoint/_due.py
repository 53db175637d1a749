"""When `pztrain.Checkpoints` saves: bookkeeping of a run's host points.

Pure Python, no JAX and no files: the callback reports what happened at each
host point (a log record, an evaluation, an epoch end) and asks, once the
point is over, whether to save its step. A step is saved once every hook of
its point ran, so its checkpoint holds everything that point did.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SavePoints"]


@dataclasses.dataclass
class SavePoints:
    """Which host points a run saves at.

    Attributes:
      every_steps: Save at the first point at least this many steps after the
        last save (``None``: no periodic saves).
      at_epoch_end: Save at every epoch end.
      on_eval: Save after every evaluation.
      last_done: The last step saved (or refused, or resumed from).
      due: The step the current point should save at its end.
      last_log: The step of the latest train record.
      open_point: The step of the point whose hooks are running.

    Example:
      >>> points = SavePoints(every_steps=100)
      >>> points.start(0)
      >>> points.logged(50); points.point_ended(50)
      False
      >>> points.logged(100); points.point_ended(100)
      True
    """

    every_steps: int | None = None
    at_epoch_end: bool = False
    on_eval: bool = False
    last_done: int | None = None
    due: int | None = None
    last_log: int | None = None
    open_point: int | None = None

    def start(self, step: int) -> None:
        """A run starts at ``step`` (a resumed run: where its checkpoint was)."""
        if self.last_done is None:
            self.last_done = step

    def reset(self) -> None:
        """Forgets the previous run."""
        self.last_done = self.due = self.last_log = self.open_point = None

    def _periodic(self, step: int) -> bool:
        every, last = self.every_steps, self.last_done
        return every is not None and last is not None and step - last >= every

    def advanced(self, step: int) -> None:
        """The loop reached host point ``step``."""
        self.open_point = step

    def logged(self, step: int) -> None:
        """A train record of ``step`` was logged."""
        self.open_point = self.last_log = step
        if self._periodic(step):
            self.due = step

    def evaluated(self, step: int) -> None:
        """An evaluation at ``step`` ended."""
        self.open_point = step
        if self.on_eval or self._periodic(step):
            self.due = step

    def epoch_ended(self, step: int) -> None:
        """An epoch ended at ``step``."""
        self.open_point = step
        if self.at_epoch_end or self._periodic(step):
            self.due = step

    def point_ended(self, step: int) -> bool:
        """The point at ``step`` is over: whether to save it now."""
        due, self.due, self.open_point = self.due, None, None
        return due == step and step != self.last_done

    def final(self, step: int) -> bool:
        """The run ended at ``step``: whether to save it. Only if its train
        record is logged and its point is over; an interruption between log
        points, or inside a point, resumes from the newest checkpoint instead
        (so the resumed log equals an uninterrupted one)."""
        return step not in (self.last_done, self.open_point) and step == self.last_log

    def saved(self, step: int) -> None:
        """Checkpoint ``step`` was saved (or deliberately not)."""
        self.last_done = step
