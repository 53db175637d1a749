"""`Callback`, the base of every callback (optional hooks), and `record_only`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pztrain.records import LoopInfo

if TYPE_CHECKING:
    from pztrain.records import History
    from pztrain.state import TrainState

__all__ = ["Callback", "record_only"]


def record_only(on_log: Callable[..., Any]) -> Callable[..., Any]:
    """Marks an ``on_log`` hook that only reads (or adds to) the record.

    Such a hook never reads the state and always returns ``None`` (a display, a
    logger). When every ``on_log`` of a run is record-only, `pztrain.fit` does
    not wait for the device at log points: it runs them once the metrics are
    computed, a little later, while training goes on. A subclass that overrides
    a marked ``on_log`` is not record-only unless it marks its own.

    Example:
      >>> from pztrain import Callback
      >>> from pztrain.callbacks import record_only
      >>> class Show(Callback):
      ...     @record_only
      ...     def on_log(self, state, record):
      ...         print(record["step"], record["metrics"])
    """
    on_log.record_only = True
    return on_log


class Callback:
    """Base class: every hook is optional and does nothing by default.

    A record is a dict with ``step``, ``epoch``, ``split`` (``"train"`` or ``"eval"``),
    ``time`` (seconds since the start) and ``metrics`` (name → float). ``on_log`` may
    add entries to ``record["metrics"]`` before the loggers see it.

    The hooks that take a state return ``None`` (nothing changes), a new
    `pztrain.TrainState` (the loop continues with it) or `pztrain.Stop`. `fit` runs its
    hooks as one ordered list: the progress bar, the callbacks in the order given, the
    loggers, then the checkpoints. An ``on_log`` that only reads the record can say so
    with `record_only`, which lets log points overlap with training. `check` refuses
    settings that do not fit a run before `fit` writes anything.

    Example:
      >>> from pztrain import Callback
      >>> from pztrain import Stop
      >>> class StopAtLoss(Callback):  # fit(..., callbacks=[StopAtLoss()])
      ...     def on_log(self, state, record):
      ...         return Stop("low") if record["metrics"]["loss"] < 0.1 else None
      ...
      >>> StopAtLoss().on_log(None, {"step": 5, "metrics": {"loss": 0.05}})
      Stop(reason='low', state=None)
    """

    train_metrics: tuple[str, ...] = ()
    """The names this callback adds to a train record's metrics in ``on_log``
    (`pztrain.LoopInfo.train_metrics`): a monitor of one passes `fit`'s check."""

    def check(self, state: TrainState, info: LoopInfo) -> None:
        """Refuses a run its settings do not fit, before anything is written.

        `pztrain.fit` calls it on every hook of the run (the progress bar, the
        callbacks, the checkpoints; and ``check(info)`` on every logger that
        has one) once its own arguments are checked and its first batches
        traced, before the run directory, a log or a checkpoint is touched:
        a refusal leaves the disk as it was. It reads; it changes nothing.

        Args:
          state: The state given to `fit` (a resume has not restored one yet).
          info: The run as known before it starts (`pztrain.LoopInfo`: its
            evaluations, the metrics they record).

        Raises:
          ValueError, TypeError: naming the setting at fault and what to pass.

        Example:
          >>> from pztrain import Callback, LoopInfo
          >>> class NeedsEval(Callback):
          ...     def check(self, state, info):
          ...         if not info.evaluates:
          ...             raise ValueError("NeedsEval needs eval_step= and eval_data=.")
          ...
          >>> NeedsEval().check(None, LoopInfo(0, 10, None, 1, 5, False, None))
          Traceback (most recent call last):
          ...
          ValueError: NeedsEval needs eval_step= and eval_data=.
        """

    def on_train_start(self, state: TrainState, info: LoopInfo) -> Any:
        """Before the first step (after `check`, and a resume)."""

    def on_log(self, state: TrainState, record: dict[str, Any]) -> Any:
        """At each train log point, with the metrics averaged since the last."""

    def on_eval_end(self, state: TrainState, record: dict[str, Any]) -> Any:
        """After each evaluation."""

    def on_epoch_end(self, state: TrainState, epoch: int) -> Any:
        """After the last step of each epoch (``epoch`` counts from 0)."""

    def on_point_end(self, state: TrainState, step: int) -> Any:
        """After every other hook of a host point (log, epoch end, evaluation).

        The state is final for ``step``: nothing at this point changes it any
        more. `pztrain.Checkpoints` saves here, so a checkpoint holds the effects
        of everything its step did (its evaluation record included).
        """

    def on_train_end(self, state: TrainState, history: History) -> Any:
        """After the last step, whatever ended the run (exceptions included).

        Every callback's ``on_train_end`` runs even if an earlier one raises; the
        first exception is raised after all of them ran.
        """

    def on_advance(self, step: int, t: float) -> int | None:
        """At every point where the loop stops running steps, and at the start.

        For pacing by wall time (a progress bar, a periodic action): it must not
        read the device.

        Args:
          step: The step reached.
          t: The loop clock's time, in seconds.

        Returns:
          The step by which it wants to be called again, or ``None``.
        """

    def state_dict(self) -> dict[str, Any] | None:
        """JSON-able counters to keep in checkpoints, or ``None`` (the default):
        `pztrain.Checkpoints` stores them and gives them back to `load_state_dict`
        when a run resumes."""
        return None

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores what `state_dict` returned (on resume)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines state_dict() but not load_state_dict(); "
            "define both to resume its counters."
        )
