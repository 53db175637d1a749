"""A Flax NNX CNN with BatchNorm and Dropout trained on scikit-learn's digits.

Run: ``python examples/nnx_digits.py`` (after ``pip install -e ".[examples,nnx]"``).
Nothing is downloaded. The model is a plain ``flax.nnx.Module``; pztrain trains
its ``nnx.Param`` s, carries the BatchNorm statistics from step to step, draws
each step's dropout masks from the step key, and evaluates in eval mode (running
averages, no dropout). It prints the test accuracy beside the penzai MLP of
``examples/digits.py`` trained on the same split, then saves the params (batch
statistics included) and loads them into a freshly built model.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import pztrain


class CNN(nnx.Module):
    """Two 3×3 convolutions with BatchNorm, then Dropout and a linear head."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.3):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

    def __call__(self, images):
        x = images.reshape(-1, 8, 8, 1)
        x = jax.nn.relu(self.bn1(self.conv1(x)))
        x = jax.nn.relu(self.bn2(self.conv2(x)))
        return self.head(self.drop(x.reshape(x.shape[0], -1)))


def metrics(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def loss_fn(*, model, state, rng, images, labels):
    """In train mode: batch statistics from the batch, dropout on."""
    loss, aux = metrics(model(images), labels)
    return loss, state, aux


def eval_fn(*, model, state, rng, images, labels):
    """In eval mode: running averages, no dropout."""
    return metrics(model(images), labels)[1]


def _digits_example():
    path = Path(__file__).with_name("digits.py")
    spec = importlib.util.spec_from_file_location("digits_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(
    epochs: int = 20,
    batch_size: int = 32,
    run_dir: str | None = None,
    progress: bool = True,
    seed: int = 0,
    compare: bool = True,
) -> float:
    digits = _digits_example()
    train, valid, test = digits.load(seed)  # the same split as the penzai MLP
    if run_dir is None:
        run_dir = time.strftime("runs/nnx_digits/%Y%m%d-%H%M%S")
    model = CNN(nnx.Rngs(params=seed, dropout=seed + 1))
    optimizer = optax.adamw(optax.cosine_decay_schedule(3e-3, epochs * 40), 1e-4)
    state = pztrain.TrainState.initial_state(model, optimizer, jax.random.key(seed))
    print(state.summary())

    eval_step = pztrain.build_eval_step(eval_fn)  # eval mode by default
    state, history = pztrain.fit(
        state,
        pztrain.build_train_step(loss_fn),  # train mode by default
        pztrain.ArrayLoader(train, batch_size, seed=seed),
        num_epochs=epochs,
        eval_step=eval_step,
        eval_data=pztrain.ArrayLoader(valid, 256, shuffle=False, drop_remainder=False),
        log_every=20,
        callbacks=[pztrain.EarlyStopping("eval/loss", patience=5, restore_best=True)],
        run_dir=run_dir,
        hparams={"batch_size": batch_size, "epochs": epochs, "lr": 3e-3},
        progress=progress,
    )
    test_data = pztrain.ArrayLoader(test, 256, shuffle=False, drop_remainder=False)
    accuracy = pztrain.evaluate(state, eval_step, test_data)["accuracy"]

    # The params checkpoint keeps the batch statistics: a fresh model loads them.
    with tempfile.TemporaryDirectory() as tmp:
        pztrain.save_params(f"{tmp}/cnn", state)
        fresh = pztrain.load_params(f"{tmp}/cnn", CNN(nnx.Rngs(99)))
    fresh.eval()
    logits = fresh(jnp.asarray(test["images"]))
    reloaded = float(jnp.mean(jnp.argmax(logits, -1) == test["labels"]))
    print(f"reloaded into a fresh CNN: test accuracy {reloaded:.4f}")
    print(f"NNX CNN (BatchNorm, Dropout) test accuracy: {accuracy:.4f}")
    if compare:
        mlp = digits.main(epochs, batch_size, run_dir + "-mlp", progress, seed)
        print(f"penzai MLP test accuracy:                   {mlp:.4f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--run-dir", help="default: runs/nnx_digits/<date-time>")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-compare", action="store_true")
    args = parser.parse_args()
    main(
        args.epochs,
        args.batch_size,
        args.run_dir,
        not args.no_progress,
        compare=not args.no_compare,
    )
