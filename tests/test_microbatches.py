"""build_train_step(microbatches=m): gradient accumulation inside the step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai import pz

from pztrain.data import ArrayLoader, BatchError
from pztrain.loop import fit
from pztrain.state import TrainState
from pztrain.step import build_train_step

B, M, FEATURES = 16, 4, 3
ATOL = 1e-5


def _data(seed: int = 0, n: int = B):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def mean_loss(*, model, state, rng, x, y):
    """A deterministic mean loss; aux: a float and an int scalar, an array."""
    del rng
    err = (x @ model["w"] + model["b"] - y) ** 2
    loss = jnp.mean(err)
    return loss, state, {"mse": loss, "count": jnp.int32(x.shape[0]), "err": err}


def _state(tx=None, root=0, loss_fn_state=None):
    params = {"w": jnp.zeros(FEATURES), "b": jnp.zeros(())}
    tx = optax.adam(0.1) if tx is None else tx
    return TrainState.initial_state(
        params, tx, jax.random.key(root), loss_fn_state=loss_fn_state
    )


def _close(a, b, atol=ATOL):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=atol, rtol=0)


def test_microbatches_equal_the_full_batch_step_and_combine_aux():
    x, y = _data()
    full, micro = (
        build_train_step(mean_loss),
        build_train_step(mean_loss, microbatches=M),
    )
    a, b = _state(), _state()
    for _ in range(5):
        a, aux_a = full(a, x=x, y=y)
        b, aux_b = micro(b, x=x, y=y)
    _close(a.params, b.params)
    assert int(b.step) == 5
    # The params moved: the equality above is not vacuous.
    assert float(jnp.abs(b.params["w"]).max()) > 0.3
    np.testing.assert_allclose(aux_b["mse"], aux_a["mse"], atol=ATOL)
    # Float scalars averaged, int scalars summed, arrays back in batch order.
    assert aux_b["count"].dtype == jnp.int32 and int(aux_b["count"]) == B
    assert aux_b["err"].shape == (B,)
    np.testing.assert_allclose(aux_b["err"], aux_a["err"], atol=ATOL)
    np.testing.assert_allclose(aux_b["mse"], jnp.mean(aux_b["err"]), atol=ATOL)


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_microbatches_equal_multisteps_over_the_strided_microbatches():
    x, y = _data(1)
    micro = build_train_step(mean_loss, microbatches=M)
    multi = build_train_step(mean_loss)
    a = _state()
    b = _state(optax.MultiSteps(optax.adam(0.1), every_k_schedule=M))
    for _ in range(3):
        a, _ = micro(a, x=x, y=y)
        for i in range(M):  # micro-batch i holds examples i, i + M, ...
            b, _ = multi(b, x=x[i::M], y=y[i::M])
    _close(a.params, b.params)
    assert int(b.opt_state.gradient_step) == 3


def keyed_loss(*, model, state, rng, x, y):
    """Returns its key's data per example, and counts its calls in ``state``."""
    loss = jnp.mean((x @ model["w"] + model["b"] - y) ** 2)
    n = x.shape[0]
    rows = {"key": jnp.broadcast_to(jax.random.key_data(rng), (n, 2))}
    rows["seen"] = jnp.broadcast_to(state, (n,))  # the counter this call got
    return loss, state + 1, rows


@pytest.mark.slow  # a second or more (compiles, imports)
def test_microbatch_keys_and_loss_fn_state_thread_in_order():
    x, y = _data(2)
    step = build_train_step(keyed_loss, microbatches=M)
    state = _state(root=7, loss_fn_state=jnp.int32(0))
    root = jax.random.key(7)
    for s in range(3):
        state, aux = step(state, x=x, y=y)
        step_key = jax.random.fold_in(root, s)
        want = [
            jax.random.key_data(jax.random.fold_in(step_key, j % M)) for j in range(B)
        ]
        np.testing.assert_array_equal(aux["key"], np.stack(want))
        # Micro-batch i saw the counter after the i before it, step after step.
        np.testing.assert_array_equal(aux["seen"], [s * M + j % M for j in range(B)])
    assert int(state.loss_fn_state) == 3 * M


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_steps_per_call_with_microbatches_equals_separate_calls():
    (x0, y0), (x1, y1) = _data(3), _data(4)
    fused = build_train_step(mean_loss, steps_per_call=2, microbatches=2)
    single = build_train_step(mean_loss, microbatches=2)
    a, aux_a = fused(_state(), x=jnp.stack([x0, x1]), y=jnp.stack([y0, y1]))
    b, aux_b0 = single(_state(), x=x0, y=y0)
    b, aux_b1 = single(b, x=x1, y=y1)
    _close(a.params, b.params, atol=1e-6)
    assert int(a.step) == int(b.step) == 2
    np.testing.assert_allclose(aux_a["err"], np.stack([aux_b0["err"], aux_b1["err"]]))
    np.testing.assert_array_equal(aux_a["count"], [B, B])


def test_compute_grads_averages_over_microbatches():
    x, y = _data(5)
    state = _state()
    one = build_train_step(mean_loss).compute_grads(state, x=x, y=y)
    four = build_train_step(mean_loss, microbatches=M).compute_grads(state, x=x, y=y)
    _close(one.grads, four.grads, atol=1e-6)
    np.testing.assert_allclose(four.loss, one.loss, atol=1e-6)
    assert int(four.aux["count"]) == B


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_fit_with_microbatches_logs_the_averaged_loss():
    x, y = _data(6, n=4 * B)
    runs = {}
    for m in (1, M):
        runs[m] = fit(
            _state(),
            build_train_step(mean_loss, microbatches=m),
            ArrayLoader({"x": x, "y": y}, batch_size=B, seed=0),
            num_steps=8,
            log_every=4,
            progress=False,
            loggers=[],
        )
    (a, hist_a), (b, hist_b) = runs[1], runs[M]
    assert int(b.step) == 8
    _close(a.params, b.params)
    steps, losses = hist_b.series("loss")
    assert steps == [4, 8]
    np.testing.assert_allclose(losses, hist_a.series("loss")[1], atol=ATOL)
    # one MetricSums entry per optimizer step; the int metric summed per step
    assert hist_b.series("count")[1] == [B, B]


def test_a_batch_that_does_not_split_is_refused_by_name():
    x, y = _data(7, n=10)
    step = build_train_step(mean_loss, microbatches=M)
    with pytest.raises(
        BatchError,
        match=re.escape("microbatches=4")
        + ".*"
        + re.escape("batch['x'] has shape [10, 3]"),
    ):
        step(_state(), x=x, y=y)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
            build_train_step(mean_loss, microbatches=bad)


@pz.pytree_dataclass
class CountCalls(pz.nn.Layer):
    """Counts its calls in a penzai state variable; passes its input through."""

    count: pz.StateVariable

    def __call__(self, x, **side_inputs):
        del side_inputs
        self.count.value = self.count.value + 1
        return x


@pytest.mark.slow  # a second or more (compiles, imports)
def test_penzai_state_variables_are_threaded_through_microbatches():
    model = pz.nn.Sequential(
        [
            pz.nn.Affine.from_config(
                name="affine",
                init_base_rng=jax.random.key(0),
                input_axes={"features": FEATURES},
                output_axes={"out": 1},
            ),
            CountCalls(count=pz.StateVariable(jnp.int32(0), label="calls")),
        ]
    )

    def loss_fn(*, model, state, rng, x, y):
        del rng
        out = model(pz.nx.wrap(x).tag("batch", "features"))
        pred = out.untag("batch", "out").unwrap()[:, 0]
        return jnp.mean((pred - y) ** 2), state, {}

    x, y = _data(8)
    state = TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0))
    step = build_train_step(loss_fn, microbatches=M)
    for _ in range(2):
        state, _ = step(state, x=x, y=y)
    _, state_vars = pz.unbind_state_vars(state.model)
    assert [int(v.value) for v in state_vars] == [2 * M]


@pytest.mark.slow  # compiles steps of its own (seconds)
def test_scalar_batch_leaves_go_whole_to_every_microbatch_also_without_jit():
    def scaled(*, model, state, rng, x, y, scale):
        loss, state, _ = mean_loss(model=model, state=state, rng=rng, x=x, y=y)
        return scale * loss, state, {}

    x, y = _data(9)
    want, _ = build_train_step(scaled)(_state(), x=x, y=y, scale=3.0)
    for jit in (True, False):
        step = build_train_step(scaled, jit=jit, microbatches=M)
        got, aux = step(_state(), x=x, y=y, scale=jnp.float32(3.0))
        _close(want.params, got.params, atol=1e-6)
        assert aux == {}
