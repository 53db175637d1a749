"""Paired, in-process speed of this checkout's pztrain against another revision.

Ratios between runs of ``step_bench.py`` move with the machine's state (on a
shared machine the same code measured 0.85 and 0.96 of the baseline an hour
apart), so a change's own cost is best seen with both versions in one process:
this script exports ``pztrain/`` at a git revision into a temporary directory
as the package ``pztrain_rev``, builds the same train step and ``fit`` with both,
and times them in interleaved rounds (a baseline trial of each between the
other's, median of paired ratios).

    python benchmarks/ab_revisions.py HEAD~3              # W0, per step and fit
    python benchmarks/ab_revisions.py 4d1fbcf --workloads W0,W1 --rounds 61

Figures above 1 mean this checkout is faster: medians [quartiles] of the paired
ratios, of the wall clock and of the process's CPU time.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
import step_bench as sb

ROOT = Path(__file__).resolve().parent.parent


def export_revision(rev: str, into: Path) -> str:
    """Writes ``pztrain/`` at ``rev`` as the package ``pztrain_rev``; its name."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "pztrain"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "pztrain").rename(into / "pztrain_rev")
    for path in (into / "pztrain_rev").rglob("*.py"):
        text = re.sub(r"\bpztrain\b", "pztrain_rev", path.read_text())
        path.write_text(text)
    sys.path.insert(0, str(into))
    return "pztrain_rev"


def step_runner(mod, problem):
    """``run(n)``: n calls of mod's train step on the workload's penzai model."""
    state = mod.TrainState.initial_state(
        problem.penzai_v2_model(), optax.adam(sb.LEARNING_RATE), jax.random.key(0)
    )
    step = mod.build_train_step(sb._penzai_loss(sb.penzai_v2_logits))
    holder = [state]

    def run(n):
        state, aux = holder[0], None
        for _ in range(n):
            state, aux = step(state, **problem.batch)
        holder[0] = state
        return aux["loss"]

    return run


def fit_runner(mod, problem):
    """``run(n)``: one ``fit`` call of n more steps, on-device data, no bar."""
    state = mod.TrainState.initial_state(
        problem.penzai_v2_model(), optax.adam(sb.LEARNING_RATE), jax.random.key(0)
    )
    step = mod.build_train_step(sb._penzai_loss(sb.penzai_v2_logits))
    arrays = {k: np.concatenate([np.asarray(v)] * 64) for k, v in problem.batch.items()}
    loader = mod.ArrayLoader(arrays, problem.workload.batch, on_device=True)
    holder = [state, 0]

    def run(n):
        state, done = holder
        state, _ = mod.fit(
            state, step, loader, num_steps=done + n, log_every=100, progress=False
        )
        holder[:] = [state, done + n]
        return state.step

    return run


def paired(new, old, rounds: int, n: int) -> tuple[str, str]:
    """Old time / new time over rounds (both blocked on at the end): the
    median [quartiles] of the wall-clock ratios, and of the process's CPU time
    ratios (all threads: steadier than the wall clock on a loaded machine)."""
    for f in (new, old):
        jax.block_until_ready(f(n))
    wall, cpu = [], []
    gc.disable()
    try:
        for r in range(rounds):
            times, cpus = {}, {}
            for name, f in (("new", new), ("old", old))[:: 1 if r % 2 else -1]:
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(f(n))
                times[name] = time.perf_counter() - t0
                cpus[name] = time.process_time() - c0
            wall.append(times["old"] / times["new"])
            cpu.append(cpus["old"] / cpus["new"])
            gc.collect()
    finally:
        gc.enable()
    return _spread(wall), _spread(cpu)


def _spread(ratios: list[float]) -> str:
    """``median [first–third quartile]``."""
    if len(ratios) < 4:
        return f"{statistics.median(ratios):.3f}"
    lo, mid, hi = statistics.quantiles(ratios, n=4)
    return f"{mid:.3f} [{lo:.3f}–{hi:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare against")
    parser.add_argument("--workloads", default="W0")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=300, help="calls per trial")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_mod = importlib.import_module(export_revision(args.revision, Path(tmp)))
        new_mod = importlib.import_module("pztrain")
        print(f"this checkout against {args.revision}, {args.rounds} paired rounds")
        print(
            "| workload | per step (new/old speed) | per step, CPU time "
            "| fit (new/old speed) | fit, CPU time |"
        )
        print("|---|---|---|---|---|")
        for name in args.workloads.split(","):
            problem = sb.Problem(sb.WORKLOADS[name])
            per_step = paired(
                step_runner(new_mod, problem),
                step_runner(old_mod, problem),
                args.rounds,
                args.calls,
            )
            fitted = paired(
                fit_runner(new_mod, problem),
                fit_runner(old_mod, problem),
                args.rounds,
                args.calls,
            )
            print(f"| {name} | {' | '.join(per_step)} | {' | '.join(fitted)} |")


if __name__ == "__main__":
    main()
