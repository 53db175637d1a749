"""What `pztrain.fit` leaves when it ends early: the line it prints after a stop
by a signal, and the newest state on the error that ended it.

An exception that escapes ``fit`` carries the newest state the loop held, as
``err.train_state`` (a PEP 678 note on it says so and how to go on), so no
error after the first step loses the steps trained since the last checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from pztrain.loop._hooks import host_reads
from pztrain.loop._signals import StopFlag
from pztrain.state import DonatedStateError, TrainState

__all__ = ["keep_state", "stop_line"]


def keep_state(error: BaseException, state: TrainState) -> None:
    """Puts ``state`` on ``error`` as ``train_state``, with a note that says
    where it is (an error that carries one already, from a `fit` inside this
    one, keeps its own)."""
    if getattr(error, "train_state", None) is not None:
        return
    try:
        error.train_state = state  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type without attributes
        return
    try:
        state.check_not_donated("fit")
        with host_reads():
            step = int(state.step)
    except DonatedStateError:
        error.add_note(
            "pztrain.fit: the call that failed consumed the newest state "
            "(err.train_state is deleted); resume from the newest checkpoint."
        )
        return
    except Exception:  # noqa: BLE001 - the device is failing: say less
        step = "?"
    error.add_note(
        f"pztrain.fit: the newest state (step {step}) is kept on this error: "
        "state = err.train_state (in a notebook, after the cell failed: state = "
        "sys.last_value.train_state); fit(state, ...) goes on from there."
    )


def stop_line(
    flag: StopFlag, step: int, saved: Path | None, unrun: bool = False
) -> str:
    """The one line `fit` prints when a signal stopped it at ``step``
    (``saved``: the checkpoint of that step, if there is one; ``unrun``: an
    evaluation due at that step did not run, and nothing owes it).

    It names the call that goes on: ``fit(state, ...)`` from the returned
    state, or, once a checkpoint of that step is saved, ``fit(...,
    resume=True)`` (in this process or a new one; a run with checkpoints
    refuses to start without it in a directory that holds some). With several
    processes, a SIGTERM goes to JAX's preemption service, which stops them all
    and names no process: the line says so.

    Example:
      >>> from pztrain.loop._signals import LocalFlag
      >>> import signal
      >>> flag = LocalFlag()
      >>> flag.signalled(signal.SIGINT)
      >>> print(stop_line(flag, 37, None))
      pztrain.fit: interrupted (SIGINT) at step 37. The returned state is that \
step's: fit(state, ...) goes on from there.
      >>> print(stop_line(flag, 37, Path("ckpt/37")))
      pztrain.fit: interrupted (SIGINT) at step 37. Checkpoint saved: ckpt/37. \
fit(..., resume=True) goes on from there.
    """
    # No name: JAX's preemption notice stopped every process, and it does not
    # say which got the SIGTERM (it holds that signal: pztrain's handler saw none).
    how = flag.signal_name or "SIGTERM to this process or another, through JAX"
    head = f"pztrain.fit: {flag.reason} ({how}) at step {step}."
    if saved is None:
        line = (
            f"{head} The returned state is that step's: fit(state, ...) goes on "
            "from there."
        )
        if unrun:  # no checkpoint to owe it to: fit(state, ...) starts after it
            line += (
                f" The evaluation due at step {step} did not run (without "
                "checkpoints nothing owes it): pztrain.evaluate(state, ...) runs it."
            )
        return line
    return (
        f"{head} Checkpoint saved: {saved}. fit(..., resume=True) goes on from there."
    )
