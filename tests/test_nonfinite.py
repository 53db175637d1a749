"""The first NaN, named: a step re-run with a finiteness check per array, only
after something went non-finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import pztrain
from pztrain.step import find_nonfinite

# Each test compiles a step and re-runs it array by array to name the first
# non-finite value: seconds apiece. The fast subset keeps the doctests of
# pztrain.step._nonfinite and NanPolicy's.
pytestmark = pytest.mark.slow

SIZES = [4, 8, 8, 8, 2]


def _model(seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
    return {
        f"layers/{i}/w": jnp.abs(jax.random.normal(k, (a, b))) / a
        for i, (k, a, b) in enumerate(zip(keys, SIZES, SIZES[1:], strict=False))
    }


def _loss(*, model, state, rng, x, y):
    del rng
    h = x
    for i in range(len(SIZES) - 1):
        h = h @ model[f"layers/{i}/w"]
        if i < 2:
            h = jnp.tanh(h)
    loss = jnp.mean((h - y) ** 2)
    return loss, state, {"loss": loss}


def _batch(n: int = 8, seed: int = 1) -> dict:
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jnp.abs(jax.random.normal(kx, (n, 4))) + 0.5  # positive: no cancelling
    return {"x": x, "y": jax.random.normal(ky, (n, 2))}


def _state(model: dict, tx=None) -> pztrain.TrainState:
    return pztrain.TrainState.initial_state(
        model, tx or optax.sgd(0.1), jax.random.key(0)
    )


def test_an_overflow_in_one_layer_is_named():
    step = pztrain.build_train_step(_loss)
    found = find_nonfinite(step, _state(_overflowing_model()), _batch(), step=1234)
    assert found.forward == ("layers/2/w",)
    assert found.operation == "dot_general"
    assert not found.loss_finite
    assert found.line().startswith(
        "non-finite values first in ['layers/2/w'] (dot_general) at step 1234; "
        "loss non-finite; grads non-finite in "
    )


def test_non_finite_grads_with_a_finite_loss_are_named():
    def loss_fn(*, model, state, rng, x, y):
        loss, state, aux = _loss(model=model, state=state, rng=rng, x=x, y=y)
        return loss + jnp.sum(jnp.sqrt(model["layers/1/gate"])), state, aux

    model = {**_model(), "layers/1/gate": jnp.zeros(3)}  # d sqrt(0) = inf
    found = find_nonfinite(pztrain.build_train_step(loss_fn), _state(model), _batch())
    assert found.line() == (
        "non-finite grads first in ['layers/1/gate'] at step 0; params non-finite "
        "in ['layers/1/gate']; loss finite"
    )


def test_an_update_that_overflows_names_the_params():
    def loss_fn(*, model, state, rng, x, y):
        loss, state, aux = _loss(model=model, state=state, rng=rng, x=x, y=y)
        return loss + 4 * jnp.sum(model["layers/1/bias"]), state, aux

    model = {**_model(), "layers/1/bias": jnp.zeros(3)}
    step = pztrain.build_train_step(loss_fn)
    found = find_nonfinite(step, _state(model, optax.sgd(1e38)), _batch())
    assert found.line() == (
        "non-finite params first in ['layers/1/bias'] after the update at step 0; "
        "grads finite; loss finite"
    )


def test_a_finite_step_says_so():
    step = pztrain.build_train_step(_loss)
    assert find_nonfinite(step, _state(_model()), _batch(), step=5).line() == (
        "step 5 re-run: loss finite; grads finite; params finite"
    )


def _traced_loss(traces: list):
    def loss_fn(**kwargs):
        traces.append(1)
        return _loss(**kwargs)

    return loss_fn


def _overflowing_model() -> dict:
    model = _model()
    model["layers/2/w"] = jnp.full((8, 8), 1e38)  # a sum of 8 overflows
    return model


def test_nan_policy_skip_names_the_first_nan_in_the_record():
    state, history = pztrain.fit(
        _state(_overflowing_model(), optax.apply_if_finite(optax.sgd(0.1), 10)),
        pztrain.build_train_step(_loss),
        pztrain.ArrayLoader(_batch(16), 4, seed=0),
        num_steps=6,
        log_every=3,
        callbacks=[pztrain.NanPolicy("skip")],
        progress=False,
    )
    first, second = history.records
    assert first["first_nonfinite_step"] == 0 and second["first_nonfinite_step"] == 3
    for record in history.records:
        step = record["first_nonfinite_step"]
        assert record["nonfinite"] == (
            f"non-finite loss at step {step}: non-finite values first in "
            f"['layers/2/w'] (dot_general) at step {step}; loss non-finite; grads "
            "non-finite in ['layers/0/w', 'layers/1/w', 'layers/2/w', "
            "'layers/3/w']; params finite"  # apply_if_finite skips the update
        )
    assert history.stop_reason is None and int(state.step) == 6


def test_nan_policy_stop_names_the_params_that_went_non_finite():
    _, history = pztrain.fit(
        _state(_overflowing_model()),
        pztrain.build_train_step(_loss),
        pztrain.ArrayLoader(_batch(16), 4, seed=0),
        num_steps=6,
        log_every=2,
        callbacks=[pztrain.NanPolicy("stop")],
        progress=False,
    )
    assert history.stop_reason.startswith(
        "non-finite loss at step 0: params non-finite in ['layers/0/w', "
    )


def test_the_normal_path_runs_nothing_more():
    traces: list = []
    fit_args = dict(num_steps=4, log_every=2, progress=False)
    pztrain.fit(
        _state(_model()),
        pztrain.build_train_step(_traced_loss(traces)),
        pztrain.ArrayLoader(_batch(16), 4, seed=0),
        **fit_args,
    )
    without = len(traces)
    traces.clear()
    _, history = pztrain.fit(
        _state(_model()),
        pztrain.build_train_step(_traced_loss(traces)),
        pztrain.ArrayLoader(_batch(16), 4, seed=0),
        callbacks=[pztrain.NanPolicy("stop")],
        **fit_args,
    )
    assert "nonfinite" not in history.records[-1]
    assert len(traces) == without  # no re-run, no other program


def _gated_loss(*, model, state, rng, x, y, g):
    """`_loss` plus a gate whose grads are 0/0 (NaN) on a batch of ``g == 0``:
    the loss stays finite at that step, the params do not."""
    loss, state, aux = _loss(model=model, state=state, rng=rng, x=x, y=y)
    return loss + jnp.sum(jnp.sqrt(model["layers/1/gate"] * jnp.mean(g))), state, aux


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_nan_policy_stop_replays_from_the_newest_checkpoint(tmp_path, steps_per_call):
    batch = _batch(64)
    g = jnp.ones(64).at[36:40].set(0.0)  # the batch of step 9 (4 a step, in order)
    ckpts = pztrain.Checkpoints(tmp_path, every_steps=4, async_save=False)
    with pytest.warns(UserWarning, match="Not saving checkpoint 12 .* not finite"):
        state, history = pztrain.fit(
            _state({**_model(), "layers/1/gate": jnp.ones(3)}),
            pztrain.build_train_step(_gated_loss, steps_per_call=steps_per_call),
            pztrain.ArrayLoader({**batch, "g": g}, 4, shuffle=False),
            num_steps=16,
            log_every=4,
            checkpoints=ckpts,
            callbacks=[pztrain.NanPolicy("stop")],
            progress=False,
        )
    # Step 9's update made the params NaN; the loss went NaN at step 10. The
    # replay from checkpoint 8 finds step 9, and re-runs it from before it.
    assert history.stop_reason == (
        "non-finite loss at step 10: non-finite grads first in ['layers/1/gate'] "
        "at step 9; params non-finite in ['layers/1/gate']; loss finite"
    )
    assert int(state.step) == 12 and ckpts.steps() == [4, 8]  # nothing else saved
