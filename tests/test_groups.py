"""Parameter groups by name: labels, checks, frozen groups, decay masks, and a
learning rate per group."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import (
    XOR_X,
    XOR_Y,
    dict_mlp_apply,
    dict_mlp_params,
    equinox_mlp,
    penzai_v1_mlp,
    penzai_v2_mlp,
    xor_loss,
)

import pztrain
from pztrain import groups

RULES = [(r"bias", "no_decay"), (r"(^|/)(layers/1|Affine_1|dense1)", "head")]

HAND_BUILT = {
    "penzai_v2": (
        penzai_v2_mlp,
        {
            "mlp/Affine_0/AddBias.bias": "no_decay",
            "mlp/Affine_0/Linear.weights": "body",
            "mlp/Affine_1/AddBias.bias": "no_decay",
            "mlp/Affine_1/Linear.weights": "head",
        },
    ),
    "penzai_v1": (
        penzai_v1_mlp,
        {
            "Affine_0.AddBias.bias": "no_decay",
            "Affine_0.Linear.weights": "body",
            "Affine_1.AddBias.bias": "no_decay",
            "Affine_1.Linear.weights": "head",
        },
    ),
    "equinox": (
        equinox_mlp,
        {
            "layers/0/bias": "no_decay",
            "layers/0/weight": "body",
            "layers/1/bias": "no_decay",
            "layers/1/weight": "head",
        },
    ),
}


@pytest.mark.parametrize("family", sorted(HAND_BUILT))
def test_labels_match_hand_built_trees(family):
    make, expected = HAND_BUILT[family]
    model = make()
    state = pztrain.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
    assert groups.labels(state, RULES, default="body") == expected
    assert groups.labels(model, RULES, default="body") == expected
    # The same labels as a function of the params, as optax calls it.
    assert groups.by_name(RULES, default="body")(state.params) == expected


def test_labels_of_a_flax_style_params_pytree_keep_its_structure():
    state = pztrain.TrainState.create(
        apply_fn=dict_mlp_apply, params=dict_mlp_params(), tx=optax.sgd(0.1)
    )
    expected = {
        "dense0": {"bias": "no_decay", "kernel": "body"},
        "dense1": {"bias": "no_decay", "kernel": "head"},
    }
    assert groups.labels(state, RULES, default="body") == expected
    assert groups.labels(dict_mlp_params(), RULES, default="body") == expected


@pytest.mark.slow  # a second or more (compiles, imports)
def test_labels_of_an_nnx_model():
    nnx_models = pytest.importorskip("nnx_models")
    model = nnx_models.mlp()
    state = pztrain.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
    got = groups.labels(state, [(r"bias", "b"), (r"^bn/", "norm")], default="w")
    assert got == {
        name: "b" if "bias" in name else "norm" if name.startswith("bn/") else "w"
        for name in state.params
    }
    assert got["l1/kernel"] == "w" and got["bn/scale"] == "norm"
    assert groups.labels(model, [(r"bias", "b"), (r"^bn/", "norm")], default="w") == got


def test_predicates_and_first_match_wins():
    params = {"a/w": jnp.ones((2, 2)), "a/b": jnp.ones(2), "c": jnp.ones(3)}
    rules = [
        (lambda name, value: value.ndim == 1, "vector"),
        (r"^a/", "a"),
    ]
    assert groups.labels(params, rules) == {"a/b": "vector", "a/w": "a", "c": "vector"}


def test_a_rule_matching_nothing_warns_with_its_name():
    params = {"w": jnp.ones(2)}
    with pytest.warns(UserWarning, match=re.escape("rule 'embed' (label 'emb')")):
        groups.labels(params, [("embed", "emb")])


def test_a_label_without_transformation_is_an_error_naming_it():
    tx = groups.group_optimizer(
        {"decay": optax.sgd(0.1)}, [(r"bias", "no_decay")], default="decay"
    )
    with pytest.raises(
        groups.GroupError,
        match=re.escape("'no_decay' has no transformation (it labels ['bias'])"),
    ):
        tx.init({"w": jnp.ones(2), "bias": jnp.ones(2)})
    with pytest.raises(
        groups.GroupError, match=re.escape("The default label 'rest' has no")
    ):
        groups.group_optimizer({"a": optax.sgd(0.1)}, [("w", "a")], default="rest")


def test_labels_that_do_not_cover_every_parameter_name_the_parameter():
    tx = groups.group_optimizer({"w": optax.sgd(0.1)}, [(r"^w$", "w")])
    with pytest.raises(
        groups.GroupError,
        match=re.escape("Parameter 'bias' matches no rule and there is no default"),
    ):
        pztrain.TrainState.initial_state(
            {"w": jnp.ones(2), "bias": jnp.ones(2)}, tx, jax.random.key(0)
        )


def test_a_bad_regex_names_its_label():
    with pytest.raises(
        groups.GroupError, match=re.escape("The rule '(' (label 'x') is not a valid")
    ):
        groups.by_name([("(", "x")])


def _train(state, steps=5):
    step = pztrain.build_train_step(xor_loss)
    for _ in range(steps):
        state, _ = step(state, x=XOR_X, y=XOR_Y)
    return state


def test_frozen_params_do_not_change_and_hold_no_optimizer_state():
    tx = groups.frozen(optax.adam(0.1), r"Affine_0")
    state = pztrain.TrainState.initial_state(penzai_v2_mlp(), tx, jax.random.key(0))
    before = {k: np.asarray(v) for k, v in state.params.items()}
    frozen_names = [n for n in state.params if "Affine_0" in n]
    assert len(frozen_names) == 2
    state_paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    ]
    assert not [p for p in state_paths if "Affine_0" in p]
    assert [p for p in state_paths if "Affine_1" in p]  # the trained ones have mu, nu
    after = _train(state)
    for name, value in after.params.items():
        same = np.array_equal(np.asarray(value), before[name])
        assert same == (name in frozen_names), name


@pytest.mark.slow  # adamw's update op by op
def test_weight_decay_mask_spares_biases_and_norms():
    tx = optax.adamw(0.1, weight_decay=0.5, mask=groups.weight_decay_mask())
    params = {
        "dense/kernel": jnp.ones((2, 2)),
        "dense/bias": jnp.ones(2),
        "ln/scale": jnp.ones(2),
        "LayerNorm_0/kernel": jnp.ones((2, 2)),  # a norm's name, even 2-D
    }
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    moved = {k: bool(jnp.any(v != 0)) for k, v in updates.items()}
    assert moved == {
        "dense/kernel": True,
        "dense/bias": False,
        "ln/scale": False,
        "LayerNorm_0/kernel": False,
    }


def test_a_learning_rate_per_group_is_read_and_set_without_recompiling():
    lr = optax.inject_hyperparams(optax.sgd)
    tx = groups.group_optimizer(
        {"head": lr(learning_rate=0.1), "body": lr(learning_rate=0.2)},
        [(r"Affine_1", "head")],
        default="body",
    )
    state = pztrain.TrainState.initial_state(penzai_v2_mlp(), tx, jax.random.key(0))
    assert sorted(state.hyperparams) == ["body/learning_rate", "head/learning_rate"]
    assert float(state.hyperparams["head/learning_rate"]) == pytest.approx(0.1)

    traces = []

    def counted(**kwargs):
        traces.append(1)
        return xor_loss(**kwargs)

    step = pztrain.build_train_step(counted)
    state, _ = step(state, x=XOR_X, y=XOR_Y)
    state = state.with_hyperparams(**{"head/learning_rate": 0.0})
    assert float(state.hyperparams["head/learning_rate"]) == 0.0
    before = {k: np.asarray(v) for k, v in state.params.items()}
    state, _ = step(state, x=XOR_X, y=XOR_Y)
    assert len(traces) == 1  # the new rate took effect in the same program
    for name, value in state.params.items():
        same = np.array_equal(np.asarray(value), before[name])
        assert same == ("Affine_1" in name), name
    with pytest.raises(ValueError, match=re.escape("Unknown hyperparameter(s)")):
        state.with_hyperparams(learning_rate=0.1)
