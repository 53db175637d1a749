"""`Checkpoints`: periodic full-state checkpoints during `pztrain.fit`, and resume.

The policy (when to save, which checkpoints to keep, resuming from the newest
readable one) lives here, over an orbax ``CheckpointManager``; what a checkpoint
holds on disk is `pztrain.checkpoint`'s format.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pztrain import _orbax, checkpoint
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
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}.")
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (resume needs the newest); got {keep_last}."
            )
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be >= 1; got {every_steps}.")
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self.at_epoch_end = at_epoch_end
        self.on_eval = keep_best > 0 if on_eval is None else on_eval
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self.async_save = async_save
        self._manager = None
        self._open = 0  # nesting depth of with-blocks (fit opens one)
        self._callbacks: tuple[Callback, ...] = ()
        self._last_saved: int | None = None
        self._latest_metrics: dict[str, float] = {}
        self._hparams: dict[str, Any] = {}

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

    def save(self, state: TrainState, step: int, metrics: dict | None = None) -> None:
        """Saves ``state`` as checkpoint ``step``.

        In the background inside `fit` or a ``with`` block (if ``async_save``);
        otherwise it returns once the checkpoint is on disk.
        """
        if step in self.manager.all_steps():
            return
        meta = {"callbacks": self._callback_states(), "hparams": self._hparams}
        meta = checkpoint.state_metadata(state, meta)
        if metrics:
            meta["metrics"] = metrics
        best = {self.monitor: metrics[self.monitor]} if metrics else None
        args = checkpoint.save_args(state.params, state, meta)
        self.manager.save(step, args=args, metrics=best)
        self._last_saved = step
        if not self._open:
            self.wait()

    def _callback_states(self) -> dict[str, Any]:
        found = {}
        for i, cb in enumerate(self._callbacks):
            saved = cb.state_dict()
            if saved is not None:
                found[f"{i}:{type(cb).__name__}"] = saved
        return found

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases the manager (used again later,
        it makes a new one)."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    # -- resume

    def restore_latest(
        self, like: TrainState, callbacks: Sequence[Callback] = ()
    ) -> TrainState | None:
        """The newest complete, readable checkpoint restored into ``like``.

        Incomplete checkpoints (a save killed midway) and unreadable ones are
        skipped with a warning that names them.

        Args:
          like: A state built in code, with the structure of the saved one.
          callbacks: The run's callbacks, in the order the saving run had them:
            each gets back its saved ``state_dict`` (``load_state_dict``).

        Returns:
          The restored state, or ``None`` if there is no checkpoint.
        """
        if not self.directory.exists():
            return None
        for tmp in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
            warnings.warn(
                f"Skipping incomplete checkpoint {tmp} (a save that did not finish).",
                stacklevel=2,
            )
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self.directory / str(step)
            try:
                state = checkpoint.load_state(path, like)
                meta = checkpoint.read_metadata(path)
            except checkpoint.CheckpointError as e:
                warnings.warn(
                    f"Skipping unreadable checkpoint {path}: {e}", stacklevel=2
                )
                continue
            saved = meta.get("metadata", {}).get("callbacks", {})
            for i, cb in enumerate(callbacks):
                key = f"{i}:{type(cb).__name__}"
                if key in saved:
                    cb.load_state_dict(saved[key])
            self._last_saved = step
            return state
        return None

    # -- callback hooks

    def on_train_start(self, state, info):
        self._hparams = jsonable(dict(info.hparams))
        self._callbacks = tuple(info.callbacks)
        if self._last_saved is None:
            self._last_saved = info.start_step

    def _maybe_save(self, state, step: int, metrics=None) -> None:
        if (
            self.every_steps is not None
            and self._last_saved is not None
            and step - self._last_saved >= self.every_steps
        ):
            self.save(state, step, metrics)

    def on_log(self, state, record):
        self._latest_metrics.update(record["metrics"])
        self._maybe_save(state, record["step"])

    def on_eval_end(self, state, record):
        metrics = {f"eval/{k}": v for k, v in record["metrics"].items()}
        metrics.update(self._latest_metrics)
        if not self.on_eval:
            self._maybe_save(state, record["step"])
            return
        if self.keep_best and self.monitor not in metrics:
            raise KeyError(
                f"Checkpoints monitors {self.monitor!r}, which is not among the "
                f"metrics {sorted(metrics)}."
            )
        self.save(state, record["step"], metrics)

    def on_epoch_end(self, state, epoch):
        step = int(state.step)
        if self.at_epoch_end:
            self.save(state, step)
        else:
            self._maybe_save(state, step)

    def on_train_end(self, state, history):
        """Saves the final state (also after an exception), unless it was consumed."""
        try:
            state.check_not_donated("Checkpoints.on_train_end")
        except DonatedStateError:
            return  # a step failed after taking the state: nothing valid to save
        step = int(state.step)
        if self._last_saved != step:
            self.save(state, step)
