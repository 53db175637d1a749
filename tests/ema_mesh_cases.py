"""EMA and grad norms on 8 simulated CPU devices, run by ``test_ema_mesh.py`` in a
subprocess (the device count must be set before jax is imported)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from mesh_cases import LAYOUTS, batches, loss_fn, mesh, shardings_of

import pztrain
from pztrain.sharding import sharded_initial_state


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


def make_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "b1": jax.numpy.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
    }
    tx = pztrain.with_ema(optax.adam(1e-2), 0.9, warmup=True)
    return pztrain.TrainState.initial_state(params, tx, jax.random.key(1))


def run(state, step):
    norms = []
    for x, y in zip(*batches(), strict=True):
        state, aux = step(state, x=x, y=y)
        norms.append({k: float(v) for k, v in aux.items() if k != "loss"})
    return state, norms


@pytest.mark.parametrize("types", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["fsdp", "2d"])
def test_the_ema_is_sharded_like_the_params_and_equals_one_device(layout, types):
    shape, names, rules = LAYOUTS[layout]
    m = mesh(shape, names, types)
    state = sharded_initial_state(make_state, m, rules)
    before = shardings_of(state)
    assert shardings_of(state.ema_params) == shardings_of(state.params)
    step = pztrain.build_train_step(loss_fn, mesh=m, grad_norms="per_param")
    state, norms = run(state, step)
    assert shardings_of(state) == before
    want, want_norms = run(
        make_state(), pztrain.build_train_step(loss_fn, grad_norms="per_param")
    )
    for name in want.params:
        np.testing.assert_allclose(
            state.ema_params[name], want.ema_params[name], atol=1e-5
        )
    for got, expected in zip(norms, want_norms, strict=True):
        assert got == pytest.approx(expected, rel=1e-4)
