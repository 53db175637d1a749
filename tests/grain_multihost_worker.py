"""One process of a `fit` on a `pztrain.GrainLoader`, for ``test_grain_scale.py``.

``python grain_multihost_worker.py RUN_DIR PROCESS_ID NUM_PROCESSES PORT KILL_STEP
TAG``, with ``XLA_FLAGS=--xla_force_host_platform_device_count=<4 /
NUM_PROCESSES>``: four devices in all (a ``data`` mesh), a replicated MLP, a
`GrainLoader` sharded over the mesh (each process reads its rows), `Checkpoints`
every 8 steps and ``resume=True``, 32 steps. Every example the process reads
while training is appended to ``RUN_DIR/reads-TAG-<process id>.txt`` (one
example id per line, in reading order). With ``KILL_STEP > 0`` every process
SIGKILLs itself at that log point once every save is on disk. At the end
process 0 writes the params to ``RUN_DIR/final.npz``.
"""

from __future__ import annotations

import os
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType

import pztrain

NUM_STEPS = 32
N = 96  # examples
BATCH = 16  # global
LOG: list = []  # the file reads go to, once training starts


def example(i) -> dict[str, np.ndarray]:
    """Example ``i`` (noting the read, once training has started)."""
    i = int(i)
    if LOG:
        LOG[0].write(f"{i}\n")
        LOG[0].flush()
    x = np.random.default_rng(i).standard_normal(8).astype(np.float32)
    return {"x": x, "y": np.float32(np.sin(x).sum()), "id": np.int32(i)}


def dataset() -> grain.MapDataset:
    return grain.MapDataset.range(N).map(example)


from multihost_fit_worker import KillAt  # noqa: E402  (SIGKILL once saved)


def loss_fn(*, model, state, rng, x, y, id):
    del rng, id
    h = jnp.tanh(x @ model["w1"] + model["b1"][None])
    loss = jnp.mean(((h @ model["w2"])[:, 0] - y) ** 2)
    return loss, state, {"loss": loss}


def make_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (8, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 1)) * 0.3,
    }
    return pztrain.TrainState.initial_state(params, optax.adam(1e-2), jax.random.key(1))


def main(run_dir: str, pid: int, num: int, port: int, kill: int, tag: str) -> None:
    if num > 1:
        address = f"127.0.0.1:{port}"
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num,
            process_id=pid,
            coordinator_bind_address=address,
        )
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    state = pztrain.sharded_initial_state(make_state, mesh, pztrain.ShardingRules())
    step = pztrain.build_train_step(loss_fn, mesh=mesh)
    loader = pztrain.GrainLoader(dataset(), BATCH, seed=5, sharding=step.batch_sharding)
    os.makedirs(run_dir, exist_ok=True)
    LOG.append(open(os.path.join(run_dir, f"reads-{tag}-{pid}.txt"), "w"))
    ckpt = pztrain.Checkpoints(os.path.join(run_dir, "ckpt"), every_steps=8)
    state, _ = pztrain.fit(
        state,
        step,
        loader,
        num_steps=NUM_STEPS,
        log_every=4,
        callbacks=[KillAt(kill, ckpt)] if kill > 0 else [],
        checkpoints=ckpt,
        resume=True,
        run_dir=os.path.join(run_dir, "log"),
        progress=False,
    )
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if jax.process_index() == 0:
        np.savez(os.path.join(run_dir, "final.npz"), **jax.device_get(params))


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6])
