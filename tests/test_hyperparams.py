"""`TrainState.with_hyperparams` and the read-only `TrainState.hyperparams`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pztrain.state import TrainState
from pztrain.step import build_train_step

X = np.array([1.0, 2.0, -1.0], np.float32)
TRACES = []


def linear_loss(*, model, state, rng, x):
    """Gradient ``x`` for ``w``: sgd moves ``w`` by ``-lr * x`` each step."""
    TRACES.append(1)
    loss = jnp.sum(model["w"] * x)
    return loss, state, {"loss": loss}


def _state(tx):
    return TrainState.initial_state({"w": jnp.zeros(3)}, tx, jax.random.key(0))


def test_with_hyperparams_sets_the_lr_of_the_next_donated_step():
    state = _state(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    step = build_train_step(linear_loss)  # donates the state by default
    assert step.donate
    state, _ = step(state, x=X)
    np.testing.assert_allclose(state.params["w"], -0.1 * X, rtol=1e-6)
    traces = len(TRACES)
    lr = jnp.asarray(0.5)
    before = state
    state = state.with_hyperparams(learning_rate=lr)
    assert float(before.hyperparams["learning_rate"]) == pytest.approx(0.1)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.5)
    state, _ = step(state, x=X)
    np.testing.assert_allclose(state.params["w"], -0.6 * X, rtol=1e-6)
    state, _ = step(state, x=X)
    np.testing.assert_allclose(state.params["w"], -1.1 * X, rtol=1e-6)
    assert len(TRACES) == traces  # same dtype and shape: no retrace
    assert float(lr) == 0.5  # the caller's array was copied, not donated
    assert int(state.step) == 3
    # with_hyperparams copied what the steps donated: the state before is intact
    np.testing.assert_allclose(before.params["w"], -0.1 * X, rtol=1e-6)
    assert float(before.with_hyperparams(learning_rate=0.2).step) == 1


def test_nested_chain_sets_only_the_named_values():
    decay = optax.inject_hyperparams(optax.add_decayed_weights)(weight_decay=0.0)
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.0)
    tx = optax.chain(
        optax.clip_by_global_norm(1e3),
        optax.masked(decay, {"w": True}),
        optax.MultiSteps(sgd, every_k_schedule=1),
    )
    state = _state(tx).replace(params={"w": jnp.ones(3)})
    new = state.with_hyperparams(learning_rate=1, weight_decay=0.5)
    hp = new.hyperparams
    assert dict(hp) == pytest.approx(
        {"learning_rate": 1.0, "weight_decay": 0.5, "momentum": 0.0}
    )
    assert hp["learning_rate"].dtype == jnp.float32  # the stored dtype, not int
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    # Every other leaf of the optimizer state has the same value (in a copy).
    old_leaves, new_leaves = (
        jax.tree.leaves(state.opt_state),
        jax.tree.leaves(new.opt_state),
    )
    same = [
        np.array_equal(a, b) and a is not b
        for a, b in zip(old_leaves, new_leaves, strict=True)
    ]
    assert same.count(False) == 2
    # grads 0: the update is -lr * (grad + weight_decay * w) = -1 * 0.5 * w
    stepped = new.apply_gradients({"w": jnp.zeros(3)})
    np.testing.assert_allclose(stepped.params["w"], 0.5 * np.ones(3), rtol=1e-6)


def test_unknown_and_unsettable_names_are_errors():
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    state = _state(sgd)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Unknown hyperparameter(s) ['lr']; the injected ones are "
            "['learning_rate', 'momentum']."
        ),
    ):
        state.with_hyperparams(lr=0.1)
    with pytest.raises(ValueError, match="'learning_rate' has shape \\(\\)"):
        state.with_hyperparams(learning_rate=jnp.ones(2))
    scheduled = optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(1.0, 0.0, 10)
    )
    with pytest.raises(ValueError, match="'learning_rate' follows a schedule"):
        _state(scheduled).with_hyperparams(learning_rate=0.1)
    twice = optax.chain(sgd, optax.inject_hyperparams(optax.sgd)(learning_rate=0.2))
    with pytest.raises(ValueError, match="injected by more than one"):
        _state(twice).with_hyperparams(learning_rate=0.1)
    with pytest.raises(ValueError, match=re.escape("optax.inject_hyperparams(")):
        _state(optax.sgd(0.1)).with_hyperparams(learning_rate=0.1)
    assert _state(optax.sgd(0.1)).with_hyperparams().step is not None  # no-op


def test_hyperparams_is_read_only_and_points_to_with_hyperparams():
    state = _state(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    hp = state.hyperparams
    hint = "state = state.with_hyperparams(b1=0.01)"
    with pytest.raises(TypeError, match=re.escape(hint)):
        hp["b1"] = 0.5
    with pytest.raises(TypeError, match="read-only"):
        del hp["learning_rate"]
    with pytest.raises(TypeError, match=re.escape("with_hyperparams(")):
        hp.update(learning_rate=0.5)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)
    assert sorted(hp) == ["b1", "b2", "eps", "eps_root", "learning_rate"]
    assert "learning_rate" in hp and len(hp) == 5
    assert repr(hp).startswith("HyperparamsView({")
