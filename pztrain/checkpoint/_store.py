"""The checkpoints of one directory: written, kept by a policy, read back.

`Checkpoints` decides when to save and what a checkpoint carries besides the
state (the run's metrics, hyperparameters and callback states); a
`CheckpointStore` does the rest: it writes through a `Writer` (orbax, in the
background or not), deletes what its `Retention` lets go once nothing is
pending (but not a checkpoint an evaluation job is reading: its reader's mark,
`pztrain.checkpoint._readers`), holds the directory's lock for a run, and
finds the newest readable checkpoint to resume from
(`pztrain.checkpoint._directory`).

What it writes: params that are finite, and a population while one of its
members' are. A population is one state, so its checkpoint holds every
member (a run resumes with the same members, keys and hyperparameters): a
member that diverged (NaN or inf params) does not stop the others'
checkpoints; a warning names it, and its records show it (its
``loss/member_<i>`` is NaN, ``loss/diverged`` counts it). Ranking by
``loss/min`` or ``eval/<metric>/min`` uses the finite members
(`pztrain._members.spread`).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from pztrain._members import finite_members, member_count
from pztrain._tree import all_finite
from pztrain.checkpoint import _directory, _format, _readers
from pztrain.checkpoint._lock import locked
from pztrain.checkpoint._metadata import CheckpointError
from pztrain.checkpoint._retention import Retention
from pztrain.checkpoint._targets import params_of
from pztrain.checkpoint._writer import Writer
from pztrain.state import TrainState

__all__ = ["CheckpointStore"]

Metrics = dict[str, float] | None


class CheckpointStore:
    """The checkpoints ``<directory>/<step>`` of one directory.

    Args:
      directory: The root directory (absolute).
      retention: Which checkpoints to keep.
      async_save: Write in the background (else each save returns once on disk).
      overwrite: Let `write` replace a step that exists.

    Attributes:
      metrics: The metrics saved with each checkpoint this store wrote or
        found, by step (what `retention` ranks by).
    """

    def __init__(
        self, directory: Path, retention: Retention, async_save: bool, overwrite: bool
    ):
        self.directory = directory
        self.retention = retention
        self.writer = Writer(directory, async_save)
        self.overwrite = overwrite
        self.metrics: dict[int, Metrics] = {}
        self._lock = contextlib.ExitStack()  # the directory's, from open to close

    @property
    def failed(self) -> CheckpointError | None:
        """The error of a save that failed in the background, or ``None``."""
        return self.writer.failed

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk."""
        return self.writer.steps()

    def confirm(self) -> None:
        """Raises the error of a background save that has finished and failed
        (naming its step)."""
        self.writer.confirm()

    def delete(self, steps: list[int]) -> None:
        """Deletes checkpoints ``steps`` (e.g. another run's, with ``overwrite``)."""
        self.writer.delete(steps)

    def best_step(self) -> int | None:
        """The step of the best checkpoint by the retention's ``monitor``."""
        if not self.retention.keep_best:
            return None
        best = self.retention.best(self._saved())
        return best[0] if best else None

    def _saved(self) -> dict[int, Metrics]:
        return {s: self.metrics.get(s) for s in self.steps()}

    def open(self) -> None:
        """Starts a run: the pending save of a run before finished (its error
        raised), the directory locked until `close` and checked writable.

        Raises:
          CheckpointError: if a save still pending failed, or the directory
            cannot be written.
          DirectoryInUseError: if another run holds the directory's lock.
        """
        self.writer.failed = None
        self.writer.wait()
        self.metrics = {}
        self._lock.close()
        self._lock.enter_context(locked(self.directory))
        _directory.check_writable(self.directory)

    def worth_saving(self, state: TrainState, step: int) -> bool:
        """Whether checkpoint ``step`` of ``state`` is written: not if its
        params are not finite (for a population: no member's are), with a
        warning (as the caller of `pztrain.Checkpoints.save`) that says so,
        or that names a population's members that are not."""
        if all_finite(state.params):
            return True
        members = member_count(state.root_rng)
        finite = None if members is None else finite_members(state.params, members)
        if finite is None or not finite.any():
            whose = "its params are not" if finite is None else "no member's params are"
            warnings.warn(
                f"Not saving checkpoint {step} in {self.directory}: {whose} "
                "finite (NaN or inf). The newest checkpoint stays "
                f"{max(self.steps(), default=None)}.",
                stacklevel=4,
            )
            return False
        warnings.warn(
            f"Saving the checkpoints in {self.directory} with population members "
            f"{np.flatnonzero(~finite).tolist()} whose params are not finite (NaN "
            f"or inf): the whole population is saved, {int(finite.sum())} of its "
            f"{members} members finite (their loss/member_<i> is NaN, "
            "loss/diverged counts them).",
            stacklevel=4,
        )
        return True

    def write(
        self,
        step: int,
        state: TrainState,
        meta: dict[str, Any],
        metrics: Metrics,
        *,
        wait: bool,
    ) -> None:
        """Saves ``state`` with the JSON ``meta`` as checkpoint ``step``.

        Raises:
          CheckpointError: if checkpoint ``step`` exists (and not
            ``overwrite``), or this or an earlier save failed.
        """
        if _directory.must_replace(self.directory, self.steps(), step, self.overwrite):
            self.writer.delete([step])
        args = _format.save_args(params_of(state), state, meta)
        self.metrics[step] = metrics
        self.writer.save(step, args, wait=wait)
        if wait:
            self._tidy()

    def wait(self) -> None:
        """Waits for pending saves, then deletes what the retention policy drops.

        Raises:
          CheckpointError: if a background save failed (naming its step).
        """
        self.writer.wait()
        self._tidy()

    def _tidy(self) -> None:
        """Deletes the complete checkpoints the retention policy lets go,
        but not one that a job beside the run is reading (its reader's mark,
        `pztrain.checkpoint._readers`): a later tidy deletes that one."""
        if self.writer.failed is None and self.metrics:
            drop = self.retention.delete(self._saved())
            self.writer.delete(_readers.unheld(self.directory, drop))

    def close(self) -> None:
        """Finishes pending saves and releases the manager (even if one failed)
        and the directory's lock."""
        try:
            self.wait()
        finally:
            try:
                self.writer.close()
            finally:
                self._lock.close()

    def newest(self, like: TrainState) -> _directory.Found | None:
        """The newest complete, readable checkpoint, read into ``like``
        (`pztrain.checkpoint._directory.newest_readable`); the unreadable ones
        newer than it set aside. ``None`` if the directory does not exist.

        Raises:
          CheckpointMismatchError: if a readable checkpoint's structure differs
            from ``like`` 's.
        """
        if not self.directory.exists():
            return None
        _directory.warn_temporaries(self.directory)
        found = _directory.newest_readable(self.directory, self.steps(), like)
        if found.unreadable:
            self.writer.close()  # the manager must not keep listing them
            _directory.set_aside(self.directory, found.unreadable)
        self.metrics = found.metrics
        return found

    def read(self, step: int, like: TrainState) -> TrainState:
        """Checkpoint ``step`` read into ``like``, once pending saves are on disk.

        Raises:
          ValueError: if the directory holds no checkpoint of ``step``.
          CheckpointError: if it cannot be read (its message names the file).
        """
        self.writer.wait()
        steps = self.steps()
        if step not in steps:
            raise ValueError(
                f"{self.directory} holds no checkpoint of step {step}; it holds "
                f"steps {steps}."
            )
        return _format.load_state(self.directory / str(step), like)
