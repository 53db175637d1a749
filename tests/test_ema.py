"""EMA of the params (`pztrain.with_ema`): the update, its cost when off, resume,
evaluation on the EMA weights, checkpoints and exports of them, bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import XOR_X, XOR_Y, equinox_mlp, logits_of, penzai_v1_mlp, penzai_v2_mlp

import pztrain
from pztrain import (
    ArrayLoader,
    CheckpointMismatchError,
    Checkpoints,
    TrainState,
    build_eval_step,
    build_train_step,
    evaluate,
    fit,
    load_params,
    save_params,
    with_ema,
)
from pztrain.ema import EmaState, NoEmaError

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
ADAM = optax.adam(0.05)


def loss_fn(*, model, state, rng, x, y):
    err = x @ model["w"] + model["b"] - y
    return jnp.mean(err**2), state, {}


def eval_fn(*, model, state, rng, x, y):
    err = x @ model["w"] + model["b"] - y
    return {"mse": jnp.mean(err**2)}


STEP = build_train_step(loss_fn)
EVAL = build_eval_step(eval_fn)


def _model():
    return {"w": jnp.zeros(3), "b": jnp.zeros(())}


def _state(tx):
    return TrainState.initial_state(_model(), tx, jax.random.key(0))


def _data(batch_size=8):
    return ArrayLoader({"x": X, "y": Y}, batch_size=batch_size, shuffle=False)


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_equals_a_hand_written_one_over_50_steps(warmup):
    decay = 0.9
    state = _state(with_ema(ADAM, decay, warmup=warmup))
    plain = _state(ADAM)
    ema = {k: np.asarray(v) for k, v in plain.params.items()}
    for t in range(50):
        i = (t * 8) % 32
        batch = {"x": X[i : i + 8], "y": Y[i : i + 8]}
        state, _ = STEP(state, **batch)
        plain, _ = STEP(plain, **batch)
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        ema = {k: d * ema[k] + (1 - d) * np.asarray(plain.params[k]) for k in ema}
    for k in ema:
        np.testing.assert_array_equal(state.params[k], plain.params[k])
        np.testing.assert_allclose(state.ema_params[k], ema[k], rtol=0, atol=1e-6)
    assert int(state.opt_state.count) == 50


def test_ema_off_adds_nothing_and_on_costs_one_copy_of_the_params():
    batch = {"x": X[:8], "y": Y[:8]}
    off, on = _state(ADAM), _state(with_ema(ADAM, 0.99))
    assert jax.tree.structure(off.opt_state) == jax.tree.structure(ADAM.init(_model()))
    assert not any(
        isinstance(s, EmaState)
        for s in jax.tree.leaves(
            off.opt_state, is_leaf=lambda s: isinstance(s, EmaState)
        )
    )
    mem_off, mem_on = STEP.memory(off, **batch), STEP.memory(on, **batch)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(off.params))
    # the EMA (a copy of the params) and its int32 count, in and out (donated)
    assert mem_on.arguments - mem_off.arguments == params_bytes + 4
    assert mem_on.aliased - mem_off.aliased == params_bytes + 4


def test_the_ema_is_its_own_array_donated_with_the_state():
    state = _state(with_ema(ADAM, 0.9))
    assert state.ema_params["w"] is not state.params["w"]
    old = state
    state, _ = STEP(state, x=X[:8], y=Y[:8])
    assert old.opt_state.ema_params["w"].is_deleted()
    assert not state.ema_params["w"].is_deleted()


@pytest.mark.slow  # three runs
def test_resume_with_ema_is_exact(tmp_path):
    tx = with_ema(ADAM, 0.9, warmup=True)
    kw = dict(log_every=2, progress=False, loggers=[])
    whole, _ = fit(_state(tx), STEP, _data(), num_steps=8, **kw)
    with Checkpoints(tmp_path / "c", every_steps=2) as ckpts:
        fit(_state(tx), STEP, _data(), num_steps=4, checkpoints=ckpts, **kw)
    with Checkpoints(tmp_path / "c", every_steps=2) as ckpts:
        resumed, _ = fit(
            _state(tx), STEP, _data(), num_steps=8, checkpoints=ckpts, resume=True, **kw
        )
    for k in whole.params:
        np.testing.assert_array_equal(resumed.ema_params[k], whole.ema_params[k])
        np.testing.assert_array_equal(resumed.params[k], whole.params[k])


@pytest.mark.slow  # a run with evaluations and keep_best
def test_fit_evaluates_the_ema_too_and_keep_best_can_monitor_it(tmp_path):
    # a learning rate that makes the run diverge after step 6: the best is early
    lr = optax.piecewise_constant_schedule(0.05, {6: 60.0})  # lr 3.0
    tx = with_ema(optax.sgd(lr), 0.8)
    ckpts = Checkpoints(
        tmp_path / "c", keep_last=1, keep_best=1, monitor="eval/ema/mse"
    )
    state, history = fit(
        _state(tx),
        STEP,
        _data(),
        num_steps=12,
        eval_step=EVAL,
        eval_data=_data(16),
        eval_every=4,
        eval_ema=True,
        log_every=4,
        progress=False,
        loggers=[],
        checkpoints=ckpts,
    )
    evals = [r for r in history.records if r["split"] == "eval"]
    assert [sorted(r["metrics"]) for r in evals] == [["ema/mse", "mse"]] * 3
    last = evals[-1]["metrics"]
    assert last["mse"] == pytest.approx(evaluate(state, EVAL, _data(16))["mse"])
    on_ema = evaluate(state, EVAL, _data(16), ema=True)["mse"]
    assert last["ema/mse"] == pytest.approx(on_ema)
    assert last["ema/mse"] != pytest.approx(last["mse"])
    assert np.isfinite(last["ema/mse"])
    ema_step = build_eval_step(eval_fn, ema=True)
    assert evaluate(state, ema_step, _data(16))["mse"] == pytest.approx(on_ema)
    both = evaluate(state, EVAL, _data(16), ema="both")
    assert both == pytest.approx({"mse": last["mse"], "ema/mse": on_ema})
    best = min(evals, key=lambda r: r["metrics"]["ema/mse"])["step"]
    assert best != 12
    assert ckpts.best_step() == best
    assert ckpts.steps() == [best, 12]
    assert history.series("ema/mse", "eval")[0] == [4, 8, 12]


def test_ema_weights_saved_loaded_and_exported(tmp_path):
    state = _state(with_ema(ADAM, 0.9))
    for _ in range(5):
        state, _ = STEP(state, x=X[:8], y=Y[:8])
    want = {k: np.asarray(v) for k, v in state.ema_params.items()}
    pztrain.save_state(tmp_path / "full", state)
    got = load_params(tmp_path / "full", _model(), ema=True)
    raw = load_params(tmp_path / "full", _model())
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(raw[k], state.params[k])
    into_state = load_params(tmp_path / "full", _state(ADAM), ema=True)
    np.testing.assert_array_equal(into_state.params["w"], want["w"])
    save_params(tmp_path / "ema_only", state, ema=True)
    np.testing.assert_array_equal(
        load_params(tmp_path / "ema_only", _model())["w"], want["w"]
    )
    from safetensors.numpy import load_file

    pztrain.export_safetensors(tmp_path / "ema.safetensors", state, ema=True)
    np.testing.assert_array_equal(
        load_file(tmp_path / "ema.safetensors")["w"], want["w"]
    )


def test_loading_ema_weights_from_a_checkpoint_without_them_names_it(tmp_path):
    pztrain.save_state(tmp_path / "plain", _state(ADAM))
    save_params(tmp_path / "params", _model())
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(f"{tmp_path / 'plain'} holds no EMA weights (a state"),
    ):
        load_params(tmp_path / "plain", _model(), ema=True)
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape("holds no EMA weights (params only (save_params))"),
    ):
        load_params(tmp_path / "params", _model(), ema=True)


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1, True, "0.9", None])
def test_a_decay_outside_0_1_is_refused(decay):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "with_ema(decay=...) must be a number in (0, 1), e.g. 0.999; got "
            f"{decay!r}."
        ),
    ):
        with_ema(ADAM, decay)


def test_asking_a_state_without_ema_for_it_says_how():
    state = _state(ADAM)
    fix = "build its optimizer with pztrain.with_ema(optimizer, decay=0.999)"
    with pytest.raises(NoEmaError, match=re.escape(fix)):
        _ = state.ema_params
    with pytest.raises(NoEmaError, match=re.escape(fix)):
        evaluate(state, EVAL, _data(16), ema=True)
    with pytest.raises(NoEmaError, match=re.escape("fit(eval_ema=True) needs a state")):
        fit(
            state,
            STEP,
            _data(),
            num_steps=1,
            eval_step=EVAL,
            eval_data=_data(),
            eval_ema=True,
            progress=False,
            loggers=[],
        )
    with pytest.raises(ValueError, match=re.escape("eval_ema=True needs eval_step")):
        fit(
            _state(with_ema(ADAM, 0.9)),
            STEP,
            _data(),
            num_steps=1,
            eval_ema=True,
            progress=False,
            loggers=[],
        )
    with pytest.raises(
        ValueError, match=re.escape("ema must be False, True or 'both'")
    ):
        evaluate(_state(with_ema(ADAM, 0.9)), EVAL, _data(16), ema="yes")
    with pytest.raises(TypeError, match=re.escape("save_params(..., ema=True) takes")):
        save_params("/nonexistent", _model(), ema=True)


@pytest.mark.slow  # a compile per family (the EMA tests on a dict model stay fast)
@pytest.mark.parametrize("make", [penzai_v2_mlp, penzai_v1_mlp, equinox_mlp])
def test_ema_of_penzai_and_equinox_models(make):
    def xent(*, model, state, rng, x, y):
        logits = logits_of(model, x)
        return (
            optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
            state,
            {},
        )

    state = TrainState.initial_state(make(), with_ema(ADAM, 0.5), jax.random.key(0))
    first = {k: np.asarray(v) for k, v in state.params.items()}
    state, _ = build_train_step(xent)(state, x=XOR_X, y=XOR_Y)
    for name, value in state.ema_params.items():
        np.testing.assert_allclose(
            value, 0.5 * first[name] + 0.5 * np.asarray(state.params[name]), atol=1e-6
        )
    logits = logits_of(state.using_ema().model, XOR_X)
    assert logits.shape == (4, 2)


def test_summary_shows_the_ema_and_shardings_place_it_like_the_params():
    state = _state(with_ema(ADAM, 0.9))
    text = str(state.summary())
    assert re.search(
        r"  ema_params +2 +4 +16 B .*in opt_state \(with_ema\), 0 updates", text
    )
    mesh = jax.make_mesh((1,), ("data",))
    rules = pztrain.ShardingRules(patterns=[("w", jax.sharding.PartitionSpec("data"))])
    shardings = pztrain.state_shardings(state, mesh, rules)
    assert shardings.opt_state.ema_params == shardings.params


def test_injected_hyperparams_are_read_and_set_through_the_ema():
    tx = with_ema(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 0.9)
    state = _state(tx).with_hyperparams(learning_rate=0.5)
    assert float(state.hyperparams["learning_rate"]) == 0.5
    state, _ = STEP(state, x=X[:8], y=Y[:8])
    plain = _state(optax.sgd(0.5))
    plain, _ = STEP(plain, x=X[:8], y=Y[:8])
    np.testing.assert_array_equal(state.params["w"], plain.params["w"])


@pytest.mark.slow  # an NNX model's step: compiles
def test_an_nnx_models_ema_loads_with_its_batch_statistics(tmp_path):
    import nnx_models

    tx = with_ema(optax.adam(0.01), 0.5)
    state = TrainState.initial_state(nnx_models.mlp(), tx, jax.random.key(0))
    step = build_train_step(nnx_models.loss_fn)
    for seed in range(3):
        state, _ = step(state, **nnx_models.batch(seed))
    pztrain.save_state(tmp_path / "c", state)
    loaded = load_params(tmp_path / "c", nnx_models.mlp(seed=7), ema=True)
    params, _ = pztrain.partition.split(loaded)
    assert sorted(params) == sorted(state.params)
    for name, value in params.items():
        np.testing.assert_array_equal(value, state.ema_params[name])
    np.testing.assert_array_equal(loaded.bn.mean[...], state.model.bn.mean[...])
    assert not np.allclose(loaded.bn.mean[...], 0.0)


def test_a_flax_style_states_nested_ema_loads_into_a_params_tree(tmp_path):
    params = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    state = TrainState.create(
        apply_fn=lambda v, x: x @ v["params"]["dense"]["kernel"],
        params=params,
        tx=with_ema(optax.sgd(0.5), 0.5),
    )
    grads = jax.tree.map(jnp.ones_like, params)
    state = state.apply_gradients(grads=grads)  # params 0.5 and -0.5, EMA halfway
    pztrain.save_state(tmp_path / "c", state)
    like = jax.tree.map(jnp.zeros_like, params)
    got = load_params(tmp_path / "c", like, ema=True)
    np.testing.assert_array_equal(got["dense"]["kernel"], np.full((2, 3), 0.75))
    np.testing.assert_array_equal(got["dense"]["bias"], np.full(3, -0.25))
