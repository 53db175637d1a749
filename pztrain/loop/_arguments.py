"""`fit`'s arguments, checked once: each error names the argument and the fix."""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from types import NoneType
from typing import Any

from pztrain.callbacks import Callback, ProgressBar
from pztrain.checkpoint import Checkpoints
from pztrain.data._kinds import as_fit_data
from pztrain.ema import NoEmaError, has_ema
from pztrain.loggers import Logger
from pztrain.loop._evaluations import check_evaluations, unnamed_evaluation
from pztrain.loop._schedule import check_eval_every_epochs
from pztrain.loop._signals import check_signals
from pztrain.loop._sources import check_epochs, check_placement, data_callbacks
from pztrain.state import TrainState
from pztrain.state._donation import note_consumer
from pztrain.step import EvalStep, TrainStep

__all__ = ["FitArguments"]


@dataclasses.dataclass
class FitArguments:
    """The arguments of one `pztrain.fit` call (see its docstring), checked.

    ``evaluations`` becomes a tuple of checked `pztrain.Evaluation` s, the
    unnamed one of ``eval_step=`` first. ``callbacks`` becomes a list (with the
    callback that keeps sequential train data's iterator state last),
    ``loggers`` a list or ``None``; grain datasets become the loop's kinds of
    data (`pztrain.data._kinds.as_fit_data`);
    ``preempt_on`` becomes a tuple of `signal.Signals`.

    Raises:
      TypeError: for an argument of the wrong type (named in the message).
      ValueError: for inconsistent options (named in the message).
    """

    state: TrainState
    train_step: TrainStep
    train_data: Any
    num_steps: int | None = None
    num_epochs: int | None = None
    eval_step: EvalStep | None = None
    eval_data: Iterable[Any] | None = None
    eval_every: int | None = None
    eval_every_epochs: int | None = None
    eval_ema: bool = False
    evaluations: Sequence[Any] = ()
    log_every: int = 100
    callbacks: Sequence[Callback] = ()
    loggers: Sequence[Logger] | None = None
    run_dir: str | os.PathLike | None = None
    hparams: dict[str, Any] | None = None
    progress: bool | ProgressBar = True
    prefetch: int = 2
    checkpoints: Checkpoints | None = None
    resume: bool = False
    peak_flops: float | None = None
    preempt_on: Any = ("SIGTERM",)

    def __post_init__(self) -> None:
        self.train_data = as_fit_data(self.train_data, "train_data", train=True)
        self.eval_data = as_fit_data(self.eval_data, "eval_data", train=False)
        _check_parts(
            self.state,
            self.train_step,
            self.train_data,
            self.eval_step,
            self.eval_data,
            self.hparams,
        )
        _check_options(
            self.train_step,
            self.log_every,
            self.eval_every,
            self.eval_step,
            self.eval_data,
            self.prefetch,
        )
        _check_length(self.num_steps, self.num_epochs, self.checkpoints, self.resume)
        check_epochs(self.train_data, self.num_epochs)
        check_eval_every_epochs(
            self.eval_every_epochs, self.eval_every, self.eval_step is not None
        )
        _check_eval_ema(self.eval_ema, self.eval_step, self.state)
        unnamed = None
        if self.eval_step is not None:
            unnamed = unnamed_evaluation(
                self.eval_step,
                self.eval_data,
                self.eval_every,
                self.eval_every_epochs,
                self.eval_ema,
            )
        k = self.train_step.steps_per_call
        self.evaluations = check_evaluations(self.evaluations, unnamed, self.state, k)
        if self.peak_flops is not None and not (
            isinstance(self.peak_flops, int | float) and self.peak_flops > 0
        ):
            raise ValueError(
                "peak_flops must be a device's peak FLOPs per second, a number > 0 "
                f"(e.g. 197e12); got {self.peak_flops!r}."
            )
        self.callbacks = _checked_callbacks(self.callbacks)
        self.callbacks += data_callbacks(self.train_data)  # after the user's
        self.loggers = _checked_loggers(self.loggers)
        self.preempt_on = check_signals(self.preempt_on)

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates."""
        return bool(self.evaluations)


def _check_options(
    train_step, log_every, eval_every, eval_step, eval_data, prefetch
) -> None:
    k = train_step.steps_per_call
    for name, value in (("log_every", log_every), ("eval_every", eval_every)):
        if value is not None and (not _is_count(value) or value < 1 or value % k):
            raise ValueError(
                f"{name} must be a positive multiple of steps_per_call={k}; got "
                f"{value!r}."
            )
    if (eval_step is None) != (eval_data is None):
        raise ValueError("eval_step and eval_data go together: pass both or neither.")
    if eval_every is not None and eval_step is None:
        raise ValueError(
            f"eval_every={eval_every!r} needs eval_step and eval_data: pass both, "
            "or drop eval_every."
        )
    if not _is_count(prefetch) or prefetch < 0:
        raise ValueError(
            f"prefetch must be an int >= 0 (batches moved to the device ahead; 0 "
            f"turns it off); got {prefetch!r}."
        )


def _check_length(num_steps, num_epochs, checkpoints, resume) -> None:
    if num_steps is None and num_epochs is None:
        raise ValueError("Say how long to train: pass num_steps or num_epochs.")
    if num_steps is not None and num_epochs is not None:
        raise ValueError("Pass num_steps or num_epochs, not both.")
    for name, value in (("num_steps", num_steps), ("num_epochs", num_epochs)):
        if value is not None and (not _is_count(value) or value < 0):
            raise ValueError(
                f"{name} must be an int >= 0 (the total to reach); got {value!r}."
            )
    if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
        raise TypeError(
            "checkpoints must be a pztrain.Checkpoints (e.g. "
            f"checkpoints=Checkpoints('run/ckpt')); got {type(checkpoints).__name__}."
        )
    if resume and checkpoints is None:
        raise ValueError("resume=True needs checkpoints=Checkpoints(directory).")


def _check_parts(state, train_step, train_data, eval_step, eval_data, hparams) -> None:
    """The types of `fit`'s main arguments (each error names the argument), and
    a state whose arrays a step consumed."""
    for name, value, kind, what in (
        ("state", state, TrainState, "a pztrain.TrainState (initial_state, create)"),
        ("train_step", train_step, TrainStep, "a TrainStep (build_train_step)"),
        ("eval_step", eval_step, (EvalStep, NoneType), "an EvalStep or None"),
        ("hparams", hparams, (Mapping, NoneType), "a dict name -> value, or None"),
    ):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be {what}; got {type(value).__name__}.")
    state.check_not_donated("fit(state, ...)")
    donated = (state.step, state.params, state.opt_state, state.loss_fn_state)
    note_consumer(donated, "pztrain.fit(...)")  # named if the state is used again
    for name, data in (("train_data", train_data), ("eval_data", eval_data)):
        if isinstance(data, Mapping):
            raise TypeError(
                f"{name} is a {type(data).__name__}, one batch; pass "
                "ArrayLoader(arrays, batch_size) or a list of batch dicts."
            )
        if data is not None and not isinstance(data, Iterable):
            raise TypeError(
                f"{name} must be an ArrayLoader or an iterable of batch dicts; got "
                f"{type(data).__name__}."
            )
    if train_data is None:
        raise TypeError("train_data is None; pass an ArrayLoader or a list of batches.")
    check_placement(train_data, getattr(train_step, "batch_sharding", None))


def _is_count(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
        raise TypeError(
            "callbacks must be a list of pztrain.Callback (callbacks=[...]); got "
            f"{type(callbacks).__name__}."
        )
    callbacks = list(callbacks)
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            raise TypeError(
                f"callbacks[{i}] is a {type(cb).__name__}; callbacks subclass "
                "pztrain.Callback (override the hooks you need). Loggers go in "
                "loggers=."
            )
    return callbacks


def _checked_loggers(loggers: Sequence[Logger] | None) -> list[Logger] | None:
    if loggers is None:
        return None
    if isinstance(loggers, Logger) or not isinstance(loggers, Iterable):
        raise TypeError(
            "loggers must be a list of loggers (loggers=[...]); got "
            f"{type(loggers).__name__}."
        )
    loggers = list(loggers)
    for i, lg in enumerate(loggers):
        if isinstance(lg, Callback):
            raise TypeError(
                f"loggers[{i}] is a {type(lg).__name__}, a Callback; callbacks go "
                "in callbacks=."
            )
        if not isinstance(lg, Logger):
            raise TypeError(
                f"loggers[{i}] has type {type(lg).__name__}; a logger has "
                "log_hparams, log_record and close (pztrain.loggers.Logger)."
            )
    return loggers


def _check_eval_ema(eval_ema: Any, eval_step: Any, state: Any) -> None:
    if not isinstance(eval_ema, bool):
        raise TypeError(f"eval_ema must be True or False; got {eval_ema!r}.")
    if not eval_ema:
        return
    if eval_step is None:
        raise ValueError(
            "eval_ema=True needs eval_step and eval_data: pass both, or drop eval_ema."
        )
    if not has_ema(state.opt_state):
        raise NoEmaError(
            "fit(eval_ema=True) needs a state that keeps an EMA of its params: "
            "build its optimizer with pztrain.with_ema(optimizer, decay=0.999)."
        )
