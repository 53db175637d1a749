"""`fit` fed from disk through grain against `fit` on arrays already on the device.

Run from the repository root::

    python benchmarks/data_bench.py            # 5 interleaved rounds, ~5 minutes
    python benchmarks/data_bench.py --quick    # 1 short round, 0 and 1 worker

The data: ``--examples`` records in a ``.npy`` file on disk, memory-mapped
(8×8 uint8 images and a label, 65 bytes each), read a batch at a time
(`pztrain.data.BulkSource`). The pipeline does real work per example: it
decodes the record (scaling to float32) and augments it with NumPy (a shift,
a flip and noise drawn from a hash of grain's index, repeated ``rounds``
times). ``rounds`` is calibrated at the start so that preparing one batch in
this process (reading, grain's shuffle, decoding, augmenting, stacking) takes
about as long as one train step.

The model is the step benchmark's W1: an MLP 64-256-256-10, batch 128, Adam,
softmax cross-entropy. Every variant runs the same `pztrain.fit` (a log record
every ``--log-every`` steps, no progress bar), ``--steps`` steps per trial:

* ``device``: an `pztrain.ArrayLoader(on_device=True)` over the decoded arrays
  (no per-step host work at all): the baseline;
* ``grain, N workers``: a `pztrain.GrainLoader` over the pipeline with N grain
  worker processes (0: the pipeline runs in `fit`'s prefetch thread).

Speed is the steady state: steps between the first and the last log point over
the time between them (each log point reads the step's metrics, so the time is
taken once those steps have run). Worker start-up (spawning, imports) is
reported apart: the time from the call to the first log point, over the
baseline's. Trials are interleaved (baseline, variant, baseline, ...); a
variant's ratio is its speed over the mean of the two baseline trials around
it, the median over rounds. Host memory: the resident set of this process and
the sum over grain's worker processes, sampled at every log point (the largest
value seen in a trial; ``/proc``, Linux only).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain

BATCH = 128
SIZES = (64, 256, 256, 10)


# ----------------------------------------------------------------------------
# the data


def write_records(path: str, n: int) -> None:
    """``n`` records in a ``.npy`` file: an 8×8 uint8 image (a class pattern with
    noise) and its label, 65 bytes each."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 12, size=(10, 64), dtype=np.uint8)
    labels = np.arange(n) % 10
    images = patterns[labels] + rng.integers(0, 4, size=(n, 64), dtype=np.uint8)
    np.save(path, np.concatenate([images, labels[:, None].astype(np.uint8)], axis=1))


def records(path: str) -> np.ndarray:
    """The records, memory-mapped: read from disk as they are indexed."""
    return np.load(path, mmap_mode="r")


def decode(record: np.ndarray) -> dict[str, np.ndarray]:
    return {"x": record[:64].astype(np.float32) / 16.0, "y": np.int32(record[64])}


NOISE = np.random.default_rng(1).normal(0, 0.05, size=(97, 8, 8)).astype(np.float32)


class Augment:
    """A shift, a flip and noise, ``rounds`` times, drawn from the index
    grain passes (``map_with_index``: epoch ``e`` reads example ``i`` at index
    ``e * n + i``, so each epoch draws anew)."""

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, index: int, example: dict) -> dict:
        image = example["x"].reshape(8, 8)
        for r in range(self.rounds):
            h = (index * 2654435761 + r * 40503) % 2**32  # a hash of (index, round)
            image = np.roll(image, h % 3 - 1, axis=1)
            if h & 8:
                image = image[:, ::-1]
            image = np.clip(image + NOISE[h % 97], 0.0, 2.0)
        return {"x": np.ascontiguousarray(image).reshape(64), "y": example["y"]}


def pipeline(path: str, rounds: int) -> grain.MapDataset:
    """Records read a batch at a time, decoded and augmented one by one."""
    source = pztrain.data.BulkSource(records(path))
    augment = Augment(rounds)
    return grain.MapDataset.source(source).map(decode).map_with_index(augment)


class Record:
    """The records as examples ``{"record": <65 uint8>}``, read a batch at a
    time (what `BatchAugment` decodes and augments once stacked)."""

    def __init__(self, path: str):
        self.path, self._rows = path, None

    def rows(self) -> np.ndarray:
        if self._rows is None:  # mapped once per process
            self._rows = records(self.path)
        return self._rows

    def __getstate__(self) -> dict:
        return {"path": self.path, "_rows": None}  # a worker maps the file anew

    def __len__(self) -> int:
        return len(self.rows())

    def __getitem__(self, i: int) -> dict:
        return {"record": np.asarray(self.rows()[int(i)])}

    def __getitems__(self, keys: list[int]) -> list[dict]:
        return [{"record": r} for r in np.asarray(self.rows()[keys])]


class BatchAugment:
    """`decode` and `Augment` on a whole batch at once (vectorised NumPy): the
    same shift, flip and noise drawn from each row's index."""

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, batch: dict, positions: np.ndarray) -> dict:
        rows = batch["record"]
        image = (rows[:, :64].astype(np.float32) / 16.0).reshape(-1, 8, 8)
        index = positions.astype(np.uint64)
        for r in range(self.rounds):
            h = (index * np.uint64(2654435761) + np.uint64(r * 40503)) % 2**32
            shift = (h % 3).astype(np.int64)[:, None, None] - 1
            rolled = [np.roll(image, s, axis=2) for s in (-1, 1)]
            image = np.where(
                shift < 0, rolled[0], np.where(shift > 0, rolled[1], image)
            )
            flip = (h & 8).astype(bool)[:, None, None]
            image = np.where(flip, image[:, :, ::-1], image)
            image = np.clip(image + NOISE[(h % 97).astype(np.int64)], 0.0, 2.0)
        return {"x": image.reshape(-1, 64), "y": rows[:, 64].astype(np.int32)}


def batched_loader(path: str, rounds: int, workers: int = 0) -> pztrain.GrainLoader:
    """The records read a batch at a time, decoded and augmented per batch."""
    return pztrain.GrainLoader(
        Record(path),  # a data source: read a batch at a time (BulkSource)
        BATCH,
        seed=1,
        workers=workers,
        batch_transform=BatchAugment(rounds),
    )


def decoded(path: str) -> dict[str, np.ndarray]:
    """Every record decoded (not augmented): the baseline's arrays."""
    rows = np.asarray(records(path))
    return {
        "x": rows[:, :64].astype(np.float32) / 16.0,
        "y": rows[:, 64].astype(np.int32),
    }


# ----------------------------------------------------------------------------
# the model (W1)


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
    params = {}
    for i, (k, a, b) in enumerate(zip(keys, SIZES, SIZES[1:], strict=False)):
        params[f"w{i}"] = jax.random.normal(k, (a, b)) / np.sqrt(a)
        params[f"b{i}"] = jnp.zeros(b)
    return params


def loss_fn(*, model, state, rng, x, y):
    del rng
    h = x
    for i in range(len(SIZES) - 1):
        h = h @ model[f"w{i}"] + model[f"b{i}"][None]
        if i < len(SIZES) - 2:
            h = jax.nn.relu(h)
    loss = optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)


def new_state() -> pztrain.TrainState:
    return pztrain.TrainState.initial_state(
        init_params(), optax.adam(1e-3), jax.random.key(0)
    )


# ----------------------------------------------------------------------------
# trials


def _rss_mib(pid: int) -> float:
    """The resident set of process ``pid`` (MiB), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children() -> list[int]:
    """This process's child processes (grain's workers), from ``/proc``."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


class Probe(pztrain.Callback):
    """At each log point (after its steps ran): the time and host memory."""

    def __init__(self):
        self.points: list[tuple[int, float]] = []
        self.rss = self.workers_rss = 0.0

    def on_log(self, state, record):
        self.points.append((record["step"], time.perf_counter()))
        self.rss = max(self.rss, _rss_mib(os.getpid()))
        self.workers_rss = max(self.workers_rss, sum(_rss_mib(p) for p in _children()))


def trial(loader, steps: int, log_every: int) -> dict[str, float]:
    """One `fit` call: steady steps/s, seconds to the first log point, memory."""
    probe = Probe()
    start = time.perf_counter()
    pztrain.fit(
        new_state(),
        STEP,
        loader,
        num_steps=steps,
        log_every=log_every,
        callbacks=[probe],
        progress=False,
        loggers=[],
    )
    (s0, t0), (s1, t1) = probe.points[0], probe.points[-1]
    return {
        "steps_per_sec": (s1 - s0) / (t1 - t0),
        "first_point": t0 - start,
        "rss": probe.rss,
        "workers_rss": probe.workers_rss,
    }


def batch_seconds(ds: grain.MapDataset | pztrain.GrainLoader) -> float:
    """Seconds to prepare one batch in this process (median of 9 batches)."""
    loader = (
        ds
        if isinstance(ds, pztrain.GrainLoader)
        else pztrain.GrainLoader(ds, BATCH, seed=1)
    )
    times = []
    for step in range(9):
        t = time.perf_counter()
        loader.batch_at(step)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def calibrate(make, step_seconds: float) -> tuple[int, float]:
    """The augmentation rounds with which ``make(rounds)``'s batch takes about
    ``step_seconds``, and the seconds of a batch without augmentation."""
    base = batch_seconds(make(0))
    per_round = max(batch_seconds(make(16)) - base, 1e-6) / 16
    return max(1, round((step_seconds - base) / per_round)), base


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 short round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--examples", type=int, default=16384)
    parser.add_argument("--workers", default="0,1,2", help="worker counts to run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.log_every, args.workers = 1, 300, 100, "0,1"
    worker_counts = [int(w) for w in args.workers.split(",")]
    load_start = _load()
    print(f"load average at the start: {load_start:.2f} (2 cores)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "data.npy")
        write_records(path, args.examples)
        device = pztrain.ArrayLoader(decoded(path), BATCH, on_device=True)
        warm = trial(device, max(args.steps // 2, 2 * args.log_every), args.log_every)
        step_seconds = 1 / warm["steps_per_sec"]
        rounds, base = calibrate(lambda r: pipeline(path, r), step_seconds)
        ds = pipeline(path, rounds)
        per_batch = batch_seconds(ds)
        print(
            f"one step: {step_seconds * 1e3:.2f} ms; one batch of the per-example "
            f"pipeline in this process: {per_batch * 1e3:.2f} ms with {rounds} "
            f"augmentation rounds ({base * 1e3:.2f} ms without)",
            flush=True,
        )
        b_rounds, b_base = calibrate(lambda r: batched_loader(path, r), step_seconds)
        print(
            f"one batch of the batched pipeline (batch_transform) in this process: "
            f"{batch_seconds(batched_loader(path, b_rounds)) * 1e3:.2f} ms with "
            f"{b_rounds} augmentation rounds ({b_base * 1e3:.2f} ms without)",
            flush=True,
        )
        loaders = {
            f"grain, {w} workers": pztrain.GrainLoader(ds, BATCH, seed=1, workers=w)
            for w in worker_counts
        }
        for w in worker_counts:
            loaders[f"grain batched, {w} workers"] = batched_loader(path, b_rounds, w)
        results = _interleaved(device, loaders, args)
    _report(results, load_start, _load(), args)


def _interleaved(device, loaders: dict, args) -> dict[str, list]:
    """Rounds of (baseline, variant, baseline, variant, ..., baseline)."""
    results: dict[str, list] = {name: [] for name in ["device", *loaders]}
    order = list(loaders)
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(order)
        before = trial(device, args.steps, args.log_every)
        results["device"].append(before)
        for name in order:
            got = trial(loaders[name], args.steps, args.log_every)
            after = trial(device, args.steps, args.log_every)
            results["device"].append(after)
            mean = (before["steps_per_sec"] + after["steps_per_sec"]) / 2
            got["ratio"] = got["steps_per_sec"] / mean
            got["start_over"] = (
                got["first_point"] - (before["first_point"] + after["first_point"]) / 2
            )
            results[name].append(got)
            before = after
        print(f"round {r + 1}/{args.rounds} done (load {_load():.2f})", flush=True)
    return results


def _report(results: dict, load_start: float, load_end: float, args) -> None:
    print()
    print(
        f"`fit` on W1 (MLP 64-256-256-10, batch {BATCH}), {args.steps} steps per "
        f"trial, {args.rounds} rounds; load average {load_start:.2f} at the start, "
        f"{load_end:.2f} at the end"
    )
    print()
    print(
        "| data | steps/s (median) | × arrays on the device (median of paired "
        "ratios) [range] | start-up over the baseline, s | host memory: this "
        "process / workers, MiB |"
    )
    print("|---|---|---|---|---|")
    for name, trials in results.items():
        print(_row(name, trials))
    best = max(
        (statistics.median(t["ratio"] for t in v), k)
        for k, v in results.items()
        if k != "device" and not k.endswith(" 0 workers")
    )
    verdict = "met" if best[0] >= 0.9 else "**missed**"
    print()
    print(
        "target: with grain workers >= 0.90x the arrays on the device: "
        f"{best[1]}: {best[0]:.2f}x, {verdict}"
    )


def _row(name: str, trials: list[dict]) -> str:
    speed = statistics.median(t["steps_per_sec"] for t in trials)
    memory = f"{max(t['rss'] for t in trials):.0f} / "
    memory += f"{max(t['workers_rss'] for t in trials):.0f}"
    if name == "device":
        label, ratio, start = (
            "arrays on the device (ArrayLoader, on_device)",
            "1.00",
            "–",
        )
    else:
        ratios = [t["ratio"] for t in trials]
        label = name
        ratio = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"
        start = f"{statistics.median(t['start_over'] for t in trials):.1f}"
    return f"| {label} | {speed:,.0f} | {ratio} | {start} | {memory} |"


if __name__ == "__main__":
    sys.exit(main())
