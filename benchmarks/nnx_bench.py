"""Train-step speed of pztrain on a Flax NNX model against Flax's own ways.

Run from the repository root::

    python benchmarks/nnx_bench.py                 # W1 with BatchNorm, ~1 minute
    python benchmarks/nnx_bench.py --rounds 41 --dropout 0.1 --json out.json

The model is the W1 MLP of ``step_bench.py`` (64-256-256-10, batch 128) with a
``nnx.BatchNorm`` after each hidden ``nnx.Linear`` (and, with ``--dropout``, an
``nnx.Dropout``), trained with ``optax.adam`` and softmax cross-entropy on one
batch kept on the device. Three implementations, from the same initial weights:

* ``functional`` (the baseline): Flax's functional pattern by hand.
  ``nnx.split(model, nnx.Param, ...)`` once; a ``jax.jit`` step taking the
  params, the rest (batch statistics, rng state) and the optimizer state as
  ``nnx.State`` pytrees, donating them; inside the loss ``nnx.merge`` of a fresh
  copy of the rest, ``model.train()``, the rng streams reseeded from
  ``fold_in(key, step)`` (with ``--dropout``), and ``nnx.split`` for the new
  batch statistics.
* ``functional_leaves``: the same step taking and returning flat lists of
  arrays (``jax.tree.leaves`` of the States, unflattened inside the jit), so that
  no ``nnx.State`` / ``Variable`` node is flattened in Python per call: the
  fastest form of the hand-written step.
* ``pztrain``: ``TrainState.initial_state(model, ...)`` and
  ``build_train_step(loss_fn)`` (donation on).
* ``nnx_optimizer``: Flax's idiomatic loop: ``nnx.Optimizer(model, tx,
  wrt=nnx.Param)`` and an ``nnx.jit`` step calling ``nnx.value_and_grad`` and
  ``optimizer.update(model, grads)``.

Trials are interleaved: each round runs the non-baseline implementations once,
in a shuffled (seeded) order, with a baseline trial before and after each
(B X B Y B). A trial makes its calls back to back without a host sync and
blocks on the last call's loss; Python's garbage collector is off during
trials. An implementation's speed is the median over rounds of its steps/s
divided by the mean steps/s of the two baseline trials around it; pztrain
against ``functional_leaves`` is the median over rounds of the quotient of
their two ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import pztrain

LEARNING_RATE = 1e-3
SIZES = (64, 256, 256, 10)
BATCH = 128


class MLP(nnx.Module):
    """Linear → BatchNorm → relu (→ Dropout) per hidden layer, then Linear."""

    def __init__(self, rngs: nnx.Rngs, dropout: float):
        self.hidden = nnx.List()
        for d_in, d_out in zip(SIZES[:-2], SIZES[1:-1], strict=True):
            self.hidden.append(nnx.Linear(d_in, d_out, rngs=rngs))
            self.hidden.append(nnx.BatchNorm(d_out, rngs=rngs))
            if dropout:
                self.hidden.append(nnx.Dropout(dropout, rngs=rngs))
        self.out = nnx.Linear(SIZES[-2], SIZES[-1], rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = layer(x)
            if isinstance(layer, nnx.BatchNorm):
                x = jax.nn.relu(x)
        return self.out(x)


def make_model(dropout: float) -> MLP:
    return MLP(nnx.Rngs(params=0, dropout=1), dropout)


def make_batch() -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(1))
    return {
        "x": jax.random.normal(kx, (BATCH, SIZES[0])),
        "y": jax.random.randint(ky, (BATCH,), 0, SIZES[-1]),
    }


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ----------------------------------------------------------------------------
# implementations: each returns run(n) -> the last call's loss


def _functional_step(dropout: float, graphdef, tx):
    """The functional step on ``nnx.State`` pytrees."""
    root = jax.random.key(0)

    def step(s, params, rest, opt_state, x, y):
        def loss_of(params):
            model = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
            model.train()
            if dropout:
                key = jax.random.fold_in(root, s)
                tag = zlib.crc32(b"dropout")
                nnx.reseed(model, dropout=jax.random.fold_in(key, tag))
            return xent(model(x), y), nnx.split(model, nnx.Param, ...)[2]

        (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return s + 1, optax.apply_updates(params, updates), rest, opt_state, loss

    return step


def _calls(jitted, carry: list[Any], batch) -> Callable[[int], Any]:
    def run(n):
        c, loss = tuple(carry), None
        for _ in range(n):
            *c, loss = jitted(*c, **batch)
        carry[:] = c
        return loss

    return run


def build_functional(dropout: float, batch) -> Callable[[int], Any]:
    tx = optax.adam(LEARNING_RATE)
    graphdef, params, rest = nnx.split(make_model(dropout), nnx.Param, ...)
    step = _functional_step(dropout, graphdef, tx)
    jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3))
    return _calls(
        jitted, [jnp.zeros((), jnp.int32), params, rest, tx.init(params)], batch
    )


def build_functional_leaves(dropout: float, batch) -> Callable[[int], Any]:
    tx = optax.adam(LEARNING_RATE)
    graphdef, params, rest = nnx.split(make_model(dropout), nnx.Param, ...)
    trees = (params, rest, tx.init(params))
    treedefs = [jax.tree.structure(t) for t in trees]
    step = _functional_step(dropout, graphdef, tx)

    def flat_step(s, *leaves_and_batch, x, y):
        trees = [
            d.unflatten(v) for d, v in zip(treedefs, leaves_and_batch, strict=True)
        ]
        s, *trees, loss = step(s, *trees, x, y)
        return s, *(jax.tree.leaves(t) for t in trees), loss

    jitted = jax.jit(flat_step, donate_argnums=(0, 1, 2, 3))
    carry = [jnp.zeros((), jnp.int32), *(jax.tree.leaves(t) for t in trees)]
    return _calls(jitted, carry, batch)


def build_pztrain(dropout: float, batch) -> Callable[[int], Any]:
    def loss_fn(*, model, state, rng, x, y):
        loss = xent(model(x), y)
        return loss, state, loss

    holder = [
        pztrain.TrainState.initial_state(
            make_model(dropout), optax.adam(LEARNING_RATE), jax.random.key(0)
        )
    ]
    step = pztrain.build_train_step(loss_fn)

    def run(n):
        state, loss = holder[0], None
        for _ in range(n):
            state, loss = step(state, **batch)
        holder[0] = state
        return loss

    return run


def build_nnx_optimizer(dropout: float, batch) -> Callable[[int], Any]:
    model = make_model(dropout)
    model.train()
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: xent(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    def run(n):
        loss = None
        for _ in range(n):
            loss = step(model, optimizer, **batch)
        return loss

    return run


IMPLS = {
    "functional": build_functional,
    "functional_leaves": build_functional_leaves,
    "pztrain": build_pztrain,
    "nnx_optimizer": build_nnx_optimizer,
}


# ----------------------------------------------------------------------------
# timing


def trial(run: Callable[[int], Any], calls: int) -> float:
    """Steps per second of ``calls`` back-to-back calls, blocking at the end."""
    gc.disable()
    try:
        start = time.perf_counter()
        jax.block_until_ready(run(calls))
        return calls / (time.perf_counter() - start)
    finally:
        gc.enable()


def size_trial(run: Callable[[int], Any], seconds: float) -> int:
    calls = 8
    while True:
        start = time.perf_counter()
        jax.block_until_ready(run(calls))
        took = time.perf_counter() - start
        if took >= seconds / 4:
            return max(1, int(calls * seconds / took))
        calls *= 2


def measure(args: argparse.Namespace) -> dict[str, Any]:
    batch = make_batch()
    runs, calls = {}, {}
    for key, build in IMPLS.items():
        run = build(args.dropout, batch)
        first = float(run(1))  # compile, and the step-0 loss as a check
        print(f"{key:>18}: step-0 loss {first:.6f}", file=sys.stderr)
        runs[key] = run
        calls[key] = size_trial(run, args.trial_seconds)
    base = "functional"
    ratios: dict[str, list[float]] = {k: [] for k in IMPLS if k != base}
    speeds: dict[str, list[float]] = {k: [] for k in IMPLS}
    order = random.Random(0)
    for _ in range(args.rounds):
        others = list(ratios)
        order.shuffle(others)
        before = trial(runs[base], calls[base])
        speeds[base].append(before)
        for key in others:
            mine = trial(runs[key], calls[key])
            after = trial(runs[base], calls[base])
            speeds[key].append(mine)
            speeds[base].append(after)
            ratios[key].append(mine / ((before + after) / 2))
            before = after
        gc.collect()
    return {
        "workload": "W1 + BatchNorm: MLP 64-256-256-10, batch 128",
        "dropout": args.dropout,
        "rounds": args.rounds,
        "steps_per_s": {k: statistics.median(v) for k, v in speeds.items()},
        "ratio_to_functional": {k: statistics.median(v) for k, v in ratios.items()},
        "pztrain_to_functional_leaves": statistics.median(
            p / f
            for p, f in zip(ratios["pztrain"], ratios["functional_leaves"], strict=True)
        ),
        "ratios": ratios,
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--trial-seconds", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--json", help="write every sample to this file")
    args = parser.parse_args()
    result = measure(args)
    print(f"\n{result['workload']}, dropout {args.dropout}, {args.rounds} rounds")
    print(f"{'implementation':<20}{'steps/s':>10}{'× functional':>14}")
    for key, speed in result["steps_per_s"].items():
        ratio = result["ratio_to_functional"].get(key, 1.0)
        print(f"{key:<20}{speed:>10.0f}{ratio:>14.3f}")
    print(
        "pztrain / functional_leaves (per round, median): "
        f"{result['pztrain_to_functional_leaves']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
