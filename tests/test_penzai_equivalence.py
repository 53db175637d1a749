"""pztrain reproduces penzai's own trainers step for step.

Same model, optimizer (``optax.adam``), ``root_rng`` and data: the loss sequence,
the per-step keys (``fold_in(root_rng, step)``), the loss-function state, penzai
v2 state variables and the final params must match penzai's
``basic_training`` (v1) and ``StatefulTrainer`` (v2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai import pz
from penzai.deprecated.v1 import pz as pz1
from penzai.deprecated.v1.example_models import simple_mlp as simple_mlp_v1
from penzai.deprecated.v1.toolshed import basic_training as basic_training_v1
from penzai.models import simple_mlp
from penzai.toolshed import basic_training

import pztrain

# Each test compiles penzai's trainer and pztrain's step and runs both for 20
# steps: seconds apiece, so the whole module is in the full run only.
pytestmark = pytest.mark.slow

N_STEPS = 20
BATCH = 8
FEATURES = 3
CLASSES = 2
HIDDEN = 8
RTOL = 1e-6
ATOL = 1e-7


def _batches(n: int = N_STEPS, seed: int = 0) -> list[dict[str, jax.Array]]:
    """Deterministic data: ``n`` batches of ``x`` [BATCH, FEATURES], ``y`` [BATCH]."""
    rs = np.random.RandomState(seed)
    return [
        {
            "x": jnp.asarray(rs.normal(size=(BATCH, FEATURES)), jnp.float32),
            "y": jnp.asarray(rs.randint(0, CLASSES, size=(BATCH,)), jnp.int32),
        }
        for _ in range(n)
    ]


def _key_data(rng: jax.Array) -> jax.Array:
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng


def _logits(model, x, rng):
    """Runs a v1 or v2 model on ``x``; v2 models get a random stream (dropout)."""
    if isinstance(model, pz1.Layer):
        named = pz1.nx.wrap(x).tag("batch", "features")
        return model(named).untag("batch", "features").unwrap()
    named = pz.nx.wrap(x).tag("batch", "features")
    stream = pz.RandomStream.from_base_key(jax.random.fold_in(rng, 7))
    out = model(named, random_stream=stream)
    return out.untag("batch", "features").unwrap()


def noisy_loss(*, model, state, rng, x, y):
    """Cross-entropy on noisy inputs: the result depends on ``rng``.

    Returns the loss and this step's key in aux, so that both trainers' keys can
    be compared with ``fold_in(root_rng, step)``.
    """
    noise = 0.3 * jax.random.normal(jax.random.fold_in(rng, 1), x.shape, x.dtype)
    logits = _logits(model, x + noise, rng)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state, {"loss": loss, "key": _key_data(rng)}


def counting_loss(*, model, state, rng, x, y):
    """`noisy_loss` that also counts its calls in ``loss_fn_state``."""
    loss, _, aux = noisy_loss(model=model, state=None, rng=rng, x=x, y=y)
    return loss, state + 1, {**aux, "count_seen": state}


def _stack(auxes: list[dict[str, jax.Array]]) -> dict[str, np.ndarray]:
    return {k: np.stack([np.asarray(a[k]) for a in auxes]) for k in auxes[0]}


def _expected_keys(root_rng: jax.Array, n: int = N_STEPS) -> np.ndarray:
    return np.stack(
        [np.asarray(_key_data(jax.random.fold_in(root_rng, i))) for i in range(n)]
    )


def _run_pztrain(model, loss_fn, root_rng, batches, loss_fn_state=None, **step_kw):
    state = pztrain.TrainState.initial_state(
        model, optax.adam(1e-2), root_rng, loss_fn_state
    )
    train_step = pztrain.build_train_step(loss_fn, **step_kw)
    k = step_kw.get("steps_per_call", 1)
    auxes = []
    for i in range(0, len(batches), k):
        chunk = batches[i : i + k]
        if k == 1:
            state, aux = train_step(state, **chunk[0])
            auxes.append(aux)
        else:
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *chunk)
            state, aux = train_step(state, **stacked)
            auxes.extend(jax.tree.map(lambda a, j=j: a[j], aux) for j in range(k))
    return state, _stack(auxes)


def _assert_losses_close(ours, theirs):
    assert ours.shape == (N_STEPS,)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------
# penzai v1: basic_training.TrainState + build_train_step_fn


def _v1_model(seed: int = 0):
    model = simple_mlp_v1.MLP.from_config(feature_sizes=[FEATURES, HIDDEN, CLASSES])
    return pz1.nn.initialize_parameters(model, jax.random.key(seed))


def _run_penzai_v1(loss_fn, root_rng, batches, loss_fn_state=None):
    state = basic_training_v1.TrainState.initial_state(
        _v1_model(), optax.adam(1e-2), root_rng, loss_fn_state
    )
    train_step = basic_training_v1.build_train_step_fn(loss_fn)
    auxes = []
    for batch in batches:
        state, aux = train_step(state, **batch)
        auxes.append(aux)
    return state, _stack(auxes)


def _v1_param_arrays(params: dict) -> dict[str, np.ndarray]:
    """name -> plain array, for penzai v1 (NamedArray) or pztrain (array) params."""
    out = {}
    for name, value in params.items():
        (leaf,) = jax.tree.leaves(value)
        out[name] = np.asarray(leaf)
    return out


@pytest.mark.parametrize("key_kind", ["typed", "legacy"])
@pytest.mark.parametrize("steps_per_call", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_penzai_v1_basic_training_same_losses_keys_and_params(key_kind, steps_per_call):
    root_rng = jax.random.key(42) if key_kind == "typed" else jax.random.PRNGKey(42)
    batches = _batches()
    theirs, their_aux = _run_penzai_v1(noisy_loss, root_rng, batches)
    ours, our_aux = _run_pztrain(
        _v1_model(), noisy_loss, root_rng, batches, steps_per_call=steps_per_call
    )

    # The keys are penzai's: fold_in(root_rng, step) for steps 0..N-1.
    np.testing.assert_array_equal(their_aux["key"], _expected_keys(root_rng))
    np.testing.assert_array_equal(our_aux["key"], their_aux["key"])
    _assert_losses_close(our_aux["loss"], their_aux["loss"])
    assert int(ours.step) == theirs.step == N_STEPS

    their_params = _v1_param_arrays(theirs.params)
    our_params = _v1_param_arrays(ours.params)
    assert sorted(our_params) == sorted(their_params)
    for name, value in their_params.items():
        np.testing.assert_allclose(our_params[name], value, rtol=RTOL, atol=1e-6)

    # The merged model is a v1 model with the trained values under the same names.
    merged = pz1.select(ours.model).at_instances_of(pz1.nn.Parameter).get_sequence()
    assert {p.name for p in merged} == set(their_params)
    for p in merged:
        np.testing.assert_array_equal(
            np.asarray(jax.tree.leaves(p.value)[0]), our_params[p.name]
        )


def test_losses_depend_on_the_key_so_the_key_check_can_fail():
    """A different root_rng gives different losses: the comparison sees the keys."""
    batches = _batches()
    _, aux_a = _run_pztrain(_v1_model(), noisy_loss, jax.random.key(42), batches)
    _, aux_b = _run_pztrain(_v1_model(), noisy_loss, jax.random.key(43), batches)
    assert np.max(np.abs(aux_a["loss"] - aux_b["loss"])) > 1e-3


def test_penzai_v1_loss_fn_state_is_threaded():
    root_rng = jax.random.key(3)
    batches = _batches(19)
    start = jnp.asarray(100, jnp.int32)
    theirs, their_aux = _run_penzai_v1(counting_loss, root_rng, batches, start)
    ours, our_aux = _run_pztrain(_v1_model(), counting_loss, root_rng, batches, start)
    assert int(theirs.loss_fn_state) == 119
    assert int(ours.loss_fn_state) == 119
    np.testing.assert_array_equal(our_aux["count_seen"], np.arange(100, 119))
    np.testing.assert_array_equal(our_aux["count_seen"], their_aux["count_seen"])
    np.testing.assert_allclose(our_aux["loss"], their_aux["loss"], rtol=RTOL)


# ----------------------------------------------------------------------------
# penzai v2: StatefulTrainer


def _v2_model(seed: int = 0):
    return simple_mlp.DropoutMLP.from_config(
        name="mlp",
        init_base_rng=jax.random.key(seed),
        feature_sizes=[FEATURES, HIDDEN, HIDDEN, CLASSES],
        drop_rate=0.25,
    )


def _run_stateful_trainer(model, loss_fn, root_rng, batches, loss_fn_state=None):
    trainer = basic_training.StatefulTrainer.build(
        root_rng, model, optax.adam(1e-2), loss_fn, loss_fn_state
    )
    auxes = [trainer.step(**batch) for batch in batches]
    return trainer, _stack(auxes)


def _v2_param_arrays(model) -> dict[str, np.ndarray]:
    _, params = pz.unbind_params(model)
    return {str(p.label): np.asarray(jax.tree.leaves(p.value)[0]) for p in params}


def _v2_state_values(model) -> dict[str, np.ndarray]:
    _, state_vars = pz.unbind_state_vars(model)
    return {str(v.label): np.asarray(v.value) for v in state_vars}


@pytest.mark.parametrize("steps_per_call", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_penzai_v2_stateful_trainer_same_losses_keys_and_params(steps_per_call):
    root_rng = jax.random.key(7)
    batches = _batches()
    trainer, their_aux = _run_stateful_trainer(
        _v2_model(), noisy_loss, root_rng, batches
    )
    ours, our_aux = _run_pztrain(
        _v2_model(), noisy_loss, root_rng, batches, steps_per_call=steps_per_call
    )

    np.testing.assert_array_equal(their_aux["key"], _expected_keys(root_rng))
    np.testing.assert_array_equal(our_aux["key"], their_aux["key"])
    _assert_losses_close(our_aux["loss"], their_aux["loss"])
    assert int(ours.step) == int(trainer.state.value.step) == N_STEPS

    their_params = _v2_param_arrays(trainer.model)
    our_params = _v2_param_arrays(ours.model)
    assert sorted(our_params) == sorted(their_params) == sorted(ours.params)
    for label, value in their_params.items():
        np.testing.assert_allclose(our_params[label], value, rtol=RTOL, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(ours.params[label]), our_params[label])


def test_penzai_v2_dropout_uses_the_key():
    """Dropout masks change with root_rng, so the v2 comparison sees the keys."""
    batches = _batches(3)
    _, aux_a = _run_pztrain(_v2_model(), noisy_loss, jax.random.key(7), batches)
    _, aux_b = _run_pztrain(_v2_model(), noisy_loss, jax.random.key(8), batches)
    assert np.max(np.abs(aux_a["loss"] - aux_b["loss"])) > 1e-3


def test_penzai_v2_loss_fn_state_is_threaded():
    root_rng = jax.random.key(5)
    batches = _batches(19)
    start = jnp.asarray(100, jnp.int32)
    trainer, their_aux = _run_stateful_trainer(
        _v2_model(), counting_loss, root_rng, batches, start
    )
    ours, our_aux = _run_pztrain(_v2_model(), counting_loss, root_rng, batches, start)
    assert int(trainer.state.value.loss_fn_state) == 119
    assert int(ours.loss_fn_state) == 119
    np.testing.assert_array_equal(our_aux["count_seen"], np.arange(100, 119))
    np.testing.assert_array_equal(our_aux["count_seen"], their_aux["count_seen"])
    np.testing.assert_allclose(our_aux["loss"], their_aux["loss"], rtol=RTOL)


# ----------------------------------------------------------------------------
# penzai v2 state variables


@pz.pytree_dataclass
class RunningCenter(pz.nn.Layer):
    """Centers features by a running mean kept in state variables.

    ``mean`` follows the batch means of its input (which depend on the params
    before it); ``count`` counts calls. The output uses the updated mean, so the
    loss depends on whether state updates persist from step to step.
    """

    mean: pz.StateVariable
    count: pz.StateVariable
    momentum: float = dataclasses.field(default=0.5, metadata={"pytree_node": False})

    @classmethod
    def from_config(cls, name: str, size: int) -> RunningCenter:
        return cls(
            mean=pz.StateVariable(jnp.zeros((size,)), label=f"{name}/mean"),
            count=pz.StateVariable(jnp.zeros((), jnp.int32), label=f"{name}/count"),
        )

    def __call__(self, x, **side_inputs):
        del side_inputs
        batch_mean = jnp.mean(x.untag("batch", "features").unwrap(), axis=0)
        new_mean = self.momentum * self.mean.value + (
            1 - self.momentum
        ) * jax.lax.stop_gradient(batch_mean)
        self.mean.value = new_mean
        self.count.value = self.count.value + 1
        return x - pz.nx.wrap(new_mean).tag("features")


def _stateful_model(seed: int = 0):
    key = jax.random.key(seed)
    return pz.nn.Sequential(
        [
            pz.nn.Affine.from_config(
                name="net/Affine_0",
                init_base_rng=key,
                input_axes={"features": FEATURES},
                output_axes={"features": HIDDEN},
            ),
            pz.nn.Elementwise(jax.nn.relu),
            RunningCenter.from_config("net/center", HIDDEN),
            pz.nn.Affine.from_config(
                name="net/Affine_1",
                init_base_rng=key,
                input_axes={"features": HIDDEN},
                output_axes={"features": CLASSES},
            ),
        ]
    )


@pytest.mark.parametrize("steps_per_call", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_penzai_v2_state_variables_persist_across_steps(steps_per_call):
    root_rng = jax.random.key(11)
    batches = _batches()
    trainer, their_aux = _run_stateful_trainer(
        _stateful_model(), noisy_loss, root_rng, batches
    )
    ours, our_aux = _run_pztrain(
        _stateful_model(), noisy_loss, root_rng, batches, steps_per_call=steps_per_call
    )

    their_state = _v2_state_values(trainer.model)
    our_state = _v2_state_values(ours.model)
    assert sorted(our_state) == ["net/center/count", "net/center/mean"]
    assert sorted(their_state) == sorted(our_state)
    assert int(their_state["net/center/count"]) == N_STEPS
    assert int(our_state["net/center/count"]) == N_STEPS
    np.testing.assert_allclose(
        our_state["net/center/mean"],
        their_state["net/center/mean"],
        rtol=RTOL,
        atol=1e-6,
    )
    # The mean moved away from its initial zeros, so the check above is not vacuous.
    assert np.max(np.abs(our_state["net/center/mean"])) > 1e-3

    _assert_losses_close(our_aux["loss"], their_aux["loss"])
    their_params = _v2_param_arrays(trainer.model)
    our_params = _v2_param_arrays(ours.model)
    assert sorted(our_params) == sorted(their_params) == sorted(ours.params)
    for label, value in their_params.items():
        np.testing.assert_allclose(our_params[label], value, rtol=RTOL, atol=1e-6)

    # state.model holds real StateVariables, not frozen values or slots.
    _, state_vars = pz.unbind_state_vars(ours.model)
    assert all(isinstance(v, pz.StateVariable) for v in state_vars)


def test_penzai_v2_state_variable_counts_every_step_one_by_one():
    """After each step, state.model shows the count penzai's trainer has."""
    root_rng = jax.random.key(13)
    batches = _batches(4)
    trainer = basic_training.StatefulTrainer.build(
        root_rng, _stateful_model(), optax.adam(1e-2), noisy_loss
    )
    state = pztrain.TrainState.initial_state(
        _stateful_model(), optax.adam(1e-2), root_rng
    )
    train_step = pztrain.build_train_step(noisy_loss)
    assert int(_v2_state_values(state.model)["net/center/count"]) == 0
    for i, batch in enumerate(batches, start=1):
        trainer.step(**batch)
        state, _ = train_step(state, **batch)
        ours = _v2_state_values(state.model)
        theirs = _v2_state_values(trainer.model)
        assert int(ours["net/center/count"]) == int(theirs["net/center/count"]) == i
        np.testing.assert_allclose(
            ours["net/center/mean"], theirs["net/center/mean"], rtol=RTOL, atol=1e-6
        )


def test_penzai_v2_state_variables_with_loss_fn_state():
    """State variables and loss_fn_state are threaded together."""
    root_rng = jax.random.key(17)
    batches = _batches(19)
    start = jnp.asarray(100, jnp.int32)
    trainer, their_aux = _run_stateful_trainer(
        _stateful_model(), counting_loss, root_rng, batches, start
    )
    ours, our_aux = _run_pztrain(
        _stateful_model(), counting_loss, root_rng, batches, start
    )
    assert int(ours.loss_fn_state) == int(trainer.state.value.loss_fn_state) == 119
    np.testing.assert_array_equal(our_aux["count_seen"], their_aux["count_seen"])
    np.testing.assert_allclose(our_aux["loss"], their_aux["loss"], rtol=RTOL)
    assert int(_v2_state_values(ours.model)["net/center/count"]) == 19


def test_fit_on_device_keeps_state_variables_like_fit_on_host():
    """fit's on-device stretches fall back to one call at a time for StateVariables."""
    data = {k: np.concatenate([b[k] for b in _batches(6)]) for k in ("x", "y")}
    step = pztrain.build_train_step(noisy_loss)
    runs = []
    for on_device in (False, True):
        loader = pztrain.ArrayLoader(data, BATCH, seed=4, on_device=on_device)
        state = pztrain.TrainState.initial_state(
            _stateful_model(), optax.adam(1e-2), jax.random.key(5)
        )
        state, _ = pztrain.fit(
            state, step, loader, num_steps=10, log_every=4, progress=False
        )
        runs.append(state)
    host, dev = runs
    assert int(host.step) == int(dev.step) == 10
    host_vars, dev_vars = _v2_state_values(host.model), _v2_state_values(dev.model)
    assert int(dev_vars["net/center/count"]) == 10
    for label, value in host_vars.items():
        np.testing.assert_array_equal(dev_vars[label], value)
    for label, value in host.params.items():
        np.testing.assert_array_equal(dev.params[label], value)
