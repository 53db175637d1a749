"""The main example: a penzai v2 MLP trained on scikit-learn's bundled digits.

Run: ``python examples/digits.py`` (after ``pip install -e ".[examples]"``). Nothing
is downloaded. It trains with `pztrain.fit`: evaluation every epoch, a progress
bar, early stopping on the validation loss, and a JSON-lines log in
``runs/digits/<date-time>``; then it prints the test accuracy and where the log is.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models import simple_mlp
from sklearn.datasets import load_digits

import pztrain
from pztrain.metric_states import Confusion


def logits_of(model, images):
    out = model(pz.nx.wrap(images).tag("batch", "features"))
    return out.untag("batch", "features").unwrap()


def loss_fn(*, model, state, rng, images, labels):
    """Softmax cross-entropy with a little input noise (uses the step key)."""
    images = images + 0.05 * jax.random.normal(rng, images.shape)
    logits = logits_of(model, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, state, {"loss": loss, "accuracy": accuracy}


def eval_fn(*, model, state, rng, images, labels):
    """Means over the examples, and a confusion matrix merged over the batches:
    its macro precision, recall and F1 are logged as ``classes/f1`` etc."""
    del state, rng
    logits = logits_of(model, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    classes = Confusion.of(labels, logits, num_classes=10)
    return {"loss": loss, "accuracy": accuracy, "classes": classes}


def load(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    parts = np.split(order, [1257, 1437])  # 70% train, 10% validation, 20% test
    return [{"images": x[p], "labels": y[p]} for p in parts]


def main(
    epochs: int = 30,
    batch_size: int = 32,
    run_dir: str | None = None,
    progress: bool = True,
    seed: int = 0,
) -> float:
    train, valid, test = load(seed)
    if run_dir is None:  # a new directory per run: fit never mixes two runs' logs
        run_dir = time.strftime("runs/digits/%Y%m%d-%H%M%S")
    model = simple_mlp.MLP.from_config(
        name="mlp", init_base_rng=jax.random.key(seed), feature_sizes=[64, 128, 10]
    )
    schedule = optax.cosine_decay_schedule(3e-3, decay_steps=epochs * 40)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
    state = pztrain.TrainState.initial_state(model, optimizer, jax.random.key(seed))
    print(state.summary())
    print(f"run directory: {run_dir}")

    state, history = pztrain.fit(
        state,
        pztrain.build_train_step(loss_fn),
        pztrain.ArrayLoader(train, batch_size, seed=seed),
        num_epochs=epochs,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=pztrain.ArrayLoader(valid, 256, shuffle=False, drop_remainder=False),
        log_every=20,
        callbacks=[pztrain.EarlyStopping("eval/loss", patience=5, restore_best=True)],
        run_dir=run_dir,
        hparams={"batch_size": batch_size, "epochs": epochs, "lr": 3e-3},
        progress=progress,
    )
    if history.stop_reason:
        print("stopped early:", history.stop_reason)
    result = pztrain.evaluate(
        state,
        pztrain.build_eval_step(eval_fn),
        pztrain.ArrayLoader(test, 256, shuffle=False, drop_remainder=False),
    )
    print(f"test accuracy {result['accuracy']:.4f}  test loss {result['loss']:.4f}")
    print(f"test macro F1 {result['classes/f1']:.4f}")
    print(f"the run's log: {Path(run_dir) / 'metrics.jsonl'}")
    return result["accuracy"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--run-dir", help="default: runs/digits/<date-time>")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    main(args.epochs, args.batch_size, args.run_dir, not args.no_progress)
