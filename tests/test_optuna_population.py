"""`pztrain.integrations.optuna_population`: Optuna trials trained as one
population, told through ask-and-tell, each trial its own member's values."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optuna
import pytest

import pztrain
from pztrain.integrations.optuna_population import (
    PopulationPruning,
    ask_population,
    optimize_population,
    tell_population,
)

COMPLETE, PRUNED = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
FAIL, RUNNING = optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING
optuna.logging.set_verbosity(optuna.logging.WARNING)

LRS = [0.002, 0.02, 0.1, 0.3]  # enqueued: trial i asks LRS[i]
RNG = np.random.RandomState(0)
X = RNG.randn(64, 2).astype(np.float32)
DATA = {"x": X, "y": (np.sin(X[:, 0]) + 0.5 * X[:, 1]).astype(np.float32)}


def mlp(model, x):
    hidden = jnp.tanh(x @ model["dense0"]["kernel"] + model["dense0"]["bias"])
    return hidden @ model["dense1"]["kernel"] + model["dense1"]["bias"]


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((mlp(model, x)[:, 0] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    error = mlp(model, x)[:, 0] - y
    return {"loss": jnp.mean(error**2), "mae": jnp.mean(jnp.abs(error))}


def init(seed):
    k0, k1 = jax.random.split(jax.random.key(seed))
    model = {
        "dense0": {
            "kernel": jax.random.normal(k0, (2, 8)) * 0.5,
            "bias": jnp.zeros((1, 8)),
        },
        "dense1": {
            "kernel": jax.random.normal(k1, (8, 1)) * 0.5,
            "bias": jnp.zeros((1, 1)),
        },
    }
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    return pztrain.TrainState.initial_state(model, tx, jax.random.key(seed))


TRAIN_STEP = pztrain.build_train_step(loss_fn)
EVAL_STEP = pztrain.build_eval_step(eval_fn)
FIT_ARGS = dict(  # 4 steps an epoch, evaluated at each epoch's end: steps 4, 8, 12
    train_step=TRAIN_STEP,
    num_epochs=3,
    eval_step=EVAL_STEP,
    log_every=4,
    progress=False,
)


def loaders():
    return {
        "train_data": pztrain.ArrayLoader(DATA, 16, seed=0),
        "eval_data": pztrain.ArrayLoader(DATA, 64, shuffle=False),
    }


def suggest(trial):
    return {"learning_rate": trial.suggest_float("lr", 1e-3, 1.0, log=True)}


def study_of(pruner=None, lrs=LRS):
    study = optuna.create_study(pruner=pruner or optuna.pruners.NopPruner())
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    return study


def run_batch(study, members=4, monitor="eval/loss", callbacks=()):
    """One batch through the pieces: ask, a population, fit, tell."""
    trials, hyperparams = ask_population(study, suggest, members=members)
    seeds = [t.number for t in trials]
    population = pztrain.make_population(init, seeds=seeds, **hyperparams)
    pruning = PopulationPruning(trials, monitor)
    callbacks = [pruning, *callbacks]
    _, history = pztrain.fit(population, callbacks=callbacks, **FIT_ARGS, **loaders())
    told = tell_population(study, trials, history, monitor)
    return trials, pruning, history, told


def member_series(history, i, name="loss"):
    steps, values = history.series(f"{name}/member_{i}", "eval")
    return dict(zip(steps, values, strict=True))


class PruneAt:
    """Prunes the trials ``numbers`` once they reported at ``step`` or later."""

    def __init__(self, numbers, step):
        self.numbers, self.step = set(numbers), step

    def prune(self, study, trial):
        return trial.number in self.numbers and (trial.last_step or 0) >= self.step


@pytest.mark.slow  # a population fit and four single fits
def test_four_trials_are_told_their_own_members_final_eval_loss():
    study = study_of()
    trials, pruning, history, told = run_batch(study)
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert [t.state for t in study.trials] == [COMPLETE] * 4
    assert [t.params["lr"] for t in study.trials] == LRS
    final = history.last("eval")
    assert final["step"] == 12
    values = [final["metrics"][f"loss/member_{i}"] for i in range(4)]
    assert [t.value for t in study.trials] == values
    assert [t.value for t in told] == values
    assert len(set(values)) == 4  # a mix-up of members would show
    for i, trial in enumerate(study.trials):  # every evaluation reported
        assert trial.intermediate_values == member_series(history, i)
        assert list(trial.intermediate_values) == [4, 8, 12]
        assert pruning.reported[i] == member_series(history, i)
        lr = history.last("train")["metrics"][f"learning_rate/member_{i}"]
        assert lr == pytest.approx(trial.params["lr"], rel=1e-6)
    assert pruning.pruned_steps == {} and history.stop_reason is None
    # Trial i's value is what its hyperparameters give as a run of its own.
    for trial in study.trials:
        alone = init(trial.number).with_hyperparams(learning_rate=trial.params["lr"])
        _, single = pztrain.fit(alone, **FIT_ARGS, **loaders())
        loss = single.last("eval")["metrics"]["loss"]
        assert trial.value == pytest.approx(loss, rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_pruned_trials_are_the_pruners_and_the_others_complete():
    study = study_of(PruneAt(numbers=[1, 3], step=8))
    seen = {}

    class States(pztrain.Callback):  # runs after PopulationPruning
        def on_eval_end(self, state, record):
            seen[record["step"]] = [t.state for t in study.trials]

    _, pruning, history, told = run_batch(study, callbacks=[States()])
    # Told pruned at once, during fit.
    assert seen[4] == [RUNNING] * 4 and seen[8] == [RUNNING, PRUNED] * 2
    assert [t.state for t in study.trials] == [COMPLETE, PRUNED, COMPLETE, PRUNED]
    assert [t.state for t in told] == [COMPLETE, PRUNED, COMPLETE, PRUNED]
    assert pruning.pruned_steps == {1: 8, 3: 8}
    for i, trial in enumerate(study.trials):
        series = member_series(history, i)
        assert list(series) == [4, 8, 12]  # pruned members keep computing
        if i in (1, 3):  # reported until pruned; its value is its last report
            assert trial.intermediate_values == {4: series[4], 8: series[8]}
            assert pruning.reported[i] == trial.intermediate_values
            assert trial.value == series[8]
        else:
            assert trial.intermediate_values == series
            assert trial.value == series[12]
    assert history.stop_reason is None  # two members still ran: fit went on


@pytest.mark.slow  # a reference fit, then the study with a threshold
def test_a_threshold_prunes_exactly_the_members_above_it():
    _, _, reference, _ = run_batch(study_of())
    first = sorted(member_series(reference, i)[4] for i in range(4))
    upper = (first[1] + first[2]) / 2  # two members above it at the first eval
    expected = {}  # member -> first step above the threshold
    for i in range(4):
        above = [s for s, v in member_series(reference, i).items() if v > upper]
        if above:
            expected[i] = above[0]
    assert 2 <= len(expected) < 4
    study = study_of(optuna.pruners.ThresholdPruner(upper=upper))
    _, pruning, history, _ = run_batch(study)
    assert pruning.pruned_steps == expected
    states = [PRUNED if i in expected else COMPLETE for i in range(4)]
    assert [t.state for t in study.trials] == states
    for i in range(4):  # pruning changes no member's computation
        assert member_series(history, i) == pytest.approx(member_series(reference, i))


@pytest.mark.slow
def test_fit_stops_once_every_trial_is_pruned():
    study = study_of(PruneAt(numbers=[0, 1, 2, 3], step=4))
    _, pruning, history, told = run_batch(study)
    assert history.stop_reason.startswith(
        "Optuna pruned every trial of the population ([0, 1, 2, 3]), the last at step 4"
    )
    assert [r["step"] for r in history.records if r["split"] == "eval"] == [4]
    assert pruning.pruned_steps == dict.fromkeys(range(4), 4)
    assert [t.state for t in study.trials] == [PRUNED] * 4
    assert [t.state for t in told] == [PRUNED] * 4  # left as they were


@pytest.mark.slow  # two batches, then two failing ones
def test_optimize_population_runs_batches_and_fails_the_trials_of_a_failed_one():
    study = study_of(PruneAt(numbers=[2], step=4), lrs=LRS[:3] + LRS[1:])
    seeds, ends = [], []

    def init_seen(seed):
        seeds.append(seed)
        return init(seed)

    class Ends(pztrain.Callback):
        def on_train_end(self, state, history):
            ends.append(history)

    runs = optimize_population(
        study, init_seen, suggest, members=3, n_batches=2, callbacks=[Ends()],
        **FIT_ARGS, **loaders(),
    )  # fmt: skip
    assert seeds == list(range(6))  # a trial's number is its member's seed
    assert [[t.number for t in trials] for trials, _ in runs] == [[0, 1, 2], [3, 4, 5]]
    assert [h for _, h in runs] == ends  # the callbacks given ran in each fit
    states = [t.state for t in study.trials]
    assert states == [COMPLETE, COMPLETE, PRUNED, COMPLETE, COMPLETE, COMPLETE]
    for trials, history in runs:
        for i, trial in enumerate(trials):
            frozen, series = study.trials[trial.number], member_series(history, i)
            if frozen.number == 2:
                assert frozen.intermediate_values == {4: series[4]}
                assert frozen.value == series[4]
            else:
                assert frozen.intermediate_values == series
                assert frozen.value == series[12]

    def momentum(trial):  # not injected by the optimizer
        return {"momentum": trial.suggest_float("momentum", 0.5, 0.9)}

    with pytest.raises(ValueError, match=re.escape("Unknown hyperparameter(s) ['m")):
        optimize_population(study, init, momentum, members=2, **FIT_ARGS, **loaders())
    with pytest.raises(
        KeyError,
        match=re.escape(
            "monitor 'eval/acc' is not among the population's eval metrics "
            "['eval/loss', 'eval/mae']"
        ),
    ):
        optimize_population(
            study, init, suggest, members=2, monitor="eval/acc", **FIT_ARGS,
            **loaders(),
        )  # fmt: skip
    assert [t.state for t in study.trials[6:]] == [FAIL] * 4  # none left running


def test_tell_population_fails_an_interrupted_run_and_names_missing_metrics():
    study = optuna.create_study()
    trials = [study.ask() for _ in range(2)]
    metrics = {"mae": 0.15, "mae/member_0": 0.1, "mae/member_1": 0.2}
    record = {"step": 5, "split": "eval", "metrics": metrics}
    history = pztrain.History([record])
    with pytest.raises(KeyError, match=re.escape("'eval/loss' is not among the popu")):
        tell_population(study, trials, history)
    with pytest.raises(ValueError, match="has 3 trials but the population evaluated"):
        tell_population(study, [*trials, study.ask()], history, "eval/mae")
    with pytest.raises(ValueError, match="the history has no evaluation"):
        tell_population(study, trials, pztrain.History())
    with pytest.raises(ValueError, match=re.escape("'eval/<name>' (e.g. 'eval/loss')")):
        tell_population(study, trials, history, "mae")
    single = pztrain.History([{**record, "metrics": {"loss": 0.5}}])
    with pytest.raises(KeyError, match=re.escape("[] (each logged per member as")):
        tell_population(study, trials, single)
    assert [t.state for t in study.trials] == [RUNNING] * 3  # nothing told
    interrupted = pztrain.History([record], stop_reason="interrupted")
    told = tell_population(study, trials, interrupted, "eval/mae")
    assert [t.state for t in told] == [FAIL, FAIL]


def test_ask_population_refuses_members_unlike_each_other_and_fails_them():
    study = optuna.create_study()

    def uneven(trial):  # a conditional search space
        lr = trial.suggest_float("lr", 1e-3, 1.0)
        return {"learning_rate": lr, **({"b1": 0.9} if trial.number else {})}

    with pytest.raises(ValueError, match=re.escape("['b1', 'learning_rate'] but m")):
        ask_population(study, uneven, members=3)
    with pytest.raises(TypeError, match="dict of hyperparameter name → number"):
        ask_population(study, lambda t: {"optimizer": "adam"}, members=2)
    with pytest.raises(ValueError, match="members >= 1"):
        ask_population(study, suggest, members=0)
    assert [t.state for t in study.trials] == [FAIL] * 3  # 2 + 1 asked, all told
    study = optuna.create_study()
    trials, hyperparams = ask_population(study, suggest, members=2)
    assert hyperparams == {"learning_rate": [t.params["lr"] for t in study.trials]}
    assert [t.number for t in trials] == [0, 1]


def test_population_pruning_refuses_what_it_cannot_report():
    study = optuna.create_study()
    trials = [study.ask(), study.ask()]
    with pytest.raises(ValueError, match=re.escape("'eval/<name>' (e.g. 'eval/loss')")):
        PopulationPruning(trials, "loss")
    with pytest.raises(TypeError, match=re.escape("trials[1] must be an optuna.Trial")):
        PopulationPruning([trials[0], study.trials[1]])  # a FrozenTrial
    with pytest.raises(ValueError, match="one trial per member; got none"):
        PopulationPruning([])
    pruning = PopulationPruning(trials)
    info = pztrain.LoopInfo(0, 10, 10, 1, 10, evaluates=True, run_dir=None)
    with pytest.raises(ValueError, match="2 trials but fit trains a single run"):
        pruning.check(init(0), info)
    pop = pztrain.make_population(init, seeds=range(3))
    with pytest.raises(ValueError, match="2 trials but fit trains a population of 3"):
        pruning.check(pop, info)
    with pytest.raises(ValueError, match="fit runs no evaluation"):
        no_eval = pztrain.LoopInfo(0, 10, 10, 1, 10, evaluates=False, run_dir=None)
        pruning.check(pztrain.make_population(init, seeds=[0, 1]), no_eval)
    record = {"step": 3, "split": "eval", "metrics": {"loss/member_0": 1.0}}
    with pytest.raises(ValueError, match="has 2 trials but the population evaluated"):
        pruning.on_eval_end(None, record)
    assert pruning.reported == [{}, {}]
    assert all(t.intermediate_values == {} for t in study.trials)
