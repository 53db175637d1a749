"""Log and eval points: records from metric sums, read late when nothing waits.

At a log point the train step's metric sums become a record (means, non-finite
counts, the injected learning rate). If every ``on_log`` hook is record-only,
the point does not wait for the device: it keeps the sums and emits the record
once they are computed (checked at each host point, at the latest at the next
log point, evaluation or the end); the records are the same, in the same order.

A train record also carries the throughput since the last log point
(``steps_per_sec``, and ``examples_per_sec`` once `Reporter.note_batch` has seen
a batch), from the clock read at each log point: no device read of its own.
When log points do not wait for the device, the rate is that of dispatch, which
the device paces over more than a few steps; the first includes compiling.

A record's ``time`` is the seconds since the run started: since `fit` was
called, plus, in a run resumed from a checkpoint, the records' time when that
checkpoint was saved (`Checkpoints.elapsed`), so a resumed log's times go on
from where they stopped (the time between the stop and the resume is not
counted). ``fit(state, ...)`` going on from a returned state starts at 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._members import member_count, spread
from pztrain.checkpoint import Checkpoints
from pztrain.loop._hooks import Hooks, host_reads
from pztrain.metrics import MetricSums
from pztrain.records import Stop
from pztrain.state import TrainState
from pztrain.step import StepCost

__all__ = ["Reporter"]


@dataclasses.dataclass(frozen=True)
class _LogPoint:
    """A log point not read yet: its sums and learning rate (on device)."""

    sums: MetricSums
    step: int
    epoch: int
    time: float
    learning_rate: jax.Array | None = None
    since: tuple[int, float] = (0, 0.0)  # the previous log point's step and time


class Reporter:
    """Makes the records of a run and hands them to the hooks.

    Args:
      hooks: The run's hooks.
      clock: The loop's clock (seconds); record times count from its first
        reading, after the time of the checkpoint the run resumed from.
      state: The state at the start (to see whether a learning rate is
        injected).
    """

    def __init__(
        self,
        hooks: Hooks,
        clock: Callable[[], float],
        state: TrainState,
        start: int = 0,
    ):
        self.hooks = hooks
        self.clock = clock
        self.late = hooks.record_only
        self._t0 = clock()
        self._elapsed = _resumed_time(hooks)
        self._logs_lr = _has_injected_lr(state)
        self._members = member_count(state.root_rng)
        self._pending: _LogPoint | None = None
        self._last = (start, self._t0)  # the last log point's step and time
        self.batch_size: int | None = None
        self.flops_per_step: float | None = None  # from the compiled step
        self.peak_flops: float | None = None  # all devices together, per second
        self.owed: tuple | None = None  # see evaluation

    def note_batch(
        self, batch: Any, steps_per_call: int, member_batches: bool = False
    ) -> None:
        """Takes the batch size (examples per step; a population's member's,
        after the member axis, with one batch per member) from a batch's
        shapes (no device read); `examples_per_sec` assumes every batch has it."""
        size = getattr(batch, "batch_size", None)  # an on-device epoch
        if size is None:
            leaves = jax.tree.leaves(batch)
            shape = getattr(leaves[0], "shape", ()) if leaves else ()
            axis = 1 if steps_per_call > 1 else 0
            axis += int(member_batches and self._members is not None)
            size = shape[axis] if len(shape) > axis else None
        self.batch_size = None if size is None else int(size)

    def note_cost(self, cost: StepCost, steps_per_call: int, peak: float | None):
        """Takes the FLOPs of a step (a call's over its steps) and the devices'
        peak FLOPs per second (``None``: unknown) for the records."""
        self.flops_per_step = cost.flops / steps_per_call
        self.peak_flops = peak

    def log(self, state: TrainState, sums: MetricSums, step: int, epoch: int):
        """A train log point: ``(state, stop)``. ``sums`` must not change after."""
        state, stop = self.flush(state)
        lr = state.hyperparams["learning_rate"] if self._logs_lr else None
        if self.late and lr is not None:
            lr = jnp.copy(lr)  # read later: the next step donates the original
        point = _LogPoint(sums, step, epoch, self.clock(), lr, self._last)
        self._last = (step, point.time)
        if self.late:
            self._pending = point
            return state, stop
        return _first(stop, *self._emit(state, point))

    def poll(self, state: TrainState) -> tuple[TrainState, Stop | None]:
        """Emits the pending log point if the device has computed it."""
        if self._pending is None or not self._pending.sums.is_ready():
            return state, None
        return self.flush(state)

    def flush(self, state: TrainState) -> tuple[TrainState, Stop | None]:
        """Emits the pending log point (waiting for the device if needed)."""
        point, self._pending = self._pending, None
        return (state, None) if point is None else self._emit(state, point)

    def evaluation(
        self,
        state: TrainState,
        values: dict[str, float] | None,
        step: int,
        epoch: int,
        owed: tuple | None = None,
        media: dict[str, Any] | None = None,
    ) -> tuple[TrainState, Stop | None]:
        """An eval point, after the train records before it: one record of
        ``values`` (none if empty) and ``media`` for the loggers. ``owed``:
        the evaluations a stop skipped or cut short (``(step, epoch)``, all
        of them, or ``(step, epoch, names)``), kept in ``owed`` for the
        checkpoint; ``values=None`` alone means all of them."""
        state, stop = self.flush(state)
        if owed is not None or values is None:
            self.owed = owed or (step, epoch)
        if media:
            self.hooks.log_media(step, media)
        if not values:
            return state, stop
        record = self._record("eval", step, epoch, values, self.clock())
        return _first(stop, *self.hooks.run("on_eval_end", state, record))

    def _emit(self, state: TrainState, point: _LogPoint):
        with host_reads():
            summary = point.sums.read()
            values = dict(summary.means)
            if point.learning_rate is not None:
                values.update(spread("learning_rate", np.asarray(point.learning_rate)))
        record = self._record("train", point.step, point.epoch, values, point.time)
        record.update(self._throughput(point))
        if summary.nonfinite:
            record["nonfinite_steps"] = summary.nonfinite
            record["first_nonfinite_step"] = summary.first_nonfinite_step
        if summary.nonfinite_members:  # a population's, by index
            record["nonfinite_members"] = list(summary.nonfinite_members)
        return self.hooks.run("on_log", state, record)

    def _throughput(self, point: _LogPoint) -> dict[str, float]:
        """``steps_per_sec`` (and ``examples_per_sec``) since the last log point."""
        steps, seconds = point.step - point.since[0], point.time - point.since[1]
        if steps <= 0 or seconds <= 0:
            return {}
        rate = {"steps_per_sec": round(steps / seconds, 3)}
        if self.batch_size is not None:
            rate["examples_per_sec"] = round(steps * self.batch_size / seconds, 3)
        if self.flops_per_step:
            flops = self.flops_per_step * steps / seconds
            rate["flops_per_step"] = self.flops_per_step
            rate["flops_per_sec"] = float(f"{flops:.4g}")
            if self.peak_flops:
                rate["mfu"] = round(flops / self.peak_flops, 5)
        return rate

    def _record(self, split: str, step: int, epoch: int, values: dict, t: float):
        return {
            "step": step,
            "epoch": epoch,
            "split": split,
            "time": round(t - self._t0 + self._elapsed, 4),
            "metrics": values,
        }


def _first(stop: Stop | None, state: TrainState, new_stop: Stop | None):
    """``(state, stop)`` keeping the earlier Stop."""
    return state, stop or new_stop


def _resumed_time(hooks: Hooks) -> float:
    """The records' time when the checkpoint the run resumed from was saved
    (0.0 for a run that did not resume)."""
    found = [cb.elapsed for cb in hooks.callbacks if isinstance(cb, Checkpoints)]
    return max(found, default=0.0)


def _has_injected_lr(state: TrainState) -> bool:
    try:
        return "learning_rate" in state.hyperparams
    except ValueError:
        return False
