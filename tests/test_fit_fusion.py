"""With data on the device, `fit` runs the steps between two host points as
few calls of a fused program (`pztrain.step._fusion`): at most two programs
compile, and the run is bitwise the run of single calls."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain

RNG = np.random.RandomState(0)
X = RNG.randn(320, 6).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def loss_fn(*, model, state, rng, x, y):
    noise = 0.01 * jax.random.normal(rng, (x.shape[0], 1))  # keys must match too
    h = jax.nn.relu(x @ model["w1"] + model["b1"][None, :] + noise)
    logits = h @ model["w2"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state + 1, {"loss": loss, "acc": jnp.mean(logits.argmax(-1) == y)}


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (6, 16)) * 0.4,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 2)) * 0.4,
    }
    return pztrain.TrainState.initial_state(
        params, optax.adam(1e-2), jax.random.key(1), loss_fn_state=jnp.int32(0)
    )


def run(on_device, steps_per_call=1, num_steps=230, log_every=100, **kw):
    data = pztrain.ArrayLoader(
        {"x": X, "y": Y}, batch_size=8, seed=3, on_device=on_device
    )
    step = pztrain.build_train_step(loss_fn, steps_per_call=steps_per_call)
    state, history = pztrain.fit(
        init(),
        step,
        data,
        num_steps=num_steps,
        log_every=log_every,
        progress=False,
        **kw,
    )
    return state, history, step


def assert_bitwise(a, b):
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    assert int(a.step) == int(b.step)
    np.testing.assert_array_equal(a.loss_fn_state, b.loss_fn_state)
    for x, y in zip(
        jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state), strict=True
    ):
        np.testing.assert_array_equal(x, y)


def test_fused_fit_on_device_is_bitwise_the_host_run():
    host, host_history, _ = run(on_device=False)
    fused, fused_history, step = run(on_device=True)
    assert step._fused_step is not None and step._fused_step.steps_per_call == 32
    assert_bitwise(fused, host)
    strip = lambda h: [  # noqa: E731
        {k: v for k, v in r["metrics"].items() if k in ("loss", "acc")}
        for r in h.to_dicts()
    ]
    assert strip(fused_history) == strip(host_history)


def test_at_most_two_programs_compile():
    """Fusion adds one program: the fused step (traced once for the run)."""

    def traces_of(on_device):
        traces = []

        def counted(**kw):
            traces.append(1)
            return loss_fn(**kw)

        loader = pztrain.ArrayLoader(
            {"x": X, "y": Y}, batch_size=8, seed=3, on_device=on_device
        )
        step = pztrain.build_train_step(counted)
        pztrain.fit(init(), step, loader, num_steps=300, log_every=70, progress=False)
        return len(traces)

    assert traces_of(on_device=True) == traces_of(on_device=False) + 1


def test_fusion_with_steps_per_call_and_epochs():
    host, _, _ = run(on_device=False, steps_per_call=4, num_steps=None, num_epochs=3)
    fused, _, step = run(on_device=True, steps_per_call=4, num_steps=None, num_epochs=3)
    assert step._fused_step.steps_per_call == 32  # 8 calls of 4 steps
    assert_bitwise(fused, host)


def test_a_stop_between_fused_calls_keeps_what_ran():
    class StopAt:
        requested = False

    step = pztrain.build_train_step(loss_fn)
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=8, seed=3, on_device=True)
    batches = data.device_epoch(0)
    state = init()
    sums = step.metric_sums(state, batches)
    flag = StopAt()
    flag.requested = True  # read before each call after the first
    state, sums = step.accumulate(state, sums, batches, calls=40, stop_flag=flag)
    assert int(state.step) == 32  # the first (fused) call ran, nothing after it
    assert sums.read().count == 32


@pytest.mark.parametrize("members", [3])
def test_a_population_fuses_too(members):
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=8, seed=3, on_device=True)
    host = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=8, seed=3)
    step = pztrain.build_train_step(loss_fn)
    pop = pztrain.stack_members([init() for _ in range(members)])
    a, _ = pztrain.fit(pop, step, data, num_steps=100, log_every=50, progress=False)
    pop = pztrain.stack_members([init() for _ in range(members)])
    b, _ = pztrain.fit(pop, step, host, num_steps=100, log_every=50, progress=False)
    assert_bitwise(a, b)
