"""One process of a multi-process `fit`, for ``test_multihost_fit.py``.

``python multihost_fit_worker.py RUN_DIR PROCESS_ID NUM_PROCESSES PORT KILL_STEP``,
with ``XLA_FLAGS=--xla_force_host_platform_device_count=<4 / NUM_PROCESSES>``.

Four devices in all (a ``data`` mesh over all of them, with Explicit axes if
``MESH_AXES=explicit``, else Auto), an FSDP-sharded state,
a mesh-aware `ArrayLoader` (each process feeds its rows), `Checkpoints` every 8
steps and ``resume=True``, a JSONL log in ``RUN_DIR/log``, an evaluation every 16
steps and a progress bar. With ``KILL_STEP > 0`` every process SIGKILLs itself at
that log point. At the end process 0 writes the gathered params to
``RUN_DIR/final.npz``, and every process writes its history's steps to
``RUN_DIR/history-<id>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType

import pztrain

NUM_STEPS = 32


def loss_fn(*, model, state, rng, x, y):
    h = jnp.tanh(x @ model["w1"] + model["b1"][None])
    loss = jnp.mean((h @ model["w2"] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    del state, rng
    h = jnp.tanh(x @ model["w1"] + model["b1"][None])
    return {"loss": jnp.mean((h @ model["w2"] - y) ** 2)}


def make_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (8, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 4)) * 0.3,
    }
    return pztrain.TrainState.initial_state(params, optax.adam(1e-2), jax.random.key(1))


class KillAt(pztrain.Callback):
    """SIGKILLs this process at a log point, once every save is on disk."""

    def __init__(self, step: int, checkpoints: pztrain.Checkpoints):
        self.step, self.checkpoints = step, checkpoints

    def on_log(self, state, record):
        if record["step"] == self.step:
            self.checkpoints.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main(run_dir: str, pid: int, num: int, port: int, kill: int) -> None:
    if num > 1:
        address = f"127.0.0.1:{port}"
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num,
            process_id=pid,
            coordinator_bind_address=address,
        )
    rng = np.random.default_rng(0)
    data = {
        "x": rng.standard_normal((96, 8)).astype(np.float32),
        "y": rng.standard_normal((96, 4)).astype(np.float32),
    }
    # MESH_AXES=explicit: JAX's default axis type; else Auto.
    types = {"explicit": AxisType.Explicit}.get(os.environ.get("MESH_AXES"))
    mesh = jax.make_mesh((4,), ("data",), axis_types=(types or AxisType.Auto,))
    rules = pztrain.ShardingRules(fsdp="data")
    state = pztrain.sharded_initial_state(make_state, mesh, rules)
    step = pztrain.build_train_step(loss_fn, mesh=mesh)
    loader = pztrain.ArrayLoader(data, 16, seed=3, sharding=step.batch_sharding)
    eval_data = pztrain.ArrayLoader(
        data, 32, shuffle=False, sharding=step.batch_sharding
    )
    ckpt = pztrain.Checkpoints(os.path.join(run_dir, "ckpt"), every_steps=8)
    state, history = pztrain.fit(
        state,
        step,
        loader,
        num_steps=NUM_STEPS,
        log_every=4,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=eval_data,
        eval_every=16,
        callbacks=[KillAt(kill, ckpt)] if kill > 0 else [],
        checkpoints=ckpt,
        resume=True,
        run_dir=os.path.join(run_dir, "log"),
        progress=True,
    )
    pztrain.export_safetensors(os.path.join(run_dir, "params.safetensors"), state)
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if jax.process_index() == 0:
        np.savez(os.path.join(run_dir, "final.npz"), **jax.device_get(params))
    steps = [(r["step"], r["split"]) for r in history.records]
    with open(os.path.join(run_dir, f"history-{jax.process_index()}.json"), "w") as f:
        json.dump({"steps": steps, "w1": str(state.params["w1"].sharding.spec)}, f)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]))
