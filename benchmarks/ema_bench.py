"""The step with an EMA of the params (`pztrain.with_ema`) against a hand-written one.

Run from the repository root::

    python benchmarks/ema_bench.py                      # W1 and W3, ~3 minutes
    python benchmarks/ema_bench.py --workloads W3s --rounds 7 --calls 20   # smoke
    python benchmarks/ema_bench.py --memory-against 93ad143 --workloads W0,W1,W2,W3

Every implementation trains the workload of ``step_bench.py`` (same model, params,
batch, ``optax.adam``) in this one process:

* ``raw``: ``step_bench``'s hand-written jitted step, donating params and
  optimizer state (the baseline of ``step_bench``);
* ``raw_ema``: the same with the same EMA update written by hand (an ``ema``
  pytree argument, donated, ``ema = d * ema + (1 - d) * new_params``);
* ``pztrain``: ``build_train_step`` on the penzai v2 model, EMA off;
* ``pztrain_ema``: the same with ``with_ema(optax.adam(...), DECAY)``.

Trials are interleaved: each round times every implementation for ``--calls``
calls (blocking on the last output) in a shuffled order. A figure is the median
over rounds of the ratio of two implementations' times in the same round, so the
machine's drift cancels. The target: ``pztrain_ema / raw_ema <= 1.05`` on W1 and
W3.

``--memory-against REV`` prints instead the compiled step's memory
(``TrainStep.memory``: XLA's ``memory_analysis``) with the EMA off in this
checkout and in pztrain at git revision ``REV`` (exported as in
``ab_revisions.py``), and with the EMA on here.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import jax
import optax
import step_bench as sb

import pztrain

DECAY = 0.999
TARGET = 1.05


def build_raw_ema(problem: sb.Problem) -> Callable[[int], Any]:
    """``step_bench.build_raw`` plus the same EMA update, written by hand."""
    params, apply = problem.raw_model()
    tx = optax.adam(sb.LEARNING_RATE)

    def one(params, opt_state, ema, x, y):
        loss, grads = jax.value_and_grad(lambda p: sb.cross_entropy(apply(p, x), y))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p, ema, params)
        return params, opt_state, ema, loss

    step = jax.jit(one, donate_argnums=(0, 1, 2))
    ema = jax.tree.map(sb._copy, params)
    return sb._loop(step, [params, tx.init(params), ema], problem.batch)


def build_pztrain(problem: sb.Problem, ema: bool) -> Callable[[int], Any]:
    """``build_train_step`` on the penzai v2 model, with or without the EMA."""
    tx = optax.adam(sb.LEARNING_RATE)
    tx = pztrain.with_ema(tx, DECAY) if ema else tx
    state = pztrain.TrainState.initial_state(
        problem.penzai_v2_model(), tx, jax.random.key(sb.SEED)
    )
    step = pztrain.build_train_step(sb._penzai_loss(sb.penzai_v2_logits))
    return sb._aux_loop(step, [state], problem.batch)


BUILDERS = {
    "raw": lambda p: sb.build_raw(p).run,
    "raw_ema": build_raw_ema,
    "pztrain": lambda p: build_pztrain(p, ema=False),
    "pztrain_ema": lambda p: build_pztrain(p, ema=True),
}
RATIOS = [  # (numerator, denominator, what it shows)
    ("pztrain_ema", "raw_ema", "pztrain with EMA / hand-written with EMA"),
    ("pztrain", "raw", "pztrain / hand-written, EMA off (step_bench's ratio)"),
    ("raw_ema", "raw", "the EMA's own cost, hand-written"),
    ("pztrain_ema", "pztrain", "the EMA's cost in pztrain"),
]


def measure(problem: sb.Problem, rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of each ratio of times (lower is faster)."""
    runs = {name: build(problem) for name, build in BUILDERS.items()}
    rounds_s = sb.timed_rounds(runs, rounds, calls)
    return {
        f"{a}/{b}": statistics.median(times[a] / times[b] for times in rounds_s)
        for a, b, _ in RATIOS
    }


def memory_rows(revision: str, workloads: list[str]) -> list[str]:
    """A markdown table: the step's memory, EMA off here and at ``revision``,
    and EMA on here."""
    import tempfile
    from pathlib import Path

    import ab_revisions

    rows = ["| workload | step | arguments | outputs | temporaries | aliased |"]
    rows.append("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        old = __import__(ab_revisions.export_revision(revision, Path(tmp)))
        for name in workloads:
            problem = sb.Problem(sb.WORKLOADS[name])
            for label, mod, ema in (
                (f"{revision}, no EMA", old, False),
                ("this checkout, no EMA", pztrain, False),
                ("this checkout, with_ema", pztrain, True),
            ):
                tx = optax.adam(sb.LEARNING_RATE)
                tx = mod.with_ema(tx, DECAY) if ema else tx
                state = mod.TrainState.initial_state(
                    problem.penzai_v2_model(), tx, jax.random.key(sb.SEED)
                )
                step = mod.build_train_step(sb._penzai_loss(sb.penzai_v2_logits))
                m = step.memory(state, **problem.batch)
                cells = (m.arguments, m.outputs, m.temporaries, m.aliased)
                rows.append(
                    f"| {name} | {label} | " + " | ".join(map(str, cells)) + " |"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--calls", type=int, default=200, help="calls per trial")
    parser.add_argument("--memory-against", metavar="REV", default=None)
    args = parser.parse_args(argv)
    if args.memory_against:
        rows = memory_rows(args.memory_against, args.workloads.split(","))
        print("\n".join(rows))
        return 0
    print(f"time ratios (median of {args.rounds} interleaved rounds, lower = faster)")
    print("| workload | " + " | ".join(f"{a}/{b}" for a, b, _ in RATIOS) + " |")
    print("|---|" + "---|" * len(RATIOS))
    missed = []
    for name in args.workloads.split(","):
        figures = measure(sb.Problem(sb.WORKLOADS[name]), args.rounds, args.calls)
        cells = " | ".join(f"{figures[f'{a}/{b}']:.3f}" for a, b, _ in RATIOS)
        print(f"| {name} | {cells} |", flush=True)
        if figures["pztrain_ema/raw_ema"] > TARGET:
            missed.append(name)
    for a, b, what in RATIOS:
        print(f"  {a}/{b}: {what}")
    verdict = f"missed on {missed}" if missed else "met"
    print(f"target pztrain_ema/raw_ema <= {TARGET}: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
