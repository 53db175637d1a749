"""A reader's mark: the checkpoint a job beside training is reading, which
the run's retention keeps until the read is over.

An evaluation job (`pztrain.evaluate_checkpoints`) never takes the run's lock.
While it reads checkpoint ``<step>`` it holds a small file in the directory,
``.pztrain-reader-<host>-<pid>-<token>.json``: ``{"step", "host", "pid",
"expires"}``. A heartbeat thread pushes ``expires`` on every ``ttl / 3``
seconds; the mark is removed when the read ends. The run's retention
(`pztrain.checkpoint._store`) deletes no step that a live mark names; it
deletes it at a later save, once the mark is gone. A mark is dead (ignored and
removed) once ``expires`` has passed, or at once when it names a process of
this host that has ended, so a killed job pins one checkpoint for ``ttl``
seconds at most, and training never waits for a reader.

The mark covers the read only (a few seconds): the job evaluates the state
from memory, so a slow evaluation holds nothing on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from pztrain.checkpoint._orbax import all_agree_each

__all__ = ["MARK_PREFIX", "TTL", "held_steps", "reading", "unheld"]

MARK_PREFIX = ".pztrain-reader-"
TTL = 120.0
"""Seconds a mark lives without a heartbeat (a margin for clocks that differ
between the job's machine and the run's)."""


@contextlib.contextmanager
def reading(directory: Path, step: int, ttl: float = TTL) -> Iterator[bool]:
    """Marks checkpoint ``step`` of ``directory`` as being read, for the block.

    Yields ``True`` if the mark is on disk; ``False`` (with a warning) if it
    could not be written (a read-only directory): the read goes on unmarked.
    """
    name = f"{MARK_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    path = directory / f"{name}.json"
    record = {"step": step, "host": socket.gethostname(), "pid": os.getpid()}
    try:
        _write(path, {**record, "expires": time.time() + ttl})
    except OSError as e:
        warnings.warn(
            f"evaluate_checkpoints: cannot mark checkpoint {step} as being read in "
            f"{directory} ({e.strerror or e}); the run's retention may delete it "
            "while it is read (it is then skipped).",
            stacklevel=3,
        )
        yield False
        return
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat, args=(path, record, ttl, stop), daemon=True
    )
    beat.start()
    try:
        yield True
    finally:
        stop.set()
        beat.join()
        with contextlib.suppress(OSError):
            path.unlink()


def _heartbeat(path: Path, record: dict, ttl: float, stop: threading.Event) -> None:
    """Pushes the mark's expiry on every ``ttl / 3`` seconds until ``stop``."""
    while not stop.wait(ttl / 3):
        with contextlib.suppress(OSError):
            _write(path, {**record, "expires": time.time() + ttl})


def _write(path: Path, record: dict) -> None:
    """Writes ``record`` to ``path`` whole (a reader never sees half of it)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(record))
    part.replace(path)


def held_steps(directory: Path, now: float | None = None) -> set[int]:
    """The steps that live marks in ``directory`` name; dead marks (expired,
    or of an ended process on this host) are removed."""
    now = time.time() if now is None else now
    held = set()
    for path in directory.glob(f"{MARK_PREFIX}*.json"):
        try:
            record = json.loads(path.read_text())
            step, expires = int(record["step"]), float(record["expires"])
        except (OSError, ValueError, TypeError, KeyError):
            continue  # being replaced, or not a mark: not ours to judge
        if expires < now or _ended(record):
            with contextlib.suppress(OSError):
                path.unlink()
        else:
            held.add(step)
    return held


def _ended(record: dict) -> bool:
    """Whether the mark's process is known to have ended (on this host)."""
    if record.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return False


def unheld(directory: Path, steps: list[int]) -> list[int]:
    """The steps among ``steps`` that no live mark names (in every process
    of a multi-process run: all of them delete the same steps)."""
    if not steps:
        return []
    held = held_steps(directory)
    free = all_agree_each([step not in held for step in steps])
    return [step for step, ok in zip(steps, free, strict=True) if ok]
