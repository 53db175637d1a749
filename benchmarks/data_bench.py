"""`fit` fed from disk through `GrainLoader` against `fit` on arrays already on the
device.

Run from the repository root::

    python benchmarks/data_bench.py            # 3 interleaved rounds, ~8 minutes
    python benchmarks/data_bench.py --quick    # 1 short round

The data, as a user writes it: ``--examples`` examples (64 float32 features
and an int32 label) saved twice, as an ArrayRecord file (one record per
example, `pztrain.data.RecordLayout`, written ``group_size:1,uncompressed``;
a second file with the writer's default compression) and as a Hugging Face
dataset (``save_to_disk``, read back with ``load_from_disk`` and
``with_format("numpy")``).

The model is the step benchmark's W1: an MLP 64-256-256-10, batch 128, Adam,
softmax cross-entropy. Every variant runs the same `pztrain.fit` (a log record
every ``--log-every`` steps, no progress bar), ``--steps`` steps per trial:

* ``device``: an `pztrain.ArrayLoader(on_device=True)` over the arrays (no
  per-step host work at all): the baseline;
* the fast path, with N grain workers (0: reading in `fit`'s prefetch
  thread): ``GrainLoader(ArrayRecordDataSource(...), decode=layout)`` (a
  batch of records read per call, decoded with one ``np.frombuffer``) and
  ``GrainLoader(hf_dataset)`` (NumPy views of the memory-mapped columns);
* the per-example path: ``grain.MapDataset.source(BulkSource(source))
  .map(decode_one)`` (records read a batch at a time, decoded one by one in
  Python);
* the pipeline as grain teaches it, given as it is: ``grain.MapDataset
  .source(ArrayRecordDataSource([path])).map(decode_one)`` over the file
  written ``group_size:1`` (the writer's default compression), with N
  workers (`pztrain.GrainLoader` reads it through a `BulkSource` itself).

Speed is the steady state: steps between the first and the last log point over
the time between them (each log point reads the step's metrics, so the time is
taken once those steps have run). Start-up (worker processes, compiling) is
reported apart: the time from the call to the first log point, over the
baseline's. Trials are interleaved (baseline, variant, baseline, ...) in one
process; a variant's ratio is its speed over the mean of the two baseline
trials around it: the median over rounds and the quartiles. ``--only`` runs
the variants whose names hold one of its comma-separated words (more rounds
of fewer variants). Host memory: the resident set of this process and
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

import datasets
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from array_record.python.array_record_module import ArrayRecordWriter

import pztrain

BATCH = 128
SIZES = (64, 256, 256, 10)
FAST = ("ArrayRecord", "Hugging Face")  # the fast path's rows start so


# ----------------------------------------------------------------------------
# the data


def arrays(n: int) -> dict[str, np.ndarray]:
    """``n`` examples: 64 features around one of 10 class patterns, a label."""
    rng = np.random.default_rng(0)
    patterns = rng.normal(size=(10, 64)).astype(np.float32)
    y = (np.arange(n) % 10).astype(np.int32)
    x = patterns[y] + rng.normal(0, 0.5, size=(n, 64)).astype(np.float32)
    return {"x": x, "y": y}


def write_array_record(path: str, data: dict, options: str) -> None:
    """One record per example, laid out by `pztrain.data.RecordLayout`."""
    writer = ArrayRecordWriter(path, options)
    for record in pztrain.data.RecordLayout.like(data).encode(data):
        writer.write(record)
    writer.close()


def write_hugging_face(path: str, data: dict) -> None:
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(data).save_to_disk(path)


class DecodeOne:
    """One record to one example (the per-example path's ``.map``)."""

    def __init__(self, layout: pztrain.data.RecordLayout):
        self.dtype = layout.dtype

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        row = np.frombuffer(record, self.dtype)[0]
        return {"x": row["x"].astype(np.float32), "y": np.int32(row["y"])}


def loaders(files: dict[str, str], layout, workers: list[int]) -> dict:
    """Every variant's loader, by name."""

    def source(name: str):
        return grain.sources.ArrayRecordDataSource([files[name]])

    hf = datasets.load_from_disk(files["hf"]).with_format("numpy")
    per_example = grain.MapDataset.source(pztrain.data.BulkSource(source("ar")))
    per_example = per_example.map(DecodeOne(layout))
    out = {}
    for w in workers:
        out[f"ArrayRecord, decode=RecordLayout, {w} workers"] = pztrain.GrainLoader(
            source("ar"), BATCH, seed=1, workers=w, decode=layout
        )
        out[f"Hugging Face, numpy format, {w} workers"] = pztrain.GrainLoader(
            hf, BATCH, seed=1, workers=w
        )
        out[f"per-example .map(decode), {w} workers"] = pztrain.GrainLoader(
            per_example, BATCH, seed=1, workers=w
        )
        as_given = grain.MapDataset.source(source("zstd")).map(DecodeOne(layout))
        out[f"as given: MapDataset.source(...).map(decode), {w} workers"] = (
            pztrain.GrainLoader(as_given, BATCH, seed=1, workers=w)
        )
    out["ArrayRecord zstd (the writer's default), decode, 0 workers"] = (
        pztrain.GrainLoader(source("zstd"), BATCH, seed=1, decode=layout)
    )
    return out


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


def batch_ms(loader: pztrain.GrainLoader, steps: int = 32) -> tuple[float, float]:
    """Milliseconds per step to read ``steps`` steps' batches in this process,
    the way `fit` reads them (one block; median of 5): wall time and the
    process's CPU time (ArrayRecord's reader works in threads of its own; on a
    loaded machine the CPU time is the steadier figure)."""
    blocks = loader.fit_source(0, 1, 0, None)
    walls, cpus = [], []
    for b in range(6):
        t, c = time.perf_counter(), time.process_time()
        if blocks is None:  # read a step at a time
            for s in range(b * steps, (b + 1) * steps):
                loader.batch_at(s)
        else:
            next(blocks.stretch(b * steps, (b + 1) * steps))
        walls.append((time.perf_counter() - t) / steps)
        cpus.append((time.process_time() - c) / steps)
    if blocks is not None:
        blocks.close()
    return statistics.median(walls[1:]) * 1e3, statistics.median(cpus[1:]) * 1e3


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 short round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--examples", type=int, default=16384)
    parser.add_argument("--workers", default="0,1", help="worker counts to run")
    parser.add_argument("--only", default="", help="variants naming one of these")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.log_every = 1, 500, 100
    workers = [int(w) for w in args.workers.split(",")]
    load_start = _load()
    print(f"load average at the start: {load_start:.2f} (2 cores)", flush=True)
    data = arrays(args.examples)
    layout = pztrain.data.RecordLayout.like(data)
    with tempfile.TemporaryDirectory() as tmp:
        files = {k: str(Path(tmp) / k) for k in ("ar", "zstd", "hf")}
        write_array_record(files["ar"], data, "group_size:1,uncompressed")
        write_array_record(files["zstd"], data, "group_size:1")
        write_hugging_face(files["hf"], data)
        device = pztrain.ArrayLoader(data, BATCH, on_device=True)
        warm = trial(device, max(args.steps // 2, 2 * args.log_every), args.log_every)
        variants = loaders(files, layout, workers)
        if args.only:
            words = args.only.split(",")
            variants = {k: v for k, v in variants.items() if any(w in k for w in words)}
        print(f"one step: {1e3 / warm['steps_per_sec']:.2f} ms; reading, per step "
              "in this process:", flush=True)  # fmt: skip
        for name, loader in variants.items():
            if " 0 workers" in name:
                wall, cpu = batch_ms(loader)
                print(f"  {name}: {wall:.3f} ms ({cpu:.3f} ms CPU)", flush=True)
        results = _interleaved(device, variants, args)
    _report(results, load_start, _load(), args)


def _interleaved(device, variants: dict, args) -> dict[str, list]:
    """Rounds of (baseline, variant, baseline, variant, ..., baseline)."""
    results: dict[str, list] = {name: [] for name in ["device", *variants]}
    order = list(variants)
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(order)
        before = trial(device, args.steps, args.log_every)
        results["device"].append(before)
        for name in order:
            got = trial(variants[name], args.steps, args.log_every)
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
        f"trial, {args.rounds} rounds, {args.examples} examples; load average "
        f"{load_start:.2f} at the start, {load_end:.2f} at the end"
    )
    print()
    print(
        "| data | steps/s (median) | × arrays on the device (median of paired "
        "ratios) [quartiles] [range] | start-up over the baseline, s | host "
        "memory: this process / workers, MiB |"
    )
    print("|---|---|---|---|---|")
    for name, trials in results.items():
        print(_row(name, trials))
    ratio = {
        k: statistics.median(t["ratio"] for t in v)
        for k, v in results.items()
        if k != "device"
    }
    print()
    for want, prefix, floor in (
        ("target: the fast path", FAST, 0.9),
        ("wanted: the per-example path", ("per-example",), 0.5),
        ("target: the pipeline as given", ("as given",), 0.5),
    ):
        got = {
            k: r for k, r in ratio.items() if k.startswith(prefix) and "zstd" not in k
        }
        if got:
            worst = min(got, key=got.get)
            print(
                f"{want} >= {floor:.2f}x the arrays on the device: lowest {worst}: "
                f"{got[worst]:.2f}x, {'met' if got[worst] >= floor else '**missed**'}"
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
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        ratio = (
            f"{statistics.median(ratios):.2f} [{q1:.2f}–{q3:.2f}] "
            f"[{min(ratios):.2f}–{max(ratios):.2f}]"
        )
        start = f"{statistics.median(t['start_over'] for t in trials):.1f}"
    return f"| {label} | {speed:,.0f} | {ratio} | {start} | {memory} |"


if __name__ == "__main__":
    sys.exit(main())
