"""Checkpoint speed: pztrain params-only save+load vs np.save/np.load, and async saves.

Run: ``python benchmarks/checkpoint_bench.py [--quick] [--params N] [--trials T]``.

Two measurements, in one process, with interleaved trials (A B A B …) and medians:

1. Params-only: ``pztrain.save_params`` + ``pztrain.load_params`` of a dict of float32
   arrays (100M values by default, 400 MiB) against ``np.save`` + ``np.load`` of the
   same arrays (one ``.npy`` file per array, device→host and host→device included).
   The ratio is pztrain's time over numpy's (target ≤ 1.3). orbax's writer
   (TensorStore) fsyncs every file it writes, so the checkpoint is on disk when the
   save returns; ``np.save`` leaves it in the page cache. A second baseline,
   ``np.save`` + ``fsync`` per file, compares like with like.
2. Async saves: how long ``Checkpoints.save`` blocks the caller (the training loop)
   with ``async_save=True``, against a synchronous save of the same state (target:
   blocked < 10% of the synchronous time).

It also times one xxh3-64 pass over the params' host bytes on one thread: the
checksums a save stores and a load verifies cost about that much each (less on
several cores), a figure that does not move with the disk as the others do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import xxhash

import pztrain


def make_params(total: int, per_array: int = 4 * 1024 * 1024) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    params, i = {}, 0
    while total > 0:
        n = min(per_array, total)
        params[f"block_{i:03d}/w"] = jnp.asarray(rng.standard_normal(n, np.float32))
        total -= n
        i += 1
    return jax.block_until_ready(params)


def time_numpy(params, root, sync=False):
    path = tempfile.mkdtemp(dir=root)
    t0 = time.perf_counter()
    for i, value in enumerate(jax.device_get(params).values()):
        with open(os.path.join(path, f"{i}.npy"), "wb") as f:
            np.save(f, value)
            if sync:  # on disk, as orbax's writer (TensorStore) makes its files
                f.flush()
                os.fsync(f.fileno())
    t1 = time.perf_counter()
    loaded = {
        name: jnp.asarray(np.load(os.path.join(path, f"{i}.npy"), allow_pickle=False))
        for i, name in enumerate(params)
    }
    jax.block_until_ready(loaded)
    t2 = time.perf_counter()
    shutil.rmtree(path)
    return t1 - t0, t2 - t1


def time_pztrain(params, root):
    path = os.path.join(tempfile.mkdtemp(dir=root), "ckpt")
    like = jax.tree.map(jnp.zeros_like, params)
    t0 = time.perf_counter()
    pztrain.save_params(path, params)
    t1 = time.perf_counter()
    loaded = pztrain.load_params(path, like)
    jax.block_until_ready(loaded)
    t2 = time.perf_counter()
    for name in list(params)[:2]:
        np.testing.assert_array_equal(loaded[name], params[name])
    shutil.rmtree(os.path.dirname(path))
    return t1 - t0, t2 - t1


def time_checksums(params):
    t0 = time.perf_counter()
    for value in params.values():
        xxhash.xxh3_64_intdigest(np.asarray(value).reshape(-1).view(np.uint8))
    return time.perf_counter() - t0


def time_async(params, root):
    state = pztrain.TrainState.initial_state(params, optax.sgd(0.1), jax.random.key(0))
    out = {}
    for mode in ("sync", "async"):
        directory = os.path.join(tempfile.mkdtemp(dir=root), mode)
        # Inside a with-block (as inside fit) saves run in the background.
        with pztrain.Checkpoints(directory, async_save=mode == "async") as ckpt:
            t0 = time.perf_counter()
            ckpt.save(state, 1)
            blocked = time.perf_counter() - t0
        out[mode] = blocked
    return out["sync"], out["async"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10M params, 3 trials")
    parser.add_argument("--params", type=int, default=None)
    parser.add_argument("--trials", type=int, default=None)
    args = parser.parse_args()
    total = args.params or (10_000_000 if args.quick else 104_857_600)
    trials = args.trials or (3 if args.quick else 5)
    params = make_params(total)
    root = tempfile.mkdtemp(prefix="pztrain-ckpt-bench-")
    try:
        time_pztrain(params, root)  # warm up imports and code paths
        rows = {k: [] for k in ("numpy", "numpy+fsync", "pztrain", "sync", "async")}
        rows["xxh3"] = []
        for _ in range(trials):
            rows["numpy"].append(time_numpy(params, root))
            rows["numpy+fsync"].append(time_numpy(params, root, sync=True))
            rows["pztrain"].append(time_pztrain(params, root))
            sync, asyn = time_async(params, root)
            rows["sync"].append(sync)
            rows["async"].append(asyn)
            rows["xxh3"].append(time_checksums(params))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(xs):
        return statistics.median(xs)

    def ratios(base):
        totals = [[s + load for s, load in rows[name]] for name in (base, "pztrain")]
        return [p / n for n, p in zip(*totals, strict=True)]

    print(
        f"jax {jax.__version__}, {os.cpu_count()} CPUs, {total:,} float32 params, "
        f"{trials} interleaved trials (medians)"
    )
    print("| what | save s | load s | total s | pztrain's time over this |")
    print("|---|---|---|---|---|")
    for name in ("numpy", "numpy+fsync", "pztrain"):
        saves = [s for s, _ in rows[name]]
        loads = [load for _, load in rows[name]]
        totals = [s + load for s, load in rows[name]]
        ratio = "" if name == "pztrain" else f"{med(ratios(name)):.2f}"
        print(
            f"| {name} | {med(saves):.3f} | {med(loads):.3f} | {med(totals):.3f} "
            f"| {ratio} |"
        )
    print(f"\nxxh3-64 of the params on one thread: {med(rows['xxh3']):.3f} s")
    blocked = [a / s for a, s in zip(rows["async"], rows["sync"], strict=True)]
    print()
    print("| full-state save | loop blocked s |")
    print("|---|---|")
    print(f"| synchronous | {med(rows['sync']):.3f} |")
    print(
        f"| asynchronous | {med(rows['async']):.3f} "
        f"({100 * med(blocked):.1f}% of synchronous) |"
    )


if __name__ == "__main__":
    main()
