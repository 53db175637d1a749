"""`evaluate_checkpoints`: an evaluation job beside training.

On a cluster the usual layout is a training job plus an evaluation job that
follows its checkpoint directory. The job reads checkpoints as they appear
(never taking the training run's lock, never listing them through an orbax
manager that would clean up a save in progress), evaluates each once, in step
order, with named `Evaluation` s, and logs each as one eval record in its own
run directory. Its log says what is done: started again, it skips the steps
it has logged.

While it reads a checkpoint it holds a reader's mark in the directory
(`pztrain.checkpoint._readers`), which the run's retention honours: the
checkpoint is deleted at a later save, once read. The mark covers the read
only (one checkpoint more than ``keep_last`` at most); a job slower than
training goes on in step order with the checkpoints still there, and names
each one it listed but found deleted in a warning.
Retention deletes a checkpoint by renaming it away, then removing it, so a
read that fails on a checkpoint that is gone was a deletion; on one that is
still there, damage: that one raises.

It runs at a lower CPU priority, so training keeps its speed, and gives the
process its priority back when it returns (`lowered_priority`).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from pztrain.checkpoint import load_params, load_state
from pztrain.checkpoint._lock import lock_holder, locked
from pztrain.checkpoint._metadata import checkpoint_steps
from pztrain.checkpoint._readers import reading
from pztrain.loggers import JsonlLogger, Logger, log_media
from pztrain.loop._evaluations import Evaluation, check_evaluations, evaluation_values
from pztrain.loop._job_directory import check_source, waiting_line
from pztrain.loop._signals import stop_signals
from pztrain.records import History, read_jsonl
from pztrain.state import TrainState
from pztrain.state._state import check_state

__all__ = ["evaluate_checkpoints", "lowered_priority"]


def evaluate_checkpoints(
    directory: str | os.PathLike,
    like: TrainState,
    evaluations: Sequence[Evaluation],
    *,
    run_dir: str | os.PathLike,
    loggers: Sequence[Logger] = (),
    follow: bool = True,
    timeout: float = 3600.0,
    poll: float = 10.0,
    priority: int | None = 19,
) -> History:
    """Evaluates each checkpoint of a run once, in step order, as it appears.

    Beside training, it reads checkpoints without the run's lock and logs one
    eval record per step (``eval/<name>/<metric>``) to ``run_dir`` and ``loggers``;
    run again, it skips the steps it logged. It uses the evaluations' ``ema``,
    not their cadences; a checkpoint deleted before it was read is skipped, named.

    Args:
      directory: The run's `pztrain.Checkpoints` directory (with ``follow``, it
        may not exist yet: the job says at once that it waits for it).
      like: A state of the run's structure, as for `pztrain.load_state`.
      evaluations: The `pztrain.Evaluation` s to run on each checkpoint.
      run_dir: The job's own directory (log, lock): not ``directory``.
      loggers: More loggers, besides ``run_dir``'s ``metrics.jsonl``.
      follow: While the run holds ``directory``'s lock, wait for new checkpoints.
      timeout: Seconds without a new checkpoint after which it ends.
      poll: Seconds between two looks at ``directory``.
      priority: Lower the CPU priority by this much until it returns (nice;
        at 19 Linux's idle class too; ``None``: not): training keeps its speed.

    Returns:
      A `pztrain.History` of what it logged (``stop_reason``: a timeout).

    Raises:
      ValueError, TypeError, FileNotFoundError: a bad argument or directory.
      TimeoutError: no checkpoint came. CheckpointError: one is damaged.
      KeyboardInterrupt: Ctrl-C (what is logged stays; run again, it goes on).

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, numpy as np, optax, pztrain
      >>> def loss_fn(*, model, state, rng, x):
      ...     return jnp.mean((x - model["w"]) ** 2), state, {}
      ...
      >>> state = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros(())}, optax.sgd(0.1), jax.random.key(0))
      >>> d, data = tempfile.mkdtemp(), pztrain.ArrayLoader({"x": np.ones(8)}, 4)
      >>> _ = pztrain.fit(state, pztrain.build_train_step(loss_fn), data,
      ...     num_steps=4, progress=False, loggers=[],
      ...     checkpoints=pztrain.Checkpoints(d + "/ckpt", every_steps=2))
      >>> evals = [pztrain.Evaluation("w", lambda s: {"w": s.params["w"]})]
      >>> h = pztrain.evaluate_checkpoints(d + "/ckpt", state, evals,
      ...     run_dir=d + "/eval_job", follow=False, priority=None)
      >>> [(r["step"], round(r["metrics"]["w/w"], 3)) for r in h.records]
      [(2, 0.36), (4, 0.59)]
    """
    directory, run_dir = _check_job(directory, like, run_dir, follow, poll, timeout)
    job = (directory, like, evaluations, run_dir, loggers)
    return _run(*job, follow=follow, timeout=timeout, poll=poll, priority=priority)


def _run(directory, like, evaluations, run_dir, loggers, *, priority, **waits):
    """The job, on checked arguments: its priority, log and lock, then
    `_follow` (``waits``: ``follow``, ``timeout``, ``poll``)."""
    evaluations = check_evaluations(list(evaluations), None, like, 1)
    history = History()
    with lowered_priority(priority), locked(run_dir), stop_signals() as flag:
        done = _logged_steps(run_dir)
        log = JsonlLogger(run_dir, resume_step=max(done, default=None))
        outputs = [log, *loggers]
        job = _Job(directory, like, evaluations, outputs, history, flag, done)
        try:
            history.stop_reason = _follow(job, **waits)
        finally:
            for lg in outputs:
                lg.close()
    return history


class _Job:
    """One evaluation job's pieces: what it reads, runs and writes."""

    def __init__(self, directory, like, evaluations, loggers, history, flag, done):
        self.directory, self.like, self.evaluations = directory, like, evaluations
        self.loggers, self.history, self.flag = loggers, history, flag
        self.done = set(done)
        self.skipped: list[int] = []  # deleted by the run before they were read
        self.seen = False  # whether the directory has held a checkpoint
        self.marks = True  # whether it can leave reader's marks there
        self.started = time.time()
        self.params_only = params_suffice(like, evaluations)

    def new_steps(self) -> list[int]:
        """The complete checkpoints not yet evaluated, in step order."""
        steps = checkpoint_steps(self.directory)
        self.seen = self.seen or bool(steps)
        return [s for s in steps if s not in self.done and s not in self.skipped]

    def evaluate(self, step: int) -> bool:
        """Evaluates and logs checkpoint ``step``; ``False`` if the run
        deleted it before it could be read (skipped, with a warning)."""
        state = self.read_marked(step)
        if state is None:
            return False
        metrics, media = {}, {}
        for ev in self.evaluations:
            if self.flag.requested:
                raise KeyboardInterrupt(_interrupted(step))
            values = evaluation_values(ev, state, step, self.flag)
            if values is None:
                raise KeyboardInterrupt(_interrupted(step))
            prefix = f"{ev.name}/" if ev.name else ""
            metrics.update({prefix + k: v for k, v in values[0].items()})
            media.update({f"eval/{prefix}{k}": v for k, v in values[1].items()})
        self._log(step, metrics, media)
        return True

    def read_marked(self, step: int) -> TrainState | None:
        """Checkpoint ``step``, read under a reader's mark (the run's
        retention keeps it until the read is over); ``None`` if the run
        deleted it first (a warning names it; retention deletes a checkpoint
        by renaming it away whole, so a failed read of a checkpoint that is
        gone is a deletion, and of one that is still there, damage).

        Raises:
          CheckpointError: checkpoint ``step`` is still there and unreadable.
        """
        path = self.directory / str(step)
        mark = reading(self.directory, step) if self.marks else _unmarked()
        try:
            with mark as self.marks:  # a directory it cannot write: warned once
                return self.read(path, step)
        except Exception as e:
            if path.exists():
                e.add_note(_damaged(path, step))
                raise
            self.skipped.append(step)
            warnings.warn(_deleted(path, step), stacklevel=4)
        return None

    def read(self, path: Path, step: int) -> TrainState:
        """Checkpoint ``step``: its params alone when they suffice (a fifth
        of the reading: no optimizer state), else the whole state."""
        if not self.params_only:
            return load_state(path, self.like)
        state = load_params(path, self.like)
        return state.replace(step=jnp.asarray(step, self.like.step.dtype))

    def _log(self, step: int, metrics: dict, media: dict) -> None:
        record = {
            "step": step,
            "epoch": None,  # a checkpoint does not record its epoch
            "split": "eval",
            "time": time.time() - self.started,
            "metrics": metrics,
        }
        self.history.records.append(record)
        for lg in self.loggers:
            lg.log_record(record)
        if media:
            log_media(self.loggers, step, media)
        self.done.add(step)


def params_suffice(like: TrainState, evaluations: Sequence[Evaluation]) -> bool:
    """Whether a checkpoint's params (and step) are all its evaluations read:
    none asks for the EMA (kept in the optimizer state), the model keeps no
    state (loss-function state, state variables) and ``like`` holds arrays
    (its other parts stand in for the checkpoint's)."""
    if any(ev.ema is not False for ev in evaluations):
        return False
    if jax.tree.leaves(like.loss_fn_state) or jax.tree.leaves(
        like.model_without_params
    ):
        return False
    return all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(like))


def _follow(job: _Job, follow: bool, timeout: float, poll: float) -> str | None:
    """Evaluates new checkpoints until the run ends (its lock is gone, the
    directory has held checkpoints and no new one is left) or none comes for
    ``timeout`` seconds."""
    waited_since, said = time.monotonic(), False
    while True:
        steps = job.new_steps()
        for step in steps:
            job.evaluate(step)
        if steps:
            waited_since = time.monotonic()
            continue  # more may have come while evaluating
        running = lock_holder(job.directory) is not None
        if not follow or (not running and job.seen):
            if job.new_steps():
                continue  # saved just before the run ended
            return None
        if time.monotonic() - waited_since > timeout:
            return _timed_out(job, timeout)
        if not job.seen:  # a run directory shows itself at its first save
            check_source(job.directory, follow=True)
        if not said and jax.process_index() == 0:
            print(waiting_line(job.directory, timeout), flush=True)
            said = True
        time.sleep(poll)
        if job.flag.requested:
            raise KeyboardInterrupt("evaluate_checkpoints was interrupted waiting.")


def _timed_out(job: _Job, timeout: float) -> str:
    """The stop reason after ``timeout`` seconds with no new checkpoint; an
    error if the job never saw one."""
    if not job.done:
        gone = "" if job.directory.exists() else " (it does not exist)"
        raise TimeoutError(
            f"evaluate_checkpoints: no checkpoint appeared in {job.directory}{gone} "
            f"within {timeout:g} s. Is it the training run's Checkpoints directory? "
            "Pass a longer timeout= to wait longer."
        )
    return f"no new checkpoint within {timeout:g} s"


@contextlib.contextmanager
def _unmarked():
    yield False


def _deleted(path: Path, step: int) -> str:
    return (
        f"evaluate_checkpoints: skipped checkpoint {step} ({path}): the training "
        "run deleted it (its Checkpoints' keep_last / keep_best) before this job "
        "could read it. To evaluate every checkpoint, keep more: keep_last of at "
        "least 1 + the job's time per checkpoint / the time between saves."
    )


def _damaged(path: Path, step: int) -> str:
    return (
        f"evaluate_checkpoints: checkpoint {step} is still in {path.parent}, so "
        "the run did not delete it: it is damaged. Move it out of the directory "
        f"(e.g. rename it {step}.unreadable) and start the job again with the same "
        "run_dir: it goes on after the steps it logged."
    )


def _interrupted(step: int) -> str:
    return (
        f"evaluate_checkpoints was interrupted evaluating step {step} (not "
        "logged); started again with the same run_dir, it goes on from there."
    )


def _logged_steps(run_dir: Path) -> list[int]:
    """The steps the job's log holds eval records of (none if new)."""
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return sorted({r["step"] for r in read_jsonl(run_dir) if r.get("split") == "eval"})


def _check_job(directory, like, run_dir, follow, poll, timeout) -> tuple[Path, Path]:
    check_state(like, "evaluate_checkpoints(directory, like, ...)")
    directory, run_dir = Path(directory).absolute(), Path(run_dir).absolute()
    if run_dir == directory:
        raise ValueError(
            f"evaluate_checkpoints: run_dir is the checkpoint directory {directory}; "
            "the job logs to its own directory (and must not take the training "
            f"run's lock): pass e.g. run_dir={str(directory.parent / 'eval_job')!r}."
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"evaluate_checkpoints(run_dir={str(run_dir)!r}) is a file; pass a "
            "directory for the job's log."
        )
    for name, value in (("poll", poll), ("timeout", timeout)):
        if not isinstance(value, int | float) or value < 0:
            raise ValueError(
                f"evaluate_checkpoints: {name} must be >= 0; got {value!r}."
            )
    check_source(directory, follow)
    return directory, run_dir


_TASKS = Path("/proc/self/task")
_warned = False


@contextlib.contextmanager
def lowered_priority(by: int | None) -> Iterator[None]:
    """Lowers this process's CPU priority by ``by`` (``None``: not) inside
    the block, every thread of it, and gives each thread its priority and
    scheduling back on the way out (new threads get the calling thread's):
    called in-process (a notebook's cell), the job leaves its caller as it
    was. Raising a priority again may need rights (root, ``RLIMIT_NICE``);
    where the OS refuses, a warning says so, once."""
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
