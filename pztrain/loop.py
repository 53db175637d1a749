"""`fit` and `evaluate`: the training loop, one function, no trainer object.

Between log points the loop only calls the jitted step: the metrics of each
step are summed on device inside that same call, and the host reads them (one
transfer) at log, eval and callback points only; when no callback reads the
log records, even a log point's read waits until the device has computed it.
Every device→host read of the loop sits inside an explicit
``jax.transfer_guard_device_to_host("allow")``, so a run under ``"disallow"``
proves that nothing else syncs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pztrain import metrics
from pztrain.callbacks import Callback, ProgressBar, Stop
from pztrain.checkpoint import Checkpoints
from pztrain.data import (
    ArrayLoader,
    BatchError,
    IndexedBatches,
    check_batch,
    prefetch_to_device,
    stack_batches,
)
from pztrain.loggers import JsonlLogger, Logger
from pztrain.state import TrainState
from pztrain.step import EvalStep, TrainStep

__all__ = ["History", "LoopInfo", "evaluate", "fit"]


def _host_reads():
    """The context in which the loop may read from the device."""
    return jax.transfer_guard_device_to_host("allow")


@dataclasses.dataclass(frozen=True)
class LoopInfo:
    """What a run will do; given to ``Callback.on_train_start``.

    Attributes:
      start_step: The step the run starts at (``state.step``).
      end_step: The step it will stop at unless stopped earlier (``None`` when
        the data decides).
      steps_per_epoch: Steps in an epoch, or ``None`` if the data does not say.
      steps_per_call: Steps fused in each call of the train step.
      log_every: Steps between log points.
      evaluates: Whether the run evaluates.
      run_dir: The run directory, or ``None``.
      hparams: The hyperparameters given to `fit`.
    """

    start_step: int
    end_step: int | None
    steps_per_epoch: int | None
    steps_per_call: int
    log_every: int
    evaluates: bool
    run_dir: str | None
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class History:
    """The records a run logged, in order.

    Each record is a dict: ``step``, ``epoch``, ``split`` (``"train"`` or
    ``"eval"``), ``time`` (seconds since the start) and ``metrics``.

    Attributes:
      records: The records.
      stop_reason: Why the run ended early, or ``None``.
    """

    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stop_reason: str | None = None

    def to_dicts(self) -> list[dict[str, Any]]:
        """The records as plain dicts (copies)."""
        return [{**r, "metrics": dict(r["metrics"])} for r in self.records]

    def series(self, name: str, split: str = "train") -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one metric of one split."""
        pairs = [
            (r["step"], r["metrics"][name])
            for r in self.records
            if r["split"] == split and name in r["metrics"]
        ]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def metric_names(self, split: str | None = None) -> set[str]:
        """Names logged (for one split, or all)."""
        return {
            k
            for r in self.records
            if split is None or r["split"] == split
            for k in r["metrics"]
        }

    def last(self, split: str = "train") -> dict[str, Any] | None:
        """The last record of ``split``."""
        found = [r for r in self.records if r["split"] == split]
        return found[-1] if found else None

    def plot(self, names: Sequence[str] | None = None, ax: Any = None) -> Any:
        """Plots metrics against steps with matplotlib (optional extra).

        Args:
          names: Metrics to plot (default: every train and eval metric).
          ax: A matplotlib axes to draw on (default: a new figure).

        Returns:
          The axes.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "History.plot needs matplotlib: pip install 'pztrain[plot]'."
            ) from None
        if ax is None:
            _, ax = plt.subplots()
        for split in ("train", "eval"):
            for name in sorted(self.metric_names(split)):
                if names is None or name in names or f"{split}/{name}" in names:
                    steps, values = self.series(name, split)
                    ax.plot(steps, values, label=f"{split}/{name}")
        ax.set_xlabel("step")
        ax.legend()
        return ax


# ----------------------------------------------------------------------------
# evaluation


@jax.jit
def _weighted_add(sums: Any, values: Any, n: jax.Array) -> Any:
    return jax.tree.map(lambda s, v: s + jnp.asarray(v, jnp.float32) * n, sums, values)


def evaluate(state: TrainState, eval_step: EvalStep, data: Iterable[Any]) -> dict:
    """Averages ``eval_step``'s metrics over all batches of ``data``.

    Each batch's metrics are taken as means over that batch and weighted by its
    size, so a last partial batch counts exactly as much as its examples. The sums
    stay on device; the host reads them once, at the end.

    Args:
      state: The state to evaluate.
      eval_step: From `pztrain.build_eval_step`; its metrics are scalars.
      data: An `ArrayLoader` (one pass, in order) or any iterable of batch dicts.

    Returns:
      Metric name → float mean over all examples.

    Raises:
      BatchError: for an empty ``data`` or a bad batch.
    """
    if isinstance(data, ArrayLoader):
        data = data.epoch(0)
    sums, total = None, 0
    for batch in data:
        n = check_batch(batch)
        values = eval_step(state, **batch)
        if sums is None:
            sums = jax.tree.map(lambda _: jnp.zeros((), jnp.float32), values)
        sums = _weighted_add(sums, values, jnp.float32(n))
        total += n
    if sums is None:
        raise BatchError("evaluate got no batches: the eval data is empty.")
    with _host_reads():
        host = jax.device_get(sums)
    flat = jax.tree_util.tree_flatten_with_path(host)[0]
    return {
        jax.tree_util.keystr(p, simple=True, separator="/"): float(v) / total
        for p, v in flat
    }


# ----------------------------------------------------------------------------
# the loop


def _groups(source: Iterator[Any], k: int) -> Iterator[Any]:
    """Checked batches of one pass, stacked ``k`` at a time (a rest is dropped)."""
    group: list[Any] = []
    keys = None
    for batch in source:
        if keys is None:
            check_batch(batch)
            keys = set(batch)
        elif set(batch) != keys:
            check_batch(batch, keys)
            raise BatchError(
                f"Batch has unexpected key(s) {sorted(set(batch) - keys)}; "
                f"the first batch had {sorted(keys)}."
            )
        group.append(batch)
        if len(group) == k:
            yield group[0] if k == 1 else stack_batches(group)
            group = []


def _batches_from_iterable(data: Iterable[Any], k: int) -> Iterator[tuple[Any, bool]]:
    """Yields ``(batch, ends_epoch)``; re-iterable data restarts after each pass.

    Looking one batch ahead marks the last batch of each pass, so an epoch that
    ends on the run's last step still ends.
    """
    reiterable = iter(data) is not data
    while True:
        groups = _groups(iter(data), k)
        previous = next(groups, None)
        if previous is None:
            return
        for group in groups:
            yield previous, False
            previous = group
        yield previous, True
        if not reiterable:
            return


def _check_every(name: str, value: int | None, k: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or value < 1 or value % k:
        raise ValueError(
            f"{name} must be a positive multiple of steps_per_call={k}; got {value!r}."
        )


def fit(
    state: TrainState,
    train_step: TrainStep,
    train_data: ArrayLoader | Iterable[Any],
    *,
    num_steps: int | None = None,
    num_epochs: int | None = None,
    eval_step: EvalStep | None = None,
    eval_data: Iterable[Any] | None = None,
    eval_every: int | None = None,
    log_every: int = 100,
    callbacks: Sequence[Callback] = (),
    loggers: Sequence[Logger] | None = None,
    run_dir: str | os.PathLike | None = None,
    hparams: dict[str, Any] | None = None,
    progress: bool = True,
    prefetch: int = 2,
    checkpoints: Checkpoints | None = None,
    resume: bool = False,
) -> tuple[TrainState, History]:
    """Trains ``state`` with ``train_step`` on ``train_data``.

    Args:
      state: The state to start from; training continues from ``state.step``.
      train_step: From `pztrain.build_train_step`; with ``steps_per_call=k``
        batches are grouped ``k`` at a time.
      train_data: An `ArrayLoader` (its position follows the step, so a resumed
        run sees exactly the batches an uninterrupted one would) or any iterable
        of batch dicts (re-iterable data restarts each epoch; a one-shot iterator
        ends the run when exhausted).
      num_steps: Train until ``state.step == num_steps`` (a total, not a count
        from here).
      num_epochs: Train until this many epochs are done (needs an
        `ArrayLoader`, or re-iterable data).
      eval_step: From `pztrain.build_eval_step`, with ``eval_data``.
      eval_data: Data for `evaluate`.
      eval_every: Steps between evaluations (default: at each epoch end when
        epochs are known, else at the end).
      log_every: Steps between log points (a multiple of ``steps_per_call``).
        If no callback but a `ProgressBar` has an ``on_log`` hook, a log point
        does not wait for the device: its metrics are read once computed (at
        the latest at the next log point, evaluation or the end), and the
        record, unchanged, reaches the loggers then.
      callbacks: `pztrain.callbacks.Callback` s.
      loggers: `pztrain.loggers.Logger` s. Default: a `JsonlLogger` in
        ``run_dir`` if one is given, else none.
      run_dir: The run directory for the default logger.
      hparams: Hyperparameters to log once, at the start.
      progress: Show a `pztrain.callbacks.ProgressBar` (needs tqdm).
      prefetch: Batches moved to the device ahead of time in a background
        thread (0 turns it off).
      checkpoints: A `pztrain.checkpoint.Checkpoints` that saves the state
        during the run (and finishes its saves when the run ends).
      resume: Continue from the newest complete checkpoint in ``checkpoints``,
        if there is one: state, data position (from the step), log records
        (JSONL records after that step are replaced) and callback counters.

    Returns:
      ``(state, history)``.

    Raises:
      ValueError: for inconsistent options (named in the message).
    """
    k = train_step.steps_per_call
    _check_every("log_every", log_every, k)
    _check_every("eval_every", eval_every, k)
    if (eval_step is None) != (eval_data is None):
        raise ValueError("eval_step and eval_data go together: pass both or neither.")
    if num_steps is None and num_epochs is None:
        raise ValueError("Say how long to train: pass num_steps or num_epochs.")
    if num_steps is not None and num_epochs is not None:
        raise ValueError("Pass num_steps or num_epochs, not both.")

    if resume and checkpoints is None:
        raise ValueError("resume=True needs checkpoints=Checkpoints(directory).")
    callbacks = list(callbacks)
    if checkpoints is not None:
        checkpoints.peers = list(callbacks)
        if resume:
            state = checkpoints.restore_latest(state) or state
        # Checkpoints run after the other callbacks and after the loggers, so a
        # checkpoint at step s is taken once everything up to s is logged.
        callbacks.append(checkpoints)
    with _host_reads():
        start = int(state.step)
    loader = train_data if isinstance(train_data, ArrayLoader) else None
    per_epoch = loader.steps_per_epoch if loader is not None else None
    if num_epochs is not None:
        if per_epoch is None:
            end = math.inf  # re-iterable data: run until the epochs are done
        else:
            end = num_epochs * per_epoch
    else:
        end = num_steps
    if end != math.inf and (end - start) % k and end > start:
        raise ValueError(
            f"The run covers {end - start} steps (from step {start} to {end}), not a "
            f"multiple of steps_per_call={k}; choose num_steps accordingly."
        )
    bars = [cb for cb in callbacks if isinstance(cb, ProgressBar)]
    if progress and not bars:
        bars = [ProgressBar()]
        callbacks.insert(0, bars[0])
    if loggers is None:
        loggers = [JsonlLogger(run_dir, resume_step=start)] if run_dir else []
    info = LoopInfo(
        start_step=start,
        end_step=None if end == math.inf else end,
        steps_per_epoch=per_epoch,
        steps_per_call=k,
        log_every=log_every,
        evaluates=eval_step is not None,
        run_dir=None if run_dir is None else str(run_dir),
        hparams=dict(hparams or {}),
    )
    history = History()
    t0 = time.perf_counter()
    injected = _has_injected_lr(state)

    def record(split: str, step: int, epoch: int, values: dict[str, float], at=None):
        return {
            "step": step,
            "epoch": epoch,
            "split": split,
            "time": round((time.perf_counter() if at is None else at) - t0, 4),
            "metrics": values,
        }

    def run_hooks(hook: str, *args: Any, late: bool = False) -> Stop | None:
        """Runs ``hook`` of the callbacks (``late``: only of the checkpoints)."""
        nonlocal state
        stop = None
        for cb in callbacks:
            if (cb is checkpoints) != late and hook in _LOGGED_HOOKS:
                continue
            with _host_reads():
                out = getattr(cb, hook)(state, *args)
            if isinstance(out, Stop):
                stop = stop or out
                if out.state is not None:
                    state = out.state
            elif isinstance(out, TrainState):
                state = out
            elif out is not None:
                raise TypeError(
                    f"{type(cb).__name__}.{hook} returned a {type(out).__name__}; "
                    "hooks return None, a TrainState or pztrain.callbacks.Stop."
                )
        return stop

    def log_point(step: int, epoch: int) -> Stop | None:
        nonlocal sums, pending
        stop = flush()
        lr = state.hyperparams["learning_rate"] if injected else None
        if defer and lr is not None:
            lr = jnp.copy(lr)  # read later: the next step donates the original
        point = _LogPoint(sums, step, epoch, time.perf_counter(), lr)
        sums = metrics._zeros_like(sums)  # a dispatch: it does not wait
        if not defer:
            return emit(point) or stop
        pending = point
        return stop

    def flush(wait: bool = True) -> Stop | None:
        """Emits the pending log point (``wait=False``: only if it is computed)."""
        nonlocal pending
        if pending is None or not (wait or pending.sums.sums.is_ready()):
            return None
        point, pending = pending, None
        return emit(point)

    def emit(point: _LogPoint) -> Stop | None:
        with _host_reads():
            summary = metrics.summarize(point.sums)
            values = dict(summary.means)
            if point.learning_rate is not None:
                values["learning_rate"] = float(point.learning_rate)
        rec = record("train", point.step, point.epoch, values, at=point.time)
        if summary.nonfinite:
            rec["nonfinite_steps"] = summary.nonfinite
            rec["first_nonfinite_step"] = summary.first_nonfinite_step
        stop = run_hooks("on_log", rec)
        _log(loggers, history, rec)
        stop = run_hooks("on_log", rec, late=True) or stop
        return stop

    def evaluation(step: int, epoch: int) -> Stop | None:
        stop = flush()  # the train record comes first
        values = evaluate(state, eval_step, eval_data)
        rec = record("eval", step, epoch, values)
        stop = run_hooks("on_eval_end", rec) or stop
        _log(loggers, history, rec)
        stop = run_hooks("on_eval_end", rec, late=True) or stop
        return stop

    on_device = loader is not None and loader.on_device
    if on_device:
        _check_device_epochs(loader, start, k)
        source: Iterator[tuple[Any, bool]] = iter(())
    elif loader is not None:
        batches = loader.iter_from_step(start, k) if end > start else iter(())
        source = ((b, False) for b in batches)
    else:
        source = _batches_from_iterable(train_data, k)
    if prefetch and not on_device:
        source = prefetch_to_device(source, prefetch, put=_put_pair)

    step, epoch = start, (start // per_epoch if per_epoch else 0)
    sums = carried = pending = None
    # Log points wait for the device only if a callback other than the progress
    # bar reads the record there; otherwise a log point's sums are read when they
    # are computed (checked at each host point) or at the next log point.
    defer = all(
        getattr(cb.on_log, "__func__", None) in _DEFERRABLE_ON_LOG for cb in callbacks
    )
    last_log = last_eval = start
    try:
        with _host_reads():
            for lg in loggers:
                lg.log_hparams(
                    {"steps_per_call": k, "log_every": log_every, **(hparams or {})}
                )
        stop = run_hooks("on_train_start", info)
        # The progress bar moves about 10 times per log interval at first, then
        # about every _BAR_SECONDS (see _bar_tick).
        tick = max(k, log_every // 10 // k * k) if bars else None
        ran_out = False
        while stop is None and step < end and not ran_out:
            # Run the calls up to the next point where the host has work to do;
            # between points the loop only calls the step.
            target = _next_point(step, end, log_every, eval_every, per_epoch, tick)
            first, ends_pass, began = step, False, time.perf_counter()
            if on_device:  # the stretch lies in one epoch: one IndexedBatches
                batches = loader.device_epoch(step // per_epoch)
                # The sums carry the step between host points; a callback that
                # returned a state with another step array is caught here.
                if sums is None:
                    sums = _metric_sums(train_step, state, batches)
                if state.step is not carried:
                    sums = metrics._with_step(sums, state.step)
                state, sums = train_step._accumulate_calls(
                    state, sums, batches, (target - step) // k
                )
                carried, step = state.step, target
            while step < target and not ends_pass:
                try:
                    batch, ends_pass = next(source)
                except StopIteration:
                    ran_out = True
                    break
                if sums is None:
                    sums = _metric_sums(train_step, state, batch)
                state, sums = train_step._accumulate(state, sums, batch)
                step += k
            for bar in bars:
                bar.advance(step - first)
            if bars and step > first:
                tick = _bar_tick(tick, step - first, time.perf_counter() - began, k)
            if ran_out:
                history.stop_reason = "the training data ran out"
            if step == first:
                break
            stop = flush(wait=False) or stop
            if step % log_every == 0 or step >= end:
                stop = log_point(step, epoch) or stop
                last_log = step
            if per_epoch is not None:
                ended_epoch = step // per_epoch > epoch
            else:
                ended_epoch = ends_pass  # the last batch of a pass over the data
            if ended_epoch:
                stop = run_hooks("on_epoch_end", epoch) or stop
            if eval_step is not None and (
                (eval_every is not None and step % eval_every == 0)
                or (eval_every is None and ended_epoch)
            ):
                stop = evaluation(step, epoch) or stop
                last_eval = step
            if ended_epoch:
                epoch = step // per_epoch if per_epoch is not None else epoch + 1
                if num_epochs is not None and epoch >= num_epochs:
                    break
        if last_log != step:  # steps not logged yet
            final = log_point(step, epoch)
            stop = stop or final
        stop = flush() or stop
        if eval_step is not None and stop is None and last_eval != step:
            stop = evaluation(step, epoch)
        if stop is not None:
            history.stop_reason = stop.reason
    finally:
        try:
            if pending is not None:  # the run failed: keep what was computed
                try:
                    flush()
                except Exception:  # noqa: BLE001 - the original error matters
                    pass
            run_hooks("on_train_end", history)
        finally:
            for lg in loggers:
                lg.close()
    return state, history


def _check_device_epochs(loader: ArrayLoader, start: int, k: int) -> None:
    per_epoch = loader.steps_per_epoch
    if per_epoch % k or start % k:
        raise ValueError(
            f"ArrayLoader(on_device=True) with steps_per_call={k} needs the steps "
            f"per epoch ({per_epoch}) and the start step ({start}) to be multiples "
            f"of {k}, so that no call spans two epochs."
        )


_BAR_SECONDS = 0.2  # wall time between progress-bar moves, once the rate is known


def _bar_tick(tick: int, steps: int, seconds: float, k: int) -> int:
    """Steps between bar moves: about ``_BAR_SECONDS`` at the rate just seen.

    Moving the bar stops the loop's run of calls, which costs a few µs: every 10
    steps that is several % of a 30 µs step; every 0.2 s it is nothing. The
    tick changes by at most 2x per interval (the first interval includes the
    compile).
    """
    if seconds <= 0:
        return tick
    want = steps / seconds * _BAR_SECONDS
    want = min(max(want, tick / 2), tick * 2)
    return max(k, int(want) // k * k)


def _put_pair(pair: tuple[Any, bool]) -> tuple[Any, bool]:
    batch, ends_pass = pair
    return jax.device_put(batch), ends_pass


_LOGGED_HOOKS = ("on_log", "on_eval_end")
# on_log hooks that only show the record: fit need not wait for the device there.
_DEFERRABLE_ON_LOG = (Callback.on_log, ProgressBar.on_log)


@dataclasses.dataclass(frozen=True)
class _LogPoint:
    """A log point: its sums and learning rate (on device), step, epoch, time."""

    sums: metrics.MetricSums
    step: int
    epoch: int
    time: float
    learning_rate: jax.Array | None = None


def _next_point(step, end, log_every, eval_every, per_epoch, tick) -> float:
    """The next step at which the loop logs, evaluates, ends an epoch or stops
    (or moves the progress bar, every ``tick`` steps)."""
    points = [end, (step // log_every + 1) * log_every]
    for every in (eval_every, per_epoch, tick):
        if every:
            points.append((step // every + 1) * every)
    return min(points)


def _metric_sums(train_step: TrainStep, state: TrainState, batch: Any):
    if isinstance(batch, IndexedBatches):
        return train_step.metric_sums(state, batch)
    return train_step.metric_sums(state, **batch)


def _log(loggers, history: History, rec: dict[str, Any]) -> None:
    history.records.append(rec)
    for lg in loggers:
        lg.log_record(rec)


def _has_injected_lr(state: TrainState) -> bool:
    try:
        return "learning_rate" in state.hyperparams
    except ValueError:
        return False
