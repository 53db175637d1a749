"""ArrayLoader(on_device=True): the step takes its own batch on device."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain


def _data(n=48):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(n, 3)).astype(np.float32),
        "y": rng.normal(size=(n,)).astype(np.float32),
    }


def _loss(*, model, state, rng, x, y):
    pred = x @ model["w"] + model["b"]
    loss = jnp.mean((pred - y) ** 2)
    return loss, state, {"loss": loss, "first_x": x[0, 0]}


def _state():
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    return pztrain.TrainState.initial_state(params, optax.sgd(0.05), jax.random.key(0))


def test_device_epoch_matches_host_batches():
    host = pztrain.ArrayLoader(_data(), 8, seed=3)
    dev = pztrain.ArrayLoader(_data(), 8, seed=3, on_device=True)
    for epoch in (0, 2):
        batches = dev.device_epoch(epoch)
        assert batches.steps_per_epoch == host.steps_per_epoch
        for i, want in enumerate(host.epoch(epoch)):
            got = batches.take(jnp.int32(epoch * host.steps_per_epoch + i))
            np.testing.assert_array_equal(got["x"], want["x"])


@pytest.mark.slow  # runs on host and on device (one on-device fit stays fast)
@pytest.mark.parametrize("k", [1, 2])
def test_fit_on_device_equals_fit_on_host(k):
    step = pztrain.build_train_step(_loss, steps_per_call=k)
    runs = []
    for on_device in (False, True):
        loader = pztrain.ArrayLoader(_data(), 8, seed=1, on_device=on_device)
        state, history = pztrain.fit(
            _state(), step, loader, num_steps=12, log_every=2 * k, progress=False
        )
        runs.append((state, history))
    (a, ha), (b, hb) = runs
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    assert [r["metrics"] for r in ha.records] == [r["metrics"] for r in hb.records]
    assert a.step.dtype == b.step.dtype == jnp.int32
    assert int(a.step) == int(b.step) == 12
    assert [r["step"] for r in hb.records] == list(range(2 * k, 13, 2 * k))


def test_fit_on_device_continues_from_a_state_a_callback_returns():
    """A callback's state replaces fit's, step included."""

    class JumpOnce(pztrain.Callback):
        def __init__(self):
            self.seen = []

        def on_log(self, state, record):
            self.seen.append(int(state.step))
            if len(self.seen) == 1:
                return state.replace(step=state.step + 1000)

    step = pztrain.build_train_step(_loss)
    loader = pztrain.ArrayLoader(_data(), 8, seed=1, on_device=True)
    jump = JumpOnce()
    state, _ = pztrain.fit(
        _state(),
        step,
        loader,
        num_steps=8,
        log_every=4,
        callbacks=[jump],
        progress=False,
    )
    # fit counts its own steps (4 more after the jump); the state's step moved on
    # from what the callback returned.
    assert jump.seen == [4, 1008]
    assert int(state.step) == 1008


@pytest.mark.slow  # three runs
def test_resume_mid_epoch_on_device_sees_the_same_batches():
    step = pztrain.build_train_step(_loss)
    loader = pztrain.ArrayLoader(_data(), 8, seed=2, on_device=True)
    full, _ = pztrain.fit(_state(), step, loader, num_steps=10, progress=False)
    half, _ = pztrain.fit(_state(), step, loader, num_steps=4, progress=False)
    rest, _ = pztrain.fit(half, step, loader, num_steps=10, progress=False)
    np.testing.assert_array_equal(full.params["w"], rest.params["w"])


def test_on_device_errors():
    with pytest.raises(pztrain.BatchError, match=re.escape("use drop_remainder=True")):
        pztrain.ArrayLoader(_data(), 8, on_device=True, drop_remainder=False)
    step = pztrain.build_train_step(_loss, steps_per_call=4)
    loader = pztrain.ArrayLoader(_data(), 8, on_device=True)  # 6 steps per epoch
    with pytest.raises(ValueError, match=re.escape("steps per epoch (6)")):
        pztrain.fit(_state(), step, loader, num_steps=8, progress=False)
    plain = pztrain.build_train_step(_loss)
    with pytest.raises(TypeError, match="not both"):
        plain(_state(), loader.device_epoch(0), x=np.zeros((8, 3)))


def test_device_epochs_in_any_order_match_host_batches():
    """The device copy is re-permuted from whatever epoch it holds."""
    host = pztrain.ArrayLoader(_data(), 8, seed=5)
    dev = pztrain.ArrayLoader(_data(), 8, seed=5, on_device=True)
    n = host.steps_per_epoch
    for epoch in (0, 2, 1, 2, 0, 3):
        batches = dev.device_epoch(epoch)
        for i, want in enumerate(host.epoch(epoch)):
            got = batches.take(jnp.int32(epoch * n + i))
            np.testing.assert_array_equal(got["x"], want["x"])
            np.testing.assert_array_equal(got["y"], want["y"])
        stacked = batches.take(jnp.int32(epoch * n + 2), count=2)
        np.testing.assert_array_equal(
            stacked["x"][1], host.batch_at(epoch * n + 3)["x"]
        )


def test_unshuffled_device_epochs_keep_the_original_order():
    data = _data(24)
    dev = pztrain.ArrayLoader(data, 8, shuffle=False, on_device=True)
    for epoch in (0, 4):
        got = dev.device_epoch(epoch).take(jnp.int32(epoch * 3 + 1))
        np.testing.assert_array_equal(got["x"], data["x"][8:16])


def test_one_device_copy_of_the_data_stays_alive():
    data = _data(40)
    dev = pztrain.ArrayLoader(data, 8, seed=0, on_device=True)
    for epoch in range(4):
        dev.device_epoch(epoch)
    # The device copy is laid out [batches, batch_size, ...]: 40 rows as 5 x 8.
    alive = [a for a in jax.live_arrays() if a.shape == (5, 8, 3)]
    assert len(alive) == 1


def test_the_step_slices_its_batch_instead_of_gathering_it():
    """A per-step gather from the whole dataset is costed by XLA as reading all
    of it (and split across threads on CPU for data over 512 KiB); the step reads
    one contiguous slice instead."""
    loader = pztrain.ArrayLoader(_data(), 8, seed=0, on_device=True)
    step = pztrain.build_train_step(_loss)
    text = step.lower(_state(), loader.device_epoch(1)).as_text()
    assert "dynamic_slice" in text
    assert "gather" not in text


def test_metric_names_come_from_a_forward_trace_alone():
    """metric_sums traces the loss without its gradient (cheaper: no backward pass)."""

    @jax.custom_vjp
    def scaled(x):
        return 2.0 * x

    def forward(x):
        return scaled(x), None

    def backward(_, g):
        raise AssertionError("metric_sums traced the backward pass")

    scaled.defvjp(forward, backward)

    def loss(*, model, state, rng, x, y):
        value = jnp.mean((scaled(x @ model["w"]) - y) ** 2)
        return value, state, {"loss": value, "acc": jnp.float32(0.5), "vec": x[0]}

    step = pztrain.build_train_step(loss)
    loader = pztrain.ArrayLoader(_data(), 8, seed=0, on_device=True)
    sums = step.metric_sums(_state(), loader.device_epoch(0))
    assert sums.names == ("loss", "acc")  # the vector leaf is no metric
    assert step.metric_sums(_state(), **_data(8)).names == ("loss", "acc")
