"""A lower CPU priority for the time of a job, given back when it returns.

`pztrain.evaluate_checkpoints` runs beside training: it lowers its process's
priority (nice, and at 19 Linux's idle scheduling class) so that training keeps
its speed. Called in-process (a notebook's cell), the caller gets its own
priority back when the job returns: raising a priority again may need rights
(root, ``RLIMIT_NICE``); where the OS refuses, a warning says so, once.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = ["lowered_priority"]

_TASKS = Path("/proc/self/task")
_warned = False


@contextlib.contextmanager
def lowered_priority(by: int | None) -> Iterator[None]:
    """Lowers this process's CPU priority by ``by`` (``None``: not) inside
    the block, every thread of it, and gives each thread its priority and
    scheduling back on the way out (new threads get the calling thread's)."""
    if by is None:
        yield
        return
    before = _priorities()
    _lower(by)
    try:
        yield
    finally:
        _restore(before)


def _threads() -> list[int]:
    """This process's thread ids (Linux), or ``[0]``: the process."""
    if not _TASKS.is_dir():
        return [0]
    with contextlib.suppress(OSError, ValueError):
        return [int(t.name) for t in _TASKS.iterdir()]
    return [0]


def _priorities() -> dict[int, tuple]:
    """Each thread's ``(nice, policy, param)`` (policy ``None`` off Linux)."""
    out = {}
    for tid in _threads():
        with contextlib.suppress(OSError):
            sched = None
            if tid and hasattr(os, "sched_getscheduler"):
                sched = (os.sched_getscheduler(tid), os.sched_getparam(tid))
            out[tid] = (os.getpriority(os.PRIO_PROCESS, tid), sched)
    return out


def _lower(by: int) -> None:
    """Lowers every thread's priority by ``by`` (nice): on Linux a thread's
    niceness is its own, and the threads that compute (XLA's) started with
    JAX. At 19 (the lowest), the threads also take Linux's idle scheduling
    class: they run only on CPU time that no other process wants."""
    idle = by >= 19 and hasattr(os, "SCHED_IDLE")
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that has ended
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, max(now, 0) + by))
            if idle and tid:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _restore(before: dict[int, tuple]) -> None:
    """Gives each thread its priority of ``before`` back (a thread started
    since: the calling thread's); warns once if the OS refuses."""
    own = before.get(_own_id()) or next(iter(before.values()), None)
    refused = []
    for tid in _threads():
        nice, sched = before.get(tid, own) or (None, None)
        try:
            if sched is not None:
                os.sched_setscheduler(tid, sched[0], sched[1])
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # a thread that has ended
            continue
        except OSError as e:
            refused.append(e)
    if refused:
        _warn(refused[0])


def _own_id() -> int:
    """The calling thread's id as in ``/proc/self/task`` (0 off Linux)."""
    return os.gettid() if hasattr(os, "gettid") and _TASKS.is_dir() else 0


def _warn(error: OSError) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "evaluate_checkpoints: could not give this process its CPU priority "
        f"back after the job ({error}); raising a priority again needs rights "
        "(root, or ulimit -e). Pass priority=None to evaluate_checkpoints in a "
        "process that goes on with other work.",
        RuntimeWarning,
        stacklevel=4,
    )
