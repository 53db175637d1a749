"""A step composes with JAX's own transformations: called inside the user's
``jax.jit``, ``lax.scan``, ``lax.fori_loop``, ``jax.vmap`` and ``jax.grad``, it
gives what the plain Python loop gives (within float rounding)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain


def loss_fn(*, model, state, rng, x, y):
    noise = 0.01 * jax.random.normal(rng, y.shape)  # the step's key matters
    pred = jnp.tanh(x @ model["w1"]) @ model["w2"]
    loss = jnp.mean((pred - y - noise) ** 2)
    return loss, state + 1, {"loss": loss, "pred_mean": jnp.mean(pred)}


def eval_fn(*, model, state, rng, x, y):
    pred = jnp.tanh(x @ model["w1"]) @ model["w2"]
    return {"mse": jnp.mean((pred - y) ** 2)}


def make_state(seed=0, lr=0.05):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (3, 4)) * 0.5,
        "w2": jax.random.normal(k2, (4,)) * 0.5,
    }
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    return pztrain.TrainState.initial_state(
        params, tx, jax.random.key(seed + 100), loss_fn_state=jnp.zeros((), jnp.int32)
    )


X = jax.random.normal(jax.random.key(7), (8, 3))
Y = jnp.sin(X[:, 0])


def python_loop(step, state, n):
    losses = []
    for _ in range(n):
        state, aux = step(state, x=X, y=Y)
        losses.append(aux["loss"])
    return state, jnp.stack(losses)


def assert_states_close(a, b, rtol=1e-5):
    assert int(a.step) == int(b.step)
    assert int(a.loss_fn_state) == int(b.loss_fn_state)
    for name in a.params:
        np.testing.assert_allclose(a.params[name], b.params[name], rtol=rtol, atol=1e-6)


@pytest.fixture(scope="module")
def eager():
    return python_loop(pztrain.build_train_step(loss_fn, donate=False), make_state(), 4)


def test_step_inside_jit_equals_eager(eager):
    """The regression of 9bc5ac1: a donating step under the user's jit."""
    step = pztrain.build_train_step(loss_fn)  # donates by default
    state = make_state()
    jitted = jax.jit(lambda s: step(s, x=X, y=Y))
    losses = []
    for _ in range(4):
        state, aux = jitted(state)
        losses.append(aux["loss"])
    assert_states_close(state, eager[0])
    np.testing.assert_allclose(jnp.stack(losses), eager[1], rtol=1e-6)


def test_step_inside_scan_equals_eager(eager):
    step = pztrain.build_train_step(loss_fn)
    state, aux = jax.lax.scan(
        lambda s, _: step(s, x=X, y=Y), make_state(), None, length=4
    )
    assert_states_close(state, eager[0])
    np.testing.assert_allclose(aux["loss"], eager[1], rtol=1e-5)


def test_step_inside_fori_loop_equals_eager(eager):
    step = pztrain.build_train_step(loss_fn)
    state = jax.lax.fori_loop(0, 4, lambda i, s: step(s, x=X, y=Y)[0], make_state())
    assert_states_close(state, eager[0])


def test_fused_and_single_steps_inside_jit(eager):
    """``steps_per_call=2`` under the user's jit, and ``single()`` under scan."""
    fused = pztrain.build_train_step(loss_fn, steps_per_call=2)
    two = jax.tree.map(lambda a: jnp.stack([a, a]), {"x": X, "y": Y})
    state = make_state()
    run = jax.jit(lambda s: fused(s, **two))
    state, aux = run(state)
    state, aux2 = run(state)
    assert_states_close(state, eager[0])
    np.testing.assert_allclose(
        jnp.concatenate([aux["loss"], aux2["loss"]]), eager[1], rtol=1e-5
    )
    single = fused.single()
    state, aux = jax.lax.scan(
        lambda s, _: single(s, x=X, y=Y), make_state(), None, length=4
    )
    assert_states_close(state, eager[0])


def test_accumulate_inside_jit(eager):
    step = pztrain.build_train_step(loss_fn)
    sums = step.metric_sums(make_state(), x=X, y=Y)
    state, sums = jax.jit(lambda s, m: step.accumulate(s, m, x=X, y=Y, calls=4))(
        make_state(), sums
    )
    assert_states_close(state, eager[0])
    summary = sums.read()
    assert summary.count == 4
    np.testing.assert_allclose(summary.means["loss"], float(eager[1].mean()), rtol=1e-5)


def test_eval_step_inside_jit_and_vmap():
    eval_step = pztrain.build_eval_step(eval_fn)
    state = make_state()
    plain = eval_step(state, x=X, y=Y)["mse"]
    assert jax.jit(lambda s: eval_step(s, x=X, y=Y))(state)["mse"] == pytest.approx(
        float(plain), rel=1e-6
    )
    states = jax.vmap(make_state)(jnp.arange(3))
    mse = jax.vmap(lambda s: eval_step(s, x=X, y=Y))(states)["mse"]
    for i in range(3):
        solo = eval_step(make_state(i), x=X, y=Y)["mse"]
        np.testing.assert_allclose(mse[i], solo, rtol=1e-5)


def test_step_inside_vmap_equals_each_member():
    """Members differing in seed and learning rate, vmapped, equal solo runs."""
    seeds, lrs = jnp.arange(3), jnp.array([0.01, 0.05, 0.1])
    step = pztrain.build_train_step(loss_fn)
    states = jax.vmap(make_state)(seeds, lrs)
    vstep = jax.jit(jax.vmap(lambda s: step(s, x=X, y=Y)))
    for _ in range(3):
        states, aux = vstep(states)
    solo_step = pztrain.build_train_step(loss_fn, donate=False)
    for i in range(3):
        solo, losses = python_loop(solo_step, make_state(i, float(lrs[i])), 3)
        np.testing.assert_allclose(aux["loss"][i], losses[-1], rtol=1e-4)
        for name in solo.params:
            np.testing.assert_allclose(
                states.params[name][i], solo.params[name], rtol=1e-4, atol=1e-6
            )


def test_grad_through_unrolled_steps_wrt_learning_rate():
    """Meta-learning: d(loss after 3 steps)/d(learning rate), through the step,
    against a central finite difference."""
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state0 = pztrain.TrainState.initial_state(
        {"w1": jnp.full((3, 4), 0.1), "w2": jnp.linspace(-0.5, 0.5, 4)},
        tx,
        jax.random.key(0),
        loss_fn_state=jnp.zeros((), jnp.int32),
    )
    step = pztrain.build_train_step(loss_fn)

    def final_loss(lr):
        state = state0.with_hyperparams(learning_rate=lr)
        _, aux = jax.lax.scan(lambda s, _: step(s, x=X, y=Y), state, None, length=3)
        return aux["loss"][-1]

    grad = jax.grad(final_loss)(0.1)
    eps = 1e-2
    numeric = (final_loss(0.1 + eps) - final_loss(0.1 - eps)) / (2 * eps)
    assert float(grad) == pytest.approx(float(numeric), rel=2e-2)
    assert abs(float(grad)) > 1e-3  # the check could fail


def test_eager_donation_check_still_fires():
    """Skipping the check under a trace leaves the eager one as it was."""
    step = pztrain.build_train_step(loss_fn)
    state = make_state()
    step(state, x=X, y=Y)
    with pytest.raises(pztrain.DonatedStateError, match="donated"):
        step(state, x=X, y=Y)
