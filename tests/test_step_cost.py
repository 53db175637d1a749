"""What a step costs, known before it runs: memory per device, FLOPs, MFU, and a
run refused when the step cannot fit."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain.loop import _resources
from pztrain.step import StepCost

SIZES = (64, 256, 256, 10)
BATCH = 128


def mlp_state():
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    params = {
        f"w{i}": jax.random.normal(k, (a, b)) * 0.1
        for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:], strict=True))
    }
    return pztrain.TrainState.initial_state(params, optax.adam(1e-3), jax.random.key(1))


def loss_fn(*, model, state, rng, x, y):
    h = x
    for i in range(len(SIZES) - 1):
        h = h @ model[f"w{i}"]
        h = jnp.tanh(h) if i < len(SIZES) - 2 else h
    loss = jnp.mean((h - y) ** 2)
    return loss, state, {"loss": loss}


def batch(n=BATCH):
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((n, SIZES[0])).astype(np.float32),
        "y": rng.standard_normal((n, SIZES[-1])).astype(np.float32),
    }


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_a_dense_step_costs_about_six_flops_per_param_and_example():
    state, step = mlp_state(), pztrain.build_train_step(loss_fn)
    cost = step.cost(state, **batch())
    params = sum(a * b for a, b in zip(SIZES[:-1], SIZES[1:], strict=True))
    analytic = 6 * params * BATCH  # forward 2, backward 4 per param and example
    assert cost.devices == 1
    assert abs(cost.flops - analytic) / analytic < 0.10, (cost.flops, analytic)
    # Cached per batch shape, and the same compilation the first call uses.
    assert step.cost(state, **batch()) is cost
    assert step.cost(state, **batch(64)).flops < cost.flops


@pytest.mark.slow  # a second or more (compiles, imports)
def test_memory_per_device_counts_the_state_and_the_batch():
    state, step = mlp_state(), pztrain.build_train_step(loss_fn)
    memory = step.memory(state, **batch())
    state_bytes = sum(
        x.nbytes for x in jax.tree.leaves((state.params, state.opt_state))
    )
    batch_bytes = sum(v.nbytes for v in batch().values())
    assert memory.arguments >= state_bytes + batch_bytes
    assert memory.aliased >= state_bytes - 64  # donated: params and optimizer state
    assert memory.total == (
        memory.arguments + memory.outputs + memory.temporaries - memory.aliased
    )
    assert re.fullmatch(r"[\d.]+ \w?i?B per device \(arguments .*\)", str(memory))


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_fit_records_carry_flops_and_mfu():
    state, step = mlp_state(), pztrain.build_train_step(loss_fn)
    data = [batch()] * 4
    _, history = pztrain.fit(
        state, step, data, num_steps=8, log_every=4, progress=False, peak_flops=1e9
    )
    record = history.last()
    fresh = mlp_state()  # fit's calls add the metrics to sums: that program's
    flops = step.cost(fresh, **batch(), sums=step.metric_sums(fresh, **batch())).flops
    assert record["flops_per_step"] == flops
    assert record["flops_per_sec"] == pytest.approx(
        flops * record["steps_per_sec"], rel=1e-3
    )
    assert record["mfu"] == pytest.approx(record["flops_per_sec"] / 1e9, rel=1e-3)
    _, without = pztrain.fit(mlp_state(), step, data, num_steps=4, progress=False)
    assert "mfu" not in without.last()  # a CPU's peak is unknown


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_a_run_that_cannot_fit_is_refused_before_the_first_step(monkeypatch):
    state, step = mlp_state(), pztrain.build_train_step(loss_fn)
    monkeypatch.setattr(_resources, "_capacity", lambda device: 4096)
    with pytest.raises(MemoryError, match=r"needs .* per device.*holds 4.0 KiB"):
        pztrain.fit(state, step, [batch()] * 2, num_steps=2, progress=False)
    assert int(state.step) == 0  # nothing ran: the state was not donated
    monkeypatch.setattr(_resources, "_capacity", lambda device: 2**40)
    state, _ = pztrain.fit(state, step, [batch()] * 2, num_steps=2, progress=False)
    assert int(state.step) == 2


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_a_cpu_says_once_at_debug_level_that_memory_is_not_checked(monkeypatch, caplog):
    monkeypatch.setattr(_resources, "_said_no_memory", False)
    caplog.set_level(logging.DEBUG, logger="pztrain")
    state, step = mlp_state(), pztrain.build_train_step(loss_fn)
    for total in (1, 2):  # two runs: one line
        state, _ = pztrain.fit(state, step, [batch()], num_steps=total, progress=False)
    said = [r for r in caplog.records if "memory capacity" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.DEBUG]
    assert re.fullmatch(
        r"cpu reports no memory capacity: the step's [\d.]+ \w?i?B per device "
        r"\(.*\) is not checked against it\.",
        said[0].getMessage(),
    )
    assert int(state.step) == 2


def test_peak_flops_must_be_a_positive_number():
    with pytest.raises(ValueError, match=r"peak_flops must be .* got -1"):
        pztrain.fit(
            mlp_state(),
            pztrain.build_train_step(loss_fn),
            [batch()],
            num_steps=1,
            peak_flops=-1,
        )


def test_known_accelerators_have_a_peak():
    class Device:
        device_kind = "TPU v4"

    assert _resources.peak_flops([Device()] * 4, None) == 4 * 275e12
    assert _resources.peak_flops([Device()], 1e12) == 1e12
    Device.device_kind = "cpu"
    assert _resources.peak_flops([Device()], None) is None
    assert isinstance(
        pztrain.build_train_step(loss_fn).cost(mlp_state(), **batch()), StepCost
    )


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_fit_compiles_its_step_once_for_the_memory_check_and_the_calls(caplog):
    # fit checks the memory of the program its calls run (the step that adds
    # the metrics to on-device sums), so the first call reuses that compilation.
    state, step = mlp_state(), pztrain.build_train_step(loss_fn)
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        pztrain.fit(
            state, step, [batch()] * 4, num_steps=4, log_every=2, progress=False
        )
    compiled = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("Finished XLA compilation of jit(flat_run)")
    ]
    assert len(compiled) == 1, compiled
