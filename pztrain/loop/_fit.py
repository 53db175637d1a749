"""`fit`: wiring, and the loop of stretches and host points.

Between host points the loop only calls the jitted step: the metrics of each
step are summed on device inside that same call. At a host point (a log point,
an evaluation, an epoch end, the end, or a step a hook asked for) it runs the
hooks. The pieces: `Schedule` (where the points are), a batch source
(`batch_source`), `Hooks` (the ordered callbacks) and `Reporter` (records).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax

from pztrain._members import shared_batch_sharding
from pztrain.callbacks import Callback, ProgressBar
from pztrain.checkpoint import Checkpoints
from pztrain.checkpoint._lock import locked
from pztrain.data import ArrayLoader, StepLoader
from pztrain.loggers import JsonlLogger, Logger
from pztrain.loop._arguments import FitArguments
from pztrain.loop._evaluations import EvalRunner, Evaluation, cadence_of
from pztrain.loop._hooks import Hooks, RecordLog, host_reads
from pztrain.loop._plan import check_run, loop_info, progress_bar
from pztrain.loop._reporting import Reporter
from pztrain.loop._resources import check_memory, peak_flops, step_devices
from pztrain.loop._schedule import Schedule, run_end
from pztrain.loop._signals import StopFlag, stop_signals
from pztrain.loop._sources import BatchSource, batch_source
from pztrain.loop._stops import keep_state, stop_line
from pztrain.records import History, LoopInfo, Stop
from pztrain.state import TrainState
from pztrain.step import EvalStep, TrainStep

__all__ = ["fit"]


def fit(
    state: TrainState,
    train_step: TrainStep,
    train_data: StepLoader | Iterable[Any],
    *,
    num_steps: int | None = None,
    num_epochs: int | None = None,
    eval_step: EvalStep | None = None,
    eval_data: Iterable[Any] | None = None,
    eval_every: int | None = None,
    eval_every_epochs: int | None = None,
    eval_ema: bool = False,
    evaluations: Sequence[Evaluation] = (),
    log_every: int = 100,
    callbacks: Sequence[Callback] = (),
    loggers: Sequence[Logger] | None = None,
    run_dir: str | os.PathLike | None = None,
    hparams: dict[str, Any] | None = None,
    progress: bool | ProgressBar = True,
    prefetch: int = 2,
    checkpoints: Checkpoints | None = None,
    resume: bool = False,
    peak_flops: float | None = None,
    preempt_on: Sequence[str] = ("SIGTERM",),
) -> tuple[TrainState, History]:
    """Trains ``state`` with ``train_step`` on ``train_data``.

    Args:
      state: The state to start from; training continues from ``state.step``.
      train_step: From `pztrain.build_train_step`.
      train_data: An `ArrayLoader`, `GrainLoader`, grain IterDataset or batches.
      num_steps: Train until ``state.step == num_steps`` (a total).
      num_epochs: Train until this many epochs are done (not a generator's).
      eval_step: From `pztrain.build_eval_step`.
      eval_data: The data for `pztrain.evaluate` (with ``eval_step``).
      eval_every: Steps between evaluations (default: each epoch end, or the end).
      eval_every_epochs: Evaluate at every this many epoch ends (and the end).
      eval_ema: Evaluate the EMA params too (``"eval/ema/<name>"``, `evaluate`).
      evaluations: More `pztrain.Evaluation` s, each named (``eval/<name>/...``).
      log_every: Steps between log points (a multiple of ``steps_per_call``).
      callbacks: `pztrain.Callback` s, run in this order at each point.
      loggers: Added to ``run_dir``'s `pztrain.JsonlLogger` (``[]``: none).
      run_dir: The default logger's directory (continued from the start step).
      hparams: Hyperparameters to log once, at the start.
      progress: Show a `pztrain.ProgressBar` (needs tqdm), or this one.
      prefetch: Batches moved to the device ahead (0 turns it off).
      checkpoints: A `pztrain.Checkpoints`; its saves finish before ``fit`` ends.
      resume: Continue from the newest checkpoint in ``checkpoints`` (all of it).
      peak_flops: A device's peak FLOPs/s for ``mfu`` (`pztrain.loop.PEAK_FLOPS`).
      preempt_on: Signals that preempt the run (``[]``: none).

    Returns:
      ``(state, history)``; Ctrl-C or ``preempt_on`` stops it before a call, saved
      (``stop_reason``: "interrupted", "preempted"); errors keep ``err.train_state``.

    Raises:
      TypeError, ValueError: A bad argument, first batch or hook check; disk untouched.
      DirectoryInUseError: Another run holds ``checkpoints`` or ``run_dir``.
    """
    return _fit(state, FitArguments(**locals()))  # FitArguments checks them all


def _fit(state: TrainState, args: FitArguments) -> tuple[TrainState, History]:
    """`fit` on checked arguments: the run's signal handlers; the run checked
    before anything is written (its first batches traced, every hook's
    ``check``: a signal meanwhile stops it before its first call); the run
    directory's lock (`Checkpoints.prepare` takes its own), checkpoints
    prepared, the run wired and trained."""
    checkpoints, trained = args.checkpoints, None
    try:
        with stop_signals(args.preempt_on) as flag:
            metrics = check_run(state, args, _schedule(state, args, warn=False))
            with (
                locked(_own_run_dir(args)),
                checkpoints if checkpoints is not None else contextlib.nullcontext(),
            ):
                if checkpoints is not None:
                    state = checkpoints.prepare(
                        state, args.callbacks, resume=args.resume
                    )
                run = _Run.wire(args, _schedule(state, args), flag, metrics)
                trained = _train(state, run)
                return trained, run.history
    except BaseException as e:  # e.g. a late signal's KeyboardInterrupt
        if trained is not None:
            keep_state(e, trained)
        raise


@dataclasses.dataclass(frozen=True)
class _Run:
    """The pieces of a run, wired by `fit`."""

    train_step: TrainStep
    source: BatchSource
    schedule: Schedule
    hooks: Hooks
    info: LoopInfo
    history: History
    reporter: Reporter
    evals: EvalRunner
    clock: Callable[[], float]  # the reporter's too
    peak_flops: float | None  # per device, as given to fit
    stops: StopFlag
    checkpoints: Checkpoints | None
    owed_eval: tuple | None  # (step, epoch[, names]) a stop left unevaluated

    @classmethod
    def wire(
        cls, args: FitArguments, schedule: Schedule, stops: StopFlag, metrics: tuple
    ) -> _Run:
        """The pieces of a run from ``schedule.start`` (after a resume);
        ``metrics``: the names its evaluations and train records take
        (`check_run`)."""
        loggers, bar = _outputs(args, schedule.start)
        history = History()
        ckpts = [] if args.checkpoints is None else [args.checkpoints]
        hooks = Hooks([*bar, *args.callbacks, RecordLog(history, loggers), *ckpts])
        clock = time.perf_counter
        reporter = Reporter(hooks, clock, args.state, schedule.start)
        return cls(
            train_step=args.train_step,
            source=_source(args, schedule),
            schedule=schedule,
            hooks=hooks,
            info=loop_info(args, schedule, *metrics),
            history=history,
            reporter=reporter,
            evals=EvalRunner(args.evaluations, schedule, reporter, stops),
            clock=clock,
            peak_flops=args.peak_flops,
            stops=stops,
            checkpoints=args.checkpoints,
            owed_eval=None if args.checkpoints is None else args.checkpoints.owed_eval,
        )

    def owed_evaluation(self, state: TrainState) -> tuple[TrainState, Stop | None]:
        """The evaluations of the start step that a stop left undone, and the
        end of its point."""
        state, stop = self.evals.owed(state, self.owed_eval)
        return _first(stop, *self.hooks.run("on_point_end", state, self.owed_eval[0]))

    def stopped(self, state: TrainState, step: int) -> None:
        """After a stop by a signal at ``step``: its checkpoint (synchronous,
        after the pending saves), and one line that says so (process 0)."""
        self.stops.acted = True
        saved = None
        if self.checkpoints is not None:
            saved = self.checkpoints.save_stopped(state, step, self.reporter.owed)
        if jax.process_index() == 0:
            unrun = saved is None and self.reporter.owed is not None
            print(stop_line(self.stops, step, saved, unrun), flush=True)


def _train(state: TrainState, run: _Run) -> TrainState:
    """The loop: stretches of steps, each ended by a host point. A stop by a
    signal ends it like a `Stop`, then saves; an error keeps the newest state.
    The ``at_end`` evaluations run at the last step whatever ended the run,
    except a signal before the end (the resumed run's end runs them)."""
    s, hooks, reporter, flag = run.schedule, run.hooks, run.reporter, run.stops
    step, epoch, sums, stop = s.start, s.epoch_at(s.start), None, None
    last_log = step
    try:
        state, stop = hooks.run("on_train_start", state, run.info)
        if run.owed_eval is not None:
            state, stop = _first(stop, *run.owed_evaluation(state))
        wish = hooks.advance(step, run.clock())
        while stop is None and not s.done(step, epoch):
            ran, stop_at = 0, s.next_point(step, wish)
            for done in _stretch(run, state, sums, step, stop_at):
                state, sums, ran = done  # after each call: an error keeps it
            stop = stop or _signalled(flag)
            if not ran:
                break
            step += ran
            wish = hooks.advance(step, run.clock())
            state, stop = _first(stop, *reporter.poll(state))
            if s.logs_at(step):
                state, stop = _first(stop, *reporter.log(state, sums, step, epoch))
                sums, last_log = sums.reset(), step
            ended = s.ends_epoch(step, epoch, run.source.ended_pass)
            if ended:
                state, stop = _first(stop, *hooks.run("on_epoch_end", state, epoch))
            evals = run.evals.at_point(state, step, ended, epoch, stop)
            state, stop = _first(stop, *evals)
            epoch = s.next_epoch(step, epoch) if ended else epoch
            stop = stop or _signalled(flag)  # one during this point: it ends below
            if stop is None and not s.done(step, epoch):  # the last point ends below
                state, stop = _first(stop, *hooks.run("on_point_end", state, step))
        if last_log != step:  # a stretch cut short by a stop, or the end
            state, stop = _first(stop, *reporter.log(state, sums, step, epoch))
        state, stop = _first(stop, *reporter.flush(state))
        if not flag.stopped or s.done(step, epoch):  # a signal: the resumed run's
            state, stop = _first(stop, *run.evals.at_end(state, step, epoch))
        stop = stop or _signalled(flag)
        if flag.stopped:
            run.stopped(state, step)
        state, stop = _first(stop, *hooks.run("on_point_end", state, step))
        run.history.stop_reason = _stop_reason(stop, run.source) or s.nothing_left()
    except BaseException as e:
        keep_state(e, state)
        raise
    finally:
        _end(state, run)
    return state


def _stretch(run: _Run, state, sums, step: int, stop_at: float):
    """Runs the calls from ``step`` to ``stop_at``, each only if no stop is
    requested before it; after each batch, yields ``(state, sums, steps run
    so far)``."""
    ran, k, flag = 0, run.schedule.steps_per_call, run.stops
    for batch, calls in run.source.stretch(step, stop_at):
        if flag.requested:  # read once before each call (the step's too)
            return
        if sums is None:
            sums = run.train_step.metric_sums(state, batch)
            run.reporter.note_batch(batch, k, run.train_step.member_batches)
            _note_cost(run, state, batch, sums)
        if calls == 1:
            state, sums = run.train_step.accumulate(state, sums, batch)
            ran += k
        else:  # the step reads the flag before each of its calls
            state, sums = run.train_step.accumulate(
                state, sums, batch, calls=calls, stop_flag=flag
            )
            ran += calls * k
            if flag.stopped:  # it may have skipped some
                with host_reads():
                    ran = int(state.step) - step
        yield state, sums, ran


def _note_cost(run: _Run, state: TrainState, batch: Any, sums: Any) -> None:
    """Before a step's first call: its memory against the devices' (an error
    if it cannot fit) and its FLOPs for the records. The compilation this
    needs is the one the call then uses."""
    if not run.train_step.jit:  # nothing compiled to ask
        return
    cost = run.train_step.cost(state, batch, sums=sums)
    devices = step_devices(run.train_step)
    check_memory(cost, devices)
    peak = peak_flops(devices, run.peak_flops)
    run.reporter.note_cost(cost, run.schedule.steps_per_call, peak)


def _end(state: TrainState, run: _Run) -> None:
    """Ends the hooks; after an error, first emits the log point computed."""
    try:
        with contextlib.suppress(Exception):  # the error being raised matters more
            run.reporter.flush(state)  # (after a normal end, nothing is left)
        run.hooks.end(state, run.history)
    except BaseException as e:
        keep_state(e, state)
        raise
    finally:
        run.source.close()  # no more reading ahead: prefetch, grain's workers


def _signalled(flag: StopFlag) -> Stop | None:
    """The `Stop` of a stop by a signal, if one came."""
    return Stop(flag.reason) if flag.stopped else None


def _first(stop: Stop | None, state: TrainState, new_stop: Stop | None):
    """``(state, stop)`` keeping the earlier Stop's reason (the hooks that
    returned the state already replaced it)."""
    return state, stop or new_stop


def _stop_reason(stop: Stop | None, source: BatchSource) -> str | None:
    if stop is not None:
        return stop.reason
    return "the training data ran out" if source.ran_out else None


# ----------------------------------------------------------------------------
# wiring


def _schedule(state: TrainState, args: FitArguments, warn: bool = True) -> Schedule:
    """The run's `Schedule` from the state's step; warns if it has nothing to
    do (if ``warn``, unless resuming: a finished run resumed is done)."""
    with host_reads():
        start = int(state.step)
    k, per_epoch = args.train_step.steps_per_call, _epoch_length(args.train_data)
    end = run_end(start, k, per_epoch, args.num_steps, args.num_epochs)
    cadences = tuple(cadence_of(ev) for ev in args.evaluations)
    schedule = Schedule(
        start, end, k, args.log_every, steps_per_epoch=per_epoch,
        num_epochs=args.num_epochs, cadences=cadences,
    )  # fmt: skip
    idle = schedule.nothing_left()
    if idle is not None and warn and not args.resume:
        warnings.warn(f"fit: {idle}.", UserWarning, stacklevel=4)
    return schedule


def _own_run_dir(args: FitArguments) -> str | os.PathLike | None:
    """``run_dir``, unless it is the checkpoint directory (locked by it).

    Raises:
      ValueError: if ``run_dir`` is a file or a log file's name (refused
        before the lock would make it a directory).
    """
    run_dir, ckpt = args.run_dir, args.checkpoints
    path = Path(run_dir or ".")
    is_file = path.exists() and not path.is_dir()
    if run_dir is not None and (is_file or path.suffix in (".jsonl", ".csv", ".json")):
        what = "is a file" if is_file else f"names a {path.suffix} file"
        raise ValueError(
            f"fit(run_dir={str(run_dir)!r}): {path} {what}, not a directory. "
            "run_dir is the directory of the run's log (metrics.jsonl) and lock: "
            "pass a new directory, or the one whose log the run goes on with."
        )
    if run_dir is None or ckpt is None:
        return run_dir
    same = os.path.abspath(run_dir) == str(ckpt.directory)
    return None if same else run_dir


def _outputs(args: FitArguments, start: int) -> tuple[list[Logger], list]:
    """The run's loggers and progress bar: on process 0 only, so that a run of
    several processes writes one log and shows one bar. Every log goes on from
    ``start`` (`Checkpoints.prepare` says whether the run resumed): each given
    logger with a ``start_run`` is told, the default `JsonlLogger` made so. If
    one refuses, those already started are closed."""
    if jax.process_index() != 0:
        return [], []
    resumed = args.checkpoints is not None and args.checkpoints.continues_run
    started = []
    try:
        for lg in args.loggers or ():
            if callable(getattr(lg, "start_run", None)):
                lg.start_run(start, resumed=resumed)
                started.append(lg)
        loggers = _default_loggers(args.run_dir, start, resumed, args.loggers)
    except BaseException:
        for lg in started:
            with contextlib.suppress(Exception):  # the refusal matters more
                lg.close()
        raise
    return loggers, progress_bar(args.progress, args.callbacks)


def _default_loggers(run_dir, start: int, resumed: bool, given) -> list[Logger]:
    """``given`` after a `JsonlLogger` in ``run_dir`` (if given, unless ``given``
    is ``[]`` or holds one) that continues its log from ``start``. Only a
    resumed run (``resumed``: its checkpoint directory was used before) drops
    the records after it; any other run refuses a log that holds records after
    ``start``."""
    if (
        run_dir is None
        or given == []
        or any(isinstance(g, JsonlLogger) for g in given or ())
    ):
        return list(given or ())
    since = start if resumed else start or None
    log = JsonlLogger(run_dir, resume_step=since, drop_later=resumed)
    return [log, *(given or ())]


def _source(args: FitArguments, schedule: Schedule) -> BatchSource:
    """The run's batches from its first step, where the step wants them
    (``batch_sharding``; a population split over devices: replicated on its
    mesh; ``None``: the default device)."""
    sharding = getattr(args.train_step, "batch_sharding", None)
    if sharding is None and not _on_device(args.train_data):
        per_member = getattr(args.train_step, "member_batches", False)
        sharding = shared_batch_sharding(args.state, per_member)
    k = schedule.steps_per_call
    return batch_source(args.train_data, schedule.start, k, args.prefetch, sharding)


def _on_device(train_data: Any) -> bool:
    return isinstance(train_data, ArrayLoader) and train_data.on_device


def _epoch_length(train_data: Any) -> int | None:
    """Steps per epoch if the data says (a `StepLoader`), else ``None``."""
    if isinstance(train_data, StepLoader):
        return train_data.steps_per_epoch
    return None
