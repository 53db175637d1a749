"""A run as known before it starts: its first batches traced, the names its
evaluations record, and every hook's and logger's ``check``.

`pztrain.fit` does all of this before the run directory, a log or a checkpoint
is touched (DESIGN.md contract 8): a bad first batch fails here with the note
a call of the step gives, and a monitor that names a metric no evaluation
records is refused here. Nothing runs on the device: the train step and the
eval steps are traced abstractly (``jax.eval_shape``).

Data is read ahead only where that is cheap and changes nothing: a
`StepLoader` (one batch, read on the host) or a list or tuple of batches.
Data that can be read once (a generator, a grain ``IterDataset``) is left
alone: its first batch is checked by the first step, and the names of an
evaluation over it are known when it runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pztrain._members import member_count, spread
from pztrain._tree import named_leaves
from pztrain.callbacks import Callback, ProgressBar
from pztrain.data import StepLoader
from pztrain.data._batch import check_batch, stack_batches
from pztrain.loop._arguments import FitArguments
from pztrain.loop._evaluations import Evaluation
from pztrain.loop._hooks import host_reads
from pztrain.loop._schedule import Schedule
from pztrain.metric_states import is_metric_state, metric_entries
from pztrain.metrics import MetricSums
from pztrain.records import LoopInfo
from pztrain.state import TrainState
from pztrain.step import EvalStep, TrainStep

__all__ = [
    "check_hooks",
    "check_run",
    "check_train_batch",
    "eval_metrics",
    "first_batch",
    "loop_info",
    "progress_bar",
    "train_metrics",
]


def check_run(state: TrainState, args: FitArguments, schedule: Schedule) -> tuple:
    """Checks a run before anything is written: its first train batch traced
    (`check_train_batch`), the names its evaluations and train records take
    found (`eval_metrics`, `train_metrics`), then every hook's and logger's
    ``check`` given the run's `LoopInfo` (``schedule``: from the given state,
    before a resume).

    Returns:
      ``(eval_metrics, train_metrics)``, for the run's info (`loop_info`).
    """
    sums = check_train_batch(state, args.train_step, args.train_data)
    ckpts = [] if args.checkpoints is None else [args.checkpoints]
    hooks = [*progress_bar(args.progress, args.callbacks), *args.callbacks, *ckpts]
    names = eval_metrics(args.evaluations, state), train_metrics(sums, state, hooks)
    check_hooks(hooks, args.loggers or (), state, loop_info(args, schedule, *names))
    return names


def first_batch(
    data: Any, step: int, steps_per_call: int = 1, steps_axis: int = 0
) -> Any:
    """The batch of the call at ``step`` (``steps_per_call`` batches stacked;
    from a `StepLoader`, their shapes, the steps on ``steps_axis``: 1 for
    per-member batches, whose member axis comes first), read ahead without
    changing ``data``; ``None`` for data that cannot be (see the module's
    docstring), or with several processes (each holds its rows: the step's
    batch is assembled only in the run)."""
    if jax.process_count() > 1:
        return None
    if isinstance(data, StepLoader):  # one batch read (on the host: no workers)
        batch, k, a = data.batch_at(step), steps_per_call, steps_axis
        if k == 1:
            return batch
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (*np.shape(x)[:a], k, *np.shape(x)[a:]), np.asarray(x).dtype
            ),
            batch,
        )  # its k batches stacked, as shapes
    if isinstance(data, list | tuple) and len(data) >= steps_per_call:
        batches = list(data[:steps_per_call])
        for batch in batches:
            check_batch(batch)  # a batch dict: the rest is the step's to check
    else:
        return None
    return batches[0] if steps_per_call == 1 else stack_batches(batches)


def check_train_batch(
    state: TrainState, train_step: TrainStep, data: Any
) -> MetricSums | None:
    """Traces ``train_step`` on the first batch of ``data`` (as the run's
    first call does, for its metric names): an error there is the call's,
    with its note (`pztrain.step.TrainStep.metric_sums`). Returns its zero
    sums (``None`` if the batch cannot be read ahead)."""
    with host_reads():
        step = int(state.step)
    axis = 1 if train_step.member_batches else 0  # the members, then the steps
    batch = first_batch(data, step, train_step.steps_per_call, axis)
    if batch is None:
        return None
    return train_step.metric_sums(state, batch)  # cached: the run's first call's


def train_metrics(
    sums: MetricSums | None, state: TrainState, hooks: Sequence[Any]
) -> tuple[str, ...] | None:
    """The names a train record's metrics take (`pztrain.LoopInfo.train_metrics`):
    the step's (``sums``), an injected learning rate (the loop logs it), and
    those the hooks declare they add (``train_metrics``)."""
    if sums is None:
        return None
    names = [*sums.names, *sums.states]
    try:
        if "learning_rate" in state.hyperparams:
            names.append("learning_rate")
    except ValueError:  # no injected hyperparameters
        pass
    for hook in hooks:
        names += [n for n in getattr(hook, "train_metrics", ()) if n not in names]
    return tuple(dict.fromkeys(names))


def eval_metrics(
    evaluations: Sequence[Evaluation], state: TrainState
) -> dict[str, tuple[str, ...] | None]:
    """Evaluation name → the names its values take in an eval record, from
    its eval step traced on its first batch; ``None`` where they are known
    only when it runs (a host function, data read once, ``jit=False``: its
    function may need values, not shapes).

    Raises:
      Exception: the eval step's own error on that batch, with its note.
    """
    found: dict[str, tuple[str, ...] | None] = {}
    for ev in evaluations:
        names = _names(ev, state)
        prefix = f"{ev.name}/" if ev.name else ""
        found[ev.name] = None if names is None else tuple(prefix + n for n in names)
    return found


def _names(ev: Evaluation, state: TrainState) -> list[str] | None:
    """An evaluation's metric names (without its prefix), or ``None``."""
    if not isinstance(ev.step, EvalStep) or not ev.step.jit:
        return None
    batch = first_batch(ev.data, 0)
    if batch is None:
        return None
    states = {} if ev.ema is True else {"": state}  # as evaluate weighs them
    if ev.ema is not False:
        states["ema/" if ev.ema == "both" else ""] = state.using_ema()
    members = member_count(state.root_rng)
    names: list[str] = []
    for prefix, weights in states.items():
        try:
            out = ev.step.output_shapes(weights, batch)
        except Exception as e:
            e.add_note(f"pztrain: in Evaluation({ev.name!r}), on its first batch.")
            raise
        names += [prefix + n for n in _record_names(out, members)]
    return names


def _record_names(out: Any, members: int | None) -> list[str]:
    """The record names of metrics shaped as ``out`` (as `EvalSums.read`
    names them: a population's spread, a metric state's entries)."""
    names: list[str] = []
    for name, leaf in named_leaves(out, is_leaf=is_metric_state):
        ones = jax.tree.map(lambda x: np.ones(x.shape, x.dtype), leaf)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # ones make no metric's values
            if is_metric_state(leaf):
                names += metric_entries(name, ones, members)
            else:
                names += spread(name, ones)
    return names


def check_hooks(
    hooks: Sequence[Any], loggers: Sequence[Any], state: TrainState, info: LoopInfo
) -> None:
    """``check(state, info)`` of every hook (`pztrain.Callback.check`), then
    ``check(info)`` of every logger that has one."""
    with host_reads():
        for hook in hooks:
            hook.check(state, info)
        for logger in loggers:
            check = getattr(logger, "check", None)
            if callable(check):
                check(info)


def progress_bar(progress: bool | Callback, callbacks: Sequence[Callback]) -> list:
    """The bar that runs first: ``progress`` itself, a new `ProgressBar`, or none
    (``progress=False``, or a `ProgressBar` already among the callbacks)."""
    if isinstance(progress, Callback):
        return [progress]
    if not progress or any(isinstance(cb, ProgressBar) for cb in callbacks):
        return []
    return [ProgressBar()]


def loop_info(
    args: FitArguments,
    schedule: Schedule,
    eval_metrics: dict[str, tuple[str, ...] | None],
    train_metrics: tuple[str, ...] | None = None,
) -> LoopInfo:
    """The `LoopInfo` of a run from ``schedule`` (its first step on)."""
    return LoopInfo(
        start_step=schedule.start,
        end_step=schedule.end_step,
        steps_per_epoch=schedule.steps_per_epoch,
        steps_per_call=schedule.steps_per_call,
        log_every=schedule.log_every,
        evaluates=schedule.evaluates,
        run_dir=None if args.run_dir is None else str(args.run_dir),
        hparams=dict(args.hparams or {}),
        callbacks=tuple(args.callbacks),
        train_step=args.train_step,
        train_data=args.train_data,
        checkpoints=args.checkpoints,
        evaluations=tuple(ev.name for ev in args.evaluations),
        eval_metrics=eval_metrics,
        resume=args.resume,
        train_metrics=train_metrics,
    )
