"""Sharded train steps: pztrain on a mesh against a hand-written ``jax.jit`` step
with the same shardings, on simulated CPU devices.

Run from the repository root::

    python benchmarks/mesh_bench.py            # 8 devices, DP and FSDP
    python benchmarks/mesh_bench.py --quick    # smaller model, fewer rounds

Both implementations train the same MLP with ``optax.adam`` from the same params on
the same batch, which is split over the mesh's ``data`` axis. Data parallel: params
replicated. FSDP: every param split over ``data`` along its largest dimension that
divides (``ShardingRules(fsdp="data")``). Each on a mesh with Auto axes and on one
with Explicit axes (JAX's default). The baseline is one ``jax.jit`` of ``loss → grad
→ adam`` with ``in_shardings``/``out_shardings`` equal to the state's and the
batch's shardings, params and optimizer state donated; on the Explicit mesh it
reshards the params to their compute layout (FSDP axes gathered) before the loss and
the grads back to the params' layout, as pztrain does. Trials are interleaved
(baseline, pztrain, baseline, …); the ratio is pztrain's steps/s over the mean of
the two baseline trials around it, median over rounds (target ≥ 0.95). It also
prints the collectives of each compiled step.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import pztrain  # noqa: E402

# SYNC: both implementations wait for each step before dispatching the next. With
# steps queued back to back, XLA's in-process collectives of 8 simulated devices on
# 2 cores deadlock for models this size (an all-reduce rendezvous where only some of
# the 8 device threads ever arrive, aborted after 40 s).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def make_params(width: int, depth: int) -> dict[str, jax.Array]:
    key = jax.random.key(0)
    sizes = [64] + [width] * depth + [10]
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = jax.random.normal(jax.random.fold_in(key, i), (a, b)) / a**0.5
        params[f"b{i}"] = jnp.zeros(b)
    return params


def apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    n = len(params) // 2
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"][None]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def loss_of(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()


def pz_loss(*, model, state, rng, x, y):
    loss = loss_of(model, x, y)
    return loss, state, {"loss": loss}


def build_pztrain(state, mesh, x, y):
    step = pztrain.build_train_step(pz_loss, mesh=mesh)
    holder = [state]

    def run(n, x, y):
        s = holder[0]
        for _ in range(n):
            s, _ = step(s, x=x, y=y)
            jax.block_until_ready(s.params)  # see SYNC
        holder[0] = s
        return s.params

    return run, step.lower(state, x=x, y=y).compile().as_text()


def build_raw(state, batch_sharding, x, y):
    tx = optax.adam(1e-3)
    shard = jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state))

    def one(params, opt_state, x, y):
        grads = jax.grad(loss_of)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(
        one,
        in_shardings=(*shard, batch_sharding, batch_sharding),
        out_shardings=shard,
        donate_argnums=(0, 1),
    )
    return _runner(jitted, state, shard, x, y)


def _runner(jitted, state, shard, x, y):
    """``(run, compiled HLO text)`` of a hand-written step ``jitted(params,
    opt_state, x, y)`` on its own copy of ``state``'s arrays placed as
    ``shard``; ``run(n, x, y)`` takes ``n`` steps, each waited for."""
    copy = jax.tree.map(lambda a: jnp.copy(a), (state.params, state.opt_state))
    holder = [jax.device_put(copy, shard)]

    def run(n, x, y):
        p, o = holder[0]
        for _ in range(n):
            p, o = jitted(p, o, x, y)
            jax.block_until_ready(p)  # see SYNC
        holder[0] = (p, o)
        return p

    text = jitted.lower(*holder[0], x, y).compile().as_text()
    return run, text


def build_raw_explicit(state, batch_sharding, x, y):
    """The hand-written step on an Explicit mesh: params resharded to their
    compute layout (FSDP axes gathered), the grads back to the storage layout."""
    from jax.sharding import PartitionSpec as P
    from jax.sharding import reshard

    tx = optax.adam(1e-3)
    shard = jax.tree.map(lambda a: a.sharding, (state.params, state.opt_state))
    storage = jax.tree.map(lambda a: a.sharding.spec, state.params)

    def one(params, opt_state, x, y):
        compute = jax.tree.map(lambda p: reshard(p, P()), params)
        grads = jax.grad(loss_of)(compute, x, y)
        grads = jax.tree.map(reshard, grads, storage)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(one, out_shardings=shard, donate_argnums=(0, 1))
    return _runner(jitted, state, shard, x, y)


def timed(run, n, x, y) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(run(n, x, y))
    return n / (time.perf_counter() - t0)


def collectives(text: str) -> dict[str, int]:
    ops = re.findall(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)
    return {c: ops.count(c) for c in COLLECTIVES if ops.count(c)}


def compare(name, rules, mesh, data, steps, rounds, width, depth):
    make = lambda: pztrain.TrainState.initial_state(  # noqa: E731
        make_params(width, depth), optax.adam(1e-3), jax.random.key(0)
    )
    state = pztrain.sharded_initial_state(make, mesh, rules)
    sharding = pztrain.sharding.data_sharding(mesh)
    x, y = (pztrain.put_batch(v, sharding) for v in data)
    explicit = mesh.axis_types[0] == AxisType.Explicit
    build = build_raw_explicit if explicit else build_raw
    raw, raw_text = build(state, sharding, x, y)
    pz_run, pz_text = build_pztrain(state, mesh, x, y)
    for run in (raw, pz_run):  # compile and warm up
        timed(run, 5, x, y)
    ratios, raw_rates, pz_rates = [], [], []
    before = timed(raw, steps, x, y)
    for _ in range(rounds):
        rate = timed(pz_run, steps, x, y)
        after = timed(raw, steps, x, y)
        ratios.append(rate / ((before + after) / 2))
        raw_rates.append(after)
        pz_rates.append(rate)
        before = after
    print(
        f"| {name} | {statistics.median(raw_rates):.0f} | "
        f"{statistics.median(pz_rates):.0f} | {statistics.median(ratios):.3f} | "
        f"{collectives(raw_text)} | {collectives(pz_text)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    width, depth = (128, 2) if args.quick else (512, 4)
    steps, rounds = (20, 3) if args.quick else (50, 9)
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((args.batch, 64)).astype(np.float32)
    y_host = rng.integers(0, 10, args.batch).astype(np.int32)
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    explicit = jax.make_mesh((8,), ("data",))  # JAX's default: Explicit
    print(
        f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices on "
        f"{os.cpu_count()} cores; MLP 64-{width}x{depth}-10, batch {args.batch}; "
        f"{rounds} interleaved rounds of {steps} steps (medians)"
    )
    print(
        "| layout | jax.jit steps/s | pztrain steps/s | ratio | jit collectives "
        "| pztrain collectives |"
    )
    print("|---|---|---|---|---|---|")
    fsdp = pztrain.ShardingRules(fsdp="data")
    data = (x_host, y_host)
    for kind, mesh in (("Auto", auto), ("Explicit", explicit)):
        if kind == "Explicit":
            jax.set_mesh(mesh)  # the hand-written explicit step's context
        compare(f"data parallel, {kind}", None, mesh, data, steps, rounds, width, depth)
        compare(f"FSDP, {kind}", fsdp, mesh, data, steps, rounds, width, depth)


if __name__ == "__main__":
    main()
