"""When a run logs, evaluates, ends epochs and stops: arithmetic on steps.

Pure Python, no JAX: the loop asks the schedule where the next host point is and
what is due there.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

__all__ = ["Cadence", "Schedule", "check_eval_every_epochs", "run_end"]


class Cadence(NamedTuple):
    """When one evaluation runs (see `pztrain.Evaluation`).

    Attributes:
      name: The evaluation's name (``""``: the unnamed one of ``eval_step=``).
      every: Steps between runs, or ``None``.
      every_epochs: Epoch ends between runs, or ``None``. With neither, it runs
        at each epoch end.
      at_end: Whether it also runs at the end (unless it just ran there).
    """

    name: str
    every: int | None = None
    every_epochs: int | None = None
    at_end: bool = True

    def due(self, step: int, ended_epoch: bool, epoch: int) -> bool:
        """Whether it runs at ``step`` (``ended_epoch``: that step ended
        ``epoch``; epochs counted from 1 for ``every_epochs``)."""
        if self.every is not None:
            return step % self.every == 0
        if ended_epoch and self.every_epochs:
            return (epoch + 1) % self.every_epochs == 0
        return ended_epoch


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
      cadences: One `Cadence` per evaluation, in the order they run (if
        given, ``eval_every``, ``eval_every_epochs`` and ``evaluates`` are
        not read: ``evaluates`` is then whether there is one).

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
    cadences: tuple[Cadence, ...] | None = None

    def __post_init__(self) -> None:
        if self.cadences is None:  # the single evaluation of eval_every=...
            one = Cadence("", self.eval_every, self.eval_every_epochs)
            object.__setattr__(self, "cadences", (one,) if self.evaluates else ())
        object.__setattr__(self, "evaluates", bool(self.cadences))

    @property
    def end_step(self) -> int | None:
        """The step the run stops at, or ``None`` when the data decides."""
        return None if self.end == math.inf else int(self.end)

    def next_point(self, step: int, wish: int | None = None) -> float:
        """The next step after ``step`` where the host has work: a log point,
        an evaluation, an epoch end, the end, or ``wish`` (a hook's request)."""
        points = [self.end, _next_multiple(step, self.log_every)]
        everies = {c.every for c in self.cadences}
        everies |= {self.eval_every, self.steps_per_epoch}
        for every in everies:
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
        """Whether any evaluation runs at ``step`` (see `due_at`)."""
        return bool(self.due_at(step, ended_epoch, epoch))

    def due_at(self, step: int, ended_epoch: bool, epoch: int = 0) -> tuple[str, ...]:
        """The evaluations that run at ``step``, in order: each every its
        ``every`` steps, else at the end of ``epoch`` (of every
        ``every_epochs``-th epoch, counted from 1).

        Example:
          >>> s = Schedule(0, 12, 1, 4, steps_per_epoch=6, cadences=(
          ...     Cadence("val", every=4), Cadence("test", at_end=True),
          ...     Cadence("slow", every_epochs=2, at_end=False)))
          >>> s.due_at(4, False), s.due_at(6, True, 0), s.due_at(12, True, 1)
          (('val',), ('test',), ('val', 'test', 'slow'))
          >>> s.due_at_end(12, ran={"val": 12, "slow": 12})
          ('test',)
        """
        return tuple(c.name for c in self.cadences if c.due(step, ended_epoch, epoch))

    def due_at_end(self, step: int, ran: dict[str, int]) -> tuple[str, ...]:
        """The evaluations that run at the end ``step``: those ``at_end`` that
        did not run at it (``ran``: name → the step it last ran at)."""
        return tuple(
            c.name for c in self.cadences if c.at_end and ran.get(c.name) != step
        )

    def owed_at(self, step: int, epoch: int) -> tuple[str, ...]:
        """The evaluations a stop left owed at ``step`` when the checkpoint
        does not name them (written before evaluations had names, or all of
        them owed): those due there (at an epoch end, if epochs are unknown;
        at the end, the ``at_end`` ones too), else all of them."""
        spe = self.steps_per_epoch
        ended = step > 0 and step % spe == 0 if spe else True
        due = set(self.due_at(step, ended, epoch))
        if step >= self.end:
            due |= {c.name for c in self.cadences if c.at_end}
        names = tuple(c.name for c in self.cadences)
        return tuple(n for n in names if n in due) or names

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
