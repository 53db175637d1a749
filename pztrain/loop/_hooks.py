"""A run's hooks as one ordered list, and the loop's one way to read the device.

`fit` builds the list: the progress bar, the callbacks in the order given, the
loggers with the history (`RecordLog`), then the checkpoints. Every hook point
runs the whole list in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from pztrain.callbacks import Callback, record_only
from pztrain.loggers import Logger
from pztrain.records import History, Stop
from pztrain.state import TrainState

__all__ = ["Hooks", "RecordLog", "host_reads"]


def host_reads() -> Any:
    """The context in which the loop (and its hooks) may read from the device.

    Every device→host read of the loop sits inside it, so a run under
    ``jax.transfer_guard_device_to_host("disallow")`` proves that nothing else
    syncs.
    """
    return jax.transfer_guard_device_to_host("allow")


class Hooks:
    """Runs a hook of every callback, in order, and merges what they return.

    Attributes:
      callbacks: The callbacks, in the order they run.
      record_only: Whether every ``on_log`` only reads the record (see
        `pztrain.callbacks.record_only`): log points then need not wait for the
        device.
    """

    def __init__(self, callbacks: Sequence[Callback]):
        self.callbacks = tuple(callbacks)
        self.record_only = all(
            getattr(cb.on_log, "record_only", False) or not _defines(cb, "on_log")
            for cb in self.callbacks
        )

    def run(self, hook: str, state: TrainState, arg: Any) -> tuple[Any, Stop | None]:
        """Runs ``hook(state, arg)`` of each callback: ``(state, first Stop)``.

        A hook returning a state (alone or in a `Stop`) hands it to the hooks
        after it and to the loop; the first `Stop` gives the reason.
        """
        stop = None
        for cb in self.callbacks:
            with host_reads():
                out = getattr(cb, hook)(state, arg)
            if isinstance(out, Stop):
                stop = stop or out
                state = state if out.state is None else out.state
            elif isinstance(out, TrainState):
                state = out
            elif out is not None:
                raise TypeError(
                    f"{type(cb).__name__}.{hook} returned a {type(out).__name__}; "
                    "hooks return None, a TrainState or pztrain.callbacks.Stop."
                )
        return state, stop

    def end(self, state: TrainState, history: History) -> None:
        """``on_train_end`` of every callback, even if one raises; the first
        exception is raised after all of them ran."""
        error = None
        for cb in self.callbacks:
            try:
                with host_reads():
                    cb.on_train_end(state, history)
            except BaseException as e:  # noqa: BLE001 - raised below
                error = error or e
        if error is not None:
            raise error

    def advance(self, step: int, t: float) -> int | None:
        """``on_advance`` of every callback: the earliest step one asks for."""
        wishes = [cb.on_advance(step, t) for cb in self.callbacks]
        wishes = [w for w in wishes if w is not None]
        return min(wishes) if wishes else None


def _defines(cb: Callback, hook: str) -> bool:
    """Whether ``cb`` has its own ``hook`` (not `Callback`'s no-op)."""
    return getattr(getattr(cb, hook), "__func__", None) is not getattr(Callback, hook)


class RecordLog(Callback):
    """The history and the loggers, as one hook: every record goes to both.

    Loggers get host values only: they run under the device-read guard that was
    in effect where the run started, not under the loop's `host_reads`.

    Args:
      history: The run's `History`.
      loggers: The `pztrain.loggers.Logger` s.
    """

    def __init__(self, history: History, loggers: Sequence[Logger]):
        self.history = history
        self.loggers = tuple(loggers)
        self._guard = jax.config.jax_transfer_guard_device_to_host

    def on_train_start(self, state, info):
        hparams = {
            "steps_per_call": info.steps_per_call,
            "log_every": info.log_every,
            **info.hparams,
        }
        for lg in self.loggers:
            lg.log_hparams(hparams)

    @record_only
    def on_log(self, state, record):
        self._add(record)

    def on_eval_end(self, state, record):
        self._add(record)

    def _add(self, record: dict[str, Any]) -> None:
        self.history.records.append(record)
        with jax.transfer_guard_device_to_host(self._guard):
            for lg in self.loggers:
                lg.log_record(record)

    def on_train_end(self, state, history):
        """Closes every logger (all of them, even if one raises)."""
        error = None
        for lg in self.loggers:
            try:
                lg.close()
            except Exception as e:  # noqa: BLE001 - raised below
                error = error or e
        if error is not None:
            raise error
