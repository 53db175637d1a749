"""The directory an evaluation job follows, checked before the job starts.

`pztrain.evaluate_checkpoints` is given the training run's `pztrain.Checkpoints`
directory. A path that cannot be one (a file, one checkpoint, the run's own
directory whose ``ckpt/`` holds the checkpoints) is refused at once, naming
what to pass; a directory with no checkpoint yet is refused when the job does
not follow, and otherwise waited for with a line that says what for.
"""

from __future__ import annotations

from pathlib import Path

from pztrain.checkpoint._lock import lock_holder
from pztrain.checkpoint._metadata import checkpoint_steps

__all__ = ["check_source", "waiting_line"]


def check_source(directory: Path, follow: bool) -> None:
    """Refuses ``directory`` if it cannot be a run's checkpoint directory
    (or, with ``follow=False``, if it holds no checkpoint).

    Raises:
      FileNotFoundError: ``directory`` does not exist (``follow=False``).
      ValueError: it is a file, one checkpoint, a directory whose subfolder
        holds the checkpoints, or (``follow=False``) one that holds none.
    """
    if directory.is_dir() and checkpoint_steps(directory):
        return
    head = f"evaluate_checkpoints({str(directory)!r})"
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{head}: it is a file; pass the run's checkpoint directory.")
    if (directory / "meta").is_dir():
        raise ValueError(
            f"{head}: it is one checkpoint; pass the directory that holds the "
            f"run's checkpoints: directory={str(directory.parent)!r}."
        )
    inner = _holding_subfolders(directory)
    if inner:
        raise ValueError(
            f"{head}: it holds no checkpoint, but its subfolder {inner[0].name!r} "
            f"does: pass directory={str(inner[0])!r} (the run's Checkpoints "
            "directory, not its run directory)."
        )
    if follow:
        return
    if not directory.exists():
        raise FileNotFoundError(
            f"{head}: no such directory{_elsewhere(directory)}. Pass the "
            "training run's Checkpoints directory, or follow=True to wait for a "
            "run to create it."
        )
    raise ValueError(
        f"{head}: the directory holds no checkpoint ({_holder(directory)}). Pass "
        "the training run's Checkpoints directory, or follow=True to wait for "
        "its first checkpoint."
    )


def waiting_line(directory: Path, timeout: float) -> str:
    """What a following job prints when it starts waiting: for what, where,
    how long, and (when the directory is missing) that it does not exist."""
    head = f"evaluate_checkpoints: waiting for checkpoints in {directory}"
    up_to = f"up to {timeout:g} s without a new one"
    if not directory.exists():
        near = _elsewhere(directory)
        return (
            f"{head}, which does not exist yet ({up_to}, for the training run to "
            f"create it; check the path if the run has started{near})."
        )
    held = _holder(directory)
    if not checkpoint_steps(directory):
        return f"{head}, which holds none yet ({up_to}; {held})."
    return f"{head} ({up_to}; {held})."


def _holding_subfolders(directory: Path) -> list[Path]:
    """The subfolders of ``directory`` that hold checkpoints, by name."""
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_dir() and not p.name.isdigit() and checkpoint_steps(p)
    )


def _elsewhere(directory: Path) -> str:
    """``"; <sibling> holds checkpoints"`` for a missing ``directory``."""
    near = [p for p in _holding_subfolders(directory.parent) if p != directory]
    return f"; {near[0]} holds checkpoints" if near else ""


def _holder(directory: Path) -> str:
    """Which training run holds ``directory``'s lock, if any."""
    holder = lock_holder(directory)
    if holder is None:
        return "no training run holds it"
    return f"held by the run pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
