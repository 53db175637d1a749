"""Flax NNX models in checkpoints: batch statistics and rng state kept everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from nnx_models import MLP, batch, loss_fn, mlp

import pztrain
from pztrain.partition import model_state


def _state(seed: int = 0):
    return pztrain.TrainState.initial_state(
        mlp(seed), optax.adam(1e-2), jax.random.key(0)
    )


def _trained(steps: int = 4):
    state = _state()
    step = pztrain.build_train_step(loss_fn)
    for s in range(steps):
        state, _ = step(state, **batch(s))
    return state


def _plain(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _assert_same_model(model: MLP, state) -> None:
    """``model`` holds ``state``'s params and model state, bit for bit."""
    got = nnx.split(model)[1]
    want = nnx.split(state.model)[1]
    la, lb = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(la) == len(lb) == 10
    for a, b in zip(la, lb, strict=True):
        np.testing.assert_array_equal(_plain(a), _plain(b))


@pytest.mark.slow  # loads into three targets (test_load_from_checkpoint_... stays fast)
def test_params_checkpoints_keep_batch_statistics_and_rng_state(tmp_path):
    trained = _trained()
    pztrain.save_params(tmp_path / "p", trained)
    names = pztrain.read_metadata(tmp_path / "p")["params"]["names"]
    assert "bn/mean" in names and "drop/rngs/key" in names
    fresh = pztrain.load_params(tmp_path / "p", mlp(seed=7))
    assert isinstance(fresh, MLP)
    _assert_same_model(fresh, trained)
    # into a state built from code, and into an abstract model
    loaded = pztrain.load_params(tmp_path / "p", _state(seed=7))
    _assert_same_model(loaded.model, trained)
    abstract = nnx.eval_shape(lambda: mlp(seed=7))
    _assert_same_model(pztrain.load_params(tmp_path / "p", abstract), trained)


@pytest.mark.slow  # an NNX run, a save and a rebuild
def test_load_from_checkpoint_rebuilds_the_model_with_its_state(tmp_path):
    trained = _trained()
    pztrain.save_params(tmp_path / "p", trained, metadata={"hparams": {"hidden": 16}})
    model = pztrain.load_from_checkpoint(
        tmp_path / "p", lambda hidden: mlp(seed=3, hidden=hidden)
    )
    _assert_same_model(model, trained)


@pytest.mark.slow  # an export and an import
def test_safetensors_hold_batch_statistics_and_key_data(tmp_path):
    trained = _trained()
    path = pztrain.export_safetensors(tmp_path / "m.safetensors", trained)
    tensors = safetensors.numpy.load_file(str(path))
    own = model_state(trained.model_without_params)
    np.testing.assert_array_equal(tensors["bn/var"], own["bn/var"])
    assert tensors["drop/rngs/key"].dtype == np.uint32
    assert tensors["drop/rngs/count"].shape == ()
    model = pztrain.import_safetensors(path, mlp(seed=5))
    _assert_same_model(model, trained)


@pytest.mark.slow  # 15 steps around a save and a load
def test_full_state_resume_is_bitwise_with_batch_norm_and_dropout(tmp_path):
    step = pztrain.build_train_step(loss_fn)
    full = _state()
    for s in range(10):
        full, _ = step(full, **batch(s))
    half = _state()
    for s in range(5):
        half, _ = step(half, **batch(s))
    pztrain.save_state(tmp_path / "s", half)
    meta = pztrain.read_metadata(tmp_path / "s")
    assert not any("bn/mean" in p for p in meta["state"]["paths"])  # stored once
    resumed = pztrain.load_state(tmp_path / "s", _state(seed=9))
    for s in range(5, 10):
        resumed, _ = step(resumed, **batch(s))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(_plain(a), _plain(b))


@pytest.mark.slow  # about 10 s: two fits and a resume
def test_fit_resumed_from_checkpoints_equals_an_uninterrupted_run(tmp_path):
    num_steps = 32
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    data = pztrain.ArrayLoader({"x": x, "y": (x[:, 0] > 0).astype(np.int32)}, 16)
    step = pztrain.build_train_step(loss_fn)

    def run(directory, steps, resume):
        state, _ = pztrain.fit(
            _state(),
            step,
            data,
            num_steps=steps,
            log_every=8,
            checkpoints=pztrain.Checkpoints(directory, every_steps=8),
            resume=resume,
            progress=False,
        )
        return state

    full = run(tmp_path / "a", num_steps, False)
    run(tmp_path / "b", num_steps // 2, False)
    resumed = run(tmp_path / "b", num_steps, True)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(_plain(a), _plain(b))
    # a Checkpoints directory loads into a fresh model with its statistics
    _assert_same_model(pztrain.load_params(tmp_path / "b", mlp(seed=4)), full)
