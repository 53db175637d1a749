"""`Checkpoints`: periodic full-state checkpoints during `pztrain.fit`, and resume.

The callback decides when to save (`SavePoints`) and what a checkpoint carries besides
the state: the metrics of its step, the run's hyperparameters and the other callbacks'
``state_dict`` s. Writing, keeping (`Retention`) and reading back are its
`CheckpointStore`'s.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from pztrain.callbacks import Callback
from pztrain.callbacks._monitored import check_monitor, eval_value
from pztrain.checkpoint import _directory, _format
from pztrain.checkpoint._due import SavePoints
from pztrain.checkpoint._metadata import checkpoint_steps
from pztrain.checkpoint._retention import Retention
from pztrain.checkpoint._store import CheckpointStore
from pztrain.records import jsonable
from pztrain.state import DonatedStateError, TrainState
from pztrain.state._donation import check_alive

__all__ = ["Checkpoints"]


class Checkpoints(Callback):
    """Periodic full-state checkpoints during `pztrain.fit`, and resume.

    Keeps the last ``keep_last`` checkpoints and the best ``keep_best`` by ``monitor``;
    the newest checkpoint is always kept, so best-k never deletes what resume needs.
    One that `pztrain.evaluate_checkpoints` is reading is deleted at a later save.
    With each checkpoint it stores the ``state_dict()`` of the run's other callbacks
    (e.g. `pztrain.EarlyStopping`'s counters).

    ``fit(..., checkpoints=Checkpoints(dir), resume=True)`` continues a run from its
    newest complete checkpoint. Inside `fit`, or inside a ``with Checkpoints(...) as
    ckpts:`` block, saves are asynchronous (``async_save``) and finished when the run or
    the block ends, on exceptions and KeyboardInterrupt included; outside them, `save`
    returns once the checkpoint is on disk, so a program that ends right after it loses
    nothing. Its guarantees: the checkpoints guide (docs/guides/checkpoints.md).

    Args:
      directory: The root directory; each checkpoint is ``<directory>/<step>``.
      every_steps: Save at the first log, eval or epoch point at least this many
        steps after the last save (``None``: no periodic saves).
      at_epoch_end: Save at the end of every epoch.
      on_eval: Save after every evaluation (default: when ``keep_best > 0``).
      keep_last: How many of the newest checkpoints to keep.
      keep_best: How many of the best checkpoints to keep (by ``monitor``).
      monitor: ``"eval/<name>"`` or a train metric name, for best-k.
      mode: ``"min"`` or ``"max"``.
      async_save: Write in the background while training continues.
      overwrite: Let a run that does not resume delete the checkpoints the
        directory holds (with a warning naming them), and let `save` replace a
        step that exists.

    Example:
      >>> from pztrain import Checkpoints, TrainState
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> state = TrainState.initial_state({"w": jnp.ones(2)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d, Checkpoints(d, keep_last=2) as ckpts:
      ...     for step in (10, 20, 30):  # in the background, as inside fit
      ...         ckpts.save(state.replace(step=jnp.int32(step)), step)
      ...     ckpts.wait()  # on disk; the oldest deleted
      ...     print(ckpts.steps(), int(ckpts.restore_latest(state).step))
      [20, 30] 30
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_steps: int | None = None,
        at_epoch_end: bool = False,
        on_eval: bool | None = None,
        keep_last: int = 2,
        keep_best: int = 0,
        monitor: str = "eval/loss",
        mode: str = "min",
        async_save: bool = True,
        overwrite: bool = False,
    ):
        retention = Retention(keep_last, keep_best, monitor, mode)
        if every_steps is not None and (
            isinstance(every_steps, bool)
            or not isinstance(every_steps, int)
            or every_steps < 1
        ):
            raise ValueError(f"every_steps must be an int >= 1; got {every_steps!r}.")
        on_eval = keep_best > 0 if on_eval is None else on_eval
        self.points = SavePoints(every_steps, at_epoch_end, on_eval)
        root = Path(directory).absolute()
        self.store = CheckpointStore(root, retention, async_save, overwrite)
        self._open = 0  # nesting depth of with-blocks (fit opens one)
        self._new_run()

    # The settings, as the arguments named them.
    every_steps = property(lambda self: self.points.every_steps)
    at_epoch_end = property(lambda self: self.points.at_epoch_end)
    on_eval = property(lambda self: self.points.on_eval)
    directory = property(lambda self: self.store.directory)
    keep_last = property(lambda self: self.store.retention.keep_last)
    keep_best = property(lambda self: self.store.retention.keep_best)
    monitor = property(lambda self: self.store.retention.monitor)
    mode = property(lambda self: self.store.retention.mode)
    async_save = property(lambda self: self.store.writer.async_save)

    @property
    def overwrite(self) -> bool:
        """Whether a run that does not resume may delete the directory's
        checkpoints, and `save` may replace a step (settable)."""
        return self.store.overwrite

    @overwrite.setter
    def overwrite(self, value: bool) -> None:
        self.store.overwrite = value

    def _new_run(self) -> None:
        """Forgets what the previous run told it (`prepare` starts a run)."""
        self.points.reset()
        self._callbacks: tuple[Callback, ...] = ()
        self._eval: tuple[int, dict[str, float]] | None = None  # (step, metrics)
        self._latest_metrics: dict[str, float] = {}
        self._evaluations: tuple[str, ...] = ("",)  # the run's (on_train_start)
        self._hparams: dict[str, Any] = {}
        self._stale: list[int] = []  # the steps overwrite deletes at the start
        self._saves = self._ranked = 0  # saves this run, and those with monitor
        self._running = False  # between on_train_start and on_train_end
        self.continues_run = False  # see prepare
        self.elapsed = 0.0  # see restore_latest
        self._time: float | None = None  # the newest record's time
        self.owed_eval: tuple | None = None  # see restore_latest

    @property
    def manager(self) -> Any:
        """The orbax ``CheckpointManager`` (made on first use)."""
        return self.store.writer.manager

    def __enter__(self) -> Checkpoints:
        self._open += 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._open -= 1
        self.close()

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk."""
        return self.store.steps()

    def best_step(self) -> int | None:
        """The step of the best checkpoint by ``monitor`` (``None`` if unknown)."""
        return self.store.best_step()

    # -- saving

    def save(self, state: TrainState, step: int, metrics: dict | None = None) -> None:
        """Saves ``state`` as checkpoint ``step``.

        In the background inside `fit` or a ``with`` block (if ``async_save``);
        otherwise it returns once the checkpoint is on disk. Params that are not
        finite are not saved (a warning says so); a population is saved while
        one member's are (a warning names the others).

        Raises:
          CheckpointError: if checkpoint ``step`` exists (and not
            ``overwrite``), or this or an earlier save failed.
          DonatedStateError: if a train step consumed ``state``.
        """
        self._save(state, step, metrics, wait=not self._open)

    def _save(
        self,
        state: TrainState,
        step: int,
        metrics: dict | None,
        *,
        wait: bool,
        owed_eval: tuple | None = None,
    ) -> None:
        check_alive(state, "Checkpoints.save", "the arrays of this TrainState")
        self.wait()  # the previous save first: its error names its step
        self.points.saved(step)
        if not self.store.worth_saving(state, step):
            return  # params not finite (a population's: no member's): a warning
        meta = self._metadata(state, metrics)
        if owed_eval is not None:
            meta["owed_eval"] = {"step": owed_eval[0], "epoch": owed_eval[1]}
            if len(owed_eval) > 2:  # some of the evaluations (else all of them)
                meta["owed_eval"]["names"] = list(owed_eval[2])
        self.store.write(step, state, meta, metrics, wait=wait)
        self._saves += 1
        self._ranked += metrics is not None and self.monitor in metrics

    def save_stopped(
        self, state: TrainState, step: int, owed_eval: tuple | None = None
    ) -> Path | None:
        """Saves the step a run stopped at (`pztrain.fit` calls it after a
        signal), synchronously, once the pending saves are on disk.

        Args:
          state: The state at ``step``.
          step: The step.
          owed_eval: ``(step, epoch)`` of the evaluations that the stop skipped
            or cut short (``(step, epoch, names)`` if not all of them): stored,
            so that the resumed run does them first.

        Returns:
          The checkpoint of ``step`` (saved now or before), or ``None`` if there
          is none (a run stopped where it started, or params not finite).
        """
        self.wait()
        if step != self.points.last_done:
            self._save(
                state, step, self._metrics_at(step), wait=True, owed_eval=owed_eval
            )
        return self.directory / str(step) if step in self.steps() else None

    def _metadata(self, state: TrainState, metrics: dict | None) -> dict[str, Any]:
        meta = {"callbacks": self._callback_states(), "hparams": self._hparams}
        if self._time is not None:
            meta["time"] = self._time  # where a resumed run's record times go on
        meta = _format.state_metadata(state, meta)
        if metrics:
            meta["metrics"] = metrics
        return meta

    def _callback_states(self) -> dict[str, Any]:
        found = {}
        for i, cb in enumerate(self._callbacks):
            saved = cb.state_dict()
            if saved is not None:
                found[_state_key(i, cb)] = saved
        return found

    def wait(self) -> None:
        """Waits for pending saves, then deletes what the retention policy drops.

        Raises:
          CheckpointError: if a background save failed (naming its step).
        """
        self.store.wait()

    def close(self) -> None:
        """Finishes pending saves and releases the manager (even if one failed)
        and the directory's lock."""
        self.store.close()

    # -- the start of a run

    def prepare(
        self, state: TrainState, callbacks: Sequence[Callback] = (), *, resume: bool
    ) -> TrainState:
        """Starts a run from ``state`` (`pztrain.fit` calls it before the first step).

        Takes the directory's lock (until `close`: one run writes it at a
        time) and checks that it can be written. With ``resume``, returns
        `restore_latest` (or ``state``); without, the directory must hold no
        checkpoint (``overwrite=True`` deletes them when training starts).
        ``continues_run``: ``resume`` into a directory a run used (its log goes on).

        Raises:
          CheckpointError: if the directory cannot be written, or holds
            checkpoints and not ``resume`` (the message relates them to
            ``state.step``); `pztrain.CheckpointMismatchError` (see
            `restore_latest`).
          DirectoryInUseError: if another run holds the directory's lock.
        """
        self._new_run()
        self.continues_run = resume and self.directory.is_dir()  # maybe killed early
        self.store.open()
        if resume:
            return self.restore_latest(state, callbacks) or state
        steps = self.steps()
        if not self.overwrite:
            _directory.refuse_used(self.directory, steps, _step_of(state))
        self._stale = steps  # deleted when training starts (nothing failed before)
        return state

    # -- resume

    def restore_latest(
        self, like: TrainState, callbacks: Sequence[Callback] = ()
    ) -> TrainState | None:
        """The newest complete, readable checkpoint restored into ``like``.

        Incomplete checkpoints (a save killed midway) are removed and unreadable
        ones skipped, each with a warning that names it; the unreadable ones
        newer than the one restored are renamed ``<step>.unreadable`` (kept for
        inspection, out of the way of the steps the run saves next). A
        checkpoint of another structure is an error: nothing is touched.

        Args:
          like: A state built in code, with the structure of the saved one.
          callbacks: The run's callbacks, in the order the saving run had them:
            each gets back its saved ``state_dict`` (``load_state_dict``).

        Returns:
          The restored state, or ``None`` if there is no readable checkpoint.
          ``owed_eval`` then holds the evaluation that a stop left undone at
          its step (see `save_stopped`), or ``None``; ``elapsed`` the records'
          ``time`` when it was saved (where the resumed run's go on), or 0.

        Raises:
          CheckpointMismatchError: if a readable checkpoint's structure differs
            from ``like`` 's (another model or optimizer), naming the paths.
        """
        found = self.store.newest(like)
        if found is None or found.state is None:
            return None
        self.points.saved(found.step)
        self.owed_eval = found.owed_eval
        self.elapsed = found.time
        for i, cb in enumerate(callbacks):
            if _state_key(i, cb) in found.callbacks:
                cb.load_state_dict(found.callbacks[_state_key(i, cb)])
        return found.state

    def restore(self, step: int, like: TrainState) -> TrainState:
        """Checkpoint ``step`` restored into ``like``, once pending saves are
        on disk. Nothing else changes: no callback state, no bookkeeping.

        Raises:
          ValueError: if the directory holds no checkpoint of ``step``.
          CheckpointError: if it cannot be read (its message names the file).
        """
        return self.store.read(step, like)

    # -- callback hooks

    def check(self, state, info):
        """Refuses a fresh run into a directory that holds checkpoints (as
        `prepare` does), and ``keep_best`` by a metric no record holds."""
        if not info.resume and not self.overwrite:
            steps = checkpoint_steps(self.directory)  # the listing: no manager
            _directory.refuse_used(self.directory, steps, _step_of(state))
        who = f"Checkpoints(keep_best={self.keep_best})"
        if self.keep_best and self.monitor.startswith("eval/") and not info.evaluates:
            raise ValueError(
                f"{who} ranks checkpoints by {self.monitor!r}, but fit runs no "
                "evaluation: pass eval_step and eval_data to fit, or monitor a "
                "train metric."
            )
        if self.keep_best:
            check_monitor(who, self.monitor, info)

    def on_train_start(self, state, info):
        self._evaluations = info.evaluation_names
        self._hparams = jsonable(dict(info.hparams))
        self._running = True
        self._callbacks = tuple(info.callbacks)
        self.points.start(info.start_step)
        if self._stale:
            warnings.warn(
                f"Deleting checkpoints {self._stale} in {self.directory} "
                "(overwrite=True).",
                stacklevel=2,
            )
            self.store.delete(self._stale)
            self._stale = []

    def on_advance(self, step, t):
        self.store.confirm()  # a failed background save stops the run here
        self.points.advanced(step)

    def on_log(self, state, record):
        self._latest_metrics.update(record["metrics"])
        self._time = record.get("time", self._time)
        self.points.logged(record["step"])

    def on_eval_end(self, state, record):
        metrics = {f"eval/{k}": v for k, v in record["metrics"].items()}
        metrics.update(self._latest_metrics)
        if self.keep_best and self.monitor.startswith("eval/"):
            try:  # None: the monitored evaluation did not run at this point
                eval_value(record, self.monitor, self._evaluations)
            except KeyError:
                raise KeyError(
                    f"Checkpoints monitors {self.monitor!r}, which is not among the "
                    f"metrics {sorted(metrics)}."
                ) from None
        self._eval = (record["step"], metrics)
        self._time = record.get("time", self._time)
        self.points.evaluated(record["step"])

    def on_epoch_end(self, state, epoch):
        self.points.epoch_ended(int(state.step))

    def on_point_end(self, state, step):
        """Saves if a hook of this point asked: after all of them ran."""
        if self.points.point_ended(step):
            self.save(state, step, self._metrics_at(step))

    def _metrics_at(self, step: int) -> dict[str, float]:
        """The metrics of the evaluation at ``step`` (if there was one) and the
        latest train metrics."""
        if self._eval and self._eval[0] == step:
            return self._eval[1]
        return dict(self._latest_metrics)

    def on_train_end(self, state, history):
        """Saves the final state (also after an exception) if its train record
        is logged and its point over. Nothing is saved if the state was
        consumed, a save failed or the run did not start."""
        running, self._running = self._running, False
        if self.store.failed is not None or not running:
            return
        try:
            state.check_not_donated("Checkpoints.on_train_end")
        except DonatedStateError:
            return  # a step failed after taking the state: nothing valid to save
        step = int(state.step)
        if self.points.final(step):
            self.save(state, step, self._metrics_at(step))
        # A run stopped by a signal before its monitor's first value is not
        # monitoring a wrong metric: the resumed run ranks its saves.
        stopped = getattr(history, "stop_reason", None) in ("interrupted", "preempted")
        if self.keep_best and self._saves and not self._ranked and not stopped:
            warnings.warn(
                f"Checkpoints(keep_best={self.keep_best}) ranked no checkpoint: no "
                f"save saw the metric {self.monitor!r}. Monitor a metric the run "
                "logs or evaluates.",
                stacklevel=2,
            )


def _state_key(index: int, callback: Callback) -> str:
    """Where a callback's ``state_dict`` goes in a checkpoint: its ``state_key`` if
    it has one (the data's iterator state), else place:class (``"0:EarlyStopping"``)."""
    return getattr(callback, "state_key", None) or f"{index}:{type(callback).__name__}"


def _step_of(state: TrainState) -> int | None:
    """``state.step`` read to the host (``None`` if it cannot be: abstract)."""
    try:
        with jax.transfer_guard_device_to_host("allow"):
            return int(state.step)
    except Exception:  # noqa: BLE001 - the message then says less
        return None
