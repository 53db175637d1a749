"""A training run on data from disk, for the grain tests, run as a real subprocess.

``python grain_worker.py RUN_DIR DATA KIND [KILL_STEP]``: trains a small MLP for
24 steps on the ArrayRecord file ``DATA`` (records of 16 float32 features and
an int32 label, see `write_records`) with ``Checkpoints(every_steps=4)``,
resuming from ``RUN_DIR/ckpt`` if it holds a checkpoint, and writes the final
params and optimizer state to ``RUN_DIR/final.npz``. ``KIND`` is ``grain`` (a
`pztrain.GrainLoader`, shuffled, one grain worker process) or ``iter`` (a grain
``IterDataset``: shuffled, batched in order; its iterator state is
checkpointed). With ``KILL_STEP`` the process SIGKILLs itself at that log point,
once every save is on disk; its grain workers write their pids to
``RUN_DIR/workers``.
"""

from __future__ import annotations

import os
import signal
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain

NUM_STEPS = 24
FEATURES = 16


def write_records(path: str, n: int) -> None:
    """``n`` records: 16 float32 features and an int32 label, as bytes."""
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(0)
    writer = ArrayRecordWriter(path, "group_size:1")
    for _ in range(n):
        x = rng.standard_normal(FEATURES).astype(np.float32)
        label = np.int32(x[:4].sum() > 0)
        writer.write(x.tobytes() + label.tobytes())
    writer.close()


def decode(record: bytes) -> dict[str, np.ndarray]:
    values = np.frombuffer(record, np.float32, FEATURES)
    label = np.frombuffer(record, np.int32, 1, offset=4 * FEATURES)[0]
    return {"x": values.copy(), "y": label}


def note_worker(run_dir: str, record):
    """Records this process's pid once (the grain worker's), then passes on."""
    path = os.path.join(run_dir, "workers")
    if getattr(note_worker, "pid", None) != os.getpid():  # pickled with the pipeline
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        note_worker.pid = os.getpid()
    return record


def loss_fn(*, model, state, rng, x, y):
    del rng
    h = jnp.tanh(x @ model["w1"] + model["b1"][None])
    logits = h @ model["w2"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state, {"loss": loss}


def initial_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (FEATURES, 32)) * 0.3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 2)) * 0.3,
    }
    return pztrain.TrainState.initial_state(params, optax.adam(1e-2), jax.random.key(1))


def data(path: str, kind: str, run_dir: str):
    source = grain.sources.ArrayRecordDataSource([path])
    records = grain.MapDataset.source(source)
    if kind == "grain":
        examples = records.map(lambda r: decode(note_worker(run_dir, r)))
        return pztrain.GrainLoader(examples, 8, seed=3, workers=1)
    shuffled = records.shuffle(seed=3).map(decode).repeat()
    return shuffled.to_iter_dataset().batch(8, drop_remainder=True)


class Kill(pztrain.Callback):
    def __init__(self, checkpoints, step):
        self.checkpoints, self.step = checkpoints, step

    def on_log(self, state, record):
        if record["step"] == self.step:
            self.checkpoints.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main(run_dir: str, path: str, kind: str, kill_step: int | None = None) -> None:
    os.makedirs(run_dir, exist_ok=True)
    checkpoints = pztrain.Checkpoints(os.path.join(run_dir, "ckpt"), every_steps=4)
    state, _ = pztrain.fit(
        initial_state(),
        pztrain.build_train_step(loss_fn),
        data(path, kind, run_dir),
        num_steps=NUM_STEPS,
        log_every=2,
        callbacks=[Kill(checkpoints, kill_step)] if kill_step else [],
        checkpoints=checkpoints,
        resume=True,
        run_dir=run_dir,
        progress=False,
    )
    flat = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
    arrays = {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
    np.savez(os.path.join(run_dir, "final.npz"), **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:4], *(int(a) for a in sys.argv[4:5]))
