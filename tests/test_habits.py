"""Habits users bring from Flax, Lightning / Keras and penzai (issue 13)."""

from __future__ import annotations

import re

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import penzai_v1_mlp, penzai_v2_mlp, xor_loss
from penzai.deprecated.v1.toolshed import basic_training as pz1_training

from pztrain.checkpoint import Checkpoints, load_from_checkpoint, save_params
from pztrain.data import ArrayLoader
from pztrain.loop import fit
from pztrain.partition import param_values
from pztrain.state import TrainState
from pztrain.step import build_eval_step, build_train_step

_rng = np.random.default_rng(0)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        return nn.Dense(1)(x)[..., 0]


NET = BNNet()
VARIABLES = NET.init(jax.random.key(0), X[:2], train=False)


def bn_loss(*, model, state, rng, x, y):
    """The recipe: Flax's batch_stats as the loss-function state."""
    variables = {"params": model.params, "batch_stats": state}
    pred, updates = model.apply_fn(variables, x, train=True, mutable=["batch_stats"])
    loss = jnp.mean((pred - y) ** 2)
    return loss, updates["batch_stats"], {"loss": loss}


def bn_eval(*, model, state, rng, x, y):
    pred = model.apply_fn({"params": model.params, "batch_stats": state}, x, False)
    return {"mse": jnp.mean((pred - y) ** 2)}


def flax_state(cls=TrainState, **extra):
    return cls.create(
        apply_fn=NET.apply, params=VARIABLES["params"], tx=optax.adam(0.05), **extra
    )


def lin_loss(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


def lin_eval(*, model, state, rng, x, y):
    return {"mse": jnp.mean((x @ model["w"] - y) ** 2)}


LIN_STEP, LIN_EVAL = build_train_step(lin_loss), build_eval_step(lin_eval)


def lin_state():
    return TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.key(0)
    )


def lin_fit(state, **kw):
    data = ArrayLoader({"x": X, "y": Y}, batch_size=4, seed=0)
    return fit(state, LIN_STEP, data, progress=False, log_every=4, **kw)


# ---------------------------------------------------------------- Flax


@pytest.mark.slow  # a run with evaluations: compiles
def test_batch_stats_through_the_loss_function_state():
    state = flax_state(loss_fn_state=VARIABLES["batch_stats"])
    data = ArrayLoader({"x": X, "y": Y}, batch_size=8, seed=0)
    state, history = fit(
        state, build_train_step(bn_loss), data, num_steps=20, log_every=10,
        eval_step=build_eval_step(bn_eval), eval_data=[{"x": X, "y": Y}],
        progress=False,
    )  # fmt: skip
    mean = state.loss_fn_state["BatchNorm_0"]["mean"]
    assert np.allclose(mean, X.mean(0), atol=0.3)  # running stats were updated
    assert not np.allclose(mean, 0.0)
    losses = history.series("loss")[1]
    assert losses[-1] < losses[0]
    variables = {"params": state.params, "batch_stats": state.loss_fn_state}
    want = jnp.mean((NET.apply(variables, X, False) - Y) ** 2)  # running stats
    assert np.isclose(history.series("mse", split="eval")[1][-1], want, rtol=1e-5)


def test_batch_stats_as_a_subclass_field_in_a_flax_style_step():
    class BNState(TrainState):
        batch_stats: dict

    state = flax_state(BNState, batch_stats=VARIABLES["batch_stats"])

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            pred, upd = state.apply_fn(variables, x, True, mutable=["batch_stats"])
            return jnp.mean((pred - y) ** 2), upd

        grads, upd = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])

    new = train_step(state, X, Y)
    assert type(new) is BNState and int(new.step) == 1
    assert np.allclose(new.batch_stats["BatchNorm_0"]["mean"], 0.5 * X.mean(0))


def test_replace_apply_fn_and_tx_as_in_flax():
    state = flax_state()
    doubled = state.replace(apply_fn=lambda v, x, train: 2 * NET.apply(v, x, train))
    variables = {"params": state.params, **VARIABLES}
    want = 2 * NET.apply(variables, X, False)
    got = doubled.apply_fn({**variables, "params": doubled.params}, X, False)
    assert np.allclose(got, want)
    assert doubled.params is state.params and state.apply_fn == NET.apply
    sgd = optax.sgd(1.0)
    assert (
        state.replace(tx=sgd).tx is sgd and state.replace(tx=sgd).optimizer_def is sgd
    )
    with pytest.raises(TypeError, match=re.escape("replace(apply_fn=...) needs")):
        lin_state().replace(apply_fn=NET.apply)
    with pytest.raises(TypeError, match=re.escape("both tx= and optimizer_def=")):
        state.replace(tx=sgd, optimizer_def=sgd)


def test_fp8_overwrite_with_gradient_collection_is_refused():
    params = {"params": VARIABLES["params"], "_overwrite_with_gradient": {"s": 1.0}}
    msg = "in Flax's fp8 '_overwrite_with_gradient' collection"
    with pytest.raises(ValueError, match=re.escape(msg)):
        TrainState.create(apply_fn=NET.apply, params=params, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=re.escape("'_overwrite_with_gradient/s'")):
        TrainState.initial_state(
            {"_overwrite_with_gradient": {"s": jnp.ones(2)}},
            optax.sgd(0.1),
            jax.random.key(0),
        )


def test_flax_serialization_state_dict_and_bytes_round_trip():
    state = flax_state(loss_fn_state=VARIABLES["batch_stats"])
    sd = flax.serialization.to_state_dict(state)
    assert set(sd) == {"step", "root_rng", "params", "opt_state", "loss_fn_state"}
    assert set(sd["params"]) == {"Dense_0", "BatchNorm_0"}
    step = build_train_step(bn_loss, donate=False)
    trained, _ = step(state, x=X, y=Y)
    data = flax.serialization.to_bytes(trained)
    back = flax.serialization.from_bytes(state, data)
    assert type(back) is TrainState and int(back.step) == 1
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(trained), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- Lightning / Keras


def test_fit_again_with_the_same_total_says_nothing_is_left():
    state, _ = lin_fit(lin_state(), num_epochs=2)
    assert int(state.step) == 8
    msg = "nothing to do: state.step=8 already reached num_epochs=2"
    with pytest.warns(UserWarning, match=re.escape(msg)) as caught:
        again, history = lin_fit(state, num_epochs=2)
    assert "to train 2 more epochs, pass num_epochs=4" in str(caught[0].message)
    assert int(again.step) == 8 and history.stop_reason.startswith(msg)
    with pytest.warns(UserWarning, match=re.escape("pass num_steps=16")):
        _, history = lin_fit(state, num_steps=8)
    assert "already reached num_steps=8" in history.stop_reason
    more, history = lin_fit(state, num_epochs=3)  # a larger total trains on
    assert int(more.step) == 12 and history.stop_reason is None


def test_num_epochs_with_a_generator_is_an_error_not_a_hang():
    def endless():
        while True:
            yield {"x": X[:4], "y": Y[:4]}

    msg = "num_epochs=1 with train_data a one-shot generator that has no length"
    with pytest.raises(ValueError, match=re.escape(msg)):
        fit(lin_state(), LIN_STEP, endless(), num_epochs=1, progress=False)
    state, history = fit(lin_state(), LIN_STEP, endless(), num_steps=3, progress=False)
    assert int(state.step) == 3  # num_steps works, as the message says


def test_eval_every_epochs():
    kw = {"eval_step": LIN_EVAL, "eval_data": [{"x": X, "y": Y}]}
    _, history = lin_fit(lin_state(), num_epochs=5, eval_every_epochs=2, **kw)
    assert history.series("mse", split="eval")[0] == [8, 16, 20]  # epochs 2, 4, end
    with pytest.raises(ValueError, match=re.escape("eval_every_epochs must be an int")):
        lin_fit(lin_state(), num_epochs=1, eval_every_epochs=0, **kw)
    with pytest.raises(ValueError, match=re.escape("not both")):
        lin_fit(lin_state(), num_epochs=1, eval_every_epochs=1, eval_every=4, **kw)
    with pytest.raises(ValueError, match=re.escape("needs eval_step and eval_data")):
        lin_fit(lin_state(), num_epochs=1, eval_every_epochs=1)


def build_mlp(hidden, seed=0):
    return penzai_v2_mlp(seed=seed, hidden=hidden)


@pytest.mark.slow  # a run with a checkpoint, then two rebuilds
def test_load_from_checkpoint_rebuilds_from_stored_hparams(tmp_path):
    state = TrainState.initial_state(build_mlp(8), optax.adam(0.05), jax.random.key(1))
    data = ArrayLoader({"x": X[:, :2], "y": (Y > 0).astype(np.int32)}, batch_size=4)
    state, _ = fit(
        state, build_train_step(xor_loss), data, num_steps=4, progress=False,
        hparams={"hidden": 8}, checkpoints=Checkpoints(tmp_path / "ck", every_steps=4),
    )  # fmt: skip
    model = load_from_checkpoint(tmp_path / "ck", build_mlp, seed=5)
    got = TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0)).params
    for name, value in state.params.items():
        np.testing.assert_array_equal(got[name], value)
    # A build_fn returning a TrainState; hparams from save_params' metadata.
    save_params(tmp_path / "p", state, metadata={"hparams": {"hidden": 8}})
    again = load_from_checkpoint(
        tmp_path / "p",
        lambda hidden: TrainState.initial_state(
            build_mlp(hidden), optax.sgd(0.1), jax.random.key(0)
        ),
    )
    assert isinstance(again, TrainState)
    np.testing.assert_array_equal(again.params[name], value)
    msg = "cannot take the checkpoint's hyperparameters"
    with pytest.raises(TypeError, match=re.escape(msg)) as e:
        load_from_checkpoint(tmp_path / "p", lambda width: None)
    assert "Stored: ['hidden']" in str(e.value)


# ---------------------------------------------------------------- penzai


def test_penzai_v1_params_as_penzai_returns_them():
    model = penzai_v1_mlp()
    ours = TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
    theirs = pz1_training.TrainState.initial_state(
        model, optax.sgd(0.1), jax.random.key(0)
    )
    values = param_values(ours)
    assert set(values) == set(theirs.params)
    for name, value in theirs.params.items():
        assert type(values[name]) is type(value)
        assert jax.tree.structure(values[name]) == jax.tree.structure(value)
        axes = tuple(value.named_axes)
        np.testing.assert_array_equal(values[name].unwrap(*axes), value.unwrap(*axes))
    assert all(isinstance(v, jax.Array) for v in ours.params.values())
    v2 = TrainState.initial_state(penzai_v2_mlp(), optax.sgd(0.1), jax.random.key(0))
    assert set(param_values(v2)) == set(v2.params)
    assert set(param_values(lin_state())) == {"w"}
