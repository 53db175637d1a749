"""Stops that lose nothing: a signal becomes a request the loop reads between calls.

While `pztrain.fit` runs in the main thread, the first SIGINT (Ctrl-C, a
notebook's interrupt) and the first of its preemption signals (SIGTERM by
default) only set a flag. The loop reads it before each call of the train step
and before each batch of an evaluation, then stops, saves and returns. A second
signal goes to the handler that was there before: Python's raises
`KeyboardInterrupt` (IPython's is called, then `KeyboardInterrupt` raised); the
default of SIGTERM ends the process. The previous handlers come back when `fit`
ends, however it ends. Outside the main thread no handler can be installed:
signals act as they would without pztrain.

A signal that comes after the loop's last read of the flag (during the final
save or ``on_train_end``) is not lost: once `fit` is over (its saves on disk,
its locks released) it acts as it would have without pztrain.

With JAX's distributed runtime, JAX's preemption notifier owns SIGTERM (pztrain
never replaces it). Every process asks JAX's preemption sync point
(`jax.experimental.multihost_utils.reached_preemption_sync_point`) before each
call, so all of them stop before the same call, even if one process alone got
the signal; another signal is forwarded to that notifier as a SIGTERM. That
sync point serves one stop per job: the processes are expected to end after it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax

__all__ = [
    "INTERRUPTED",
    "PREEMPTED",
    "AgreedFlag",
    "LocalFlag",
    "StopFlag",
    "check_signals",
    "stop_signals",
]

INTERRUPTED = "interrupted"
PREEMPTED = "preempted"
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def check_signals(names: Any) -> tuple[signal.Signals, ...]:
    """``fit``'s ``preempt_on``: signal names (``"SIGTERM"``), numbers or
    `signal.Signals`, as `signal.Signals`.

    Raises:
      TypeError: if ``names`` is not a list of names or signals.
      ValueError: naming an unknown signal, one that cannot be caught (SIGKILL,
        SIGSTOP), or SIGINT (always the interrupt).

    Example:
      >>> check_signals(["SIGTERM", "SIGUSR1"])
      (<Signals.SIGTERM: 15>, <Signals.SIGUSR1: 10>)
    """
    if isinstance(names, (str, int)) or not isinstance(names, Iterable):
        raise TypeError(
            "preempt_on must be a list of signal names, e.g. preempt_on=['SIGTERM', "
            f"'SIGUSR1'] (or [] for none); got {names!r}."
        )
    return tuple(dict.fromkeys(_one_signal(n) for n in names))


def _one_signal(name: Any) -> signal.Signals:
    try:
        sig = signal.Signals[name] if isinstance(name, str) else signal.Signals(name)
    except (KeyError, ValueError):
        known = sorted(
            s.name for s in signal.valid_signals() if isinstance(s, signal.Signals)
        )
        raise ValueError(
            f"preempt_on: unknown signal {name!r}. Name one of {', '.join(known)}."
        ) from None
    if sig.name in _UNCATCHABLE:
        raise ValueError(
            f"preempt_on: {sig.name} cannot be caught: the system ends (or stops) the "
            "process without telling it. Preemption uses a signal that can be "
            "caught, such as SIGTERM or SIGUSR1."
        )
    if sig == signal.SIGINT:
        raise ValueError(
            "preempt_on: SIGINT is the interrupt (Ctrl-C): fit always handles it "
            "and reports stop_reason 'interrupted'. Leave it out of preempt_on."
        )
    return sig


class StopFlag:
    """What the loop reads to know whether to stop.

    Attributes:
      requested: Read once before each call and each eval batch: whether to
        stop before it. Reading it costs an attribute read (with several
        processes, a call to JAX's preemption sync point).
      stopped: Whether a read of ``requested`` said so (read anywhere else,
        e.g. at host points; it is never a collective).
      reason: ``"interrupted"`` or ``"preempted"`` once stopped.
      signal_name: The signal this process got (``None`` if none).
      acted: Set by the run once it has stopped on the flag (saved, said
        so); a signal that came after its last read was not acted on, and
        is delivered again once the run is over (`stop_signals`).
    """

    requested: bool = False
    stopped: bool = False
    signal_name: str | None = None
    acted: bool = False

    @property
    def reason(self) -> str:
        sigint = self.signal_name == signal.SIGINT.name
        return INTERRUPTED if sigint else PREEMPTED

    def signalled(self, sig: signal.Signals) -> None:
        """This process got ``sig`` (the first one)."""
        self.signal_name = sig.name


class LocalFlag(StopFlag):
    """A stop request of this process alone: set by its signal handler."""

    def __init__(self) -> None:
        self.requested = self.stopped = False  # read from the instance: fastest

    def signalled(self, sig: signal.Signals) -> None:
        super().signalled(sig)
        self.requested = self.stopped = True


_CHECKS = itertools.count(1)  # JAX's sync point is per process: one count


class AgreedFlag(StopFlag):
    """A stop request agreed by every process through JAX's preemption sync
    point, asked at each read of ``requested`` (every process reads it at the
    same calls and batches, so the count matches)."""

    def __init__(self) -> None:
        from jax.experimental import multihost_utils

        self._reached = multihost_utils.reached_preemption_sync_point

    @property
    def requested(self) -> bool:  # type: ignore[override]
        if not self.stopped:
            self.stopped = self._reached(next(_CHECKS))
        return self.stopped

    def signalled(self, sig: signal.Signals) -> None:
        """Forwards ``sig`` to JAX's preemption notifier, which tells every
        process (SIGTERM is its signal)."""
        super().signalled(sig)
        os.kill(os.getpid(), signal.SIGTERM)


class _Handler:
    """The handler of one signal for one run: the first signal sets the flag,
    later ones go to ``previous``."""

    def __init__(self, flag: StopFlag, sig: signal.Signals, previous: Any):
        self.flag, self.sig, self.previous = flag, sig, previous
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.seen:
            self.seen = True
            if self.flag.signal_name is None:
                self.flag.signalled(self.sig)
            return
        _chain(self.previous, self.sig, frame)


def _chain(previous: Any, sig: signal.Signals, frame: Any) -> None:
    """What ``sig`` would have done without pztrain."""
    if callable(previous):
        previous(int(sig), frame)  # Python's SIGINT handler raises here
    elif sig != signal.SIGINT:  # the default action: end the process
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)
    if sig == signal.SIGINT:
        raise KeyboardInterrupt


def _jax_owns_sigterm() -> bool:
    """Whether JAX's preemption notifier holds SIGTERM (distributed runtime)."""
    return jax.distributed.is_initialized() and bool(
        jax.config.jax_enable_preemption_service
    )


@contextlib.contextmanager
def stop_signals(preempt_on: Iterable[signal.Signals] = ()) -> Iterator[StopFlag]:
    """Installs the run's handlers of SIGINT and ``preempt_on`` (main thread
    only), yields the flag they set, and puts the previous handlers back.

    Inside another run's handlers (``evaluate`` in a callback), installs
    nothing and yields a flag that stays down: the outer run stops after.
    """
    sigint = signal.getsignal(signal.SIGINT)
    agreed = _jax_owns_sigterm()
    if isinstance(sigint, _Handler) or (not agreed and _several_processes()):
        yield StopFlag()  # inside a run; or no way to agree: signals act as before
        return
    flag = AgreedFlag() if agreed else LocalFlag()
    wanted = [s for s in preempt_on if not (agreed and s == signal.SIGTERM)]
    installed = _install(flag, [(signal.SIGINT, sigint)], wanted)
    try:
        yield flag
    finally:
        for sig, handler in installed:
            replaced = signal.signal(sig, handler.previous)
            if replaced is not handler:  # another came meanwhile: it stays
                signal.signal(sig, replaced)
    _deliver_late(flag, [handler for _, handler in installed])


def _deliver_late(flag: StopFlag, handlers: list[_Handler]) -> None:
    """A signal that came after the run's last read of the flag (during its
    final save or ``on_train_end``) acts now, as it would have without
    pztrain: SIGINT raises `KeyboardInterrupt`, SIGTERM's default ends the
    process. The run is over by then: its saves are on disk."""
    if flag.acted:
        return
    for handler in handlers:
        if handler.seen and handler.sig.name == flag.signal_name:
            _chain(handler.previous, handler.sig, None)


def _several_processes() -> bool:
    return jax.distributed.is_initialized() and jax.process_count() > 1


def _install(
    flag: StopFlag, known: list[tuple[Any, Any]], sigs: list[signal.Signals]
) -> list[tuple[Any, _Handler]]:
    """Handlers for the signals of ``known`` (with their current handlers) and
    ``sigs`` that Python handles (not ignored, not a handler installed outside
    Python), in the main thread; none elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return []
    installed = []
    for sig, previous in [*known, *((s, signal.getsignal(s)) for s in sigs)]:
        if previous is None or previous == signal.SIG_IGN:
            continue
        handler = _Handler(flag, sig, previous)
        signal.signal(sig, handler)
        installed.append((sig, handler))
    return installed
