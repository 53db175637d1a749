"""Populations over one shared base: ``make_population(...,
shared="model_without_params")`` holds each array of the model without params
that every member has alike once (a member axis of 1), the step reads it for
every member, and a member is an ordinary state with the base; ``K`` LoRA
adapter sets over one frozen Llama base train, evaluate, save and resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from finetune_checkpoints import HF_CONFIG, abstract_llama, write_llama
from test_finetune_lora import LORA, MAPPING, TOKENS, lm_loss

import pztrain
from pztrain import (
    CheckpointMismatchError,
    PopulationError,
    make_population,
    member,
    stack_members,
)
from pztrain.callbacks import PopulationBasedTraining
from pztrain.finetune import add_lora, is_adapter, load_pretrained
from pztrain.population import shard_members
from pztrain.records import LoopInfo

X = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
BASE = jnp.arange(12.0).reshape(4, 3)  # K = 4 rows: a member axis by its shape
INFO = LoopInfo(
    start_step=0, end_step=10, steps_per_epoch=None, steps_per_call=1,
    log_every=5, evaluates=False, run_dir=None,
)  # fmt: skip


def init(seed, base=BASE):
    model = {
        "w": 0.1 * jax.random.normal(jax.random.key(seed), (4,)),
        "base": jnp.array(base),  # a new, equal array per member
        "tag": jnp.full((2,), seed),  # differs per member: stacked
    }
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    return pztrain.TrainState.initial_state(
        model, tx, jax.random.key(seed), trainable=lambda path, x: "w" in str(path)
    )


def loss_fn(*, model, state, rng, x):
    y = x @ model["base"].T  # (8, 4)
    loss = jnp.mean((y * model["w"][None] - 1.0) ** 2) + 0 * model["tag"].sum()
    return loss, state, {"loss": loss}


def test_an_equal_array_of_the_rest_is_held_once():
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    rest = pop.model_without_params
    assert rest["base"].shape == (1, 4, 3)  # once, not (4, 4, 3)
    assert rest["tag"].shape == (4, 2) and pop.params["w"].shape == (4, 4)
    plain = make_population(init, seeds=range(4))  # as before: all stacked
    assert plain.model_without_params["base"].shape == (4, 4, 3)
    nbytes = lambda s: sum(x.nbytes for x in jax.tree.leaves(s))  # noqa: E731
    assert nbytes(plain) - nbytes(pop) == 3 * BASE.nbytes
    one = member(pop, 2)
    np.testing.assert_array_equal(one.model_without_params["base"], BASE)
    np.testing.assert_array_equal(one.model_without_params["tag"], [2, 2])


def test_a_shared_population_steps_as_its_members_alone():
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    step = pztrain.build_train_step(loss_fn)
    for _ in range(3):
        pop, aux = step(pop, x=X)
    assert pop.model_without_params["base"].shape == (1, 4, 3)
    for i in range(4):
        solo = init(i)
        for _ in range(3):
            solo, solo_aux = step(solo, x=X)
        np.testing.assert_allclose(pop.params["w"][i], solo.params["w"], rtol=1e-6)
        np.testing.assert_allclose(aux["loss"][i], solo_aux["loss"], rtol=1e-6)
    mse = pztrain.build_eval_step(lambda **kw: loss_fn(**kw)[2])(pop, x=X)
    assert mse["loss"].shape == (4,)


def test_fused_and_microbatched_steps_read_the_shared_base():
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    fused = pztrain.build_train_step(loss_fn, steps_per_call=2)
    pop, aux = fused(pop, x=np.stack([X, X]))
    assert aux["loss"].shape == (4, 2) and int(pop.step) == 2
    pop, aux = pztrain.build_train_step(loss_fn, microbatches=2)(pop, x=X)
    assert aux["loss"].shape == (4,) and int(pop.step) == 3
    assert pop.model_without_params["base"].shape == (1, 4, 3)


def test_population_based_training_keeps_the_shared_base():
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    pbt = PopulationBasedTraining("loss", fraction=0.25)
    pbt.on_train_start(pop, INFO)
    metrics = {f"loss/member_{i}": v for i, v in enumerate([0.5, 0.1, 0.9, 0.2])}
    new = pbt.on_log(pop, {"step": 5, "split": "train", "metrics": metrics})
    np.testing.assert_array_equal(new.model_without_params["base"], BASE[None])
    sources = pbt.decisions[0]["sources"]
    np.testing.assert_array_equal(new.params["w"], np.asarray(pop.params["w"])[sources])


def test_arrays_that_differ_are_stacked_and_bad_shared_is_refused():
    bases = {0: BASE, 1: BASE + 1.0}
    pop = stack_members(
        [init(i, bases[i]) for i in range(2)], shared="model_without_params"
    )
    assert pop.model_without_params["base"].shape == (2, 4, 3)
    with pytest.raises(PopulationError, match="'params'.*model_without_params"):
        make_population(init, seeds=range(2), shared="params")


def test_a_shared_array_is_replicated_over_a_members_mesh():
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    placed = shard_members(pop, jax.make_mesh((1,), ("members",)))
    assert placed.model_without_params["base"].sharding.spec == jax.P()
    assert placed.params["w"].sharding.spec == jax.P("members")


def test_a_shared_checkpoint_into_an_unshared_target_says_what_to_do(tmp_path):
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    pztrain.save_state(tmp_path / "s", pop)
    like = make_population(init, seeds=range(4), shared="model_without_params")
    back = pztrain.load_state(tmp_path / "s", like)
    np.testing.assert_array_equal(back.model_without_params["base"], BASE[None])
    with pytest.raises(CheckpointMismatchError, match=r"base.*once for every member"):
        pztrain.load_state(tmp_path / "s", make_population(init, seeds=range(4)))


# ------------------------------------------------ K adapter sets, one base


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    write_llama(folder)
    return folder


def lora_init(folder):
    base, _ = load_pretrained(folder, abstract_llama(), MAPPING, dtype=jnp.bfloat16)

    def init(seed):
        model = add_lora(base, LORA, jax.random.key(seed))
        return pztrain.TrainState.initial_state(
            model, optax.adam(3e-2), jax.random.key(seed), trainable=is_adapter
        )

    return init


@pytest.mark.slow  # compiles and trains a transformer for seconds
def test_four_adapter_sets_over_one_llama_base(llama, tmp_path):
    init = lora_init(llama)
    pop = make_population(init, seeds=range(4), shared="model_without_params")
    solo_rest = jax.tree.leaves(init(0).model_without_params)
    rest = jax.tree.leaves(pop.model_without_params)
    assert [x.shape for x in rest] == [(1, *x.shape) for x in solo_rest]
    assert sum(x.nbytes for x in rest) == sum(x.nbytes for x in solo_rest)
    assert HF_CONFIG["vocab_size"] > 4  # the base is not a row per member

    step = pztrain.build_train_step(lm_loss)
    data = [{"tokens": TOKENS}] * 8

    def run(num_steps, resume, folder, state=None):
        if state is None:  # a fresh population: fit donates the one it is given
            state = make_population(init, seeds=range(4), shared="model_without_params")
        ckpts = pztrain.Checkpoints(folder, every_steps=2, async_save=False)
        return pztrain.fit(
            state, step, data, num_steps=num_steps, checkpoints=ckpts,
            resume=resume, progress=False, loggers=[],
        )[0]  # fmt: skip

    straight = run(4, False, tmp_path / "a")
    run(2, False, tmp_path / "b")
    resumed = run(4, True, tmp_path / "b")
    assert int(resumed.step) == 4
    for name, x in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], x)
    assert resumed.model_without_params is not None
    assert all(x.shape[0] == 1 for x in jax.tree.leaves(resumed.model_without_params))

    solo = run(4, False, tmp_path / "solo", state=init(2))
    two = member(straight, 2)
    for name, x in solo.params.items():
        np.testing.assert_allclose(two.params[name], x, rtol=2e-4, atol=2e-6)
    metrics = pztrain.build_eval_step(lambda **kw: lm_loss(**kw)[2])
    ev = pztrain.evaluate(straight, metrics, data[:2])
    assert "loss/member_3" in ev and np.isfinite(ev["loss"])
