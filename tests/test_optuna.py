"""`pztrain.integrations.optuna` with real Optuna studies, and the tuning example."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optuna
import pytest

from pztrain.callbacks import Callback
from pztrain.checkpoint import Checkpoints
from pztrain.data import ArrayLoader
from pztrain.integrations.optuna import OptunaPruning
from pztrain.loop import fit
from pztrain.state import TrainState
from pztrain.step import build_eval_step, build_train_step

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PRUNED, COMPLETE = optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.COMPLETE
optuna.logging.set_verbosity(optuna.logging.WARNING)


@functools.cache
def _digits():
    """The digits, train and validation: read when a test first trains (importing
    scikit-learn takes seconds, and the fast subset runs none of these tests)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    return {"x": x[:1280], "y": y[:1280]}, {"x": x[1280:], "y": y[1280:]}


def loss_fn(*, model, state, rng, x, y):
    logits = x @ model["w"] + model["b"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    logits = x @ model["w"] + model["b"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


TRAIN_STEP, EVAL_STEP = build_train_step(loss_fn), build_eval_step(eval_fn)
OPTIMIZER = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)


def _state(lr):
    model = {"w": jnp.zeros((64, 10)), "b": jnp.zeros((1, 10))}
    state = TrainState.initial_state(model, OPTIMIZER, jax.random.key(0))
    return state.with_hyperparams(learning_rate=lr)


def _fit(state, callbacks, **kwargs):
    return fit(
        state,
        TRAIN_STEP,
        ArrayLoader(_digits()[0], 128, seed=0),  # 10 steps per epoch
        num_epochs=4,
        eval_step=EVAL_STEP,
        eval_data=ArrayLoader(_digits()[1], 517, shuffle=False, drop_remainder=False),
        callbacks=callbacks,
        progress=False,
        **kwargs,
    )


class KeepHistory(Callback):
    """Keeps the History of each run, also of one that raises."""

    def __init__(self, histories):
        self.histories = histories

    def on_train_end(self, state, history):
        self.histories.append(history)


@pytest.mark.slow  # five trials, each a run with checkpoints
def test_pruned_trials_are_pruned_and_reports_match_the_history(tmp_path):
    study = optuna.create_study(
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    )
    for lr in (0.5, 0.5, 1e-6, 1e-6, 0.5):
        study.enqueue_trial({"lr": lr})
    histories, returned = [], {}

    def objective(trial):
        state = _state(trial.suggest_float("lr", 1e-6, 1.0, log=True))
        # Trial 3 returns from fit and raises with check_pruned (Lightning's way).
        pruning = OptunaPruning(trial, "eval/loss", raise_pruned=trial.number != 3)
        ckpts = Checkpoints(tmp_path / f"trial{trial.number}", on_eval=True)
        _, history = _fit(state, [pruning, KeepHistory(histories)], checkpoints=ckpts)
        returned[trial.number] = (pruning, history, ckpts.steps())
        pruning.check_pruned()
        return history.last("eval")["metrics"]["loss"]

    study.optimize(objective, n_trials=5)
    states = [t.state for t in study.trials]
    assert states == [COMPLETE, COMPLETE, PRUNED, PRUNED, COMPLETE]
    for trial, history in zip(study.trials, histories, strict=True):
        steps, losses = history.series("loss", "eval")
        assert trial.intermediate_values == dict(zip(steps, losses, strict=True))
    assert [len(h.series("loss", "eval")[0]) for h in histories] == [4, 4, 1, 1, 4]
    assert histories[2].stop_reason.startswith("Optuna pruned trial 2 at step 10 (")
    # Pruned through Stop: the checkpoint of the pruning step was saved and
    # finished before TrialPruned left fit.
    assert Checkpoints(tmp_path / "trial2").steps() == [10]
    assert not list((tmp_path / "trial2").glob("*tmp*"))
    assert 2 not in returned  # fit raised
    pruning, history, ckpt_steps = returned[3]
    assert pruning.pruned and pruning.pruned_step == 10 and ckpt_steps == [10]
    assert history.stop_reason.startswith("Optuna pruned trial 3 at step 10")
    assert study.best_value < 1.0  # learned: chance is log(10) = 2.3


@pytest.mark.slow  # three runs on the digits
def test_bad_monitor_trial_and_missing_optuna_are_clear_errors(monkeypatch):
    study = optuna.create_study()
    trial = study.ask()
    with pytest.raises(ValueError, match=re.escape("'eval/<name>' (e.g. 'eval/loss')")):
        OptunaPruning(trial, "loss")
    with pytest.raises(TypeError, match="trial must be the optuna.Trial"):
        OptunaPruning("trial-0")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "OptunaPruning monitors 'eval/acc', which the evaluation of eval_step= "
            "does not record: the run's eval metrics are ['eval/accuracy', "
            "'eval/loss']"
        ),
    ):
        _fit(_state(0.1), [OptunaPruning(trial, "eval/acc")])
    with pytest.raises(ValueError, match="fit runs no evaluation"):
        fit(
            _state(0.1),
            TRAIN_STEP,
            ArrayLoader(_digits()[0], 128),
            num_steps=2,
            callbacks=[OptunaPruning(trial)],
            progress=False,
        )
    assert study.trials[0].intermediate_values == {}  # the failed runs reported nothing
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'pztrain[optuna]'")):
        OptunaPruning(trial)


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tune_digits_example_prunes_and_finds_a_good_model(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    study = _load_example("tune_digits").main(n_trials=8, epochs=3, storage=storage)
    states = [
        t.state for t in optuna.load_study(study_name=None, storage=storage).trials
    ]
    assert len(states) == 8 and set(states) <= {PRUNED, COMPLETE}
    n_pruned = states.count(PRUNED)
    assert n_pruned >= 1
    out = capsys.readouterr().out
    assert f"8 trials: {8 - n_pruned} complete, {n_pruned} pruned" in out
    assert study.best_value < 0.3
    assert study.best_trial.user_attrs["accuracy"] > 0.9
    assert re.search(r"best: \{'learning_rate': [0-9.e-]+, 'width': \d+\}", out)


def test_pruning_reads_a_named_evaluation_only_where_it_ran():
    from pztrain import LoopInfo

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    pruning = OptunaPruning(study.ask(), "eval/val/loss")
    info = LoopInfo(0, 10, None, 1, 1, True, None, {}, evaluations=("val", "test"))
    pruning.on_train_start(None, info)
    for step, metrics in [(2, {"test/loss": 9.0}), (4, {"val/loss": 0.5})]:
        record = {"step": step, "split": "eval", "metrics": metrics}
        assert pruning.on_eval_end(None, record) is None
    assert pruning.reported == {4: 0.5}  # step 2 ran the test set only
    with pytest.raises(ValueError, match="names no evaluation of this run"):
        OptunaPruning(study.ask(), "eval/other/loss").check(None, info)
