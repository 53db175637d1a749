"""``Evaluation(at_end=True)`` at the run's last step whatever ended it (issue
38, point 1): the schedule's end, `EarlyStopping`, a `NanPolicy` stop, a
`Stop` a callback returns; a signal before the end owes it to the resumed run's
end; an exception in a callback is an error, not a stop: no evaluation runs.
"""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import (
    ArrayLoader,
    Callback,
    EarlyStopping,
    Evaluation,
    NanPolicy,
    Stop,
    fit,
)

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] + model["b"] - y) ** 2)
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)


def new_state():
    model = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return pztrain.TrainState.initial_state(model, optax.sgd(0.01), jax.random.key(0))


def loader():
    return ArrayLoader({"x": X, "y": Y}, 4, seed=1)  # 8 steps per epoch


class Ends:
    """A host-function evaluation that remembers the steps it ran at."""

    def __init__(self):
        self.steps = []

    def __call__(self, state):
        self.steps.append(int(state.step))
        return {"b": state.params["b"]}


def run(ends, callbacks=(), **kw):
    kw.setdefault("num_steps", 32)
    return fit(
        new_state(),
        STEP,
        loader(),
        log_every=4,
        evaluations=[
            Evaluation("val", lambda s: {"v": 1.0 / (1 + int(s.step))}, every=4),
            Evaluation("test", ends, every=10**6),  # at the end only
        ],
        callbacks=list(callbacks),
        progress=False,
        loggers=[],
        **kw,
    )


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_log(self, state, record):
        return Stop("enough") if record["step"] == self.step else None


def test_at_end_runs_at_the_schedules_end():
    ends = Ends()
    _, history = run(ends)
    assert ends.steps == [32] and history.stop_reason is None


def test_at_end_runs_after_early_stopping():
    ends = Ends()  # "val" grows as the step does: no improvement after step 4
    stopper = EarlyStopping("eval/val/v", mode="max", patience=2)
    state, history = run(ends, [stopper])
    assert "did not improve" in history.stop_reason
    assert ends.steps == [12] and int(state.step) == 12
    last = history.records[-1]
    assert (
        last["split"] == "eval" and last["step"] == 12 and "test/b" in last["metrics"]
    )


def test_at_end_runs_after_a_stop_a_callback_returns():
    ends = Ends()
    state, history = run(ends, [StopAt(8)])
    assert history.stop_reason == "enough" and ends.steps == [8]


def test_at_end_runs_after_a_nan_policy_stop():
    ends = Ends()
    state = new_state()
    state = state.replace(params={**state.params, "b": jnp.array(jnp.nan)})
    _, history = fit(
        state,
        STEP,
        loader(),
        num_steps=32,
        log_every=4,
        evaluations=[Evaluation("test", ends, every=10**6)],
        callbacks=[NanPolicy("stop")],
        progress=False,
        loggers=[],
    )
    assert "non-finite" in history.stop_reason or "NaN" in history.stop_reason
    assert ends.steps == [4]


class Raises(Callback):
    def on_log(self, state, record):
        if record["step"] == 8:
            raise RuntimeError("boom")


def test_an_exception_in_a_callback_is_an_error_not_a_stop():
    ends = Ends()
    with pytest.raises(RuntimeError, match="boom"):
        run(ends, [Raises()])
    assert ends.steps == []


class SigintAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_log(self, state, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow  # a stopped run and its resume
def test_a_signal_before_the_end_owes_at_end_to_the_resumed_runs_end(tmp_path):
    ends = Ends()
    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=8)
    state, history = run(ends, [SigintAt(8)], checkpoints=ckpt)
    assert history.stop_reason == "interrupted" and ends.steps == []
    meta = pztrain.read_metadata(tmp_path / "c" / "8")["metadata"]
    # "val" was due at 8 and is owed there; "test" is not: step 8 is not the end
    assert meta["owed_eval"] == {"step": 8, "epoch": 0, "names": ["val"]}
    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=8)
    _, history = run(ends, checkpoints=ckpt, resume=True)
    assert ends.steps == [32] and history.stop_reason is None
