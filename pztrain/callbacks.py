"""Callbacks for `pztrain.fit`: a few optional hooks, and the built-ins.

A callback subclasses `Callback` and overrides the hooks it needs. Hooks run only at
host points (log, eval and epoch points, and the steps `Callback.on_advance` asks for),
where the loop is already on the host: a callback adds no device sync of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from pztrain._bar import fit_width, pace, restart_clock, tqdm_bar
from pztrain._optax import states_of
from pztrain._tree import all_finite
from pztrain.records import LoopInfo, Stop
from pztrain.step import explain_in_run

if TYPE_CHECKING:
    from pztrain.records import History
    from pztrain.state import TrainState

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "NanPolicy",
    "ProgressBar",
    "Stop",
    "record_only",
]


def record_only(on_log: Callable[..., Any]) -> Callable[..., Any]:
    """Marks an ``on_log`` hook that only reads (or adds to) the record.

    Such a hook never reads the state and always returns ``None`` (a display, a
    logger). When every ``on_log`` of a run is record-only, `pztrain.fit` does
    not wait for the device at log points: it runs them once the metrics are
    computed, a little later, while training goes on. A subclass that overrides
    a marked ``on_log`` is not record-only unless it marks its own.

    Example:
      >>> class Show(Callback):
      ...     @record_only
      ...     def on_log(self, state, record):
      ...         print(record["step"], record["metrics"])
    """
    on_log.record_only = True
    return on_log


class Callback:
    """Base class: every hook is optional and does nothing by default.

    A record is a dict with ``step``, ``epoch``, ``split`` (``"train"`` or ``"eval"``),
    ``time`` (seconds since the start) and ``metrics`` (name → float). ``on_log`` may
    add entries to ``record["metrics"]`` before the loggers see it.

    The hooks that take a state return ``None`` (nothing changes), a new
    `pztrain.TrainState` (the loop continues with it) or `pztrain.Stop`. `fit` runs its
    hooks as one ordered list: the progress bar, the callbacks in the order given, the
    loggers, then the checkpoints. An ``on_log`` that only reads the record can say so
    with `record_only`, which lets log points overlap with training.

    Example:
      >>> class StopAtLoss(Callback):  # fit(..., callbacks=[StopAtLoss()])
      ...     def on_log(self, state, record):
      ...         return Stop("low") if record["metrics"]["loss"] < 0.1 else None
      >>> StopAtLoss().on_log(None, {"step": 5, "metrics": {"loss": 0.05}})
      Stop(reason='low', state=None)
    """

    def on_train_start(self, state: TrainState, info: LoopInfo) -> Any:
        """Before the first step."""

    def on_log(self, state: TrainState, record: dict[str, Any]) -> Any:
        """At each train log point, with the metrics averaged since the last."""

    def on_eval_end(self, state: TrainState, record: dict[str, Any]) -> Any:
        """After each evaluation."""

    def on_epoch_end(self, state: TrainState, epoch: int) -> Any:
        """After the last step of each epoch (``epoch`` counts from 0)."""

    def on_point_end(self, state: TrainState, step: int) -> Any:
        """After every other hook of a host point (log, epoch end, evaluation).

        The state is final for ``step``: nothing at this point changes it any
        more. `pztrain.Checkpoints` saves here, so a checkpoint holds the effects
        of everything its step did (its evaluation record included).
        """

    def on_train_end(self, state: TrainState, history: History) -> Any:
        """After the last step, whatever ended the run (exceptions included).

        Every callback's ``on_train_end`` runs even if an earlier one raises; the
        first exception is raised after all of them ran.
        """

    def on_advance(self, step: int, t: float) -> int | None:
        """At every point where the loop stops running steps, and at the start.

        For pacing by wall time (a progress bar, a periodic action): it must not
        read the device.

        Args:
          step: The step reached.
          t: The loop clock's time, in seconds.

        Returns:
          The step by which it wants to be called again, or ``None``.
        """

    def state_dict(self) -> dict[str, Any] | None:
        """JSON-able counters to keep in checkpoints, or ``None`` (the default):
        `pztrain.Checkpoints` stores them and gives them back to `load_state_dict`
        when a run resumes."""
        return None

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores what `state_dict` returned (on resume)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines state_dict() but not load_state_dict(); "
            "define both to resume its counters."
        )


def _split_monitor(monitor: str) -> tuple[str, str]:
    split, _, name = monitor.partition("/")
    return (split, name) if split == "eval" and name else ("train", monitor)


def _metric(record: dict[str, Any], monitor: str) -> float | None:
    """Reads ``monitor`` (``"loss"`` or ``"eval/loss"``) from a record of its split
    (a KeyError if the record is of the monitored split but lacks the metric)."""
    split, name = _split_monitor(monitor)
    if record["split"] != split:
        return None
    if name not in record["metrics"]:
        raise KeyError(
            f"Monitored metric {monitor!r} is not among the {split} metrics "
            f"{sorted(record['metrics'])}; prefix eval metrics with 'eval/'."
        )
    return record["metrics"][name]


class EarlyStopping(Callback):
    """Stops when a monitored metric has not improved for ``patience`` checks.

    Args:
      monitor: ``"eval/<name>"`` for an eval metric, ``"<name>"`` for a train
        metric (checked at every log point).
      mode: ``"min"`` or ``"max"``.
      patience: Checks without improvement before stopping.
      min_delta: The least change that counts as an improvement.
      restore_best: Finish with the params of the best check (kept as a copy on device,
        so donation cannot delete them). Only the params go back: ``state.step``, the
        optimizer state and the history's last records stay those of the stopping point
        (``step`` counts the updates made: the data position, keys and schedules follow
        it), so ``state.step`` is not `best_step`; the best check's record is the one of
        `best_step` in the history.

    Attributes:
      best: The best value seen.
      best_step: The step it was seen at.
      wait: Checks since the last improvement.

    Example:
      >>> stopper = EarlyStopping("eval/loss", patience=2)
      >>> r = lambda step, loss: {"step": step, "split": "eval",
      ...                         "metrics": {"loss": loss}}
      >>> [stopper.on_eval_end(None, r(s, v)) for s, v in [(1, 1.0), (2, 1.1)]]
      [None, None]
      >>> stopper.on_eval_end(None, r(3, 1.2)).reason
      'eval/loss did not improve on 1 (step 1) for 2 checks'
    """

    def __init__(
        self,
        monitor: str = "eval/loss",
        *,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        restore_best: bool = False,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}.")
        if patience < 1:
            raise ValueError(f"patience must be >= 1; got {patience}.")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta, self.restore_best = abs(min_delta), restore_best
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self.wait = 0
        self._best_params: Any = None

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, state: TrainState | None, record: dict[str, Any]) -> Any:
        value = _metric(record, self.monitor)
        if value is None:
            return None
        if self._improved(value):
            self.best, self.best_step, self.wait = value, record["step"], 0
            if self.restore_best and state is not None:
                self._best_params = jax.tree.map(jnp.copy, state.params)
            return None
        self.wait += 1
        if self.wait < self.patience:
            return None
        reason = (
            f"{self.monitor} did not improve on {self.best:.6g} (step "
            f"{self.best_step}) for {self.wait} checks"
        )
        if self.restore_best and self._best_params is not None and state is not None:
            return Stop(reason, state.replace(params=self._best_params))
        return Stop(reason)

    def on_log(self, state, record):
        return self._check(state, record)

    def on_eval_end(self, state, record):
        return self._check(state, record)

    def state_dict(self) -> dict[str, Any]:
        """The counters, for checkpoints (JSON-able)."""
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores the counters saved by `state_dict` (on resume).

        With ``restore_best``, the best params are not in the checkpoint: after a
        resume they are those of the best check made since.
        """
        self.best, self.best_step, self.wait = (
            saved["best"],
            saved["best_step"],
            saved["wait"],
        )

    def on_train_start(self, state, info):
        if _split_monitor(self.monitor)[0] == "eval" and not info.evaluates:
            raise ValueError(
                f"EarlyStopping monitors {self.monitor!r} but fit runs no "
                "evaluation: pass eval_step and eval_data, or monitor a train "
                "metric such as 'loss'."
            )


class LearningRateMonitor(Callback):
    """Adds the learning rate to each train log record.

    ``fit`` already logs a learning rate injected with ``optax.inject_hyperparams``.
    This callback covers a plain schedule: it evaluates the schedule on the host at log
    points (no device work) and logs it as ``learning_rate``. Like the injected value,
    it is the rate the last update used: ``schedule(step - 1)`` after ``step`` updates.

    Args:
      schedule: An optax schedule (``step -> lr``) or a constant.

    Example:
      >>> record = {"step": 3, "metrics": {}}  # a log point after 3 updates
      >>> LearningRateMonitor(optax.linear_schedule(1.0, 0.0, 8)).on_log(None, record)
      >>> record["metrics"]
      {'learning_rate': 0.75}
    """

    def __init__(self, schedule: optax.Schedule | float):
        self.schedule = schedule

    @record_only
    def on_log(self, state, record):
        last_update = max(record["step"] - 1, 0)
        lr = self.schedule(last_update) if callable(self.schedule) else self.schedule
        record["metrics"]["learning_rate"] = float(lr)


class NanPolicy(Callback):
    """What to do about a NaN or infinite loss, checked without per-step syncs.

    The train step counts non-finite losses on device; the loop reads the count
    with the metrics at each log point.

    Args:
      mode: ``"stop"`` ends training at the next log point, naming the first non-finite
        step. ``"skip"`` requires the optimizer to be wrapped in
        ``optax.apply_if_finite``, which drops non-finite updates on device; the number
        skipped is logged as ``skipped_updates``. If it gives up (more consecutive
        non-finite updates than its ``max_consecutive_errors``: it then applies them),
        training stops at the next log point.

    Either way `pztrain.Checkpoints` never saves params that are not finite, and the
    arrays at fault are named (`pztrain.step.explain_in_run`) in the stop message, or in
    the record's ``"nonfinite"`` when updates are skipped; on a stop, by replaying the
    steps from the run's newest checkpoint before the first non-finite one (only once
    the run has gone wrong).

    Example:
      >>> from pztrain import TrainState
      >>> tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=10)
      >>> state = TrainState.initial_state({"w": jnp.ones(2)}, tx, jax.random.key(0))
      >>> state = state.apply_gradients({"w": jnp.full(2, jnp.nan)})  # skipped
      >>> record = {"step": 1, "metrics": {}}  # as fit gives it at a log point
      >>> NanPolicy("skip").on_log(state, record), record["metrics"], state.params["w"]
      (None, {'skipped_updates': 1.0}, Array([1., 1.], dtype=float32))
    """

    def __init__(self, mode: str = "stop"):
        if mode not in ("stop", "skip"):
            raise ValueError(f"mode must be 'stop' or 'skip'; got {mode!r}.")
        self.mode, self.info = mode, None

    def on_train_start(self, state, info):
        if self.mode == "skip" and _apply_if_finite_state(state.opt_state) is None:
            raise ValueError(
                "NanPolicy('skip') needs the optimizer wrapped to skip non-finite "
                "updates: optimizer_def=optax.apply_if_finite(tx, "
                "max_consecutive_errors=10)."
            )
        self.info = info

    def on_log(self, state, record):
        first = record.get("first_nonfinite_step", -1)
        if self.mode == "skip":
            return self._skip(state, record, first)
        return Stop(explain_in_run(self.info, state, first)) if first >= 0 else None

    def _skip(self, state, record, first):
        found = _apply_if_finite_state(state.opt_state)
        if record.get("nonfinite_steps") and not all_finite(state.params):
            return Stop(
                "optax.apply_if_finite gave up (more consecutive non-finite updates "
                f"than its max_consecutive_errors; {int(found.notfinite_count)} in a "
                f"row from step {first}): the params are not "
                "finite. Raise max_consecutive_errors or find the source of the NaN."
            )
        record["metrics"]["skipped_updates"] = float(found.total_notfinite)
        if first >= 0:
            record["nonfinite"] = explain_in_run(self.info, state, first)
        return None


def _apply_if_finite_state(opt_state: Any) -> Any:
    found = states_of(opt_state, optax.ApplyIfFiniteState)
    return found[0] if found else None


class ProgressBar(Callback):
    """A tqdm progress bar (notebook-aware via ``tqdm.auto``).

    It paces itself: it asks the loop to stop by about every ``seconds`` of wall time at
    the step rate it has seen (ten times per log interval at first), moves there, and
    shows the last train metrics (the loss, the learning rate when logged) with the last
    eval metrics. It reads nothing from the device. Its line stays within the terminal's
    width (written to a pipe or a file: ``COLUMNS``, else 80 characters), and its rate
    and ETA count from its first move, after the compile.

    Args:
      metrics: Names to show (default: all train metrics).
      make_bar: A tqdm-like factory (for tests); default ``tqdm.auto.tqdm``.
      seconds: The wall time between moves, once the step rate is known.

    Example:
      >>> class Bar:
      ...     def __init__(self, **kw): self.moves = []
      ...     def update(self, n): self.moves.append(n)
      >>> pb = ProgressBar(make_bar=Bar)  # paced by the clock fit gives it
      >>> info = LoopInfo(start_step=0, end_step=None, steps_per_epoch=None,
      ...     steps_per_call=1, log_every=100, evaluates=False, run_dir=None)
      >>> pb.on_train_start(None, info)
      >>> pb.on_advance(0, t=0.0)  # at first: a tenth of a log interval
      10
      >>> pb.on_advance(10, t=0.001)  # fast: the interval at most doubles
      20
      >>> pb.bar.moves
      [10]
    """

    def __init__(
        self,
        metrics: tuple[str, ...] | None = None,
        make_bar: Callable[..., Any] | None = None,
        *,
        seconds: float = 0.2,
    ):
        self.metrics = metrics
        self.seconds = seconds
        self._make_bar = make_bar
        self.bar: Any = None
        self._k = 1
        self._every = 1
        self._last: tuple[int, float] | None = None
        self._timed = False  # the clock restarted after the first call
        self._train: dict[str, str] = {}  # the postfix: last train metrics
        self._eval: dict[str, str] = {}  # and last eval metrics

    def on_train_start(self, state, info):
        make_bar = self._make_bar or tqdm_bar
        self.bar = make_bar(
            total=info.end_step,
            initial=info.start_step,
            unit="step",
            dynamic_ncols=True,
        )
        fit_width(self.bar)
        self._k = info.steps_per_call
        self._every = max(self._k, info.log_every // 10 // self._k * self._k)
        self._last, self._train, self._eval, self._timed = None, {}, {}, False

    def on_advance(self, step: int, t: float) -> int:
        """Moves the bar to ``step``; returns the step of the next move."""
        if self._last is not None:
            last_step, last_t = self._last
            if step > last_step:
                self.bar.update(step - last_step)
                self._every = pace(
                    self._every, self._k, self.seconds, step - last_step, t - last_t
                )
                if not self._timed:  # the first move: the compile is behind
                    restart_clock(self.bar, step)
                    self._timed = True
        self._last = (step, t)
        return (step // self._every + 1) * self._every

    @record_only
    def on_log(self, state, record):
        self._train = {
            k: f"{v:.4g}"
            for k, v in record["metrics"].items()
            if self.metrics is None or k in self.metrics
        }
        self.bar.set_postfix({**self._train, **self._eval}, refresh=False)

    def on_eval_end(self, state, record):
        self._eval = {f"eval/{k}": f"{v:.4g}" for k, v in record["metrics"].items()}
        self.bar.set_postfix({**self._train, **self._eval}, refresh=False)

    def on_train_end(self, state, history):
        if self.bar is not None:
            self.bar.close()
