"""Mixed precision (`pztrain.precision`) and gradient accumulation with optax.

Tolerances, measured on this machine (CPU, jax 0.10.2) and given margin:
- f32 params with bfloat16 compute against an all-f32 run, MLP regression, 100
  Adam steps (the loss falls from 1.34 to 4e-4): the largest gap between the
  two runs' losses is 0.10% of the initial loss (the test allows 0.5%); while
  the f32 loss is above 1% of its initial value (65 steps), the largest
  relative gap is 1.8% (the test allows 6%). Below that, bfloat16's 8-bit
  mantissa shows: the final losses differ by 13%.
- a static loss scale of 2**10 under bfloat16 compute: the loss trajectory is
  bit-identical to the unscaled one (scaling by a power of two is exact); the
  test allows 1e-6.
- `optax.MultiSteps` over 4 micro-batches against one step on the whole batch:
  params differ by < 1e-6; the test allows 1e-5.
"""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import XOR_X, XOR_Y, penzai_v2_mlp, xor_loss
from penzai import pz

from pztrain.precision import Policy, mixed_precision
from pztrain.state import TrainState
from pztrain.step import build_train_step

MIXED = Policy(jnp.float32, jnp.bfloat16, jnp.float32)


def _mlp(seed: int = 0, sizes=(8, 32, 32, 1)):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return {
        f"dense{i}": {
            "kernel": jax.random.normal(k, (m, n)) / np.sqrt(m),
            "bias": jnp.zeros(n),
        }
        for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def _regression_data(n: int = 64, seed: int = 1):
    x = jax.random.normal(jax.random.key(seed), (n, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True)) + 0.5 * x[:, :1]
    return {"x": x, "y": y}


def _mse(*, model, state, rng, x, y):
    del rng
    h = x
    for i in range(len(model)):
        layer = model[f"dense{i}"]
        h = h @ layer["kernel"] + layer["bias"][None]
        if i < len(model) - 1:
            h = jnp.tanh(h)
    loss = jnp.mean((h - y) ** 2)
    return loss, state, {"loss": loss}


def _losses(loss_fn, model, steps: int, batch, tx=None):
    state = TrainState.initial_state(model, tx or optax.adam(1e-2), jax.random.key(0))
    step = build_train_step(loss_fn)
    losses = []
    for _ in range(steps):
        state, aux = step(state, **batch)
        losses.append(aux["loss"])
    return np.array(jnp.stack(losses)), state


def _recording(tx, seen: list):
    """``tx`` preceded by a no-op that records the grads' dtypes while tracing."""

    def record(updates, params):
        del params
        seen.extend(g.dtype for g in jax.tree.leaves(updates))
        return updates

    return optax.chain(optax.stateless(record), tx)


@pytest.mark.slow  # 50 steps in bfloat16
def test_bf16_params_train():
    policy = Policy.parse("params=bf16,compute=bf16,output=f32")
    model = policy.cast_to_param(penzai_v2_mlp(hidden=16))
    state = TrainState.initial_state(model, optax.adam(0.05), jax.random.key(0))
    assert len(state.params) == 4
    assert {v.dtype for v in state.params.values()} == {jnp.dtype(jnp.bfloat16)}
    step = build_train_step(mixed_precision(xor_loss, policy))
    losses = []
    for _ in range(50):
        state, aux = step(state, x=XOR_X, y=XOR_Y)
        losses.append(float(aux["loss"]))
    assert aux["loss"].dtype == jnp.float32
    assert losses[0] > 0.6 and losses[-1] < 0.2 * losses[0]
    assert {v.dtype for v in state.params.values()} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.slow  # two 100-step runs, one in bfloat16
def test_mixed_precision_tracks_f32_and_optimizer_gets_f32_grads():
    batch = _regression_data()
    seen: list = []
    seen_compute: list = []

    def watched(*, model, state, rng, x, y):
        seen_compute.extend(v.dtype for v in jax.tree.leaves((model, x, y)))
        return _mse(model=model, state=state, rng=rng, x=x, y=y)

    f32, _ = _losses(_mse, _mlp(), 100, batch)
    mixed, state = _losses(
        mixed_precision(watched, MIXED),
        _mlp(),
        100,
        batch,
        tx=_recording(optax.adam(1e-2), seen),
    )
    assert f32[-1] < 0.1 * f32[0]  # the run learns something
    gap = np.abs(mixed - f32)
    assert 0 < gap.max() < 0.005 * f32[0], gap.max()  # > 0: bfloat16 really ran
    above = f32 > 0.01 * f32[0]
    assert np.max(gap[above] / f32[above]) < 0.06
    assert set(seen_compute) == {jnp.dtype(jnp.bfloat16)}
    assert seen and set(seen) == {jnp.dtype(jnp.float32)}
    assert {v.dtype for v in state.params.values()} == {jnp.dtype(jnp.float32)}


@pz.pytree_dataclass
class _RunningMean(pz.nn.Layer):
    """Keeps the running mean of its input in a float32 state variable."""

    mean: pz.StateVariable
    calls: pz.StateVariable

    def __call__(self, x, **side_inputs):
        del side_inputs
        batch_mean = jnp.mean(x.untag("batch", "features").unwrap(), axis=0)
        self.mean.value = 0.5 * self.mean.value + 0.5 * batch_mean
        self.calls.value = self.calls.value + 1
        return x


def _stateful_penzai_model():
    return pz.nn.Sequential(
        [
            penzai_v2_mlp(hidden=16),
            _RunningMean(
                mean=pz.StateVariable(jnp.zeros(2), label="rm/mean"),
                calls=pz.StateVariable(jnp.zeros((), jnp.int32), label="rm/calls"),
            ),
        ]
    )


@pytest.mark.slow  # a compiled step per family
@pytest.mark.parametrize("family", ["penzai_v2", "equinox"])
def test_policy_runs_penzai_and_equinox_models(family):
    if family == "penzai_v2":
        model = _stateful_penzai_model()
    else:
        model = eqx.nn.MLP(2, 2, 16, 1, key=jax.random.key(0))
    seen: list = []

    def loss_fn(*, model, state, rng, x, y):
        floats = [v for v in jax.tree.leaves(model) if hasattr(v, "dtype")]
        seen.extend(v.dtype for v in floats if jnp.issubdtype(v.dtype, jnp.floating))
        return xor_loss(model=model, state=state, rng=rng, x=x, y=y)

    losses, state = _losses(
        mixed_precision(loss_fn, MIXED),
        model,
        60,
        {"x": XOR_X, "y": XOR_Y},
        tx=optax.adam(0.05),
    )
    assert set(seen) == {jnp.dtype(jnp.bfloat16)}
    assert losses[-1] < 0.3 * losses[0]
    assert {v.dtype for v in state.params.values()} == {jnp.dtype(jnp.float32)}
    if family == "penzai_v2":  # state variables updated, in their own dtype
        rm = state.model.sublayers[1]
        assert int(rm.calls.value) == 60
        assert rm.mean.value.dtype == jnp.float32
        assert float(jnp.abs(rm.mean.value).sum()) > 0


@pytest.mark.slow  # a second or more (compiles, imports)
def test_cast_to_param_keeps_penzai_sharing_and_leaves_ints_and_keys():
    shared = pz.Parameter(value=jnp.ones(2), label="w")
    tree = {
        "a": shared,
        "b": [shared, jnp.zeros(1), jnp.arange(3)],
        "key": jax.random.key(0),
        "name": "relu",
        "z": jnp.ones(2, jnp.complex64),
    }
    out = Policy.parse("p=bf16,c=bf16").cast_to_param(tree)
    assert out["a"] is out["b"][0] and out["a"].value.dtype == jnp.bfloat16
    assert out["b"][1].dtype == jnp.bfloat16 and out["b"][2].dtype == jnp.int32
    assert out["key"] is tree["key"] and out["name"] == "relu"
    assert out["z"].dtype == jnp.complex64
    assert shared.value.dtype == jnp.float32  # the input is untouched
    module = Policy.parse("p=bf16,c=bf16").cast_to_param(
        eqx.nn.Linear(2, 3, key=jax.random.key(0))
    )
    assert module.weight.dtype == module.bias.dtype == jnp.bfloat16


@pytest.mark.slow  # two 30-step runs
def test_static_loss_scale_gives_the_unscaled_trajectory():
    batch = _regression_data()
    plain, _ = _losses(mixed_precision(_mse, MIXED), _mlp(), 30, batch)
    scaled, state = _losses(
        mixed_precision(_mse, MIXED, loss_scale=2**10), _mlp(), 30, batch
    )
    np.testing.assert_allclose(scaled, plain, rtol=1e-6)


def test_loss_scale_keeps_float16_gradients_from_underflowing():
    def tiny_loss(*, model, state, rng, x):
        del rng
        loss = 1e-5 * jnp.mean(x @ model["w"])  # cotangents ~1e-8 per element
        return loss, state, {}

    policy = Policy.parse("params=f32,compute=f16,output=f32")
    x = jnp.ones((1000, 4))
    grads = {}
    for scale in (None, 2**12):
        state = TrainState.initial_state(
            {"w": jnp.ones((4, 1))}, optax.sgd(1.0), jax.random.key(0)
        )
        step = build_train_step(mixed_precision(tiny_loss, policy, loss_scale=scale))
        grads[scale] = step.compute_grads(state, x=x).grads["w"]
    assert float(jnp.abs(grads[None]).max()) == 0.0  # underflowed in float16
    np.testing.assert_allclose(grads[2**12], 1e-5, rtol=1e-2)
    assert grads[2**12].dtype == jnp.float32


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Policy.parse("params=float32,compute=bfloat61"),
            "compute_dtype='bfloat61' is not a dtype",
        ),
        (
            lambda: Policy(jnp.float32, jnp.int8, jnp.float32),
            "compute_dtype must be a floating-point dtype; got int8",
        ),
        (
            lambda: Policy.parse("params=f32,compute=bf16,outptu=f32"),
            "Cannot read 'outptu=f32'",
        ),
        (lambda: Policy.parse("compute=bf16"), "has no param_dtype"),
        (
            lambda: Policy.parse("params=f64,compute=f32"),
            "param_dtype=float64 needs 64-bit JAX",
        ),
        (
            lambda: mixed_precision(xor_loss, MIXED, loss_scale=0),
            "loss_scale must be a finite number > 0; got 0",
        ),
        (
            lambda: mixed_precision(xor_loss, "f32"),
            "Cannot read 'f32' in the policy 'f32'",
        ),
    ],
)
def test_errors_name_the_bad_value(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_policy_is_a_frozen_value():
    policy = Policy.parse("params=float32,compute=bfloat16,output=float32")
    assert policy == Policy("f32", "bf16", "f32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = jnp.float32  # type: ignore[misc]


@pytest.mark.slow  # two optimizers, two batch shapes: compiles
def test_multisteps_over_micro_batches_equals_one_big_batch():
    """optax.MultiSteps(k=4) on 4 quarter batches == one step on the batch."""
    batch = _regression_data(n=64)
    big = TrainState.initial_state(_mlp(), optax.adam(1e-2), jax.random.key(0))
    micro = TrainState.initial_state(
        _mlp(),
        optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4),
        jax.random.key(0),
    )
    start = {n: np.asarray(v) for n, v in big.params.items()}
    quarters = [
        {k: v[16 * i : 16 * (i + 1)] for k, v in batch.items()} for i in range(4)
    ]
    step = build_train_step(_mse)
    for _ in range(2):
        big, _ = step(big, **batch)
        for quarter in quarters:
            micro, _ = step(micro, **quarter)
    assert int(micro.step) == 8
    for name, value in big.params.items():
        np.testing.assert_allclose(micro.params[name], value, atol=1e-5, rtol=0)
        assert np.abs(value - start[name]).max() > 1e-3  # both runs moved


def test_type_errors_name_the_argument():
    with pytest.raises(TypeError, match=re.escape("policy must be a Policy or a")):
        mixed_precision(xor_loss, jnp.bfloat16)
    with pytest.raises(TypeError, match=re.escape("loss_scale must be a number")):
        mixed_precision(xor_loss, MIXED, loss_scale="1024")
