"""Cases on 8 simulated CPU devices, run by ``test_mesh.py`` in a subprocess
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax is
imported, so they cannot run in the main test process)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pztrain
from pztrain.sharding import (
    ShardingError,
    ShardingRules,
    shard_state,
    sharded_initial_state,
    state_shardings,
)

STEPS = 20
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


TYPES = {
    "auto": AxisType.Auto,
    "explicit": AxisType.Explicit,
}


def mesh(shape=(8,), names=("data",), types="auto"):
    """A mesh whose axes are all Auto, all Explicit (``jax.make_mesh``'s
    default), or ``"mixed"``: the first Explicit, the others Auto."""
    if types == "mixed":
        kinds = (AxisType.Explicit,) + (AxisType.Auto,) * (len(shape) - 1)
    else:
        kinds = (TYPES[types],) * len(shape)
    return jax.make_mesh(shape, names, axis_types=kinds)


def loss_fn(*, model, state, rng, x, y):
    h = jnp.tanh(x @ model["w1"] + model["b1"][None])
    loss = jnp.mean((h @ model["w2"] - y) ** 2)
    return loss, state, {"loss": loss}


def make_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
    }
    return pztrain.TrainState.initial_state(params, optax.adam(1e-2), jax.random.key(1))


def batches(n=STEPS, batch=32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, batch, 16)).astype(np.float32)
    y = rng.standard_normal((n, batch, 4)).astype(np.float32)
    return x, y


def one_device_run():
    state, step = make_state(), pztrain.build_train_step(loss_fn)
    for x, y in zip(*batches(), strict=True):
        state, _ = step(state, x=x, y=y)
    return state


def shardings_of(tree):
    return jax.tree.map(lambda a: a.sharding, tree)


def collectives(compiled_text):
    """Collective ops in compiled HLO (async pairs counted once)."""
    ops = re.findall(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", compiled_text)
    return {c: ops.count(c) for c in COLLECTIVES}


LAYOUTS = {
    "dp": ((8,), ("data",), None),
    "fsdp": ((8,), ("data",), ShardingRules(fsdp="data")),
    "2d": (
        (4, 2),
        ("data", "model"),
        ShardingRules(patterns=[("w1", P(None, "model")), ("w2", P("model", None))]),
    ),
}


@pytest.mark.parametrize("types", ["auto", "explicit", "mixed"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_twenty_steps_equal_one_device_and_keep_shardings(layout, types):
    shape, names, rules = LAYOUTS[layout]
    m = mesh(shape, names, types)
    state = sharded_initial_state(make_state, m, rules)
    before = shardings_of(state)
    step = pztrain.build_train_step(loss_fn, mesh=m)
    for x, y in zip(*batches(), strict=True):
        state, _ = step(state, x=x, y=y)
    assert shardings_of(state) == before
    want = one_device_run()
    for name in want.params:
        np.testing.assert_allclose(state.params[name], want.params[name], atol=1e-5)
    mu, want_mu = state.opt_state[0].mu, want.opt_state[0].mu
    for name in want.params:
        np.testing.assert_allclose(mu[name], want_mu[name], atol=1e-5)
    assert state.opt_state[0].mu["w1"].sharding == state.params["w1"].sharding
    assert state.step.sharding.spec == P() and int(state.step) == STEPS


def test_fit_keeps_every_sharding():
    m = mesh()
    state = sharded_initial_state(make_state, m, ShardingRules(fsdp="data"))
    before = shardings_of(state)
    x, y = batches(4, 64)
    loader = pztrain.ArrayLoader({"x": x.reshape(-1, 16), "y": y.reshape(-1, 4)}, 32)
    step = pztrain.build_train_step(loss_fn, mesh=m)
    state, history = pztrain.fit(state, step, loader, num_steps=12, progress=False)
    assert shardings_of(state) == before
    assert int(state.step) == 12 and np.isfinite(history.last()["metrics"]["loss"])
    # The same step by hand after fit (no metric sums in the carry now).
    state, _ = step(state, x=x[0, :32], y=y[0, :32])
    assert shardings_of(state) == before and int(state.step) == 13


def test_with_hyperparams_copies_keep_every_sharding():
    """One sharded state0 starts two fits (issue 25): the copies that
    with_hyperparams makes keep each array's sharding, and state0 stays."""
    m = mesh()
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def make():
        return pztrain.TrainState.initial_state(
            make_state().params, tx, jax.random.key(1)
        )

    state0 = sharded_initial_state(make, m, ShardingRules(fsdp="data"))
    params_before = shardings_of(state0.params)
    x, y = batches(4, 64)
    loader = pztrain.ArrayLoader({"x": x.reshape(-1, 16), "y": y.reshape(-1, 4)}, 32)
    step = pztrain.build_train_step(loss_fn, mesh=m)
    for lr in (1e-2, 1e-3):
        state = state0.with_hyperparams(learning_rate=lr)
        assert shardings_of(state.params) == params_before
        assert shardings_of(state.opt_state) == shardings_of(state0.opt_state)
        state, _ = pztrain.fit(state, step, loader, num_steps=4, progress=False)
        assert shardings_of(state.params) == params_before
        assert int(state.step) == 4
    assert int(state0.step) == 0 and not state0.params["w1"].is_deleted()


def test_compiled_steps_have_the_expected_collectives():
    found = {}
    for layout, (shape, names, rules) in LAYOUTS.items():
        m = mesh(shape, names)
        state = sharded_initial_state(make_state, m, rules)
        step = pztrain.build_train_step(loss_fn, mesh=m)
        x, y = batches(1)
        found[layout] = collectives(
            step.lower(state, x=x[0], y=y[0]).compile().as_text()
        )
    # Data parallel: one all-reduce of the gradients (and the loss), fused.
    assert found["dp"] == {
        "all-reduce": 1,
        "all-gather": 0,
        "reduce-scatter": 0,
        "collective-permute": 0,
    }
    # FSDP: each param gathered for the forward pass, gradients reduced once.
    assert found["fsdp"]["all-gather"] == 3 and found["fsdp"]["all-reduce"] == 1
    assert found["2d"]["collective-permute"] == 0


def test_steps_per_call_splits_examples_not_steps():
    m = mesh()
    state = sharded_initial_state(make_state, m, ShardingRules(fsdp="data"))
    step = pztrain.build_train_step(loss_fn, mesh=m, steps_per_call=4)
    assert step.batch_sharding.spec == P(None, "data")
    x, y = batches(STEPS)
    for i in range(0, STEPS, 4):
        state, _ = step(state, x=x[i : i + 4], y=y[i : i + 4])
    want = one_device_run()
    np.testing.assert_allclose(state.params["w1"], want.params["w1"], atol=1e-5)


def test_sharded_init_never_holds_the_whole_model_on_one_device():
    def big():
        key = jax.random.key(0)
        params = {
            f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (1024, 256))
            for i in range(4)
        }
        return pztrain.TrainState.initial_state(params, optax.adam(1e-3), key)

    m = mesh()
    abstract = jax.eval_shape(big)
    shardings = state_shardings(abstract, m, ShardingRules(fsdp="data"))
    memory = jax.jit(big, out_shardings=shardings).lower().compile().memory_analysis()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    one_param = 1024 * 256 * 4
    assert memory.output_size_in_bytes <= total // 8 + 1024
    assert memory.temp_size_in_bytes < one_param  # no whole param, let alone the model
    state = sharded_initial_state(big, m, ShardingRules(fsdp="data"))
    for x in jax.tree.leaves(state.params):
        assert {s.data.shape for s in x.addressable_shards} == {(128, 256)}


def test_penzai_named_axes_pick_the_dimension():
    from penzai import pz

    def make():
        model = pz.nn.Linear.from_config(
            name="lin",
            init_base_rng=jax.random.key(0),
            input_axes={"features": 8},
            output_axes={"features_out": 16},
        )
        return pztrain.TrainState.initial_state(
            model, optax.sgd(0.1), jax.random.key(1)
        )

    state = sharded_initial_state(
        make, mesh(), ShardingRules(axes={"features_out": "data"})
    )
    assert state.params["lin.weights"].sharding.spec == P(None, "data")


def test_dimensions_that_do_not_divide_stay_replicated():
    rules = ShardingRules(patterns=[("b1", P("data")), ("w2", P(None, "data"))])
    state = sharded_initial_state(make_state, mesh(), rules)
    assert state.params["b1"].sharding.spec == P("data")  # 32 divides by 8
    assert state.params["w2"].sharding.spec == P()  # 4 does not


def test_shard_state_copies_and_reshards():
    state = make_state()
    sharded = shard_state(state, mesh(), ShardingRules(fsdp="data"))
    step = pztrain.build_train_step(loss_fn, mesh=mesh())
    x, y = batches(1)
    step(sharded, x=x[0], y=y[0])  # donates the sharded copy only
    assert float(state.params["w1"][0, 0]) == float(make_state().params["w1"][0, 0])
    other = mesh((4, 2), ("data", "model"))
    moved = shard_state(sharded_initial_state(make_state, mesh()), other)
    assert moved.params["w1"].sharding == NamedSharding(other, P())


def test_a_state_off_the_mesh_is_refused_by_name():
    state = jax.device_put(make_state(), jax.devices()[0])
    step = pztrain.build_train_step(loss_fn, mesh=mesh())
    x, y = batches(1)
    with pytest.raises(ValueError, match=r"state.*not on the step's mesh.*shard_state"):
        step(state, x=x[0], y=y[0])


def test_rules_that_do_not_fit_name_the_parameter():
    with pytest.raises(ShardingError, match=r"'w1' has 2 dimensions.*gives 3"):
        state_shardings(
            make_state(),
            mesh(),
            ShardingRules(patterns=[("w1", P(None, None, "data"))]),
        )
    with pytest.raises(ShardingError, match=r"'b1'.*mesh axis 'model'.*\['data'\]"):
        state_shardings(
            make_state(), mesh(), ShardingRules(patterns=[("b1", P("model"))])
        )
    with pytest.raises(ShardingError, match=r"patterns\[0\]"):
        ShardingRules(patterns=["w1"])
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        pztrain.build_train_step(loss_fn, mesh="data")


def test_an_equinox_model_holding_functions_trains_on_a_mesh():
    """eqx.nn.MLP holds its activation (a function) as a pytree leaf, and
    eqx.nn.BatchNorm its flags (a Python bool) and axis name: shard_state and
    sharded_initial_state keep such leaves as they are (a combination-matrix
    row: shard_state raised 'not a valid JAX type')."""
    import equinox as eqx

    class Net(eqx.Module):
        mlp: eqx.nn.MLP
        halve: bool  # a Python flag the forward pass branches on

        def __call__(self, x):
            return self.mlp(x) / 2 if self.halve else self.mlp(x)

    def make():
        model = Net(eqx.nn.MLP(16, 4, 8, 1, key=jax.random.key(0)), True)
        return pztrain.TrainState.initial_state(
            model, optax.adam(0.01), jax.random.key(1)
        )

    def eqx_loss(*, model, state, rng, x, y):
        loss = jnp.mean((jax.vmap(model)(x) - y) ** 2)
        return loss, state, {"loss": loss}

    m = mesh()
    step = pztrain.build_train_step(eqx_loss, mesh=m)
    alone = pztrain.build_train_step(eqx_loss)
    x, y = batches(1, 32)
    for state in (shard_state(make(), m), sharded_initial_state(make, m)):
        state, _ = step(state, x=x[0], y=y[0])
        want, _ = alone(make(), x=x[0], y=y[0])
        for name, value in want.params.items():
            np.testing.assert_allclose(state.params[name], value, atol=1e-6)
        assert state.params["mlp/layers/0/weight"].sharding.mesh == m
