"""`Checkpoints`: periodic full-state checkpoints during `pztrain.fit`, and resume.

The policy (when to save, what to keep, resuming from the newest readable one,
what a directory may hold) over an orbax ``CheckpointManager``; the format on
disk is `pztrain.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pztrain.checkpoint import _directory, _format, _orbax
from pztrain.state._donation import check_alive
from pztrain._tree import all_finite
from pztrain.callbacks import Callback
from pztrain.records import jsonable
from pztrain.state import DonatedStateError, TrainState

__all__ = ["Checkpoints"]


class Checkpoints(Callback):
    """Periodic full-state checkpoints during `pztrain.fit`, and resume.

    Keeps the last ``keep_last`` checkpoints and the best ``keep_best`` by
    ``monitor``; the newest checkpoint is always kept, so best-k never deletes
    what resume needs. With each checkpoint it stores the ``state_dict()`` of the
    run's other callbacks (e.g. `pztrain.EarlyStopping`'s counters).

    Pass it to ``fit(..., checkpoints=Checkpoints(dir), resume=True)`` to continue
    a run from its newest complete checkpoint. Inside `fit`, or inside a ``with
    Checkpoints(...) as ckpts:`` block, saves are asynchronous (``async_save``)
    and finished when the run or the block ends, on exceptions and
    KeyboardInterrupt included; outside them, `save` returns once the
    checkpoint is on disk, so a program that ends right after it loses nothing.

    Its guarantees are listed in README's checkpoint section.

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
        _check_args(mode, keep_last, keep_best, every_steps)
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self.at_epoch_end = at_epoch_end
        self.on_eval = keep_best > 0 if on_eval is None else on_eval
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self.async_save = async_save
        self.overwrite = overwrite
        self._manager = None
        self._open = 0  # nesting depth of with-blocks (fit opens one)
        self._saving: int | None = None  # a background save not yet confirmed
        self._failed: _format.CheckpointError | None = None
        self._new_run()

    def _new_run(self) -> None:
        """Forgets what the previous run told it (`prepare` starts a run)."""
        self._callbacks: tuple[Callback, ...] = ()
        # Steps: the last saved (or refused), the one this host point should
        # save, the latest train record's, the host point whose hooks run.
        self._last_done = self._due = self._last_log = self._open_point = None
        self._eval: tuple[int, dict[str, float]] | None = None  # (step, metrics)
        self._latest_metrics: dict[str, float] = {}
        self._hparams: dict[str, Any] = {}
        self._stale: list[int] = []  # another run's steps, deleted at the start
        self._saves = self._ranked = 0  # saves this run, and those with monitor
        self._running = False  # between on_train_start and on_train_end
        self.continues_run = False  # see prepare

    # -- the orbax manager

    @property
    def manager(self) -> Any:
        """The orbax ``CheckpointManager`` (made on first use)."""
        if self._manager is None:
            self._manager = self._make_manager()
        return self._manager

    def _make_manager(self) -> Any:
        ocp = _orbax.ocp()
        policies = [ocp.checkpoint_managers.LatestN(self.keep_last)]
        if self.keep_best:
            policies.append(
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=lambda m: m[self.monitor],
                    reverse=self.mode == "min",
                    n=self.keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=self.async_save,
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            cleanup_tmp_directories=True,  # what killed or failed saves left
            create=True,
        )
        return ocp.CheckpointManager(
            self.directory, item_handlers=_orbax.handlers(), options=options
        )

    def __enter__(self) -> Checkpoints:
        self._open += 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._open -= 1
        self.close()

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk."""
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        """The step of the best checkpoint by ``monitor`` (``None`` if unknown)."""
        return self.manager.best_step() if self.keep_best else None

    # -- saving

    def save(self, state: TrainState, step: int, metrics: dict | None = None) -> None:
        """Saves ``state`` as checkpoint ``step``.

        In the background inside `fit` or a ``with`` block (if ``async_save``);
        otherwise it returns once the checkpoint is on disk. Params that are not
        finite are not saved (a warning says so).

        Raises:
          CheckpointError: if checkpoint ``step`` exists (and not
            ``overwrite``), or this or an earlier save failed.
          DonatedStateError: if a train step consumed ``state``.
        """
        check_alive(state, "Checkpoints.save", "the arrays of this TrainState")
        self.wait()  # the previous save first: its error names its step
        self._last_done = step
        if not all_finite(state.params):
            warnings.warn(
                f"Not saving checkpoint {step} in {self.directory}: its params are "
                "not finite (NaN or inf). The newest checkpoint stays "
                f"{max(self.steps(), default=None)}.",
                stacklevel=2,
            )
            return
        self._make_room(step)
        args = _format.save_args(state.params, state, self._metadata(state, metrics))
        ranked = metrics is not None and self.monitor in metrics
        best = {self.monitor: metrics[self.monitor]} if ranked else None
        self._saves, self._ranked = self._saves + 1, self._ranked + ranked
        try:
            self.manager.save(step, args=args, metrics=best, force=True)
        except Exception as e:  # orbax raises many kinds; name the step
            raise self._save_failed(step, e) from e
        self._saving = step
        if not self._open:
            self.wait()

    def _metadata(self, state: TrainState, metrics: dict | None) -> dict[str, Any]:
        meta = {"callbacks": self._callback_states(), "hparams": self._hparams}
        meta = _format.state_metadata(state, meta)
        if metrics:
            meta["metrics"] = metrics
        return meta

    def _make_room(self, step: int) -> None:
        """Refuses (or, with ``overwrite``, deletes) an existing checkpoint ``step``."""
        steps = self.manager.all_steps()
        newest = max(steps, default=step)
        if step < newest:  # keep-last would delete the newest steps
            raise _format.CheckpointError(
                f"Checkpoint {step} is older than the newest, {newest}, in "
                f"{self.directory}; save steps in order (or use another directory)."
            )
        if step not in steps:
            return
        if not self.overwrite:
            raise _format.CheckpointError(
                f"Checkpoint {step} already exists in {self.directory}. Save another "
                "step, or pass Checkpoints(..., overwrite=True) to replace it."
            )
        self.manager.delete(step)

    def _callback_states(self) -> dict[str, Any]:
        found = {}
        for i, cb in enumerate(self._callbacks):
            saved = cb.state_dict()
            if saved is not None:
                found[f"{i}:{type(cb).__name__}"] = saved
        return found

    def wait(self) -> None:
        """Blocks until pending saves are on disk.

        Raises:
          CheckpointError: if a background save failed (naming its step).
        """
        if self._failed is not None:
            raise self._failed
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(self._saving, e) from e
        self._saving = None

    def close(self) -> None:
        """Finishes pending saves and releases the manager (even if one failed)."""
        manager = self._manager
        if manager is None:
            return
        try:
            self.wait()
        finally:
            self._manager = None
            with contextlib.suppress(Exception):  # the save's error matters more
                manager.close()

    def _confirm_saves(self) -> None:
        """Raises the error of a background save that has finished and failed."""
        if self._saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def _save_failed(self, step: int | None, error: Exception) -> Exception:
        """The error of a failed save (kept: later saves raise it too)."""
        self._saving = None
        self._failed = _directory.failed_save(self.directory, step, error)
        return self._failed

    # -- the start of a run

    def prepare(
        self, state: TrainState, callbacks: Sequence[Callback] = (), *, resume: bool
    ) -> TrainState:
        """Starts a run from ``state`` (`pztrain.fit` calls it before the first step).

        Checks that the directory can be written. With ``resume``, returns
        `restore_latest` (or ``state``); without, the directory must hold no
        checkpoint (``overwrite=True`` deletes them when training starts).
        ``continues_run``: ``resume`` into a directory a run used (its log goes on).

        Raises:
          CheckpointError: if the directory cannot be written or holds another
            run's checkpoints; `pztrain.CheckpointMismatchError` (see
            `restore_latest`).
        """
        self._failed = None
        self.wait()  # a save still pending from a run before (raises its error)
        self._new_run()
        self.continues_run = resume and self.directory.is_dir()  # maybe killed early
        _directory.check_writable(self.directory)
        if resume:
            return self.restore_latest(state, callbacks) or state
        steps = self.steps()
        if not self.overwrite:
            _directory.refuse_used(self.directory, steps)
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

        Raises:
          CheckpointMismatchError: if a readable checkpoint's structure differs
            from ``like`` 's (another model or optimizer), naming the paths.
        """
        if not self.directory.exists():
            return None
        for tmp in _directory.temporaries(self.directory):
            warnings.warn(
                f"Removing incomplete checkpoint {tmp} (a save that did not finish).",
                stacklevel=2,
            )
        unreadable = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            found = _directory.read(self.directory / str(step), like)
            if found is not None:
                self._set_aside(unreadable)
                self._last_done = step
                state, saved = found
                for i, cb in enumerate(callbacks):
                    if f"{i}:{type(cb).__name__}" in saved:
                        cb.load_state_dict(saved[f"{i}:{type(cb).__name__}"])
                return state
            unreadable.append(step)
        self._set_aside(unreadable)
        return None

    def _set_aside(self, steps: list[int]) -> None:
        if steps:
            self.close()  # the manager must not keep listing them
            _directory.set_aside(self.directory, steps)

    # -- callback hooks

    def on_train_start(self, state, info):
        if self.keep_best and not info.evaluates and self.monitor.startswith("eval/"):
            raise ValueError(
                f"Checkpoints(keep_best={self.keep_best}) ranks checkpoints by "
                f"{self.monitor!r}, but fit runs no evaluation: pass eval_step and "
                "eval_data to fit, or monitor a train metric."
            )
        self._hparams = jsonable(dict(info.hparams))
        self._running = True
        self._callbacks = tuple(info.callbacks)
        if self._last_done is None:
            self._last_done = info.start_step
        if self._stale:
            warnings.warn(
                f"Deleting checkpoints {self._stale} in {self.directory} "
                "(overwrite=True).",
                stacklevel=2,
            )
            for step in self._stale:
                self.manager.delete(step)
            self._stale = []

    def on_advance(self, step, t):
        self._confirm_saves()  # a failed background save stops the run here
        self._open_point = step

    def _periodic(self, step: int) -> bool:
        every, last = self.every_steps, self._last_done
        return every is not None and last is not None and step - last >= every

    def on_log(self, state, record):
        self._open_point = self._last_log = record["step"]
        self._latest_metrics.update(record["metrics"])
        if self._periodic(record["step"]):
            self._due = record["step"]

    def on_eval_end(self, state, record):
        metrics = {f"eval/{k}": v for k, v in record["metrics"].items()}
        metrics.update(self._latest_metrics)
        if (
            self.keep_best
            and self.monitor.startswith("eval/")
            and (self.monitor not in metrics)
        ):
            raise KeyError(
                f"Checkpoints monitors {self.monitor!r}, which is not among the "
                f"metrics {sorted(metrics)}."
            )
        self._eval = (record["step"], metrics)
        self._open_point = record["step"]
        if self.on_eval or self._periodic(record["step"]):
            self._due = record["step"]

    def on_epoch_end(self, state, epoch):
        step = int(state.step)
        self._open_point = step
        if self.at_epoch_end or self._periodic(step):
            self._due = step

    def on_point_end(self, state, step):
        """Saves if a hook of this point asked: after all of them ran."""
        due, self._due, self._open_point = self._due, None, None
        if due == step and step != self._last_done:
            self.save(state, step, self._metrics_at(step))

    def _metrics_at(self, step: int) -> dict[str, float]:
        """The metrics of the evaluation at ``step`` (if there was one) and the
        latest train metrics."""
        if self._eval and self._eval[0] == step:
            return self._eval[1]
        return dict(self._latest_metrics)

    def on_train_end(self, state, history):
        """Saves the final state (also after an exception) if its step's train
        record is logged and its host point over: an interruption between log
        points or inside a point resumes from the newest checkpoint instead (so
        the resumed log equals an uninterrupted one). Nothing is saved if the
        state was consumed, a save failed or the run did not start."""
        running, self._running = self._running, False
        if self._failed is not None or not running:
            return
        try:
            state.check_not_donated("Checkpoints.on_train_end")
        except DonatedStateError:
            return  # a step failed after taking the state: nothing valid to save
        step = int(state.step)
        if step not in (self._last_done, self._open_point) and step == self._last_log:
            self.save(state, step, self._metrics_at(step))
        if self.keep_best and self._saves and not self._ranked:
            warnings.warn(
                f"Checkpoints(keep_best={self.keep_best}) ranked no checkpoint: no "
                f"save saw the metric {self.monitor!r}. Monitor a metric the run "
                "logs or evaluates.",
                stacklevel=2,
            )


def _check_args(mode: str, keep_last: int, keep_best: int, every_steps) -> None:
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}.")
    for name, value, least in (
        ("keep_last", keep_last, 1),  # resume needs the newest
        ("keep_best", keep_best, 0),
        ("every_steps", 1 if every_steps is None else every_steps, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}; got {value!r}.")
