"""build_train_step / build_eval_step: convergence, fusion, donation, errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import (
    XOR_X,
    XOR_Y,
    equinox_mlp,
    family_state,
    xor_loss,
)

import pztrain
from pztrain import TrainState


def _state(family: str, lr: float = 0.05):
    return family_state(family, lr=lr, key_seed=42)


@pytest.mark.parametrize(
    "family",
    [
        "penzai_v2",
        # a compile per family: the fast subset keeps two (and test_train_state's
        # Flax-style step)
        pytest.param("penzai_v1", marks=pytest.mark.slow),
        "equinox",
        pytest.param("flax", marks=pytest.mark.slow),
    ],
)
def test_xor_converges(family):
    state = _state(family)
    train_step = pztrain.build_train_step(xor_loss)
    state, aux = train_step(state, x=XOR_X, y=XOR_Y)
    first = float(aux["loss"])
    for _ in range(400):
        state, aux = train_step(state, x=XOR_X, y=XOR_Y)
    assert first > 0.3
    assert float(aux["loss"]) < 1e-3
    assert int(state.step) == 401


def _rng_loss(*, model, state, rng, x, y):
    noise = 0.1 * jax.random.normal(rng, x.shape)
    loss, _, _ = xor_loss(model=model, state=None, rng=rng, x=x + noise, y=y)
    return loss, state + 1, {"loss": loss, "key_sum": jnp.sum(jax.random.key_data(rng))}


@pytest.mark.slow  # compiles its own steps
def test_keys_are_fold_in_of_the_step():
    state = _state("equinox").replace(loss_fn_state=jnp.array(100))
    train_step = pztrain.build_train_step(_rng_loss, donate=False)
    for s in range(3):
        want = jnp.sum(jax.random.key_data(jax.random.fold_in(state.root_rng, s)))
        state, aux = train_step(state, x=XOR_X, y=XOR_Y)
        assert int(aux["key_sum"]) == int(want)
    assert int(state.loss_fn_state) == 103


@pytest.mark.slow  # two steps compiled, one fused
def test_fused_steps_equal_single_steps():
    k = 4
    xs = jnp.stack([XOR_X * (i + 1) / k for i in range(k)])
    ys = jnp.stack([XOR_Y] * k)
    single = pztrain.build_train_step(_rng_loss)
    fused = pztrain.build_train_step(_rng_loss, steps_per_call=k)
    a = _state("penzai_v2").replace(loss_fn_state=jnp.array(0))
    b = _state("penzai_v2").replace(loss_fn_state=jnp.array(0))
    losses = []
    for i in range(k):
        a, aux = single(a, x=xs[i], y=ys[i])
        losses.append(aux["loss"])
    b, aux_b = fused(b, x=xs, y=ys)
    assert aux_b["loss"].shape == (k,)
    np.testing.assert_allclose(aux_b["loss"], jnp.stack(losses), rtol=1e-6)
    assert int(b.step) == int(a.step) == k
    assert int(b.loss_fn_state) == k
    for name in a.params:
        np.testing.assert_allclose(b.params[name], a.params[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # compiles its own steps
def test_no_recompiles_across_steps():
    traces = []

    def loss_fn(*, model, state, rng, x, y):
        traces.append(1)
        return xor_loss(model=model, state=state, rng=rng, x=x, y=y)

    train_step = pztrain.build_train_step(loss_fn)
    state = _state("penzai_v2")
    with jax.log_compiles(False):
        for _ in range(20):
            state, _ = train_step(state, x=XOR_X, y=XOR_Y)
    assert len(traces) == 1
    # A new batch size is a new shape: exactly one more trace.
    state, _ = train_step(state, x=XOR_X[:2], y=XOR_Y[:2])
    state, _ = train_step(state, x=XOR_X[:2], y=XOR_Y[:2])
    assert len(traces) == 2


@pytest.mark.slow  # three steps op by op
def test_jit_false_matches_jit():
    a, b = _state("equinox"), _state("equinox")
    eager = pztrain.build_train_step(xor_loss, jit=False)
    jitted = pztrain.build_train_step(xor_loss)
    for _ in range(3):
        a, aux_a = eager(a, x=XOR_X, y=XOR_Y)
        b, aux_b = jitted(b, x=XOR_X, y=XOR_Y)
    np.testing.assert_allclose(aux_a["loss"], aux_b["loss"], rtol=1e-5)


@pytest.mark.slow  # compiles its own steps
def test_compute_grads_matches_apply_gradients_path():
    state = _state("penzai_v1")
    train_step = pztrain.build_train_step(xor_loss, donate=False)
    out = train_step.compute_grads(state, x=XOR_X, y=XOR_Y)
    assert set(out.grads) == set(state.params)
    manual = state.apply_gradients(out.grads)
    stepped, aux = train_step(state, x=XOR_X, y=XOR_Y)
    np.testing.assert_allclose(out.loss, aux["loss"], rtol=1e-6)
    for name in state.params:
        np.testing.assert_allclose(
            manual.params[name], stepped.params[name], rtol=1e-5, atol=1e-7
        )


@pytest.mark.slow  # compiles its own steps
def test_donation_consumes_the_old_state_with_a_clear_error():
    model = equinox_mlp()
    state = TrainState.initial_state(model, optax.adam(0.01), jax.random.key(0))
    train_step = pztrain.build_train_step(xor_loss)
    new, _ = train_step(state, x=XOR_X, y=XOR_Y)
    assert state.params["layers/0/weight"].is_deleted()
    assert not model.layers[0].weight.is_deleted()  # the user's model is intact
    with pytest.raises(
        pztrain.DonatedStateError, match=re.escape("were donated to a train step")
    ):
        train_step(state, x=XOR_X, y=XOR_Y)
    with pytest.raises(pztrain.DonatedStateError, match="state.model"):
        _ = state.model
    new, _ = train_step(new, x=XOR_X, y=XOR_Y)  # the returned state is fine
    kept = pztrain.build_train_step(xor_loss, donate=False)
    again, _ = kept(new, x=XOR_X, y=XOR_Y)
    assert not new.params["layers/0/weight"].is_deleted()


def test_donation_aliases_params_and_optimizer_state():
    state = _state("penzai_v2")
    train_step = pztrain.build_train_step(xor_loss)
    compiled = train_step.lower(state, x=XOR_X, y=XOR_Y).compile()
    donated = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    assert compiled.memory_analysis().alias_size_in_bytes >= donated


def test_eval_step_is_pure_and_uses_its_own_key():
    def eval_fn(*, model, state, rng, x, y):
        loss, _, _ = xor_loss(model=model, state=state, rng=rng, x=x, y=y)
        return {"loss": loss, "key": jax.random.key_data(rng)}

    state = _state("penzai_v2")
    eval_step = pztrain.build_eval_step(eval_fn)
    m1 = eval_step(state, x=XOR_X, y=XOR_Y)
    m2 = eval_step(state, x=XOR_X, y=XOR_Y)
    np.testing.assert_array_equal(m1["loss"], m2["loss"])
    train_key = jax.random.key_data(jax.random.fold_in(state.root_rng, 0))
    assert not np.array_equal(m1["key"], train_key)
    assert (
        int(state.step) == 0
        and not state.params["mlp/Affine_0/Linear.weights"].is_deleted()
    )


# ------------------------------------------------------------------ errors


def _run(loss_fn, state=None, steps_per_call=1, **batch):
    state = state or _state("equinox")
    batch = batch or {"x": XOR_X, "y": XOR_Y}
    pztrain.build_train_step(loss_fn, steps_per_call=steps_per_call)(state, **batch)


def test_error_loss_not_a_3_tuple():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "must return a 3-tuple (loss, new_state, aux); got a tuple of length 2"
        ),
    ):
        _run(lambda **kw: xor_loss(**kw)[:2])
    with pytest.raises(TypeError, match=re.escape("got a float32[] array")):
        _run(lambda **kw: xor_loss(**kw)[0])


def test_error_loss_not_scalar_or_not_float():
    def vector_loss(*, model, state, rng, x, y):
        return jnp.ones(4), state, {}

    def int_loss(*, model, state, rng, x, y):
        return jnp.array(1, jnp.int32), state, {}

    with pytest.raises(
        ValueError, match=re.escape("The loss must be a scalar; got shape [4]")
    ):
        _run(vector_loss)
    with pytest.raises(
        TypeError, match=re.escape("must be a floating-point scalar; got int32")
    ):
        _run(int_loss)


def test_error_new_state_structure():
    def bad_state(*, model, state, rng, x, y):
        loss, _, aux = xor_loss(model=model, state=state, rng=rng, x=x, y=y)
        return loss, {"count": state["count"], "extra": 1.0}, aux

    def bad_dtype(*, model, state, rng, x, y):
        loss, _, aux = xor_loss(model=model, state=state, rng=rng, x=x, y=y)
        return loss, {"count": state["count"] + 0.5}, aux

    state = _state("equinox").replace(loss_fn_state={"count": jnp.array(0)})
    with pytest.raises(
        ValueError,
        match=re.escape("new_state must have the structure of the loss_fn_state"),
    ):
        _run(bad_state, state)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "new_state['count'] is float32[] but loss_fn_state holds int32[]"
        ),
    ):
        _run(bad_dtype, state)


def test_error_batch_leading_axes():
    with pytest.raises(
        ValueError,
        match=re.escape("must share their leading (batch) axis; got x: 4, y: 3"),
    ):
        _run(xor_loss, x=XOR_X, y=XOR_Y[:3])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "With steps_per_call=2 every batch leaf needs a leading axis of 2"
        ),
    ):
        _run(xor_loss, steps_per_call=2, x=XOR_X, y=XOR_Y)


def test_error_build_arguments():
    with pytest.raises(ValueError, match="steps_per_call must be an int >= 1; got 0"):
        pztrain.build_train_step(xor_loss, steps_per_call=0)
    with pytest.raises(ValueError, match=re.escape("donate=True needs jit=True")):
        pztrain.build_train_step(xor_loss, jit=False, donate=True)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pztrain.build_train_step("loss")


@pytest.mark.slow
def test_shardings_are_passed_to_jit():
    """Params sharded over 4 CPU devices stay sharded through the step."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, optax
        from jax.sharding import NamedSharding, PartitionSpec as P
        import pztrain
        mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
        params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
        key = jax.random.key(0)
        state = pztrain.TrainState.initial_state(params, optax.adam(0.1), key)
        row = NamedSharding(mesh, P("d"))
        rep = NamedSharding(mesh, P())
        p_sh = {"w": row, "b": rep}
        o_sh = jax.tree.map(lambda _: rep, state.opt_state)
        o_sh = (o_sh[0]._replace(mu=p_sh, nu=p_sh), o_sh[1])
        shardings = state.replace(params=p_sh, opt_state=o_sh, loss_fn_state=None)
        def loss_fn(*, model, state, rng, x):
            loss = jnp.mean((x @ model["w"] + model["b"][None]) ** 2)
            return loss, state, {"loss": loss}
        step = pztrain.build_train_step(loss_fn, state_shardings=shardings,
                                        batch_shardings={"x": rep})
        state, aux = step(state, x=jnp.ones((2, 8)))
        w = state.params["w"]
        print(w.sharding.spec, len(w.sharding.device_set))
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["P('d',)", "4"]


# ------------------------------------------------------------ one hot path


@pytest.mark.slow  # compiles its own steps
def test_accumulate_calls_equal_single_calls_and_sum_their_metrics():
    step = pztrain.build_train_step(_rng_loss)
    a = _state("equinox").replace(loss_fn_state=jnp.array(0))
    b = _state("equinox").replace(loss_fn_state=jnp.array(0))
    losses = []
    for _ in range(5):
        a, aux = step(a, x=XOR_X, y=XOR_Y)
        losses.append(float(aux["loss"]))
    sums = step.metric_sums(b, x=XOR_X, y=XOR_Y)
    assert sums.names == ("loss", "key_sum")
    b, sums = step.accumulate(b, sums, {"x": XOR_X, "y": XOR_Y}, calls=5)
    assert int(b.step) == 5 and int(b.loss_fn_state) == 5
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    summary = sums.read()
    assert summary.count == 5
    assert summary.means["loss"] == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.slow  # compiles its own steps
def test_call_accumulate_and_grads_share_one_program_cache():
    traces = []

    def loss_fn(*, model, state, rng, x, y):
        traces.append(1)
        return xor_loss(model=model, state=state, rng=rng, x=x, y=y)

    step = pztrain.build_train_step(loss_fn)
    state = _state("penzai_v2")
    sums = step.metric_sums(state, x=XOR_X, y=XOR_Y)  # a forward trace
    assert len(traces) == 1
    for _ in range(3):
        state, _ = step(state, x=XOR_X, y=XOR_Y)
        state, sums = step.accumulate(state, sums, x=XOR_X, y=XOR_Y)
    assert len(traces) == 3  # one trace for the call, one for accumulate
    state, _ = step(state, {"x": XOR_X, "y": XOR_Y})  # a positional dict: the same
    assert len(traces) == 3


def test_a_batch_is_keyword_arrays_or_one_positional_batch():
    step = pztrain.build_train_step(xor_loss, donate=False)
    state = _state("equinox")
    by_kw, aux_kw = step(state, x=XOR_X, y=XOR_Y)
    by_dict, aux_dict = step(state, {"x": XOR_X, "y": XOR_Y})
    np.testing.assert_array_equal(aux_kw["loss"], aux_dict["loss"])
    with pytest.raises(TypeError, match="not both; got dict and keys \\['y'\\]"):
        step(state, {"x": XOR_X}, y=XOR_Y)


@pytest.mark.slow  # compiles its own steps
def test_scalar_batch_arguments_reach_the_loss_function():
    def scaled(*, model, state, rng, x, y, scale):
        loss, state, aux = xor_loss(model=model, state=state, rng=rng, x=x, y=y)
        return loss * scale, state, aux

    step = pztrain.build_train_step(scaled, donate=False)
    state = _state("equinox")
    _, one = step(state, x=XOR_X, y=XOR_Y, scale=jnp.float32(1.0))
    _, two = step(state, x=XOR_X, y=XOR_Y, scale=jnp.float32(2.0))
    assert float(two["loss"]) == float(one["loss"])  # aux is the unscaled loss
    grads1 = step.compute_grads(state, x=XOR_X, y=XOR_Y, scale=jnp.float32(1.0))
    grads2 = step.compute_grads(state, x=XOR_X, y=XOR_Y, scale=jnp.float32(2.0))
    assert float(grads2.loss) == pytest.approx(2 * float(grads1.loss), rel=1e-6)


@pytest.mark.parametrize(
    "make_key",
    [
        lambda: jax.random.key(3),
        pytest.param(lambda: jax.random.key(3, impl="rbg"), marks=pytest.mark.slow),
        pytest.param(lambda: jax.random.PRNGKey(3), marks=pytest.mark.slow),
    ],
    ids=["threefry", "rbg", "legacy"],
)
def test_every_kind_of_root_key_gives_the_contracts_keys(make_key):
    """The key crosses jit as its raw data; inside it is the same key."""

    def key_loss(*, model, state, rng, x, y):
        loss, _, _ = xor_loss(model=model, state=None, rng=rng, x=x, y=y)
        data = jax.random.key_data(rng) if rng.dtype != jnp.uint32 else rng
        return loss, state, {"key": data}

    root = make_key()
    state = TrainState.initial_state(equinox_mlp(), optax.sgd(0.1), root)
    step = pztrain.build_train_step(key_loss, donate=False)
    evaluate = pztrain.build_eval_step(
        lambda **kw: (
            {"key": jax.random.key_data(kw["rng"])}
            if kw["rng"].dtype != jnp.uint32
            else {"key": kw["rng"]}
        )
    )
    for s in range(2):
        want = jax.random.fold_in(root, s)
        want = jax.random.key_data(want) if want.dtype != jnp.uint32 else want
        got = evaluate(state, x=XOR_X, y=XOR_Y)["key"]
        eval_want = jax.random.fold_in(jax.random.fold_in(root, s), 1)
        if eval_want.dtype != jnp.uint32:
            eval_want = jax.random.key_data(eval_want)
        np.testing.assert_array_equal(got, eval_want)
        state, aux = step(state, x=XOR_X, y=XOR_Y)
        np.testing.assert_array_equal(aux["key"], want)
    assert state.root_rng is root  # the state keeps the key as given


def test_bfloat16_arrays_are_params():
    model = {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.zeros(2, jnp.float32)}
    state = TrainState.initial_state(model, optax.sgd(0.5), jax.random.key(0))
    assert sorted(state.params) == ["b", "w"]

    def loss_fn(*, model, state, rng, x):
        out = x @ model["w"].astype(jnp.float32) + model["b"][None]
        return jnp.sum(out), state, {}

    step = pztrain.build_train_step(loss_fn)
    state, _ = step(state, x=jnp.ones((1, 2)))
    assert state.params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(state.params["w"], np.full((2, 2), 0.5))


@pytest.mark.slow  # compiles its own steps
def test_python_numbers_in_a_batch_work_with_and_without_jit():
    def scaled(*, model, state, rng, x, y, scale):
        loss, state, aux = xor_loss(model=model, state=state, rng=rng, x=x, y=y)
        return loss * scale, state, {"scaled": loss * scale}

    losses = []
    for jit in (True, False):
        step = pztrain.build_train_step(scaled, jit=jit)
        _, aux = step(_state("equinox"), x=XOR_X, y=XOR_Y, scale=0.5)
        losses.append(float(aux["scaled"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
