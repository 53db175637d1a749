"""Trains one epoch over a big ArrayRecord file, for ``test_grain_scale.py``.

``python grain_memory_worker.py DATA WORKERS`` writes nothing; it prints one line
of JSON: the steps trained, the examples they covered, and the peak resident
memory of this process (``VmHWM``) and of its largest grain worker
(``ru_maxrss``), in MiB.
Each record of ``DATA`` is ``FEATURES`` float32 values (see `write`).
"""

from __future__ import annotations

import json
import resource
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain

FEATURES = 16384  # 64 KiB per record
BATCH = 64  # 4 MiB per batch


def write(path: str, records: int) -> None:
    """``records`` records of ``FEATURES`` float32 values, each a different roll
    of one random block (cheap to make, different per record)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    block = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)
    writer = ArrayRecordWriter(path, "group_size:1,uncompressed")
    for i in range(records):
        writer.write(np.roll(block, i).tobytes())
    writer.close()


def decode(record: bytes) -> dict[str, np.ndarray]:
    x = np.frombuffer(record, np.float32)
    return {"x": x.reshape(64, -1).mean(axis=1), "y": np.float32(x[0] > 0)}


def loss_fn(*, model, state, rng, x, y):
    del rng
    logits = x @ model["w"]
    loss = optax.sigmoid_binary_cross_entropy(logits[:, 0], y).mean()
    return loss, state, {"loss": loss}


def main(path: str, workers: int) -> None:
    source = grain.sources.ArrayRecordDataSource([path])
    examples = grain.MapDataset.source(source).map(decode)
    loader = pztrain.GrainLoader(examples, BATCH, seed=0, workers=workers)
    state = pztrain.TrainState.initial_state(
        {"w": jnp.zeros((64, 1))}, optax.sgd(0.1), jax.random.key(0)
    )
    state, history = pztrain.fit(
        state,
        pztrain.build_train_step(loss_fn),
        loader,
        num_epochs=1,
        log_every=loader.steps_per_epoch,
        progress=False,
        loggers=[],
    )
    covered = {i for s in range(int(state.step)) for i in loader.example_ids(s)}
    mib = 1024  # both in KiB on Linux
    print(
        json.dumps(
            {
                "steps": int(state.step),
                "examples": len(covered),
                "loss": history.series("loss")[1][-1],
                "rss_mib": _peak_kib() / mib,
                "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                / mib,
            }
        )
    )


def _peak_kib() -> int:
    """This process's peak resident memory since it started (``VmHWM``).

    Not ``ru_maxrss``: Linux keeps that across ``exec``, so a process started
    by a large parent (a long test session) reports the parent's size.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
