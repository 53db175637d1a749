"""Stops by a signal on data from disk: the stop checkpoint keeps a sequential
grain pipeline's iterator state and a `GrainLoader`'s position, so the resumed
run is bitwise the uninterrupted one."""

from __future__ import annotations

import os
import signal

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import Callback, Checkpoints, GrainLoader, fit

N = 48


def example(i):
    x = np.random.default_rng(int(i)).standard_normal(3).astype(np.float32)
    return {"x": x, "y": np.float32(x @ np.array([1.0, -2.0, 0.5]) + 0.3)}


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] + model["b"] - y) ** 2)
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)


def new_state():
    model = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return pztrain.TrainState.initial_state(model, optax.adam(0.05), jax.random.key(0))


def sequential():
    """Shuffled examples, repeated, batched in order: read as it comes."""
    ds = grain.MapDataset.range(N).map(example).shuffle(seed=3).repeat()
    return ds.to_iter_dataset().batch(4)


def random_access():
    return GrainLoader(grain.MapDataset.range(N).map(example), 4, seed=3)


class SigintAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_log(self, state, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow  # a run, an interrupted run and its resume, on grain data
@pytest.mark.parametrize("data", [sequential, random_access])
def test_an_interrupt_on_grain_data_resumes_bitwise(tmp_path, data):
    opts = dict(num_steps=20, log_every=2, progress=False)
    whole, _ = fit(new_state(), STEP, data(), **opts)
    ckpt = Checkpoints(tmp_path / "c", every_steps=100)
    state, history = fit(
        new_state(), STEP, data(), checkpoints=ckpt, callbacks=[SigintAt(6)], **opts
    )
    assert history.stop_reason == "interrupted"
    assert int(state.step) == 6 and ckpt.steps() == [6]
    resumed, _ = fit(new_state(), STEP, data(), checkpoints=ckpt, resume=True, **opts)
    assert int(resumed.step) == 20
    for name in ("w", "b"):
        np.testing.assert_array_equal(resumed.params[name], whole.params[name])
