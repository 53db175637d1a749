"""A training process for tests/test_eval_job.py: trains a small regression
with checkpoints every 2 steps, slowly (a pause at each host point), so that
an evaluation job in another process follows it while it runs.

Usage: python tests/eval_job_trainer.py <checkpoint dir> <num_steps> <pause s>
[<keep_last>, default 1000]
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain


def loss_fn(*, model, state, rng, x, y):
    return jnp.mean((x @ model["w"] - y) ** 2), state, {}


def initial_state() -> pztrain.TrainState:
    return pztrain.TrainState.initial_state(
        {"w": jnp.zeros((3,))}, optax.sgd(0.05), jax.random.key(0)
    )


def data() -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}


class Pause(pztrain.Callback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_point_end(self, state, step):
        time.sleep(self.seconds)


def main() -> None:
    directory, num_steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    keep_last = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
    pztrain.fit(
        initial_state(),
        pztrain.build_train_step(loss_fn),
        pztrain.ArrayLoader(data(), batch_size=16, seed=0),
        num_steps=num_steps,
        log_every=2,
        progress=False,
        loggers=[],
        callbacks=[Pause(pause)],
        checkpoints=pztrain.Checkpoints(directory, every_steps=2, keep_last=keep_last),
        resume=True,  # a second call goes on from the first run's checkpoints
    )


if __name__ == "__main__":
    main()
