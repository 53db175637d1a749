"""The directory of `pztrain.Checkpoints` on disk: writable, and kept tidy.

Orbax writes each checkpoint to ``<step>.orbax-checkpoint-tmp*`` and renames it
to ``<step>`` once complete; what a killed or failed save leaves is such a
temporary. Checkpoints that cannot be read are renamed ``<step>.unreadable``,
out of the way of the steps a resumed run saves again.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax

from pztrain.checkpoint import _format
from pztrain.checkpoint._metadata import CheckpointError, CheckpointMismatchError
from pztrain.checkpoint._orbax import all_agree, barrier
from pztrain.state import TrainState

__all__ = [
    "Found",
    "check_writable",
    "failed_save",
    "newest_readable",
    "refuse_used",
    "remove_temporaries",
    "set_aside",
    "temporaries",
    "warn_temporaries",
]


def check_writable(directory: Path) -> None:
    """Creates ``directory`` if needed and checks that a file can be written in it.

    Raises:
      CheckpointError: naming the directory and the reason.
    """
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"Cannot write checkpoints to {directory}: it is a file. Choose a "
            "directory."
        )
    probe = directory / f".pztrain-write-check-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"Cannot write checkpoints to {directory}: {e.strerror or e}. Choose a "
            "directory you can write to."
        ) from None


def temporaries(directory: Path, step: int | None = None) -> list[Path]:
    """The temporaries of unfinished saves (of ``step``, or of any step)."""
    prefix = "*" if step is None else str(step)
    return sorted(directory.glob(f"{prefix}.orbax-checkpoint-tmp*"))


def remove_temporaries(directory: Path, step: int | None) -> None:
    """Removes what an unfinished save of ``step`` left."""
    if step is not None:
        for tmp in temporaries(directory, step):
            shutil.rmtree(tmp, ignore_errors=True)


def set_aside(directory: Path, steps: list[int]) -> None:
    """Renames checkpoints ``<step>`` to ``<step>.unreadable`` (kept to inspect;
    ``<step>.unreadable-2`` … if an earlier resume set one aside already).
    With several processes, process 0 renames and the others wait."""
    if jax.process_index() == 0:
        _rename_aside(directory, steps)
    barrier(f"pztrain.set_aside {directory}")


def _rename_aside(directory: Path, steps: list[int]) -> None:
    for step in steps:
        path = directory / str(step)
        aside, n = path.with_name(f"{step}.unreadable"), 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{step}.unreadable-{n}")
        path.rename(aside)


class Found(NamedTuple):
    """What `newest_readable` found in a directory.

    Attributes:
      state: The newest readable checkpoint restored, or ``None``.
      step: Its step.
      callbacks: The callbacks' ``state_dict`` s saved with it.
      unreadable: The newer steps that could not be read.
      metrics: The metrics stored with each readable checkpoint, by step.
      owed_eval: The ``(step, epoch)`` of the evaluations that a stop left
        undone before it was saved (the resumed run does them first), or
        ``(step, epoch, names)`` when it names them, or ``None``.
      time: The run's records' ``time`` when it was saved (0.0 if it does
        not say).
    """

    state: TrainState | None
    step: int | None
    callbacks: dict[str, Any]
    unreadable: list[int]
    metrics: dict[int, dict[str, float] | None]
    owed_eval: tuple | None = None
    time: float = 0.0


def newest_readable(directory: Path, steps: list[int], like: TrainState) -> Found:
    """The newest of checkpoints ``steps`` that reads into ``like``.

    Unreadable ones are skipped with a warning naming them. With several
    processes a checkpoint counts as readable only if every process read it
    (so that all of them resume from the same step and meet at the same
    barriers).

    Raises:
      CheckpointMismatchError: if a readable checkpoint is of another structure.
    """
    unreadable = []
    for step in sorted(steps, reverse=True):
        found = _read(directory / str(step), like)
        if all_agree(found is not None):
            older = [s for s in steps if s < step]
            metrics = {s: _stored_metrics(directory / str(s)) for s in older}
            metrics[step] = found[1].get("metrics")
            callbacks = found[1].get("callbacks", {})
            owed = _owed_eval(found[1].get("owed_eval"), step)
            time = _stored_time(found[1].get("time"))
            return Found(found[0], step, callbacks, unreadable, metrics, owed, time)
        unreadable.append(step)
    return Found(None, None, {}, unreadable, {})


def _read(path: Path, like: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
    """Checkpoint ``path`` restored into ``like``, with its free-form metadata;
    ``None`` (and a warning naming it) if it cannot be read."""
    try:
        state = _format.load_state(path, like)
        return state, _format.read_metadata(path).get("metadata", {})
    except CheckpointMismatchError:
        raise
    except CheckpointError as e:
        warnings.warn(f"Skipping unreadable checkpoint {path}: {e}", stacklevel=5)
    return None


def _owed_eval(stored: Any, step: int) -> tuple | None:
    """The owed evaluations stored with checkpoint ``step`` (of that step):
    ``(step, epoch)``, or ``(step, epoch, names)`` if it names them."""
    if isinstance(stored, dict) and stored.get("step") == step:
        epoch, names = stored.get("epoch"), stored.get("names")
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            if isinstance(names, list) and all(isinstance(n, str) for n in names):
                return step, epoch, tuple(names)
            return step, epoch
    return None


def _stored_time(stored: Any) -> float:
    """The time stored with a checkpoint (0.0 if none, or not a time)."""
    ok = isinstance(stored, int | float) and not isinstance(stored, bool)
    return float(stored) if ok and 0 <= stored < float("inf") else 0.0


def _stored_metrics(path: Path) -> dict[str, float] | None:
    """The metrics stored with checkpoint ``path`` (``None`` if unreadable)."""
    try:
        return _format.read_metadata(path).get("metadata", {}).get("metrics")
    except CheckpointError:
        return None


def warn_temporaries(directory: Path) -> None:
    """Warns of each temporary of an unfinished save (orbax removes them)."""
    for tmp in temporaries(directory):
        warnings.warn(
            f"Removing incomplete checkpoint {tmp} (a save that did not finish).",
            stacklevel=3,
        )


def must_replace(directory: Path, steps: list[int], step: int, overwrite: bool) -> bool:
    """Whether checkpoint ``step`` is among ``steps`` and may be replaced
    (``overwrite``); refuses a step older than the newest, or one that exists
    without ``overwrite``."""
    newest = max(steps, default=step)
    if step < newest:  # keep-last would delete the newest steps
        raise CheckpointError(
            f"Checkpoint {step} is older than the newest, {newest}, in "
            f"{directory}; save steps in order (or use another directory)."
        )
    if step in steps and not overwrite:
        raise CheckpointError(
            f"Checkpoint {step} already exists in {directory}. Save another "
            "step, or pass Checkpoints(..., overwrite=True) to replace it."
        )
    return step in steps


def refuse_used(directory: Path, steps: list[int], step: int | None = None) -> None:
    """Refuses a fresh run from a state at ``step`` (``None``: unknown) into
    ``directory`` if it holds checkpoints ``steps``. The message says how the
    state relates to them, and names the call for each way on.

    Example:
      >>> refuse_used(Path("ckpt"), [500, 600, 651], 651)
      Traceback (most recent call last):
      ...
      pztrain.checkpoint._metadata.CheckpointError: ckpt already holds \
checkpoints [500, 600, 651], the newest at this state's step (651): a run that \
stopped there saved it. Pass resume=True to fit to go on from there (with the \
callbacks' states and the log), choose a new directory, or pass \
Checkpoints(..., overwrite=True) to delete them.
    """
    if not steps:
        return
    newest, head = max(steps), f"{directory} already holds checkpoints {steps}"
    rest = (
        "choose a new directory, or pass Checkpoints(..., overwrite=True) to "
        "delete them."
    )
    if step == newest:
        why = (
            f", the newest at this state's step ({step}): a run that stopped "
            "there saved it. Pass resume=True to fit to go on from there (with "
            f"the callbacks' states and the log), {rest}"
        )
    elif step is not None and step > newest:
        why = (
            f", up to step {newest}, before this state's step ({step}). Pass "
            "Checkpoints(..., overwrite=True) to go on from this state (it "
            f"deletes them), resume=True to fit to go on from step {newest}, or "
            "choose a new directory."
        )
    elif step in steps:
        why = (
            f", up to step {newest}, after this state's step ({step}). Pass "
            f"resume=True to fit to go on from step {newest}, {rest}"
        )
    else:
        at = "" if step is None else f" (this state is at step {step})"
        why = f" of another run{at}. Pass resume=True to fit to continue it, {rest}"
    raise CheckpointError(head + why)


def failed_save(directory: Path, step: int | None, error: Exception) -> CheckpointError:
    """The error of a failed save of ``step``, after removing its temporaries."""
    remove_temporaries(directory, step)
    return CheckpointError(
        f"Saving checkpoint {step} in {directory} failed: {type(error).__name__}: "
        f"{str(error)[:300]}. Its temporary files were removed; the earlier "
        "checkpoints are intact. Free disk space or choose another directory, then "
        "continue with fit(..., resume=True)."
    )
