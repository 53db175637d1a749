"""Where sharing buffers after donation is a trap (issue 25).

A train step donates the arrays of the state it is given. `with_hyperparams`
copies them, so one ``state0`` starts every trial of a search; a state from
`replace` shares them, and the error of a later use names the `fit` call that
was given them. A consumed state used again gets pztrain's error before XLA
runs (XLA would log "Buffer has been deleted or donated" to stderr first).
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain

X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]])).astype(np.float32)


def _loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


def _state0():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    return pztrain.TrainState.initial_state(
        {"w": jnp.zeros((3, 1))}, tx, jax.random.key(0)
    )


def _trial(state0, step, lr):
    """One trial of an Optuna-style objective: the README's pattern."""
    state = state0.with_hyperparams(learning_rate=lr)
    data = pztrain.ArrayLoader({"x": X, "y": Y}, 8, seed=0)
    state, history = pztrain.fit(state, step, data, num_steps=8, progress=False)
    return np.asarray(state.params["w"]), history.last("train")["metrics"]["loss"]


@pytest.mark.slow  # three runs
def test_one_state0_starts_every_trial_of_fit():
    state0 = _state0()
    step = pztrain.build_train_step(_loss_fn)
    w1, loss1 = _trial(state0, step, 0.1)
    w2, loss2 = _trial(state0, step, 0.01)  # state0 is still alive

    assert int(state0.step) == 0
    np.testing.assert_array_equal(np.asarray(state0.params["w"]), np.zeros((3, 1)))
    assert float(state0.hyperparams["learning_rate"]) == pytest.approx(0.1)
    assert loss1 != loss2  # each trial ran with its own learning rate
    fresh_w, fresh_loss = _trial(_state0(), step, 0.01)  # trial 2, from scratch
    np.testing.assert_array_equal(w2, fresh_w)
    assert loss2 == fresh_loss


def test_with_hyperparams_copies_the_arrays_a_step_donates():
    state0 = _state0()
    state = state0.with_hyperparams(learning_rate=0.5)
    for old, new in zip(
        jax.tree.leaves((state0.step, state0.params, state0.opt_state)),
        jax.tree.leaves((state.step, state.params, state.opt_state)),
        strict=True,
    ):
        assert old is not new
        assert old.unsafe_buffer_pointer() != new.unsafe_buffer_pointer()


def test_a_replaced_state_used_after_fit_names_the_fit_that_consumed_it():
    state0 = _state0()
    step = pztrain.build_train_step(_loss_fn)
    data = pztrain.ArrayLoader({"x": X, "y": Y}, 8, seed=0)
    shared = state0.replace(root_rng=jax.random.key(1))  # shares params and step
    line = inspect.currentframe().f_lineno + 1
    pztrain.fit(shared, step, data, num_steps=2, progress=False)

    where = f"pztrain.fit(...) called at {__file__}:{line} was given them"
    with pytest.raises(pztrain.DonatedStateError, match=re.escape(where)):
        pztrain.fit(state0, step, data, num_steps=2, progress=False)
    with pytest.raises(pztrain.DonatedStateError, match=re.escape(where)):
        state0.with_hyperparams(learning_rate=0.5)
    with pytest.raises(
        pztrain.DonatedStateError,
        match=re.escape("shares the arrays it does not replace"),
    ):
        step(state0, x=X, y=Y)


def test_a_consumed_state_fails_before_xla_logs_its_error(capfd):
    state = _state0()
    step = pztrain.build_train_step(_loss_fn)
    step(state, x=X, y=Y)
    capfd.readouterr()

    with pytest.raises(
        pztrain.DonatedStateError,
        match=re.escape("train_step(state, ...): the params of this TrainState"),
    ) as raised:
        step(state, x=X, y=Y)
    assert raised.value.__cause__ is None  # not raised from XLA's error
    err = capfd.readouterr().err
    assert "deleted or donated" not in err, err
