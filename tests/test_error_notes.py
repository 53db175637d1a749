"""Errors inside the loss name the step's inputs; an optimizer state of another
optimizer is refused by name."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain


def _loss(*, model, state, rng, x, y):
    del rng
    loss = jnp.mean((x @ model["w"] + model["b"] - y) ** 2)
    return loss, state, {"loss": loss}


def _state(tx=None):
    model = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    return pztrain.TrainState.initial_state(
        model, tx or optax.adam(0.1), jax.random.key(0)
    )


def _notes(err: BaseException) -> str:
    """pztrain's note (JAX may add its own)."""
    ours = [n for n in getattr(err, "__notes__", []) if n.startswith("pztrain:")]
    assert len(ours) == 1, err.__notes__
    return ours[0]


def test_a_wrong_feature_size_names_the_batch_and_params():
    step = pztrain.build_train_step(_loss)
    with pytest.raises(TypeError, match="dot_general") as info:
        step(_state(), x=jnp.ones((8, 5)), y=jnp.ones((8, 1)))
    notes = _notes(info.value)
    assert "x: float32[8, 5]" in notes and "y: float32[8, 1]" in notes
    assert "w: float32[4, 1]" in notes and "b: float32[1]" in notes
    assert len(notes.splitlines()) <= 15


def test_a_python_list_batch_is_named():
    step = pztrain.build_train_step(_loss)
    with pytest.raises(TypeError) as info:
        step(_state(), x=[[1.0] * 4] * 8, y=jnp.ones((8, 1)))
    assert "x: a Python list of 8 (a batch holds arrays: np.asarray it)" in _notes(
        info.value
    )


def test_the_note_lists_at_most_a_few_lines_of_a_big_model():
    params = {f"layer{i}/w": jnp.zeros((4, 4)) for i in range(40)}

    def loss_fn(*, model, state, rng, **batch):
        raise KeyError("missing")

    state = pztrain.TrainState.initial_state(params, optax.sgd(0.1), jax.random.key(0))
    batch = {f"k{i}": np.zeros((2, 3), np.int32) for i in range(20)}
    with pytest.raises(KeyError) as info:
        pztrain.build_train_step(loss_fn)(state, **batch)
    notes = _notes(info.value)
    assert "k0: int32[2, 3]" in notes and "... and 15 more" in notes
    assert "params (40):" in notes and "... and 35 more" in notes
    assert len(notes.splitlines()) <= 15


def test_eval_and_compute_grads_errors_name_their_inputs_too():
    state = _state()
    bad = {"x": jnp.ones((8, 5)), "y": jnp.ones((8, 1))}
    with pytest.raises(TypeError) as info:
        pztrain.build_train_step(_loss).compute_grads(state, **bad)
    assert "compute_grads(state, ...) raised" in _notes(info.value)

    def eval_fn(*, model, state, rng, x, y):
        return {"mse": jnp.mean((x @ model["w"] - y) ** 2)}

    with pytest.raises(TypeError) as info:
        pztrain.build_eval_step(eval_fn)(state, **bad)
    assert "x: float32[8, 5]" in _notes(info.value)


OTHER_STATE = re.escape(
    "opt_state is not a state of this optimizer (optimizer_def) for these params: "
    "it lacks [0].count, [0].mu['b'], [0].mu['w'], [0].nu['b'] and 1 more; "
    "it has [0].trace['b'], [0].trace['w'], which the optimizer does not make"
)


def test_replace_refuses_another_optimizers_state_by_name():
    state = _state()
    other = optax.sgd(0.1, momentum=0.9).init(state.params)
    with pytest.raises(ValueError, match=OTHER_STATE) as info:
        state.replace(opt_state=other)
    message = str(info.value)
    assert "its states are ['TraceState', 'EmptyState']" in message
    # Both together are fine; so is a state of the same optimizer.
    tx = optax.sgd(0.1, momentum=0.9)
    moved = state.replace(optimizer_def=tx, opt_state=other)
    assert moved.apply_gradients(moved.params).step == 1
    assert state.replace(opt_state=optax.adam(0.5).init(state.params)).step == 0


def test_a_state_for_other_params_and_a_lone_optimizer_are_refused_where_used():
    state = _state()
    wider = optax.adam(0.1).init({"w": jnp.zeros((5, 1)), "b": jnp.zeros(1)})
    with pytest.raises(
        ValueError,
        match=re.escape("[0].mu['w'] (float32[5, 1], expected float32[4, 1])"),
    ):
        state.replace(opt_state=wider)
    # A new optimizer alone is Flax's habit (tx= first, opt_state= next): it is
    # checked where it is used.
    lone = state.replace(optimizer_def=optax.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=re.escape("it lacks [0].trace['b']")):
        lone.apply_gradients(state.params)
    with pytest.raises(ValueError, match=re.escape("it lacks [0].trace['b']")):
        pztrain.build_train_step(_loss)(lone, x=jnp.ones((8, 4)), y=jnp.ones((8, 1)))


def test_apply_gradients_refuses_a_mismatched_state():
    state = _state()
    broken = dataclasses.replace(
        state, opt_state=optax.sgd(0.1, momentum=0.9).init(state.params)
    )
    with pytest.raises(ValueError, match=OTHER_STATE):
        broken.apply_gradients(state.params)


_BAD = {"x": np.ones((16, 5), np.float32), "y": np.ones((16, 1), np.float32)}


def _direct(k: int, on_device: bool):
    step = pztrain.build_train_step(_loss, steps_per_call=k)
    if on_device:
        batch = _bad_loader(True).device_epoch(0)
    else:
        batch = {
            key: np.stack([v[:8]] * k) if k > 1 else v[:8] for key, v in _BAD.items()
        }
    return lambda: step(_state(), batch)


def _bad_loader(on_device: bool):
    return pztrain.ArrayLoader(_BAD, 8, shuffle=False, on_device=on_device)


@pytest.mark.parametrize(
    ("k", "data", "prefetch"),
    [
        (1, "list", 2),  # batches moved ahead in the prefetch thread
        (1, "list", 0),
        (1, "loader", 2),
        (2, "loader", 2),  # fused: k steps a call
        (1, "on_device", 2),  # IndexedBatches, several calls in one
    ],
)
def test_fit_gives_the_note_a_direct_call_gives(k, data, prefetch):
    with pytest.raises(TypeError, match="dot_general") as direct:
        _direct(k, data == "on_device")()
    train_data = {
        "list": [{key: v[:8] for key, v in _BAD.items()}] * 2,
        "loader": _bad_loader(False),
        "on_device": _bad_loader(True),
    }[data]
    step = pztrain.build_train_step(_loss, steps_per_call=k)
    with pytest.raises(TypeError, match="dot_general") as in_fit:
        pztrain.fit(
            _state(), step, train_data, num_steps=2 * k, prefetch=prefetch,
            progress=False, loggers=[],
        )  # fmt: skip
    assert str(in_fit.value) == str(direct.value)
    assert _notes(in_fit.value) == _notes(direct.value)
    assert "x: float32[" in _notes(in_fit.value) and "w: float32[4, 1]" in _notes(
        in_fit.value
    )


@pytest.mark.parametrize("prefetch", [2, 0])  # moved in the prefetch thread, or not
def test_text_in_a_batch_read_once_is_refused_as_a_call_refuses_it(prefetch):
    batch = {"x": np.ones((8, 4), np.float32), "y": np.array(["a"] * 8)}
    step = pztrain.build_train_step(_loss)
    with pytest.raises(TypeError) as direct:
        step(_state(), batch)
    with pytest.raises(TypeError) as in_fit:
        pztrain.fit(
            _state(), step, (b for b in [batch] * 2), num_steps=2,
            prefetch=prefetch, progress=False, loggers=[],
        )  # fmt: skip
    assert str(in_fit.value) == str(direct.value)
    assert "train_step(state, ...) got batch['y'] of strings" in str(in_fit.value)


def test_a_grain_loaders_bad_batch_gets_the_note_a_direct_call_gives():
    from grain_examples import examples

    def loss_fn(*, model, state, rng, x, y, id):
        return _loss(model=model, state=state, rng=rng, x=x, y=y[:, None])

    loader = pztrain.GrainLoader(examples(), batch_size=8)  # x: float32[8, 4]
    model = {"w": jnp.zeros((5, 1)), "b": jnp.zeros(1)}
    state = pztrain.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0))
    step = pztrain.build_train_step(loss_fn)
    with pytest.raises(TypeError, match="dot_general") as direct:
        step(state, loader.batch_at(0))
    with pytest.raises(TypeError, match="dot_general") as in_fit:
        pztrain.fit(state, step, loader, num_steps=2, progress=False, loggers=[])
    assert _notes(in_fit.value) == _notes(direct.value)
