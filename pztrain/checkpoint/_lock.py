"""One writer per directory: the lock that `pztrain.Checkpoints` holds on its
directory and `pztrain.fit` on its run directory, for the whole run.

The lock is ``<directory>/.pztrain.lock``, held with ``fcntl.flock`` (advisory:
only runs that ask for it see it; the system drops it when its process ends,
however it ends) and holding its holder's host, pid, start time and command as
JSON. A second run finds it held and gets `DirectoryInUseError`, naming the
holder. A lock file that nobody holds (a run killed before it could remove it)
is taken over with a warning that names the run that left it. With several
processes, process 0 alone holds the locks, and every process raises if it could
not take them.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from pztrain.checkpoint._orbax import all_agree

__all__ = ["LOCK_NAME", "DirectoryInUseError", "DirectoryLock", "lock_holder", "locked"]

LOCK_NAME = ".pztrain.lock"


class DirectoryInUseError(RuntimeError):
    """Another run holds the lock of a checkpoint or run directory.

    Example:
      >>> import tempfile; from pztrain import Checkpoints, DirectoryInUseError
      >>> with tempfile.TemporaryDirectory() as d:
      ...     run = Checkpoints(d)
      ...     run.store.open()  # as fit does at a run's start: the directory locked
      ...     try:
      ...         Checkpoints(d).store.open()  # a second run, in the same directory
      ...     except DirectoryInUseError as e:
      ...         print(e)  # doctest: +ELLIPSIS
      ...     run.store.close()
      /... is in use by another run: this process (...) on host ...
    """


class DirectoryLock:
    """The lock of one directory (created if missing).

    Args:
      directory: The directory.

    Example:
      >>> import tempfile
      >>> d = tempfile.mkdtemp()
      >>> with DirectoryLock(d):  # doctest: +ELLIPSIS
      ...     DirectoryLock(d).acquire()
      Traceback (most recent call last):
      ...
      pztrain.checkpoint._lock.DirectoryInUseError: /... is in use by another run: ...
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).absolute()
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Takes the lock and writes this run's record into it.

        Raises:
          DirectoryInUseError: naming the holder, if another run holds it.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = self._open_held()
        left = _read(fd)
        if left:
            warnings.warn(
                f"Taking over the lock of {self.directory} from {_holder(left)}, "
                "which no longer holds it: that run ended without removing its "
                f"lock file {self.path} (it was killed, or its machine failed).",
                stacklevel=4,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_record()).encode(), 0)
        self._fd = fd

    def _open_held(self) -> int:
        """A descriptor of the lock file, flock-ed; retried if the file was
        replaced between opening and locking (its holder removed it)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_record(fd)
                os.close(fd)
                raise DirectoryInUseError(
                    f"{self.directory} is in use by another run: "
                    f"{_holder(holder)}. Two runs writing one directory mix their "
                    "checkpoints and logs. Wait for that run to end or stop it, or "
                    "choose another directory."
                ) from None
            if _same_file(fd, self.path):
                return fd
            os.close(fd)

    def release(self) -> None:
        """Removes the lock file, then lets the lock go (no-op if not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink()
        finally:
            os.close(fd)


@contextlib.contextmanager
def locked(*directories: str | os.PathLike | None) -> Iterator[None]:
    """Holds the locks of ``directories`` (``None`` s skipped, each directory
    once) for a run; with several processes, on process 0 only.

    A directory that cannot be created (a file of that name, no permission) is
    not locked here: the code that writes to it says what is wrong.

    Raises:
      DirectoryInUseError: if another run holds one of them.
    """
    paths = dict.fromkeys(Path(d).absolute() for d in directories if d is not None)
    if not paths:
        yield
        return
    with contextlib.ExitStack() as stack:
        error = None
        if jax.process_index() == 0:
            try:
                for path in paths:
                    with contextlib.suppress(OSError):  # reported by the writer
                        stack.enter_context(DirectoryLock(path))
            except DirectoryInUseError as e:
                error = e
        if not all_agree(error is None):
            raise error or DirectoryInUseError(
                f"Process 0 found {', '.join(map(str, paths))} in use by another "
                "run (its error names the holder)."
            )
        yield


def lock_holder(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the run that holds ``directory``'s lock (host, pid,
    start, command), or ``None`` if no run holds it, read without taking the
    lock (a reader must never make a starting run fail). A run killed without
    cleaning up leaves its lock file: it reads as held."""
    path = Path(directory).absolute() / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return _read(fd) or {}
    finally:
        os.close(fd)


def _holder_record(fd: int, patience: float = 1.0) -> dict[str, Any] | None:
    """The record of a held lock; a holder that has just taken it gets up to
    ``patience`` seconds to write it."""
    deadline = time.monotonic() + patience
    record = _read(fd)
    while record is None and time.monotonic() < deadline:
        time.sleep(0.02)
        record = _read(fd)
    return record


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path``."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> dict[str, Any] | None:
    """The record in a lock file (``None`` if empty; ``{}`` if unreadable)."""
    data = os.pread(fd, 4096, 0)
    if not data.strip():
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _record() -> dict[str, Any]:
    now = datetime.datetime.now().astimezone()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": now.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:300],
    }


def _holder(record: dict[str, Any] | None) -> str:
    """``"pid 12 on host h (started …: command)"``, as far as the record says."""
    if not record:
        return "a run whose lock record is empty (it is starting)"
    pid, host = record.get("pid"), record.get("host")
    this = pid == os.getpid() and host == socket.gethostname()
    who = "this process (another fit running in it)" if this else f"pid {pid}"
    return (
        f"{who} on host {host}, started {record.get('started')} "
        f"({record.get('command') or 'no command'})"
    )
