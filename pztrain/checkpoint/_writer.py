"""The background writer of a `pztrain.Checkpoints` directory.

An orbax ``CheckpointManager`` that keeps every checkpoint (which to delete is
`pztrain.checkpoint._retention`'s decision) and remembers a save that failed
in the background, so that every later call raises its error, naming its step.

A ``KeyboardInterrupt`` while it waits for a save (a second Ctrl-C during the
save of a stopped run) gets one line, a note naming the save, in place of the
traceback orbax logs at ERROR level.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any

import jax

from pztrain.checkpoint import _directory, _orbax
from pztrain.checkpoint._metadata import CheckpointError

__all__ = ["TRASH", "Writer"]

TRASH = ".pztrain-deleting"
"""Where a deleted checkpoint goes (renamed) before it is removed."""


class Writer:
    """Saves checkpoints ``<directory>/<step>``, in the background if ``async_save``.

    Args:
      directory: The root directory.
      async_save: Write in the background (else each save returns once on disk).
    """

    def __init__(self, directory: Path, async_save: bool):
        self.directory = directory
        self.async_save = async_save
        self._manager: Any = None
        self._saving: int | None = None  # a background save not yet confirmed
        self.failed: CheckpointError | None = None
        self._failed_step: int | None = None

    @property
    def manager(self) -> Any:
        """The orbax ``CheckpointManager`` (made on first use)."""
        if self._manager is None:
            ocp = _orbax.ocp()
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,  # what killed or failed saves left
                todelete_subdir=TRASH,  # deletes are renames first: atomic
                create=True,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, item_handlers=_orbax.handlers(), options=options
            )
        return self._manager

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, args: Any, *, wait: bool) -> None:
        """Starts saving ``args`` as checkpoint ``step`` (waits if ``wait``).

        Raises:
          CheckpointError: naming the step, if this or an earlier save failed.
        """
        self.wait()  # the previous save first: its error names its step
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:  # orbax raises many kinds; name the step
            raise self._failed(step, e) from e
        self._saving = step
        if wait:
            self.wait()

    def wait(self) -> None:
        """Blocks until pending saves are on disk.

        Raises:
          CheckpointError: if a background save failed (naming its step).
        """
        if self.failed is not None:
            raise self.failed
        if self._manager is None:
            return
        try:
            with _quiet_interrupts():
                self._manager.wait_until_finished()
        except KeyboardInterrupt as e:
            e.add_note(
                f"pztrain: interrupted while checkpoint {self._saving} was being "
                f"written to {self.directory}; the save goes on until it is complete "
                "(an unfinished one is removed when the run resumes)."
            )
            raise
        except Exception as e:
            raise self._failed(self._saving, e) from e
        self._saving = None

    def confirm(self) -> None:
        """Raises the error of a background save that has finished and failed."""
        if self._saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def delete(self, steps: list[int]) -> None:
        """Deletes checkpoints ``steps`` (none of them may be saving).

        Each ``<step>`` is first renamed into ``TRASH`` (orbax's
        ``todelete_subdir``), then removed: a reader beside the run finds a
        whole checkpoint or none, never one half deleted.
        """
        if not steps:
            return
        self._empty_trash()  # what a run killed while deleting left
        for step in steps:
            self.manager.delete(step)
        self._empty_trash()

    def _empty_trash(self) -> None:
        if jax.process_index() == 0:  # the process that renamed them
            trash = self.directory / TRASH
            shutil.rmtree(trash, ignore_errors=True)

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
            # A failed save's other writer threads may still have been writing
            # when its temporaries were first removed; closed, they are done.
            if self.failed is not None:
                _directory.remove_temporaries(self.directory, self._failed_step)

    def _failed(self, step: int | None, error: Exception) -> CheckpointError:
        """The error of a failed save (kept: later calls raise it too)."""
        self._saving = None
        self._failed_step = step
        self.failed = _directory.failed_save(self.directory, step, error)
        return self.failed


class _DropInterrupts(logging.Filter):
    """Drops the records that log a ``KeyboardInterrupt`` (orbax's ERROR
    "Save Finalize thread ... failed" with its traceback, when Ctrl-C stops
    the wait for a save)."""

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0] if record.exc_info else None
        return not (kind is not None and issubclass(kind, KeyboardInterrupt))


@contextlib.contextmanager
def _quiet_interrupts():
    """Within it, orbax's logger (absl's) logs no ``KeyboardInterrupt``."""
    logger, drop = logging.getLogger("absl"), _DropInterrupts()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
