"""A training run for the SIGKILL campaign (``kill_campaign.py``), run as a subprocess.

``python kill_worker.py RUN_DIR [--num-steps N] [--step-sleep S] ...`` trains a small
equinox MLP on fixed synthetic data (an `pztrain.ArrayLoader`, so the data position
follows the step on resume) with a noisy loss (it uses ``rng``), an optax schedule
injected with ``optax.inject_hyperparams``, a loss-function state, periodic evaluation
and asynchronous ``Checkpoints(RUN_DIR/ckpt)``, resuming from the newest complete
checkpoint if there is one. At the end it writes the final params, optimizer state,
loss-function state, step and root key to ``RUN_DIR/final.npz`` (through a temporary
file: the file exists only once complete). The default `pztrain.JsonlLogger` writes
``RUN_DIR/metrics.jsonl``.

The host sleeps ``--step-sleep`` seconds before each step and ``--eval-sleep`` before
each evaluation batch (a slow input pipeline), so that a kill lands at varied points.
The sleeps change no value. The worker reports its progress on stdout, one line per
event, for the driver to time its kills and describe where they landed::

    ready START_STEP    training starts (after resume, the log cut back)
    step N              step N is done (printed before sleeping)
    eval N              the evaluation at step N starts
    evaluated N         the evaluation at step N ended (before its record is written)
    done                final.npz is written
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain

DEFAULTS = {
    "num_steps": 40,
    "log_every": 2,
    "eval_every": 6,
    "every_steps": 4,
    "keep_last": 2,
    "step_sleep": 0.05,
    "eval_sleep": 0.05,
}


def say(*words: object) -> None:
    """One event line on stdout, flushed at once (the driver reads it live)."""
    print(*words, flush=True)


def loss_fn(*, model, state, rng, x, y):
    noisy = x + 0.1 * jax.random.normal(rng, x.shape)
    logits = jax.vmap(model)(noisy)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state + 1, {"loss": loss, "noise": jnp.mean(noisy - x)}


def eval_fn(*, model, state, rng, x, y):
    noisy = x + 0.1 * jax.random.normal(rng, x.shape)
    logits = jax.vmap(model)(noisy)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


def initial_state(num_steps: int) -> pztrain.TrainState:
    model = eqx.nn.MLP(4, 3, 32, 2, key=jax.random.key(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.02, 5, num_steps)
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=1e-3
    )
    return pztrain.TrainState.initial_state(
        model, tx, jax.random.key(1), loss_fn_state=jnp.array(0)
    )


def make_data(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype(np.int32) + (x[:, 3] > 1)
    return {"x": x, "y": y.astype(np.int32)}


class SlowBatches:
    """The eval batches of ``loader``, each after ``sleep`` seconds (a slow pipeline).

    Args:
      loader: An `pztrain.ArrayLoader`; one pass over it in order.
      sleep: Seconds to sleep before each batch.
      pace: The run's `Pace`, for the step an evaluation happens at.
    """

    def __init__(self, loader: pztrain.ArrayLoader, sleep: float, pace: Pace):
        self.loader, self.sleep, self.pace = loader, sleep, pace

    def __iter__(self):
        say("eval", self.pace.step)
        for batch in self.loader:
            time.sleep(self.sleep)
            yield batch


class Pace(pztrain.Callback):
    """Reports events and sleeps ``sleep`` seconds between steps."""

    def __init__(self, sleep: float):
        self.sleep = sleep
        self.step = 0

    def on_train_start(self, state, info):
        self.step = info.start_step
        say("ready", info.start_step)

    def on_advance(self, step, t):
        if step != self.step:
            say("step", step)
        self.step = step
        time.sleep(self.sleep)
        return step + 1  # a host point after every step

    def on_eval_end(self, state, record):
        say("evaluated", record["step"])


def final_arrays(state: pztrain.TrainState) -> dict[str, np.ndarray]:
    """The state's arrays by key path (a key as its raw data)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        {
            "params": state.params,
            "opt_state": state.opt_state,
            "loss_fn_state": state.loss_fn_state,
            "step": state.step,
            "root_rng": state.root_rng,
        }
    )[0]
    out = {}
    for path, x in leaves:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[jax.tree_util.keystr(path)] = np.asarray(x)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    for name, value in DEFAULTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value))
    parser.set_defaults(**DEFAULTS)
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    pace = Pace(args.step_sleep)
    checkpoints = pztrain.Checkpoints(
        os.path.join(run_dir, "ckpt"),
        every_steps=args.every_steps,
        keep_last=args.keep_last,
        async_save=True,
    )
    eval_loader = pztrain.ArrayLoader(make_data(40, 1), 8, shuffle=False)
    state, _ = pztrain.fit(
        initial_state(args.num_steps),
        pztrain.build_train_step(loss_fn),
        pztrain.ArrayLoader(make_data(40, 0), 8, seed=3),
        num_steps=args.num_steps,
        log_every=args.log_every,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=SlowBatches(eval_loader, args.eval_sleep, pace),
        eval_every=args.eval_every,
        callbacks=[pace],
        checkpoints=checkpoints,
        resume=True,
        run_dir=run_dir,
        hparams={"num_steps": args.num_steps, "model": "MLP 4-32-32-3"},
        progress=False,
    )
    tmp = os.path.join(run_dir, "final.tmp.npz")
    np.savez(tmp, **final_arrays(state))
    os.replace(tmp, os.path.join(run_dir, "final.npz"))
    say("done")


if __name__ == "__main__":
    main(sys.argv[1:])
