"""Tuning with Optuna: learning rate and width of a penzai MLP on the digits data.

Run: ``python examples/tune_digits.py`` (after ``pip install -e ".[examples,optuna]"``).
Nothing is downloaded. Each trial trains with `pztrain.fit`, evaluating every
epoch; `OptunaPruning` reports the validation loss to the trial, and Optuna's
``MedianPruner`` stops trials whose loss is worse than the median of earlier
trials at the same step (`fit` then raises ``optuna.TrialPruned``, which
``study.optimize`` records). Prints the best parameters and how many trials were
pruned. ``--storage sqlite:///tune.db`` keeps the study in a file.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optuna
from penzai import pz
from penzai.models import simple_mlp
from sklearn.datasets import load_digits

import pztrain
from pztrain.integrations.optuna import OptunaPruning


def logits_of(model, images):
    out = model(pz.nx.wrap(images).tag("batch", "features"))
    return out.untag("batch", "features").unwrap()


def loss_fn(*, model, state, rng, images, labels):
    logits = logits_of(model, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, images, labels):
    logits = logits_of(model, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def load(seed: int = 0):
    """Train and validation splits of the bundled digits (80% / 20%)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    train, valid = np.split(order, [1437])
    return [{"images": x[p], "labels": y[p]} for p in (train, valid)]


def make_objective(train, valid, epochs: int):
    # Built once for all trials: a trial compiles only for a width not seen yet.
    # The learning rate is injected, so each trial sets it on its state.
    train_step = pztrain.build_train_step(loss_fn)
    eval_step = pztrain.build_eval_step(eval_fn)
    eval_data = pztrain.ArrayLoader(valid, 360, shuffle=False, drop_remainder=False)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        width = trial.suggest_categorical("width", [32, 64, 128])
        model = simple_mlp.MLP.from_config(
            name="mlp",
            init_base_rng=jax.random.key(trial.number),
            feature_sizes=[64, width, 10],
        )
        state = pztrain.TrainState.initial_state(
            model, optimizer, jax.random.key(trial.number)
        ).with_hyperparams(learning_rate=lr)
        pruning = OptunaPruning(trial, monitor="eval/loss")
        _, history = pztrain.fit(  # raises optuna.TrialPruned when pruned
            state,
            train_step,
            pztrain.ArrayLoader(train, 64, seed=trial.number),
            num_epochs=epochs,
            eval_step=eval_step,
            eval_data=eval_data,
            log_every=22,  # one log point per epoch of 22 steps
            callbacks=[pruning],
            progress=False,
        )
        trial.set_user_attr("accuracy", history.last("eval")["metrics"]["accuracy"])
        return history.last("eval")["metrics"]["loss"]

    return objective


def main(
    n_trials: int = 12, epochs: int = 8, storage: str | None = None, seed: int = 0
) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    train, valid = load(seed)
    study = optuna.create_study(
        storage=storage,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=22),
    )
    study.optimize(make_objective(train, valid, epochs), n_trials=n_trials)
    states = [t.state for t in study.trials]
    pruned = states.count(optuna.trial.TrialState.PRUNED)
    complete = states.count(optuna.trial.TrialState.COMPLETE)
    best = study.best_trial
    print(f"{len(states)} trials: {complete} complete, {pruned} pruned")
    print(
        f"best: {best.params}  validation loss {best.value:.4f}  "
        f"accuracy {best.user_attrs['accuracy']:.4f}"
    )
    return study


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--storage", help="e.g. sqlite:///tune.db (default: memory)")
    args = parser.parse_args()
    main(args.trials, args.epochs, args.storage)
