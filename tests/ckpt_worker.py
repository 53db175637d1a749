"""A training run for the checkpoint tests, run as a real subprocess.

``python ckpt_worker.py RUN_DIR MODE [KILL_STEP]``: trains a small equinox MLP on
fixed data for 24 steps with ``Checkpoints(every_steps=4)``, resuming from
``RUN_DIR/ckpt`` if it holds a checkpoint, and writes the final params and optimizer
state to ``RUN_DIR/final.npz``. ``MODE`` is ``full`` (no kill), ``kill`` (SIGKILL
itself right after step KILL_STEP, once every save is on disk) or ``kill_saving``
(SIGKILL itself right after starting an asynchronous save at step KILL_STEP).
"""

from __future__ import annotations

import os
import signal
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain

NUM_STEPS = 24


def loss_fn(*, model, state, rng, x, y):
    noisy = x + 0.1 * jax.random.normal(rng, x.shape)
    logits = jax.vmap(model)(noisy)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state + 1, {"loss": loss}


def initial_state():
    model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
    tx = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.cosine_decay_schedule(0.01, NUM_STEPS)
    )
    return pztrain.TrainState.initial_state(
        model, tx, jax.random.key(1), loss_fn_state=jnp.array(0)
    )


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    return pztrain.ArrayLoader({"x": x, "y": (x.sum(1) > 0).astype(np.int32)}, 8)


class Kill(pztrain.Callback):
    def __init__(self, checkpoints, step, while_saving):
        self.checkpoints, self.step, self.while_saving = checkpoints, step, while_saving

    def on_log(self, state, record):
        if record["step"] != self.step:
            return
        if self.while_saving:
            self.checkpoints.save(state, record["step"])  # async: returns at once
        else:
            self.checkpoints.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def main(run_dir, mode, kill_step=None):
    checkpoints = pztrain.Checkpoints(os.path.join(run_dir, "ckpt"), every_steps=4)
    callbacks = []
    if mode != "full":
        callbacks.append(Kill(checkpoints, kill_step, mode == "kill_saving"))
    state, _ = pztrain.fit(
        initial_state(),
        pztrain.build_train_step(loss_fn),
        data(),
        num_steps=NUM_STEPS,
        log_every=2,
        callbacks=callbacks,
        checkpoints=checkpoints,
        resume=True,
        run_dir=run_dir,
        progress=False,
    )
    flat = {
        jax.tree_util.keystr(p): np.asarray(jax.random.key_data(x))
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        else np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(
            (state.params, state.opt_state, state.loss_fn_state, state.step)
        )[0]
    }
    np.savez(os.path.join(run_dir, "final.npz"), **flat)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
