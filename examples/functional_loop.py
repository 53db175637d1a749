"""A functional training loop on the core alone: digits with a penzai v2 MLP.

Run: ``python examples/functional_loop.py`` (needs the ``examples`` extra for the
bundled scikit-learn digits data; nothing is downloaded).

Every line is notebook-friendly: the state is a value, the step is a pure
function, and nothing but the explicit ``float(...)`` calls reads the device.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models import simple_mlp
from sklearn.datasets import load_digits

import pztrain


def loss_fn(*, model, state, rng, images, labels):
    """Softmax cross-entropy; penzai's loss-function contract."""
    del rng
    logits = model(pz.nx.wrap(images).tag("batch", "features"))
    logits = logits.untag("batch", "features").unwrap()
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, images, labels):
    del state, rng
    logits = model(pz.nx.wrap(images).tag("batch", "features"))
    logits = logits.untag("batch", "features").unwrap()
    return {"correct": jnp.sum(jnp.argmax(logits, -1) == labels)}


def main(epochs: int = 15, batch_size: int = 64, seed: int = 0) -> float:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:360], order[360:]

    model = simple_mlp.MLP.from_config(
        name="mlp", init_base_rng=jax.random.key(seed), feature_sizes=[64, 128, 10]
    )
    state = pztrain.TrainState.initial_state(
        model, optax.adam(3e-3), root_rng=jax.random.key(seed)
    )
    print(state.summary())
    train_step = pztrain.build_train_step(loss_fn)
    eval_step = pztrain.build_eval_step(eval_fn)

    for epoch in range(epochs):
        perm = np.random.default_rng([seed, epoch]).permutation(train)
        for start in range(0, len(perm) - batch_size + 1, batch_size):
            idx = perm[start : start + batch_size]
            state, aux = train_step(state, images=x[idx], labels=y[idx])
        correct = eval_step(state, images=x[test], labels=y[test])["correct"]
        accuracy = float(correct) / len(test)
        print(
            f"epoch {epoch + 1:2d}  loss {float(aux['loss']):.4f}  "
            f"test accuracy {accuracy:.4f}"
        )
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    args = parser.parse_args()
    main(epochs=args.epochs)
