"""TrainState: construction, views, Flax habits, subclasses and errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import treescope
from models import (
    FAMILIES,
    XOR_X,
    XOR_Y,
    dict_mlp_apply,
    dict_mlp_params,
    equinox_mlp,
    logits_of,
    penzai_v1_mlp,
    penzai_v2_mlp,
)
from penzai import pz

import pztrain
from pztrain import TrainState


def _tree_equal(a, b):
    la, da = jax.tree.flatten(a)
    lb, db = jax.tree.flatten(b)
    assert da == db
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array | np.ndarray):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_round_trip_is_exact(family):
    model = FAMILIES[family]()
    state = TrainState.initial_state(model, optax.adam(1e-3), jax.random.key(0))
    merged = state.model
    assert type(merged) is type(model)
    if family == "penzai_v2":
        u1, p1 = pz.unbind_params(model, freeze=True)
        u2, p2 = pz.unbind_params(merged, freeze=True)
        _tree_equal(u1, u2)
        _tree_equal(p1, p2)
        assert all(isinstance(p, pz.Parameter) for p in pz.unbind_params(merged)[1])
    else:
        _tree_equal(model, merged)
    np.testing.assert_array_equal(logits_of(model, XOR_X), logits_of(merged, XOR_X))


def test_parameter_names_follow_the_family():
    v2 = TrainState.initial_state(penzai_v2_mlp(), optax.sgd(0.1), jax.random.key(0))
    assert "mlp/Affine_0/Linear.weights" in v2.params
    v1 = TrainState.initial_state(penzai_v1_mlp(), optax.sgd(0.1), jax.random.key(0))
    assert "Affine_0.Linear.weights" in v1.params
    eq = TrainState.initial_state(equinox_mlp(), optax.sgd(0.1), jax.random.key(0))
    assert set(eq.params) == {
        f"layers/{i}/{w}" for i in (0, 1) for w in ("weight", "bias")
    }


def test_state_owns_its_buffers():
    model = {"w": jnp.ones(3)}
    state = TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
    assert state.params["w"] is not model["w"]
    lookahead = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
    state = TrainState.initial_state({"w": jnp.ones(3)}, lookahead, jax.random.key(0))
    ids = [id(x) for x in jax.tree.leaves((state.params, state.opt_state))]
    assert len(ids) == len(set(ids))


def test_step_is_a_jax_int32_scalar_and_keys_of_both_kinds_work():
    for key in (jax.random.key(3), jax.random.PRNGKey(3)):
        state = TrainState.initial_state({"w": jnp.ones(2)}, optax.sgd(1.0), key)
        assert isinstance(state.step, jax.Array)
        assert state.step.dtype == jnp.int32 and state.step.shape == ()


def test_apply_gradients_positional_and_keyword():
    state = TrainState.initial_state(
        {"w": jnp.ones(2)}, optax.sgd(0.5), jax.random.key(0)
    )
    g = {"w": jnp.ones(2)}
    a = state.apply_gradients(g)
    b = state.apply_gradients(grads=g)
    np.testing.assert_allclose(a.params["w"], [0.5, 0.5])
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    assert int(a.step) == int(b.step) == 1


@pytest.mark.slow  # a second or more (compiles, imports)
def test_flax_style_seed_train_step_runs_with_only_the_import_changed():
    softmax_ce = optax.softmax_cross_entropy

    def train_step(state, batch):
        def loss_fn(params):
            x, y = batch["images"], batch["labels"]
            logits = state.apply_fn({"params": params}, x=x)
            loss = softmax_ce(logits, y).mean()
            return loss, logits

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(state.params)
        state = state.apply_gradients(grads)
        return state, loss

    def apply_fn(variables, x):
        return dict_mlp_apply(variables, x)

    state = TrainState.create(
        apply_fn=apply_fn, params=dict_mlp_params(), tx=optax.adam(0.05)
    )
    assert state.tx is state.optimizer_def
    batch = {"images": XOR_X, "labels": jax.nn.one_hot(XOR_Y, 2)}
    step = jax.jit(train_step)
    for _ in range(300):
        state, loss = step(state, batch)
    assert float(loss) < 1e-3
    assert int(state.step) == 300
    # The same state also serves penzai-style loss functions through .model.
    np.testing.assert_allclose(
        state.model(XOR_X), apply_fn({"params": state.params}, XOR_X)
    )


class MyState(TrainState):
    epoch: jax.Array
    batch_stats: dict
    metrics: dict


def test_subclass_fields_are_carried_and_replaced():
    state = MyState.create(
        apply_fn=dict_mlp_apply,
        params=dict_mlp_params(),
        tx=optax.sgd(0.1),
        epoch=jnp.array(3),
        batch_stats={"mean": jnp.ones(2)},
        metrics={"acc": jnp.array(0.5)},
    )
    grads = jax.tree.map(jnp.ones_like, state.params)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    assert isinstance(new, MyState)
    assert int(new.epoch) == 3 and float(new.metrics["acc"]) == 0.5
    new = new.replace(epoch=new.epoch + 1, batch_stats={"mean": jnp.zeros(2)})
    assert int(new.epoch) == 4
    np.testing.assert_array_equal(new.batch_stats["mean"], [0.0, 0.0])
    # build_train_step carries them too
    train_step = pztrain.build_train_step(
        lambda *, model, state, rng, x, y: (
            optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean(),
            state,
            {},
        )
    )
    stepped, _ = train_step(new, x=XOR_X, y=XOR_Y)
    assert isinstance(stepped, MyState)
    assert int(stepped.epoch) == 4 and int(stepped.step) == 2


def test_subclass_with_initial_state_extra_fields():
    state = MyState.initial_state(
        {"w": jnp.ones(2)},
        optax.sgd(0.1),
        jax.random.key(0),
        epoch=jnp.array(0),
        batch_stats={},
        metrics={},
    )
    assert int(state.epoch) == 0
    with pytest.raises(TypeError, match=re.escape("has no field(s) ['epochs']")):
        state.replace(epochs=1)


def test_hyperparams_are_read_through_chains_and_wrappers():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.01, weight_decay=1e-4),
    )
    state = TrainState.initial_state({"w": jnp.ones(2)}, tx, jax.random.key(0))
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.01)
    assert float(state.hyperparams["weight_decay"]) == pytest.approx(1e-4)
    masked = optax.masked(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.3), {"w": True}
    )
    state = TrainState.initial_state({"w": jnp.ones(2)}, masked, jax.random.key(0))
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.3)
    sched = optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(1.0, 0.0, 10)
    )
    state = TrainState.initial_state({"w": jnp.ones(2)}, sched, jax.random.key(0))
    for _ in range(5):
        state = state.apply_gradients({"w": jnp.zeros(2)})
    # optax records the value used by the last update (the 5th, at count 4).
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.6)


def test_hyperparams_errors():
    state = TrainState.initial_state(
        {"w": jnp.ones(2)}, optax.adam(1e-3), jax.random.key(0)
    )
    with pytest.raises(
        ValueError, match=re.escape("optax.inject_hyperparams(optax.adam)")
    ):
        _ = state.hyperparams
    twice = optax.chain(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
    )
    state = TrainState.initial_state({"w": jnp.ones(2)}, twice, jax.random.key(0))
    with pytest.raises(
        ValueError, match="'learning_rate' is injected by more than one"
    ):
        _ = state.hyperparams


def test_treescope_shows_every_field_and_select_works():
    state = TrainState.initial_state(
        penzai_v2_mlp(), optax.adam(1e-3), jax.random.key(0)
    )
    text = treescope.render_to_text(state)
    for field in (
        "step",
        "root_rng",
        "params",
        "model_without_params",
        "opt_state",
        "loss_fn_state",
        "optimizer_def",
    ):
        assert f"{field}=" in text
    zeroed = (
        state.select()
        .at(lambda s: s.params)
        .apply(lambda p: jax.tree.map(jnp.zeros_like, p))
    )
    assert isinstance(zeroed, TrainState)
    assert all(float(jnp.abs(v).sum()) == 0 for v in zeroed.params.values())
    summary = state.summary()
    assert "step 0" in summary and "params" in summary and "opt_state" in summary
    n = sum(v.size for v in state.params.values())
    assert f"{n:,} values" in summary


def test_trainable_filter_freezes_arrays():
    model = equinox_mlp()
    state = TrainState.initial_state(
        model, optax.adam(0.1), jax.random.key(0), trainable=r"^layers/1/"
    )
    assert set(state.params) == {"layers/1/weight", "layers/1/bias"}
    adam_mu = state.opt_state[0].mu
    assert set(adam_mu) == set(state.params)
    train_step = pztrain.build_train_step(_xor_loss_any)
    for _ in range(5):
        state, _ = train_step(state, x=XOR_X, y=XOR_Y)
    after = state.model
    np.testing.assert_array_equal(after.layers[0].weight, model.layers[0].weight)
    assert not np.array_equal(after.layers[1].weight, model.layers[1].weight)
    by_predicate = TrainState.initial_state(
        model,
        optax.adam(0.1),
        jax.random.key(0),
        trainable=lambda name, value: value.ndim == 1,
    )
    assert set(by_predicate.params) == {"layers/0/bias", "layers/1/bias"}


def test_penzai_v2_trainable_metadata_is_respected():
    model = penzai_v2_mlp()
    model = (
        pz.select(model)
        .at_instances_of(pz.Parameter)
        .where(lambda p: p.label.endswith("bias"))
        .apply(
            lambda p: pz.Parameter(
                value=p.value, label=p.label, metadata={"trainable": False}
            )
        )
    )
    state = TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0))
    assert all(name.endswith("weights") for name in state.params)
    merged = pz.unbind_params(state.model, freeze=True)[1]
    assert {p.label for p in merged} == {p.label for p in pz.unbind_params(model)[1]}


def _xor_loss_any(*, model, state, rng, x, y):
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits_of(model, x), y
    ).mean()
    return loss, state, {"loss": loss}


# ------------------------------------------------------------------ errors


def test_error_duplicate_names_generic():
    model = {"a/b": jnp.ones(2), "a": {"b": jnp.ones(2)}}
    with pytest.raises(
        pztrain.PartitionError, match=re.escape("Duplicate parameter name 'a/b'")
    ):
        TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))


def test_error_duplicate_labels_penzai_v2():
    a = pz.Parameter(value=jnp.ones(2), label="w")
    b = pz.Parameter(value=jnp.ones(2), label="w")
    with pytest.raises(pztrain.PartitionError, match="Duplicate parameter label"):
        TrainState.initial_state([a, b], optax.sgd(0.1), jax.random.key(0))


def test_shared_penzai_v2_parameter_is_one_param():
    a = pz.Parameter(value=jnp.ones(2), label="w")
    state = TrainState.initial_state([a, a], optax.sgd(0.1), jax.random.key(0))
    assert list(state.params) == ["w"]
    merged = state.model
    assert merged[0] is merged[1]


def test_error_no_trainable_params():
    with pytest.raises(
        pztrain.PartitionError,
        match=re.escape("has no trainable parameters left after trainable='nothing'"),
    ):
        TrainState.initial_state(
            {"w": jnp.ones(2)}, optax.sgd(0.1), jax.random.key(0), trainable="nothing"
        )
    with pytest.raises(pztrain.PartitionError, match="no trainable parameters"):
        TrainState.initial_state(
            {"n": jnp.arange(3)}, optax.sgd(0.1), jax.random.key(0)
        )


def test_error_unsupported_leaf():
    class Unhashable:
        __hash__ = None

    with pytest.raises(
        pztrain.PartitionError,
        match=re.escape("Unsupported leaf at model['bad']: a Unhashable"),
    ):
        TrainState.initial_state(
            {"w": jnp.ones(2), "bad": Unhashable()}, optax.sgd(0.1), jax.random.key(0)
        )


def test_error_uninitialized_penzai_v1():
    from penzai.deprecated.v1.example_models import simple_mlp as v1

    model = v1.MLP.from_config(feature_sizes=[2, 4, 2])
    with pytest.raises(
        pztrain.PartitionError,
        match=re.escape("pz.nn.initialize_parameters(model, key)"),
    ):
        TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))


def test_error_bad_key_and_optimizer():
    with pytest.raises(
        TypeError, match=re.escape("root_rng must be a single PRNG key")
    ):
        TrainState.initial_state({"w": jnp.ones(2)}, optax.sgd(0.1), 0)
    with pytest.raises(
        TypeError,
        match=re.escape("optimizer_def must be an optax GradientTransformation"),
    ):
        TrainState.initial_state({"w": jnp.ones(2)}, 0.1, jax.random.key(0))


def test_error_grads_mismatch_names_keys():
    state = TrainState.initial_state(
        {"w": jnp.ones(2), "b": jnp.ones(())}, optax.sgd(0.1), jax.random.key(0)
    )
    with pytest.raises(
        ValueError, match=re.escape("missing names ['b'], unexpected names ['v']")
    ):
        state.apply_gradients({"w": jnp.ones(2), "v": jnp.ones(())})


def test_apply_fn_only_on_flax_style_states():
    state = TrainState.initial_state(
        {"w": jnp.ones(2)}, optax.sgd(0.1), jax.random.key(0)
    )
    with pytest.raises(
        AttributeError, match=re.escape("call state.model(...) instead")
    ):
        _ = state.apply_fn


def test_mixed_parameter_trains_its_float_arrays_only():
    param = pz.Parameter(value={"w": jnp.ones(2), "n": jnp.arange(2)}, label="L")
    state = TrainState.initial_state([param], optax.sgd(0.1), jax.random.key(0))
    assert list(state.params) == ["L/w"]
    value = pz.unbind_params(state.model)[1][0].value
    np.testing.assert_array_equal(value["n"], [0, 1])
    np.testing.assert_array_equal(value["w"], [1.0, 1.0])


def test_replace_runs_a_subclass_post_init_and_checks_names():
    checked = []

    class Checked(TrainState):
        epoch: jax.Array

        def __post_init__(self):
            checked.append(int(self.epoch))

    state = Checked.initial_state(
        {"w": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(0), epoch=jnp.array(1)
    )
    state = state.replace(epoch=jnp.array(2))
    step = pztrain.build_train_step(
        lambda *, model, state, rng: (jnp.sum(model["w"] ** 2), state, {})
    )
    state, _ = step(state)
    assert checked == [1, 2, 2]  # built, replaced, stepped
    with pytest.raises(TypeError, match=re.escape("Checked has no field(s) ['epok']")):
        state.replace(epok=1)
    plain = TrainState.initial_state(
        {"w": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(0)
    )
    moved = plain.replace(step=plain.step + 5)
    assert int(moved.step) == 5 and int(plain.step) == 0
    assert moved.params is plain.params and type(moved) is TrainState
