"""The evaluation job beside training: how much it slows the training run.

Run from the repository root::

    python benchmarks/eval_job_bench.py --quick     # about a minute
    python benchmarks/eval_job_bench.py             # 5 rounds: 4-6 minutes

Each round trains the W1 model of ``step_bench.py`` (MLP 64-256-256-10, Adam,
batch 128, 40,000 examples in a host `pztrain.ArrayLoader`) for ``--steps``
steps with ``pztrain.Checkpoints(every_steps=--every)``, in a process of its
own, twice in a seeded random order: alone, and beside a second process running
`pztrain.evaluate_checkpoints` on its checkpoint directory (an eval step over
4,096 examples per checkpoint, ``poll=0.5``, its default ``priority``). The job
starts first and waits for the run's checkpoints, as a long-lived job does; it
ends when training does. A trial's speed is its records' median
``steps_per_sec`` (the first log point, with the compile, left out). The figure
is the median over rounds of (beside / alone); the target is >= 0.95 (issue
32).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRAIN = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax, pztrain
sys.path.insert(0, "benchmarks")
from eval_job_bench import init, loss_fn, data
ckpt, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = pztrain.TrainState.initial_state(init(), optax.adam(1e-3), jax.random.key(0))
_, history = pztrain.fit(
    state, pztrain.build_train_step(loss_fn),
    pztrain.ArrayLoader(data(40_000), batch_size=128, seed=0),
    num_steps=steps, log_every=100, progress=False, loggers=[],
    checkpoints=pztrain.Checkpoints(ckpt, every_steps=every, keep_last=1000),
)
rates = [r["steps_per_sec"] for r in history.records if r["split"] == "train"]
print(json.dumps(rates[1:]))
"""

JOB = r"""
import sys
import jax, optax, pztrain
sys.path.insert(0, "benchmarks")
from eval_job_bench import init, eval_fn, data
ckpt, run_dir = sys.argv[1], sys.argv[2]
like = pztrain.TrainState.initial_state(init(), optax.adam(1e-3), jax.random.key(0))
val = pztrain.ArrayLoader(data(4096, seed=1), batch_size=512, shuffle=False)
ev = pztrain.Evaluation("val", pztrain.build_eval_step(eval_fn), val)
h = pztrain.evaluate_checkpoints(ckpt, like, [ev], run_dir=run_dir, poll=0.5,
                                 timeout=600)
print(len(h.records), "checkpoints evaluated", file=sys.stderr)
"""


def init(sizes=(64, 256, 256, 10)):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        f"l{i}": {
            "w": jnp.asarray(rng.normal(0, (2 / a) ** 0.5, (a, b)), jnp.float32),
            "b": jnp.zeros((b,), jnp.float32),
        }
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }


def _logits(model, x):
    import jax

    for i in range(len(model)):
        x = x @ model[f"l{i}"]["w"] + model[f"l{i}"]["b"]
        x = jax.nn.relu(x) if i < len(model) - 1 else x
    return x


def loss_fn(*, model, state, rng, x, y):
    import optax

    loss = optax.softmax_cross_entropy_with_integer_labels(_logits(model, x), y)
    return loss.mean(), state, {}


def eval_fn(*, model, state, rng, x, y):
    import optax

    logits = _logits(model, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return {"loss": loss.mean(), "accuracy": (logits.argmax(-1) == y).mean()}


def data(n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 64)).astype(np.float32)
    return {"x": x, "y": (x[:, :10].argmax(-1)).astype(np.int32)}


def _trial(beside: bool, steps: int, every: int) -> float:
    """One training run's steps/s, alone or beside a job started first (as a
    long-lived job is: it waits for the run's checkpoints)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as d:
        ckpt, job = str(Path(d, "ckpt")), None
        if beside:
            job = subprocess.Popen(
                [sys.executable, "-c", JOB, ckpt, str(Path(d, "eval_job"))],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert "waiting for checkpoints" in job.stdout.readline()
        train = subprocess.Popen(
            [sys.executable, "-c", TRAIN, ckpt, str(steps), str(every)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, _ = train.communicate(timeout=1800)
        if job is not None:
            job.communicate(timeout=600)
        if train.returncode or (job is not None and job.returncode):
            raise SystemExit("a trial failed (see its output above)")
    return statistics.median(json.loads(out.strip().splitlines()[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds of 1500 steps")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=500, help="steps between saves")
    args = p.parse_args()
    rounds, steps = (2, 1500) if args.quick else (args.rounds, args.steps)
    every = 300 if args.quick else args.every
    ratios, order = [], random.Random(0)
    for r in range(rounds):
        kinds = [False, True]
        order.shuffle(kinds)
        speed = {kind: _trial(kind, steps, every) for kind in kinds}
        ratios.append(speed[True] / speed[False])
        print(
            f"round {r + 1}: alone {speed[False]:.0f} steps/s, beside the job "
            f"{speed[True]:.0f} steps/s, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    rounds_text = ", ".join(f"{x:.3f}" for x in ratios)
    median = statistics.median(ratios)
    print(f"beside the evaluation job / alone: median {median:.3f} ({rounds_text})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
