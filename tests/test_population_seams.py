"""Populations where they meet the rest: equinox models that hold functions
and state, per-member batches counted per member, one compilation across log
windows and fit calls, and members that diverge."""

import logging
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain


def mlp_init(seed, activation=jax.nn.relu):
    """An equinox MLP: its activations (``jax.nn.relu``, a ``custom_jvp``
    object, and the identity) are leaves of the model, not arrays."""
    model = eqx.nn.MLP(3, 1, 8, 1, activation=activation, key=jax.random.key(seed))
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    return pztrain.TrainState.initial_state(model, tx, jax.random.key(seed + 10))


def mlp_loss(*, model, state, rng, x, y):
    loss = jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)
    return loss, state, {"loss": loss}


class BNNet(eqx.Module):
    """An equinox model with state: batch statistics in an ``eqx.nn.State``."""

    bn: eqx.nn.BatchNorm
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.bn = eqx.nn.BatchNorm(3, axis_name="batch", momentum=0.5, mode="batch")
        self.linear = eqx.nn.Linear(3, 1, key=key)

    def __call__(self, x, state):
        x, state = self.bn(x, state)
        return self.linear(x)[0], state


def bn_init(seed):
    model, stats = eqx.nn.make_with_state(BNNet)(jax.random.key(seed))
    tx = optax.adam(0.05)
    key = jax.random.key(seed)
    return pztrain.TrainState.initial_state(model, tx, key, loss_fn_state=stats)


def bn_loss(*, model, state, rng, x, y):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = batched(x, state)
    loss = jnp.mean((pred - y) ** 2)
    return loss, state, {"loss": loss}


RNG = np.random.default_rng(0)
X = (RNG.normal(size=(64, 3)) + 2.0).astype(np.float32)
Y = X.sum(1).astype(np.float32)


def fit_members(init, loss, members):
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=16, seed=0)
    step = pztrain.build_train_step(loss)
    return pztrain.fit(members, step, data, num_steps=8, log_every=4, progress=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("init, loss", [(mlp_init, mlp_loss), (bn_init, bn_loss)])
def test_equinox_models_with_functions_and_state_train_as_a_population(init, loss):
    pop = pztrain.make_population(init, seeds=[0, 1])
    assert pztrain.population_size(pop) == 2
    if init is mlp_init:  # the functions stay what they are: one for all
        assert pop.model_without_params.activation is jax.nn.relu
    pop = fit_members(init, loss, pop)
    for i in range(2):  # each member trained as its run alone
        alone = fit_members(init, loss, init(i))
        one = pztrain.member(pop, i)
        for name in alone.params:
            np.testing.assert_allclose(
                one.params[name], alone.params[name], rtol=2e-4, atol=1e-5
            )
        for got, want in zip(
            jax.tree.leaves(one.loss_fn_state),
            jax.tree.leaves(alone.loss_fn_state),
            strict=True,
        ):  # the batch statistics too (equinox's State)
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)


def test_members_whose_non_array_leaves_differ_are_refused_by_name():
    with pytest.raises(
        pztrain.PopulationError,
        match=re.escape(
            "Member 1 differs from member 0 at .model_without_params.activation: "
        ),
    ):
        pztrain.stack_members([mlp_init(0), mlp_init(1, jnp.tanh)])


def member_eval(*, model, state, rng, x):
    return {"mean": jnp.mean(x)}


def test_evaluate_weights_per_member_batches_by_their_examples():
    """Batches of 16 and 8 examples per member: the mean over every example
    (8 ones among 24 for member 0, 12 for member 1), not over the batches."""
    pop = pztrain.make_population(mlp_init, seeds=[0, 1])
    rows = np.zeros((2, 24), np.float32)
    rows[0, :8] = 1.0
    rows[1, :12] = 1.0
    batches = [{"x": rows[:, :16]}, {"x": rows[:, 16:]}]
    step = pztrain.build_eval_step(member_eval, member_batches=True)
    result = pztrain.evaluate(pop, step, batches)
    assert result["mean/member_0"] == pytest.approx(1 / 3)
    assert result["mean/member_1"] == pytest.approx(0.5)
    assert result["mean"] == pytest.approx(np.mean(rows))


def test_a_per_member_eval_batch_without_the_member_axis_is_refused():
    pop = pztrain.make_population(mlp_init, seeds=[0, 1])
    step = pztrain.build_eval_step(member_eval, member_batches=True)
    with pytest.raises(
        pztrain.BatchError, match=re.escape("batch['x'] has shape [3, 4]")
    ):
        pztrain.evaluate(pop, step, [{"x": np.zeros((3, 4), np.float32)}])


@pytest.mark.slow
def test_fit_counts_a_members_examples_with_per_member_batches():
    pop = pztrain.make_population(mlp_init, seeds=range(4))
    batch = {"x": np.stack([X[:16]] * 4), "y": np.stack([Y[:16]] * 4)}
    step = pztrain.build_train_step(mlp_loss, member_batches=True)
    _, history = pztrain.fit(
        pop, step, [batch] * 4, num_steps=4, log_every=2, progress=False
    )
    for record in history.to_dicts():  # 16 examples a step, not 4 (the members)
        if record["split"] == "train":
            assert record["examples_per_sec"] == pytest.approx(
                16 * record["steps_per_sec"], rel=1e-3
            )


def dict_init(seed):
    w = jax.random.normal(jax.random.key(seed), (3, 8))
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    model = {"w": w, "v": jnp.zeros(8)}
    return pztrain.TrainState.initial_state(model, tx, jax.random.key(seed))


def dict_loss(*, model, state, rng, x, y):
    loss = jnp.mean((jnp.tanh(x @ model["w"]) @ model["v"] - y) ** 2)
    return loss, state, {"loss": loss}


def compiles_during(run):
    """The programs JAX compiles while ``run()`` runs (a cache hit of the
    persistent cache counts: the in-memory cache missed)."""
    names = []

    class Seen(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling"):
                names.append(record.getMessage().split(" with ")[0])

    handler, logger = Seen(level=logging.DEBUG), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            run()
    finally:
        logger.removeHandler(handler)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("population", [True, False])
@pytest.mark.parametrize("committed", [False, True])
def test_no_compilation_across_log_windows_and_fit_calls(population, committed):
    """The step compiles for the first window of the first fit only: the
    metric sums of later windows and calls are placed as the first ones."""
    state = pztrain.make_population(dict_init, seeds=range(4)) if population else None
    state = dict_init(0) if state is None else state
    if committed:  # as a restored state is
        state = jax.device_put(state, jax.devices()[0])
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=8, seed=0)
    step = pztrain.build_train_step(dict_loss)
    kept = {}

    def fit(num_steps):
        kept["state"] = pztrain.fit(
            kept.get("state", state),
            step,
            data,
            num_steps=num_steps,
            log_every=10,
            progress=False,
        )[0]

    fit(10)  # compiles the step (and its cost: a second program)
    assert compiles_during(lambda: fit(50)) == []  # 4 more windows


@pytest.mark.slow
def test_pbt_decisions_on_a_committed_population_compile_nothing_new():
    """PBT's new hyperparameters are placed as the ones they replace."""
    pop = jax.device_put(
        pztrain.make_population(dict_init, seeds=range(4)), jax.devices()[0]
    )
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=8, seed=0)
    step = pztrain.build_train_step(dict_loss)
    pbt = pztrain.PopulationBasedTraining("loss")
    kept = {"state": pop}

    def fit(num_steps):
        kept["state"] = pztrain.fit(
            kept["state"], step, data, num_steps=num_steps, log_every=10,
            callbacks=[pbt], progress=False,
        )[0]  # fmt: skip

    fit(10)
    assert compiles_during(lambda: fit(40)) == []
    assert len(pbt.decisions) == 4


def test_a_diverged_member_is_left_out_of_min_and_max_and_counted():
    from pztrain._members import spread

    got = spread("loss", np.array([2.0, np.nan, 1.0, np.inf]))
    assert got["loss/min"] == 1.0 and got["loss/max"] == 2.0
    assert got["loss/diverged"] == 2.0
    assert np.isnan(got["loss"])  # the mean of every member
    assert "loss/diverged" not in spread("loss", np.array([2.0, 1.0]))
    none = spread("loss", np.array([np.nan, np.inf]))
    assert np.isnan(none["loss/min"]) and none["loss/diverged"] == 2.0


def poisoned_loss(*, model, state, rng, x, y):
    """Member ``i`` diverges at once if its loss-function state says so."""
    loss = jnp.mean((jnp.tanh(x @ model["w"]) @ model["v"] - y) ** 2)
    loss = loss * jnp.where(state > 0, jnp.nan, 1.0)  # NaN grads too
    return loss, state, {"loss": loss}


@pytest.mark.slow
def test_a_diverged_member_neither_stops_the_best_nor_its_checkpoints(tmp_path):
    pop = pztrain.make_population(dict_init, seeds=range(3), learning_rate=[0.05] * 3)
    pop = pop.replace(loss_fn_state=jnp.asarray([0, 1, 0], jnp.int32))
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=64, shuffle=False)
    ckpts = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=4, keep_last=5)
    with pytest.warns(UserWarning, match=re.escape("population members [1] whose")):
        pop, history = pztrain.fit(
            pop,
            pztrain.build_train_step(poisoned_loss),
            data,
            num_steps=12,
            log_every=4,
            callbacks=[pztrain.EarlyStopping("loss/min", patience=1)],
            checkpoints=ckpts,
            progress=False,
        )
    assert int(pop.step) == 12  # the best member kept improving: no early stop
    train = [r for r in history.to_dicts() if r["split"] == "train"]
    for record in train:
        assert record["nonfinite_members"] == [1]
        assert record["metrics"]["loss/diverged"] == 1.0
        assert np.isfinite(record["metrics"]["loss/min"])
    assert train[-1]["metrics"]["loss/min"] < train[0]["metrics"]["loss/min"]
    assert ckpts.steps() == [4, 8, 12]  # the whole population, every member
    restored = ckpts.restore(12, pop)
    assert np.isfinite(restored.params["w"][0]).all()
    assert np.isnan(restored.params["w"][1]).all()


@pytest.mark.slow
def test_a_population_with_no_finite_member_is_not_saved(tmp_path):
    pop = pztrain.make_population(dict_init, seeds=range(2))
    pop = pop.replace(loss_fn_state=jnp.ones(2, jnp.int32))
    pop, _ = pztrain.build_train_step(poisoned_loss)(pop, x=X, y=Y)
    with pztrain.Checkpoints(tmp_path / "ckpt") as ckpts:
        with pytest.warns(UserWarning, match="no member.s params are finite"):
            ckpts.save(pop, 1)
    assert ckpts.steps() == []
