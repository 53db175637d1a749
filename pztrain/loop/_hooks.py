"""A run's hooks as one ordered list, and the loop's one way to read the device.

`fit` builds the list: the progress bar, the callbacks in the order given, the
loggers with the history (`RecordLog`), then the checkpoints. Every hook point
runs the whole list in that order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._tree import describe
from pztrain.callbacks import Callback, record_only
from pztrain.loggers import Logger
from pztrain.loggers._media import log_media
from pztrain.records import History, Stop
from pztrain.state import TrainState

__all__ = ["Hooks", "RecordLog", "eval_inputs", "host_reads"]


def host_reads() -> Any:
    """The context in which the loop (and its hooks) may read from the device.

    Every device→host read of the loop sits inside it, so a run under
    ``jax.transfer_guard_device_to_host("disallow")`` proves that nothing else
    syncs.
    """
    return jax.transfer_guard_device_to_host("allow")


@contextlib.contextmanager
def eval_inputs() -> Iterator[None]:
    """The context of an evaluation's batches (an eval point): host→device and
    device→device transfers allowed (jit moves host batches, the sums take
    their weights and gather the values of a mesh); reads stay guarded.

    Everything else the loop moves to the device it moves explicitly
    (``jax.device_put``), so a run under ``jax.transfer_guard("disallow")``
    proves that nothing moves implicitly between host points.
    """
    with (
        jax.transfer_guard_host_to_device("allow"),
        jax.transfer_guard_device_to_device("allow"),
    ):
        yield


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

        If a callback raises in ``on_log`` or ``on_eval_end``, the record still
        reaches the `RecordLog` (history and loggers) before the error goes on.

        A hook returning a state (alone or in a `Stop`) hands it to the hooks
        after it and to the loop; the first `Stop` gives the reason. A returned
        state's ``step`` given as a Python or NumPy integer becomes a JAX scalar
        of the step's dtype (so checkpoints and the step see one structure).

        Raises:
          TypeError: naming the hook, if it returns anything but ``None``, a
            `TrainState` or a `Stop` (whose state is one or ``None``), a state
            whose step is not an integer scalar, or a state of another
            structure than the one it was given (other fields, leaves, shapes
            or dtypes: another model's), naming the first that differ.
        """
        stop = None
        for i, cb in enumerate(self.callbacks):
            try:
                with host_reads():
                    out = getattr(cb, hook)(state, arg)
            except BaseException:
                self._still_logged(hook, state, arg, self.callbacks[i + 1 :])
                raise
            if out is not None:
                state, new_stop = _taken(f"{type(cb).__name__}.{hook}", out, state)
                stop = stop or new_stop
        return state, stop

    @staticmethod
    def _still_logged(hook: str, state: TrainState, arg: Any, rest) -> None:
        """After a callback raised in ``hook``: the record still reaches the
        `RecordLog` s after it (the log stays exact), then the error goes on."""
        if hook not in ("on_log", "on_eval_end"):
            return
        for cb in rest:
            if isinstance(cb, RecordLog):
                getattr(cb, hook)(state, arg)

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

    def log_media(self, step: int, media: dict[str, Any]) -> None:
        """Hands an evaluation's text and images to the loggers (`RecordLog`)."""
        for cb in self.callbacks:
            if isinstance(cb, RecordLog):
                cb.log_media(step, media)

    def advance(self, step: int, t: float) -> int | None:
        """``on_advance`` of every callback: the earliest step one asks for."""
        wishes = [cb.on_advance(step, t) for cb in self.callbacks]
        wishes = [w for w in wishes if w is not None]
        return min(wishes) if wishes else None


def _taken(where: str, out: Any, state: TrainState) -> tuple[TrainState, Any]:
    """``(state, stop)`` from what the hook ``where`` returned, checked."""
    stop = out if isinstance(out, Stop) else None
    new = out.state if stop is not None else out
    if stop is not None and new is None:
        return state, stop
    if isinstance(new, TrainState):
        new = _with_array_step(where, new, state)
        _check_structure(where, new, state)
        return new, stop
    if stop is not None:
        raise TypeError(
            f"{where} returned Stop(state=<{type(new).__name__}>); Stop.state is a "
            "TrainState to finish with (e.g. state.replace(params=best)) or None."
        )
    raise TypeError(
        f"{where} returned a {type(out).__name__}; hooks return None, a TrainState "
        "or pztrain.callbacks.Stop."
    )


def _with_array_step(where: str, new: TrainState, old: TrainState) -> TrainState:
    """``new`` with its step as a JAX integer scalar of ``old``'s step dtype."""
    step, dtype = new.step, getattr(old.step, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        dtype = np.dtype(np.int32)
    if isinstance(step, jax.Array) and step.dtype == dtype and step.shape == ():
        return new
    kind = step.dtype if hasattr(step, "dtype") else np.asarray(step).dtype
    if np.ndim(step) == 0 and jnp.issubdtype(kind, jnp.integer):  # bool is not
        return new.replace(step=jnp.asarray(step, dtype))
    raise TypeError(
        f"{where} returned a state whose step is {describe(step)}; a step is an "
        "integer scalar: keep state.step, or set it with jnp.asarray(n, jnp.int32)."
    )


def _check_structure(where: str, new: TrainState, old: TrainState) -> None:
    """Refuses ``new`` if its tree or a leaf's shape or dtype differs from
    ``old`` 's: the step, the checkpoints and a resume need the run's own."""
    (new_leaves, new_tree), (old_leaves, old_tree) = map(jax.tree.flatten, (new, old))
    if new_tree == old_tree and all(map(_same_kind, new_leaves, old_leaves)):
        return
    got, had = _leaves(new), _leaves(old)
    diffs = [
        f"{p} is {describe(got[p])}, was {describe(x)}"
        for p, x in had.items()
        if p in got and not _same_kind(got[p], x)
    ]
    diffs += [f"{p} is missing" for p in had if p not in got]
    diffs += [f"{p} is new" for p in got if p not in had]
    more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
    what = "; ".join(diffs[:3]) or "its static fields differ (another model class?)"
    raise TypeError(
        f"{where} returned a TrainState of another structure than the state it "
        f"was given: {what}{more}. A hook may change the values (params, "
        "optimizer state, hyperparameters), not the structure: the train step, "
        "the checkpoints and a resume need the run's own. Return "
        "state.replace(params=...) with params shaped as state.params."
    )


def _leaves(state: TrainState) -> dict[str, Any]:
    """The leaves of ``state`` by path (``state.params['w']``)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {"state" + jax.tree_util.keystr(p): x for p, x in flat}


def _same_kind(a: Any, b: Any) -> bool:
    """Same shape, and the same dtype unless one is a Python number (which
    passes for a scalar of any dtype)."""
    dtypes = getattr(a, "dtype", None), getattr(b, "dtype", None)
    if np.shape(a) != np.shape(b):
        return False
    return None in dtypes or str(dtypes[0]) == str(dtypes[1])


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

    def log_media(self, step: int, media: dict[str, Any]) -> None:
        """Gives ``media`` to the loggers that record text and images
        (`pztrain.loggers.log_media`; the others skip them with a warning)."""
        with jax.transfer_guard_device_to_host(self._guard):
            log_media(self.loggers, step, media)

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
