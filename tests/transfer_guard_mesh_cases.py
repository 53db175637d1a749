"""fit on 8 simulated devices under ``jax.transfer_guard("disallow")``: a
data-parallel (FSDP) run and a population split over the devices. Run by
``test_transfer_guard.py`` in a subprocess (``XLA_FLAGS`` must be set before
jax is imported)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_loop import DISALLOWED, d2h_guard  # noqa: F401 - a fixture, by name

import pztrain
from pztrain.population import shard_members
from pztrain.sharding import ShardingRules, sharded_initial_state


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((jnp.tanh(x @ model["w1"]) @ model["w2"] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"mse": jnp.mean((jnp.tanh(x @ model["w1"]) @ model["w2"] - y) ** 2)}


def make_state(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
    }
    return pztrain.TrainState.initial_state(params, optax.adam(1e-2), jax.random.key(1))


def arrays(n=128):
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((n, 16)).astype(np.float32),
        "y": rng.standard_normal((n, 4)).astype(np.float32),
    }


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.usefixtures("d2h_guard")
def test_fsdp_fit_moves_nothing_implicitly(on_device):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    state = sharded_initial_state(make_state, mesh, ShardingRules(fsdp="data"))
    step = pztrain.build_train_step(loss_fn, mesh=mesh)
    sharding = pztrain.sharding.data_sharding(mesh) if on_device else None
    data = pztrain.ArrayLoader(
        arrays(), 32, seed=0, on_device=on_device, sharding=sharding
    )
    evals = pztrain.ArrayLoader(arrays(64), 32, shuffle=False)
    with jax.transfer_guard("disallow"):
        state, history = pztrain.fit(
            state,
            step,
            data,
            num_steps=8,
            log_every=4,
            eval_step=pztrain.build_eval_step(eval_fn),
            eval_data=evals,
            eval_every=4,
            progress=False,
        )
        with pytest.raises(Exception, match=DISALLOWED):
            float(state.step)  # the guard was on all along
    assert int(state.step) == 8
    assert [r["step"] for r in history.records if r["split"] == "train"] == [4, 8]


@pytest.mark.usefixtures("d2h_guard")
def test_population_over_the_devices_moves_nothing_implicitly():
    mesh = jax.make_mesh((8,), ("members",))
    pop = shard_members(pztrain.make_population(make_state, seeds=range(8)), mesh)
    step = pztrain.build_train_step(loss_fn)
    data = pztrain.ArrayLoader(arrays(), 32, seed=0)
    with jax.transfer_guard("disallow"):
        pop, history = pztrain.fit(
            pop, step, data, num_steps=8, log_every=4, progress=False
        )
    assert int(pop.step) == 8
    assert np.isfinite(history.last()["metrics"]["loss/max"])
