"""PopulationBasedTraining: the worst members take the best members' state
(their own keys kept), their hyperparameters are perturbed, and every
decision is a pure function of the seed, the step and the ranking."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain.callbacks import PopulationBasedTraining
from pztrain.records import LoopInfo

LRS = [0.001, 0.01, 0.1, 0.2]


def init(seed):
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    w = jax.random.normal(jax.random.key(seed), (3,))
    return pztrain.TrainState.initial_state({"w": w}, tx, jax.random.key(seed + 9))


def loss_fn(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"] - 1.0) ** 2)
    return loss, state, {}


INFO = LoopInfo(
    start_step=0,
    end_step=10,
    steps_per_epoch=None,
    steps_per_call=1,
    log_every=5,
    evaluates=False,
    run_dir=None,
)


def trained_population():
    pop = pztrain.make_population(init, seeds=range(4), learning_rate=LRS)
    step = pztrain.build_train_step(loss_fn)
    for _ in range(3):
        pop, _ = step(pop, x=jnp.ones((4, 3)))
    return pop


def record(values, step=5):
    return {
        "step": step,
        "split": "train",
        "metrics": {f"loss/member_{i}": v for i, v in enumerate(values)},
    }


def test_the_worst_take_the_state_of_the_best_and_keep_their_keys():
    pop = trained_population()
    before = {i: pztrain.member(pop, i) for i in range(4)}
    pbt = PopulationBasedTraining(
        "loss", fraction=0.5, perturb={"learning_rate": [2.0]}
    )
    pbt.on_train_start(pop, INFO)
    rec = record([0.5, 0.1, 0.9, 0.2])  # best: 1, 3; worst: 2, 0
    new = pbt.on_log(pop, rec)
    sources = pbt.decisions[0]["sources"]
    assert sources[1] == 1 and sources[3] == 3  # the best are kept
    assert {sources[0], sources[2]} <= {1, 3}  # the worst copy one of the best
    for i in range(4):
        one, src = pztrain.member(new, i), before[sources[i]]
        np.testing.assert_array_equal(one.params["w"], src.params["w"])
        mu = one.opt_state.inner_state[0].mu["w"]
        np.testing.assert_array_equal(mu, src.opt_state.inner_state[0].mu["w"])
        factor = 2.0 if i in (0, 2) else 1.0
        assert float(one.hyperparams["learning_rate"]) == pytest.approx(
            LRS[sources[i]] * factor
        )
        keys = jax.random.key_data(one.root_rng)  # each keeps its own key
        np.testing.assert_array_equal(keys, jax.random.key_data(before[i].root_rng))
    assert rec["metrics"]["pbt/replaced"] == 2.0
    assert rec["metrics"]["pbt/source/member_0"] == float(sources[0])


def test_max_mode_non_finite_values_and_every():
    pbt = PopulationBasedTraining("eval/acc", mode="max", fraction=0.25, every=2)
    sources, factors = pbt.plan(-np.array([0.9, 0.2, 0.5, 0.7]), step=3)
    assert sources.tolist()[1] == 0 and sources.tolist()[0] == 0
    assert factors["learning_rate"][1] in (0.8, 1.25)
    # the same seed, step and ranking: the same decision
    again = pbt.plan(-np.array([0.9, 0.2, 0.5, 0.7]), step=3)
    assert again[0].tolist() == sources.tolist()
    pop = trained_population()
    pbt.on_train_start(pop, dataclasses.replace(INFO, evaluates=True))
    nan = {
        "step": 5,
        "metrics": {
            f"acc/member_{i}": v for i, v in enumerate([float("nan"), 0.2, 0.3, 0.4])
        },
    }
    assert pbt.on_eval_end(pop, nan) is None  # every=2: the first is skipped
    new = pbt.on_eval_end(pop, dict(nan, step=10))
    assert pbt.decisions[0]["sources"][0] == 3  # a NaN member ranks worst
    assert pztrain.population_size(new) == 4


def test_pbt_in_fit_logs_its_decisions(tmp_path):
    pop = pztrain.make_population(init, seeds=range(4), learning_rate=LRS)
    pbt = PopulationBasedTraining("loss", fraction=0.25)
    data = pztrain.ArrayLoader({"x": np.ones((16, 3), np.float32)}, batch_size=4)
    pop, history = pztrain.fit(
        pop,
        pztrain.build_train_step(loss_fn),
        data,
        num_steps=12,
        log_every=4,
        callbacks=[pbt],
        progress=False,
        run_dir=tmp_path / "run",
    )
    assert [d["step"] for d in pbt.decisions] == [4, 8, 12]
    logged = pztrain.records.read_jsonl(tmp_path / "run")
    sources = [
        r["metrics"]["pbt/source/member_0"] for r in logged if r["split"] == "train"
    ]
    assert sources == [float(d["sources"][0]) for d in pbt.decisions]
    restored = PopulationBasedTraining("loss")
    restored.load_state_dict(pbt.state_dict())
    assert restored.decisions == pbt.decisions


def test_bad_use_is_refused_by_name():
    with pytest.raises(ValueError, match="a population of at least 2 members"):
        PopulationBasedTraining("loss").check(init(0), INFO)
    pop = trained_population()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "perturb=...) names ['momentum'], which the optimizer does not inject"
        ),
    ):
        PopulationBasedTraining("loss", perturb={"momentum": [0.9]}).check(pop, INFO)
    with pytest.raises(ValueError, match="does not evaluate"):
        PopulationBasedTraining("eval/loss").check(pop, INFO)
    pbt = PopulationBasedTraining("acc")
    pbt.on_train_start(pop, INFO)
    with pytest.raises(KeyError, match=re.escape("no 'acc/member_0' (monitor 'acc')")):
        pbt.on_log(pop, record([0.1, 0.2, 0.3, 0.4]))
    with pytest.raises(ValueError, match="fraction must be in"):
        PopulationBasedTraining("loss", fraction=0.9)


def eval_fn(*, model, state, rng, x):
    return {"loss": jnp.mean((x @ model["w"] - 1.0) ** 2)}


@pytest.mark.slow
def test_pbt_acts_where_its_named_evaluation_ran():
    """``test`` runs every 8 steps, ``val`` every 4: PBT on eval/test/loss
    decides at 8 and 16 only, and nowhere raises at val's points."""
    pop = pztrain.make_population(init, seeds=range(4), learning_rate=LRS)
    data = pztrain.ArrayLoader({"x": np.ones((16, 3), np.float32)}, batch_size=4)
    step = pztrain.build_eval_step(eval_fn)
    evals = [
        pztrain.Evaluation("val", step, data, every=4, at_end=False),
        pztrain.Evaluation("test", step, data, every=8, at_end=False),
    ]
    pbt = PopulationBasedTraining("eval/test/loss", fraction=0.25)
    pztrain.fit(
        pop,
        pztrain.build_train_step(loss_fn),
        data,
        num_steps=16,
        log_every=4,
        evaluations=evals,
        callbacks=[pbt],
        progress=False,
    )
    assert [d["step"] for d in pbt.decisions] == [8, 16]


def test_pbt_checks_its_monitor_at_the_start():
    pop = pztrain.make_population(init, seeds=range(4), learning_rate=LRS)
    info = dataclasses.replace(INFO, evaluates=True, evaluations=("val", "test"))
    with pytest.raises(ValueError, match=re.escape("evaluations are ['val', 'test']")):
        PopulationBasedTraining("eval/tset/loss").check(pop, info)
    PopulationBasedTraining("eval/test/loss").check(pop, info)  # fine


def test_a_misspelled_monitor_lists_every_name_it_could_monitor():
    pop = trained_population()
    pbt = PopulationBasedTraining("los")
    pbt.on_train_start(pop, INFO)
    metrics = {f"m{j:02d}/member_{i}": 1.0 for j in range(15) for i in range(4)}
    metrics.update({f"m{j:02d}": 1.0 for j in range(15)})
    with pytest.raises(KeyError) as raised:
        pbt.on_log(pop, {"step": 5, "split": "train", "metrics": metrics})
    assert str([f"m{j:02d}" for j in range(15)]) in str(raised.value)
