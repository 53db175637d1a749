"""Gradient accumulation: optax.MultiSteps through pztrain's step vs a scan in the step.

Run: ``python benchmarks/accum_bench.py [--batch 512] [--k 4] [--hidden 2048]``.

One optimizer update on a batch of ``--batch`` rows, as ``--k`` micro-batches, four
ways (same MLP, same Adam, same data, one process, interleaved repeats, medians):

- ``full``: pztrain, one step on the whole batch (no accumulation: the reference
  for memory and speed).
- ``multisteps``: pztrain's step with ``optax.MultiSteps(adam, every_k_schedule=k)``,
  called ``k`` times on micro-batches (what works today, no change in pztrain).
- ``multisteps_fused``: the same with ``steps_per_call=k``: one call runs the ``k``
  micro-steps in a ``lax.scan`` (also works today).
- ``scan``: a hand-written ``jax.jit`` step that scans over the ``k`` micro-batches,
  sums their gradients in the scan's carry and applies one Adam update: what a
  ``microbatches=k`` option of the step would compile to.
- ``microbatches``: pztrain's step built with ``microbatches=k``: that option
  (one call, the whole batch, split inside the step).

Printed per way: milliseconds per optimizer update, and from XLA's
``memory_analysis()`` of the compiled program(s): argument bytes (the state and
batch a call reads: MultiSteps' state holds a params-sized gradient accumulator)
and temp bytes (scratch: activations, gradients).

``--mesh``: on 8 simulated devices (data parallel, the batch split over them),
two ways: ``scan`` (the hand-written scan above, compiled by GSPMD: the grads
are all-reduced at every micro-batch, as pztrain's micro-batches were before)
and ``microbatches`` (pztrain: each device accumulates its own grads, averaged
once per step); with the all-reduces of each compiled step.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

if "--mesh" in sys.argv:  # before jax is imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain


def make_mlp(sizes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return {
        f"dense{i}": {
            "kernel": jax.random.normal(k, (m, n)) / np.sqrt(m),
            "bias": jnp.zeros(n),
        }
        for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def forward(params, x):
    h = x
    for i in range(len(params)):
        h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"][None]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return h


def loss_fn(*, model, state, rng, x, y):
    del rng
    loss = optax.softmax_cross_entropy_with_integer_labels(forward(model, x), y).mean()
    return loss, state, {}


def scan_step(tx):
    """The in-step accumulation: scan over micro-batches, one optimizer update."""

    def micro_grads(params, xy):
        x, y = xy
        return jax.grad(lambda p: loss_fn(model=p, state=None, rng=None, x=x, y=y)[0])(
            params
        )

    def step(params, opt_state, xs, ys):
        def body(acc, xy):
            return jax.tree.map(jnp.add, acc, micro_grads(params, xy)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        total, _ = jax.lax.scan(body, zeros, (xs, ys))
        grads = jax.tree.map(lambda g: g / xs.shape[0], total)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def memory(compiled):
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes, m.temp_size_in_bytes


def all_reduces(compiled) -> str:
    """All-reduces of the program: ``"entry+loop"`` (in the entry computation,
    run once per update; elsewhere, inside the micro-batch loop: once per
    micro-batch)."""
    entry = loop = 0
    in_entry = False
    for line in compiled.as_text().splitlines():
        if line and not line.startswith(" "):
            in_entry = line.startswith("ENTRY")
        if re.search(r"\sall-reduce(?:-start)?\(", line):
            entry, loop = entry + in_entry, loop + (not in_entry)
    return f"{entry}+{loop}"


def build(way, args, data, mesh=None):
    """``(run_one_update, (argument_bytes, temp_bytes, all-reduces))``."""
    sizes = (args.features, args.hidden, args.hidden, 10)
    k, micro = args.k, args.batch // args.k
    x, y = data
    xs, ys = x.reshape(k, micro, -1), y.reshape(k, micro)
    key = jax.random.key(0)
    if mesh is not None:  # each micro-batch split over the devices
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        x, y = jax.device_put((x, y), split)
        micro_split = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, "data")
        )
        xs, ys = jax.device_put((xs, ys), micro_split)
    if way == "scan":
        tx = optax.adam(1e-3)
        params = make_mlp(sizes)
        box = [params, tx.init(params)]
        if mesh is not None:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            box = list(jax.device_put(box, replicated))
        fn = scan_step(tx)
        compiled = fn.lower(*box, xs, ys).compile()
        mem = (*memory(compiled), all_reduces(compiled))

        def run():
            box[:] = fn(box[0], box[1], xs, ys)
            return box[0]

        return run, mem
    tx = optax.adam(1e-3)
    if way.startswith("multisteps"):
        tx = optax.MultiSteps(tx, every_k_schedule=k)
    state = pztrain.TrainState.initial_state(make_mlp(sizes), tx, key)
    fused = way == "multisteps_fused"
    step = pztrain.build_train_step(
        loss_fn,
        steps_per_call=k if fused else 1,
        microbatches=k if way == "microbatches" else 1,
        mesh=mesh,
    )
    if mesh is not None:
        state = pztrain.shard_state(state, mesh)
    if way in ("full", "microbatches") or fused:
        batch = {"x": xs, "y": ys} if fused else {"x": x, "y": y}
        batches = [batch]
    else:
        batches = [{"x": xs[i], "y": ys[i]} for i in range(k)]
    compiled = step.lower(state, **batches[0]).compile()
    mem = (*memory(compiled), all_reduces(compiled))
    box = [state]

    def run():
        for batch in batches:
            box[0], _ = step(box[0], **batch)
        return box[0].params

    return run, mem


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=3, help="per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mesh", action="store_true", help="8 devices, see above")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = (
        jnp.asarray(rng.standard_normal((args.batch, args.features), np.float32)),
        jnp.asarray(rng.integers(0, 10, args.batch), jnp.int32),
    )
    ways = ["full", "multisteps", "multisteps_fused", "scan", "microbatches"]
    mesh = None
    if args.mesh:
        ways = ["scan", "microbatches"]
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        jax.set_mesh(mesh)  # the hand-written scan's context
    built = {w: build(w, args, data, mesh) for w in ways}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for w in ways:  # warm-up (compiles)
        jax.block_until_ready(built[w][0]())
    for _ in range(args.repeats):
        for w in ways:
            t0 = time.perf_counter()
            for _ in range(args.updates):
                out = built[w][0]()
            jax.block_until_ready(out)
            times[w].append((time.perf_counter() - t0) / args.updates)
    n = sum(
        p.size
        for p in jax.tree.leaves(
            make_mlp((args.features, args.hidden, args.hidden, 10))
        )
    )
    print(
        f"MLP {args.features}-{args.hidden}-{args.hidden}-10 ({n / 1e6:.2f}M "
        f"params, {4 * n / 2**20:.1f} MiB), batch {args.batch} as k={args.k}, "
        f"jax {jax.__version__}, {jax.devices()[0].platform}"
    )
    print(
        f"{'way':<18}{'ms/update':>10}{'args MiB':>10}{'temp MiB':>10}"
        f"{'all-reduces (once+per micro-batch)':>36}"
    )
    for w in ways:
        arg, temp, reduces = built[w][1]
        print(
            f"{w:<18}{1e3 * statistics.median(times[w]):>10.2f}"
            f"{arg / 2**20:>10.1f}{temp / 2**20:>10.1f}{reduces:>36}"
        )


if __name__ == "__main__":
    main()
