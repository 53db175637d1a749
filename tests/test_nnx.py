"""Flax NNX models: nnx.Param trained, other variables carried, modes, rng, errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from nnx_models import MLP, batch, by_name, hand_loop, loss_fn, mlp, stream_key
from penzai import pz

import pztrain
from pztrain.partition import (
    NnxModel,
    PartitionError,
    family_of,
    model_state,
    reseed_streams,
    with_model_state,
)

ROOT = Path(__file__).resolve().parents[1]


def _state(model=None, tx=None, **kwargs):
    model = mlp() if model is None else model
    tx = optax.adam(1e-2) if tx is None else tx
    return pztrain.TrainState.initial_state(model, tx, jax.random.key(0), **kwargs)


def _keyless(tree):
    """Arrays of ``tree`` as NumPy, keys as their key data (for comparisons)."""

    def plain(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(plain, tree)


def _assert_bitwise(a, b):
    la, lb = jax.tree.leaves(_keyless(a)), jax.tree.leaves(_keyless(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------
# the split


def test_only_nnx_params_are_trained_and_named_without_value():
    state = _state()
    assert family_of(mlp()) == "nnx"
    assert sorted(state.params) == [
        "bn/bias",
        "bn/scale",
        "l1/bias",
        "l1/kernel",
        "l2/bias",
        "l2/kernel",
    ]
    rest = state.model_without_params
    assert isinstance(rest, NnxModel)
    assert sorted(model_state(rest)) == [
        "bn/mean",
        "bn/var",
        "drop/rngs/count",
        "drop/rngs/key",
    ]
    # the optimizer state covers the params only: adam's mu has 6 arrays
    assert len(jax.tree.leaves(state.opt_state[0].mu)) == 6
    names = [pztrain.summary.summarize(state).rows[i].name for i in range(10)]
    assert not any(n.endswith("value") for n in names)


def test_state_model_is_an_nnx_module_with_current_params_and_state():
    state = _state()
    step = pztrain.build_train_step(loss_fn)
    for _ in range(3):
        state, _ = step(state, **batch())
    model = state.model
    assert isinstance(model, MLP)
    np.testing.assert_array_equal(model.l1.kernel[...], state.params["l1/kernel"])
    own = model_state(state.model_without_params)
    np.testing.assert_array_equal(model.bn.mean[...], own["bn/mean"])
    assert float(jnp.abs(model.bn.mean[...]).sum()) > 0  # updated by the steps


# ----------------------------------------------------------------------------
# the step against Flax's functional pattern by hand


@pytest.mark.slow  # 20 steps, compiled, and a hand-written loop, op by op
def test_twenty_steps_equal_a_hand_written_functional_nnx_loop():
    batches = [batch(seed) for seed in range(20)]
    tx = optax.adam(1e-2)
    graphdef, params, rest = hand_loop(mlp(), tx, jax.random.key(0), batches)
    state = _state(tx=tx)
    step = pztrain.build_train_step(loss_fn)
    for b in batches:
        state, _ = step(state, **b)
    hand_params, hand_rest = by_name(params), by_name(rest)
    assert sorted(hand_params) == sorted(state.params)
    for name, value in hand_params.items():
        np.testing.assert_allclose(state.params[name], value, atol=1e-5, err_msg=name)
    own = model_state(state.model_without_params)
    for name in ("bn/mean", "bn/var"):
        np.testing.assert_allclose(own[name], hand_rest[name], atol=1e-5)
        assert np.abs(hand_rest[name] - (name == "bn/var")).max() > 1e-3
    # eval mode: the same as merging by hand and calling .eval()
    by_hand = nnx.merge(graphdef, params, rest)
    by_hand.eval()
    x = batch(99)["x"]
    eval_step = pztrain.build_eval_step(
        lambda *, model, state, rng, x: {"out": model(x)}
    )
    np.testing.assert_allclose(eval_step(state, x=x)["out"], by_hand(x), atol=1e-5)


def _mask_state():
    class Masks(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones(64))
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    return _state(Masks(nnx.Rngs(dropout=3)), optax.sgd(0.0))


def _mask_loss(*, model, state, rng, x):
    out = model.drop(model.w[...] * x)
    return jnp.mean(out), state, {"mask": out != 0}


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_dropout_masks_change_per_step_and_repeat_for_the_same_step():
    step = pztrain.build_train_step(_mask_loss, donate=False)
    state = _mask_state()
    masks = []
    for _ in range(3):
        state, aux = step(state, x=jnp.ones(64))
        masks.append(np.asarray(aux["mask"]))
    assert not (masks[0] == masks[1]).all() and not (masks[1] == masks[2]).all()
    # the same step from the same state: the same mask
    again = _mask_state()
    again, aux = step(again, x=jnp.ones(64))
    np.testing.assert_array_equal(aux["mask"], masks[0])
    # whatever the rng state the model carries: the step key decides
    rest = state.model_without_params
    other = with_model_state(
        rest, {"drop/rngs/key": jax.random.key(77), "drop/rngs/count": jnp.uint32(9)}
    )
    _, a = step(state, x=jnp.ones(64))
    _, b = step(state.replace(model_without_params=other), x=jnp.ones(64))
    np.testing.assert_array_equal(a["mask"], b["mask"])


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_streams_are_reseeded_from_the_documented_step_key():
    step = pztrain.build_train_step(_mask_loss, donate=False)
    state = _mask_state()
    _, aux = step(state, x=jnp.ones(64))
    by_hand = state.model
    nnx.reseed(
        by_hand, dropout=stream_key(jax.random.fold_in(jax.random.key(0), 0), "dropout")
    )
    np.testing.assert_array_equal(by_hand.drop(jnp.ones(64)) != 0, aux["mask"])
    # reseed_streams is that derivation, for every tag the module holds
    module = state.model
    reseed_streams(module, jax.random.fold_in(jax.random.key(0), 0))
    np.testing.assert_array_equal(module.drop(jnp.ones(64)) != 0, aux["mask"])


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_several_streams_of_one_tag_draw_different_masks():
    class Two(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones(64))
            self.a = nnx.Dropout(0.5, rngs=rngs)
            self.b = nnx.Dropout(0.5, rngs=rngs)

    def loss(*, model, state, rng, x):
        a, b = model.a(x * model.w[...]), model.b(x * model.w[...])
        return jnp.mean(a + b), state, {"a": a != 0, "b": b != 0}

    state = _state(Two(nnx.Rngs(dropout=0)), optax.sgd(0.0))
    _, aux = pztrain.build_train_step(loss)(state, x=jnp.ones(64))
    assert not (np.asarray(aux["a"]) == np.asarray(aux["b"])).all()


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_the_step_compiles_once_with_state_updates():
    traces = []

    def counting(**kwargs):
        traces.append(1)
        return loss_fn(**kwargs)

    state = _state()
    step = pztrain.build_train_step(counting)
    for seed in range(4):
        state, _ = step(state, **batch(seed))
    assert len(traces) == 1


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_micro_batches_update_batch_statistics_in_order():
    class BN(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.l1(x))

    def loss(*, model, state, rng, x, y):
        return jnp.mean(model(x) ** 2), state, {}

    state = _state(BN(nnx.Rngs(0)), optax.sgd(0.0))
    by_hand = state.model
    x = batch()["x"]
    step = pztrain.build_train_step(loss, microbatches=2, donate=False)
    state, _ = step(state, x=x, y=x)
    by_hand.train()
    by_hand(x[0::2]), by_hand(x[1::2])  # micro-batch i: examples i, i + 2, …
    own = model_state(state.model_without_params)
    np.testing.assert_allclose(own["bn/mean"], by_hand.bn.mean[...], atol=1e-6)
    np.testing.assert_allclose(own["bn/var"], by_hand.bn.var[...], atol=1e-6)


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_fused_steps_equal_single_steps():
    b = batch()
    single = _state()
    step = pztrain.build_train_step(loss_fn)
    for _ in range(2):
        single, _ = step(single, **b)
    fused, _ = pztrain.build_train_step(loss_fn, steps_per_call=2)(
        _state(), **jax.tree.map(lambda a: jnp.stack([a, a]), b)
    )
    for name in single.params:
        np.testing.assert_allclose(fused.params[name], single.params[name], atol=1e-6)
    _assert_bitwise(
        model_state(fused.model_without_params)["drop/rngs/key"],
        model_state(single.model_without_params)["drop/rngs/key"],
    )


# ----------------------------------------------------------------------------
# modes


def _eval_out(*, model, state, rng, x):
    return {"out": model(x)}


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_eval_runs_in_eval_mode_and_keeps_no_state_updates():
    state = _state()
    state, _ = pztrain.build_train_step(loss_fn)(state, **batch())
    before = model_state(state.model_without_params)
    eval_step = pztrain.build_eval_step(_eval_out)
    x = batch(5)["x"]
    a = eval_step(state, x=x)["out"]
    b = eval_step(state.replace(step=state.step + 1), x=x)["out"]  # another key
    np.testing.assert_array_equal(a, b)  # no dropout
    metrics = pztrain.evaluate(
        state,
        pztrain.build_eval_step(lambda **kw: {"m": jnp.mean(_eval_out(**kw)["out"])}),
        [{"x": x}],
    )
    assert np.isfinite(metrics["m"])
    _assert_bitwise(model_state(state.model_without_params), before)
    # in train mode an eval step sees dropout (Monte Carlo dropout)
    mc = pztrain.build_eval_step(_eval_out, mode="train")
    assert not np.allclose(mc(state, x=x)["out"], a)


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_mode_none_leaves_a_model_that_manages_its_modes_as_built():
    model = mlp()
    model.eval()  # built for inference: running averages, no dropout
    state = _state(model)
    before = model_state(state.model_without_params)
    step = pztrain.build_train_step(loss_fn, mode=None)
    state, _ = step(state, **batch())
    after = model_state(state.model_without_params)
    np.testing.assert_array_equal(after["bn/mean"], before["bn/mean"])
    # the default (train mode) updates the statistics
    trained, _ = pztrain.build_train_step(loss_fn)(_state(model), **batch())
    assert not np.array_equal(
        model_state(trained.model_without_params)["bn/mean"], before["bn/mean"]
    )


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_train_in_eval_mode_freezes_batch_statistics():
    state = _state()
    before = model_state(state.model_without_params)["bn/var"]
    state, _ = pztrain.build_train_step(loss_fn, mode="eval")(state, **batch())
    after = model_state(state.model_without_params)["bn/var"]
    np.testing.assert_array_equal(after, before)


def test_a_bad_mode_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "mode must be 'train', 'eval' or None (modes left as the model was "
            "built); got 'training'."
        ),
    ):
        pztrain.build_train_step(loss_fn, mode="training")
    with pytest.raises(ValueError, match=re.escape("got 'test'.")):
        pztrain.build_eval_step(_eval_out, mode="test")


# ----------------------------------------------------------------------------
# Flax's own NNX train-state cases (tests/nnx/helpers_test.py test_train_state*)


def test_train_state_holds_params_and_batch_stats_apart():
    model = nnx.Dict(a=nnx.Param(jnp.array(1.0)), b=nnx.BatchStat(jnp.array(2.0)))
    state = _state(model, optax.sgd(1.0))
    assert state.params == {"a": 1.0}
    assert model_state(state.model_without_params) == {"b": 2.0}
    # step, key, param, batch stat; sgd has no optimizer arrays
    assert len(jax.tree.leaves(state)) == 4


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_train_state_methods_with_a_module_that_takes_train():
    class Foo(nnx.Module):
        def __init__(self, *, rngs):
            self.linear = nnx.Linear(2, 4, rngs=rngs)
            self.batch_norm = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x, train: bool):
            return self.batch_norm(self.linear(x), use_running_average=not train)

    def loss(*, model, state, rng, x):
        y = model(x, train=True)
        return jnp.mean(y), state, {"y": y}

    state = _state(Foo(rngs=nnx.Rngs(0)), optax.sgd(1.0))
    x = jnp.ones((1, 2))
    new, aux = pztrain.build_train_step(loss, mode=None, donate=False)(state, x=x)
    assert aux["y"].shape == (1, 4)
    # BatchNorm's running mean moved 1% (momentum 0.99) toward the batch's mean
    h = x @ state.params["linear/kernel"] + state.params["linear/bias"][None]
    own = model_state(new.model_without_params)
    np.testing.assert_allclose(own["batch_norm/mean"], 0.01 * h[0], rtol=1e-5)
    # apply_gradients with fake gradients of ones: sgd(1.0) subtracts 1
    grads = jax.tree.map(jnp.ones_like, state.params)
    applied = state.apply_gradients(grads)
    assert int(applied.step) == 1
    for name, value in state.params.items():
        np.testing.assert_allclose(applied.params[name], value - 1.0)


# ----------------------------------------------------------------------------
# trainable filter and summary


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_a_trainable_filter_leaves_other_params_frozen_in_the_model():
    state = _state(trainable="^l2/")
    assert sorted(state.params) == ["l2/bias", "l2/kernel"]
    kernel = state.model.l1.kernel[...]
    state, _ = pztrain.build_train_step(loss_fn)(state, **batch())
    np.testing.assert_array_equal(state.model.l1.kernel[...], kernel)
    rows = {r.name: r for r in state.summary().rows}
    assert rows["l1/kernel"].kind_text == "frozen (Param)"
    assert rows["l2/kernel"].kind_text == "trainable (Param)"


def test_summary_names_nnx_variable_types_and_shows_keys():
    summary = _state().summary()
    rows = {r.name: r for r in summary.rows}
    assert rows["bn/mean"].kind_text == "state (BatchStat)"
    assert rows["drop/rngs/count"].kind_text == "state (RngCount)"
    key = rows["drop/rngs/key"]
    assert (key.kind_text, key.dtype, key.shape, key.nbytes) == (
        "state (RngKey)",
        "key<fry>",
        (),
        8,
    )
    line = [ln for ln in summary.splitlines() if ln.startswith("drop/rngs/key")][0]
    assert line.split() == [
        "drop/rngs/key",
        "()",
        "key<fry>",
        "1",
        "8",
        "state",
        "(RngKey)",
    ]


def test_summary_shows_keys_held_by_penzai_and_equinox_models():
    class Noisy(eqx.Module):
        w: jax.Array
        key: jax.Array

    eqx_state = _state(Noisy(jnp.ones(3), jax.random.key(1)), optax.sgd(0.1))
    row = {r.name: r for r in eqx_state.summary().rows}["key"]
    assert (row.dtype, row.kind, row.nbytes) == ("key<fry>", "buffer", 8)

    @pz.pytree_dataclass
    class Stream(pz.nn.Layer):
        w: pz.Parameter
        key: pz.StateVariable

        def __call__(self, x, **side):
            return x

    model = Stream(
        w=pz.Parameter(value=jnp.ones(3), label="w"),
        key=pz.StateVariable(value=jax.random.key(2), label="key"),
    )
    pz_state = _state(model, optax.sgd(0.1))
    row = {r.name: r for r in pz_state.summary().rows}["key"]
    assert (row.dtype, row.kind, row.shape) == ("key<fry>", "state", ())


# ----------------------------------------------------------------------------
# bad input


def test_a_linen_module_points_to_train_state_create():
    import flax.linen as nn

    with pytest.raises(
        PartitionError,
        match=re.escape(
            "The model (Dense) is a Flax linen module, which holds no arrays: "
            "initialise it (variables = model.init(key, x)) and build the state "
            "from its apply function, TrainState.create(apply_fn=model.apply, "
            "params=variables['params'], tx=...)."
        ),
    ):
        _state(nn.Dense(3))


def test_an_nnx_model_without_params_is_refused():
    class Stats(nnx.Module):
        def __init__(self):
            self.mean = nnx.BatchStat(jnp.zeros(3))

    with pytest.raises(
        PartitionError,
        match=re.escape(
            "The NNX model (Stats) has no nnx.Param (its variables: "
            "['BatchStat']). pztrain trains nnx.Param variables only: hold the "
            "weights to train in nnx.Param(...)."
        ),
    ):
        _state(Stats())


def test_a_loss_that_creates_variables_is_refused():
    def creating(*, model, state, rng, x, y):
        h = model.l1(x)
        model.seen = nnx.BatchStat(jnp.mean(h, axis=0))
        return jnp.mean(h), state, {}

    with pytest.raises(
        PartitionError,
        match=re.escape(
            "The loss function created ['seen (BatchStat)'] NNX variables of "
            "the MLP model during the step. pztrain carries a model's variables "
            "from step to step, so they are fixed when the state is built: "
            "create variables in the model's __init__, and collect intermediates with "
            "nnx.capture (or nnx.pop them before the loss returns)."
        ),
    ):
        pztrain.build_train_step(creating)(_state(), **batch())


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_a_loss_that_sows_intermediates_is_refused():
    def sowing(*, model, state, rng, x, y):
        h = model.l1(x)
        model.sow(nnx.Intermediate, "h", h)  # a new variable, outside nnx.capture
        return jnp.mean(h), state, {}

    with pytest.raises(
        PartitionError,  # sow keeps a tuple: 'h/0'
        match=r"created \['h(/0)? \(Intermediate\)'\] NNX variables of the MLP model",
    ):
        pztrain.build_train_step(sowing)(_state(), **batch())


def test_a_variable_whose_dtype_changes_is_named():
    class Counter(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.calls = Counter(jnp.zeros((), jnp.int32))

    def loss(*, model, state, rng):
        model.calls.set_value(model.calls[...] + 0.5)
        return jnp.sum(model.w[...]), state, {}

    with pytest.raises(
        PartitionError,
        match=re.escape(
            "The loss function changed NNX variable 'calls' from int32[] to float32[]."
        ),
    ):
        pztrain.build_train_step(loss)(_state(Counting(), optax.sgd(0.1)))


def test_user_variable_types_are_state_and_persist():
    class Counter(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.calls = Counter(jnp.zeros((), jnp.int32))

    def loss(*, model, state, rng):
        model.calls[...] += 1
        return jnp.sum(model.w[...] ** 2), state, {}

    state = _state(Counting(), optax.sgd(0.1))
    step = pztrain.build_train_step(loss)
    for _ in range(3):
        state, _ = step(state)
    assert int(model_state(state.model_without_params)["calls"]) == 3
    assert {r.name: r for r in state.summary().rows}["calls"].kind_text == (
        "state (Counter)"
    )


def test_nnx_modules_inside_another_pytree_are_refused():
    with pytest.raises(
        PartitionError,
        match=re.escape(
            "The model (dict) holds a Flax NNX MLP at model['m'] outside a "
            "top-level nnx.Module."
        ),
    ):
        _state({"m": mlp()})


def test_flax_missing_names_the_extra(monkeypatch):
    from pztrain.partition._model import flax_nnx

    monkeypatch.setitem(sys.modules, "flax", None)
    with pytest.raises(
        ImportError,
        match=re.escape("Flax NNX models need flax: pip install 'pztrain[nnx]'."),
    ):
        flax_nnx()


@pytest.mark.slow
def test_pztrain_does_not_import_flax_for_other_models():
    code = (
        "import sys, jax, optax, jax.numpy as jnp, pztrain\n"
        "s = pztrain.TrainState.initial_state({'w': jnp.ones(2)}, optax.sgd(0.1),"
        " jax.random.key(0))\n"
        "f = lambda *, model, state, rng: (jnp.sum(model['w'] ** 2), state, {})\n"
        "s, _ = pztrain.build_train_step(f)(s)\n"
        "print(s.summary())\n"
        "assert 'flax' not in sys.modules, [m for m in sys.modules if 'flax' in m]\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_mixed_precision_keeps_batch_statistics_updated_in_float32():
    loss = pztrain.mixed_precision(loss_fn, "params=float32,compute=bfloat16")
    state = _state()
    before = model_state(state.model_without_params)["bn/mean"]
    state, aux = pztrain.build_train_step(loss)(state, **batch())
    after = model_state(state.model_without_params)["bn/mean"]
    assert after.dtype == jnp.float32 and not np.array_equal(after, before)
    assert state.params["l1/kernel"].dtype == jnp.float32
    assert aux["loss"].dtype == jnp.float32


@pytest.mark.slow  # compiles NNX steps (test_state_model_is_an_nnx_... stays fast)
def test_a_legacy_root_key_reseeds_the_streams_too():
    state = pztrain.TrainState.initial_state(
        mlp(), optax.sgd(0.0), jax.random.PRNGKey(0)
    )
    step = pztrain.build_train_step(
        lambda *, model, state, rng, x: (
            jnp.mean(model.drop(x)),
            state,
            {"mask": model.drop(x) != 0},
        )
    )
    state, a = step(state, x=jnp.ones(64))
    state, b = step(state, x=jnp.ones(64))
    assert not (np.asarray(a["mask"]) == np.asarray(b["mask"])).all()
    key = model_state(state.model_without_params)["drop/rngs/key"]
    assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
