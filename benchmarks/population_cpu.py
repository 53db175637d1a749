"""A population step's CPU time per call against the minimal hand-written
``jax.jit(jax.vmap(step))``, paired in one process (issue 39).

On a loaded machine the wall clock of a dispatch-bound step moves by 2x
between trials; the process's CPU time (all threads: the calling thread's
Python and dispatch, and XLA's worker threads) moves far less, and it is where
the population step lost: XLA:CPU handing half of the step's thunks to a
worker thread on every call (see `pztrain.step._members.counted_after`).

    python benchmarks/population_cpu.py W0 16          # ~1 min
    python benchmarks/population_cpu.py W1 16 --rounds 21

Columns (``population_bench.py``'s model, optimizer and per-member learning
rates): ``hand_min`` (params and optimizer state in, loss per member out),
``population`` (``build_train_step`` with ``{"loss": loss}`` as aux) and
``population_no_aux`` (aux ``{}``). Each round runs every column once in a
shuffled order; a column's figure is the median over rounds of ``hand_min``'s
CPU time over its own in the same round [quartiles]. To compare with another
revision, export its ``pztrain/`` (``git archive REV pztrain | tar -x -C DIR``)
and run with ``PYTHONPATH=DIR``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import jax
import population_bench as pb

import pztrain


def population_runner(problem: pb.Problem, aux: bool):
    """``run(n)``: n calls of a population's train step."""

    def loss_fn(*, model, state, rng, x, y):
        loss = pb.mlp_loss(model, x, y)
        return loss, state, ({"loss": loss} if aux else {})

    holder = [problem.population()]
    step = pztrain.build_train_step(loss_fn)
    x, y = problem.x, problem.y

    def run(n: int):
        pop = holder[0]
        for _ in range(n):
            pop, _ = step(pop, x=x, y=y)
        holder[0] = pop
        return pop.step

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(pb.WORKLOADS))
    parser.add_argument("members", type=int)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, help="calls per trial")
    args = parser.parse_args()
    problem = pb.Problem(pb.WORKLOADS[args.workload], args.members)
    runs = {
        "hand_min": pb.build_hand_min(problem).run,
        "population": population_runner(problem, aux=True),
        "population_no_aux": population_runner(problem, aux=False),
    }
    for run in runs.values():
        jax.block_until_ready(run(3))
    n = args.calls or (300 if args.workload == "W0" else 10)
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    order = random.Random(0)
    gc.disable()
    try:
        for _ in range(args.rounds):
            keys = list(runs)
            order.shuffle(keys)
            for key in keys:
                start = time.process_time()
                jax.block_until_ready(runs[key](n))
                cpu[key].append((time.process_time() - start) / n)
            gc.collect()
    finally:
        gc.enable()
    print(
        f"{args.workload} K={args.members}: CPU time per call, {args.rounds} "
        f"rounds of {n} calls"
    )
    print("| column | µs per call | hand_min / column [quartiles] |")
    print("|---|---|---|")
    for key, times in cpu.items():
        ratios = [a / b for a, b in zip(cpu["hand_min"], times, strict=True)]
        lo, mid, hi = statistics.quantiles(ratios, n=4)
        median = statistics.median(times) * 1e6
        print(f"| {key} | {median:.1f} | {mid:.3f} [{lo:.3f}–{hi:.3f}] |")


if __name__ == "__main__":
    main()
