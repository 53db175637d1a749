"""When a run logs, evaluates, ends epochs and stops: arithmetic on steps.

Pure Python, no JAX: the loop asks the schedule where the next host point is and
what is due there.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["Schedule", "check_eval_every_epochs", "run_end"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The points of a run, as functions of the step.

    Attributes:
      start: The first step.
      end: The step to stop at (``math.inf``: when ``num_epochs`` are done).
      steps_per_call: Steps fused in one call; steps advance by this much.
      log_every: Steps between log points.
      eval_every: Steps between evaluations (``None``: at each epoch end).
      steps_per_epoch: Steps in an epoch (``None``: each pass over the data is
        one, as the data says).
      num_epochs: The number of epochs to run (``None``: ``end`` decides).
      evaluates: Whether the run evaluates.
      eval_every_epochs: Evaluate at the end of every this many epochs
        (instead of each epoch end; ``eval_every`` then is ``None``).

    Example:
      >>> s = Schedule(start=0, end=10, steps_per_call=1, log_every=4,
      ...              steps_per_epoch=3)
      >>> [s.next_point(step) for step in (0, 3, 4, 8, 9)]
      [3, 4, 6, 9, 10]
      >>> s.logs_at(8), s.logs_at(9), s.logs_at(10)  # the end is a log point
      (True, False, True)
    """

    start: int
    end: float
    steps_per_call: int
    log_every: int
    eval_every: int | None = None
    steps_per_epoch: int | None = None
    num_epochs: int | None = None
    evaluates: bool = False
    eval_every_epochs: int | None = None

    @property
    def end_step(self) -> int | None:
        """The step the run stops at, or ``None`` when the data decides."""
        return None if self.end == math.inf else int(self.end)

    def next_point(self, step: int, wish: int | None = None) -> float:
        """The next step after ``step`` where the host has work: a log point,
        an evaluation, an epoch end, the end, or ``wish`` (a hook's request)."""
        points = [self.end, _next_multiple(step, self.log_every)]
        for every in (self.eval_every, self.steps_per_epoch):
            if every:
                points.append(_next_multiple(step, every))
        if wish is not None and wish > step:
            k = self.steps_per_call  # steps advance by whole calls
            points.append(-(-wish // k) * k)
        return min(points)

    def logs_at(self, step: int) -> bool:
        """Whether ``step`` is a log point (every ``log_every``, and the end)."""
        return step % self.log_every == 0 or step >= self.end

    def epoch_at(self, step: int) -> int:
        """The epoch a run starting at ``step`` is in (0 if epochs are unknown)."""
        return step // self.steps_per_epoch if self.steps_per_epoch else 0

    def ends_epoch(self, step: int, epoch: int, ended_pass: bool) -> bool:
        """Whether reaching ``step`` ended ``epoch``; without known epoch
        lengths, whether the last batch ended a pass over the data."""
        if self.steps_per_epoch:
            return step // self.steps_per_epoch > epoch
        return ended_pass

    def evaluates_at(self, step: int, ended_epoch: bool, epoch: int = 0) -> bool:
        """Whether to evaluate at ``step``: every ``eval_every``, else at the
        end of ``epoch`` (of every ``eval_every_epochs``-th epoch, counted from 1).
        """
        if not self.evaluates:
            return False
        if self.eval_every is not None:
            return step % self.eval_every == 0
        if ended_epoch and self.eval_every_epochs:
            return (epoch + 1) % self.eval_every_epochs == 0
        return ended_epoch

    def nothing_left(self) -> str | None:
        """Why a run has nothing to do (its total already reached), else ``None``.

        Example:
          >>> s = Schedule(start=8, end=8, steps_per_call=1, log_every=5,
          ...              steps_per_epoch=4, num_epochs=2)
          >>> s.nothing_left().split("; ")[1]
          'to train 2 more epochs, pass num_epochs=4'
        """
        epoch = self.epoch_at(self.start)
        if not self.done(self.start, epoch):
            return None
        if self.num_epochs is not None:
            name, total, unit = "num_epochs", self.num_epochs, "epochs"
            more, now = max(self.num_epochs, 1), epoch
        else:
            name, total, unit = "num_steps", self.end_step, "steps"
            k = self.steps_per_call  # a whole number of calls
            more, now = -(-max(self.end_step or 0, 1) // k) * k, self.start
        return (
            f"nothing to do: state.step={self.start} already reached {name}={total} "
            f"(a total, not a number of further {unit}); to train {more} more "
            f"{unit}, pass {name}={now + more}"
        )

    def next_epoch(self, step: int, epoch: int) -> int:
        """The epoch after one that ended at ``step``."""
        return step // self.steps_per_epoch if self.steps_per_epoch else epoch + 1

    def done(self, step: int, epoch: int) -> bool:
        """Whether the run has reached its end or its number of epochs."""
        if self.num_epochs is not None and epoch >= self.num_epochs:
            return True
        return step >= self.end


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every


def check_eval_every_epochs(
    eval_every_epochs: int | None, eval_every: int | None, evaluates: bool
) -> None:
    """Checks ``fit``'s ``eval_every_epochs`` (an int >= 1, with an eval step,
    without ``eval_every``).

    Raises:
      ValueError: naming ``eval_every_epochs`` and what to change.
    """
    if eval_every_epochs is None:
        return
    n = eval_every_epochs
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"eval_every_epochs must be an int >= 1; got {n!r}.")
    if not evaluates or eval_every is not None:
        raise ValueError(
            f"eval_every_epochs={n!r} needs eval_step and eval_data, and no "
            "eval_every (evaluate by steps or by epochs, not both)."
        )


def run_end(
    start: int,
    steps_per_call: int,
    steps_per_epoch: int | None,
    num_steps: int | None,
    num_epochs: int | None,
) -> float:
    """The step a run stops at, checked against ``steps_per_call``.

    Raises:
      ValueError: if the run does not cover a whole number of calls.
    """
    if num_epochs is None:
        end: float = num_steps
    elif steps_per_epoch is None:
        end = math.inf  # re-iterable data: run until the epochs are done
    else:
        end = num_epochs * steps_per_epoch
    if end != math.inf and end > start and (end - start) % steps_per_call:
        raise ValueError(
            f"The run covers {end - start} steps (from step {start} to {end}), not a "
            f"multiple of steps_per_call={steps_per_call}; choose num_steps "
            "accordingly."
        )
    return end
