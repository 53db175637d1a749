"""Mesh-aware batches on 8 simulated CPU devices, run as a subprocess.

``XLA_FLAGS=--xla_force_host_platform_device_count=8 python mesh_data_worker.py``
runs every check below in one process (one start-up, shared compiles) and prints
``ok <name>`` per check, then one JSON line with the collectives counted in the
compiled data-parallel step (``hlo {...}``). Any failure raises.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pztrain.data import ArrayLoader, BatchError, IndexedBatches
from pztrain.loop import fit
from pztrain.state import TrainState
from pztrain.step import build_train_step

N, BATCH, STEPS = 100, 16, 20  # 6 steps per epoch: 20 steps cross 3 epochs


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    return {"x": x, "y": np.tanh(x @ np.arange(1.0, 5.0, dtype=np.float32))}


def loss_fn(*, model, state, rng, x, y):
    h = jnp.tanh(x @ model["w1"] + model["b1"])
    loss = jnp.mean((h @ model["w2"] - y) ** 2)
    return loss, state, {"loss": loss}


def fresh_state(sharding=None):
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(keys[0], (4, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(keys[1], (8,)) * 0.5,
    }
    state = TrainState.initial_state(params, optax.adam(1e-2), jax.random.key(1))
    return state if sharding is None else jax.device_put(state, sharding)


def dp_step(mesh, k, batches=True):
    """A data-parallel step; ``batches=False``: no batch sharding (on-device
    epochs carry their own layout)."""
    spec = P("data") if k == 1 else P(None, "data")
    sharding = NamedSharding(mesh, spec) if batches else None
    step = build_train_step(loss_fn, steps_per_call=k, batch_shardings=sharding)
    if batches and getattr(step, "batch_sharding", None) is None:
        step.batch_sharding = sharding  # what build_train_step(mesh=) will set
    return step


def spy(step):
    """Records the shardings of every batch the step receives from fit."""
    seen = []
    accumulate = step.accumulate

    def recording(state, sums, batch, calls=1, **kw):
        leaves = jax.tree.leaves(batch)
        seen.append((type(batch), [(a.sharding, a.ndim) for a in leaves]))
        return accumulate(state, sums, batch, calls=calls, **kw)

    step.accumulate = recording
    return seen


def close(a, b):
    for name in a.params:
        np.testing.assert_allclose(a.params[name], b.params[name], atol=1e-5)


def reference(k):
    step = build_train_step(loss_fn, steps_per_call=k)
    loader = ArrayLoader(data(), BATCH, seed=1)
    state, _ = fit(fresh_state(), step, loader, num_steps=STEPS, progress=False)
    return state


def check_host_mode(mesh, k, ref):
    sharding = NamedSharding(mesh, P("data"))
    step = dp_step(mesh, k)
    seen = spy(step)
    loader = ArrayLoader(data(), BATCH, seed=1, sharding=sharding)
    replicated = NamedSharding(mesh, P())
    state, _ = fit(
        fresh_state(replicated),
        step,
        loader,
        num_steps=STEPS,
        log_every=2 * k,
        progress=False,
    )
    close(state, ref)
    want = step.batch_sharding
    assert len(seen) == STEPS // k
    for kind, leaves in seen:
        assert kind is dict, kind
        for got, ndim in leaves:
            assert got.is_equivalent_to(want, ndim), (got, want)
            assert len(got.device_set) == 8
    print(f"ok host_mode_k{k}")


def check_host_mode_loader_sharding(mesh):
    """A step without a batch sharding: the loader's own places the batches."""
    sharding = NamedSharding(mesh, P("data"))
    step = build_train_step(loss_fn)
    seen = spy(step)
    loader = ArrayLoader(data(), BATCH, seed=1, sharding=sharding)
    fit(
        fresh_state(NamedSharding(mesh, P())), step, loader, num_steps=4, progress=False
    )
    assert all(got.is_equivalent_to(sharding, nd) for _, ls in seen for got, nd in ls)
    print("ok host_mode_loader_sharding")


def check_device_mode(mesh, k, ref):
    sharding = NamedSharding(mesh, P("data"))
    step = dp_step(mesh, k, batches=False)
    seen = spy(step)
    loader = ArrayLoader(data(), BATCH, seed=1, sharding=sharding, on_device=True)
    replicated = NamedSharding(mesh, P())
    state, _ = fit(
        fresh_state(replicated),
        step,
        loader,
        num_steps=STEPS,
        log_every=2 * k,
        progress=False,
    )
    close(state, ref)
    epoch_sharding = NamedSharding(mesh, P(None, "data"))
    assert seen
    for kind, leaves in seen:
        assert kind is IndexedBatches, kind
        for got, ndim in leaves:
            assert got.is_equivalent_to(epoch_sharding, ndim), got
    print(f"ok device_mode_k{k}")


def check_device_layout(mesh):
    """Every device holds its 2 rows of every batch; batches match the host's."""
    sharding = NamedSharding(mesh, P("data"))
    dev = ArrayLoader(data(), BATCH, seed=3, sharding=sharding, on_device=True)
    host = ArrayLoader(data(), BATCH, seed=3)
    for epoch in (0, 2, 1):
        batches = dev.device_epoch(epoch)
        x = batches.arrays["x"]
        assert x.shape == (7, BATCH, 4)  # 100 rows padded to 7 batches of 16
        assert {s.data.shape for s in x.addressable_shards} == {(7, 2, 4)}
        for i, want in enumerate(host.epoch(epoch)):
            got = batches.take(jnp.int32(epoch * 6 + i))
            np.testing.assert_array_equal(got["x"], want["x"])
    print("ok device_layout")


def collectives(text):
    """Collective ops in compiled HLO text, and the operands of each all-reduce."""
    ops = ("all-reduce", "all-gather", "collective-permute", "all-to-all")
    count = {op: len(re.findall(rf" {op}(?:-start)?\(", text)) for op in ops}
    count["reduce-scatter"] = len(re.findall(r" reduce-scatter\(", text))
    count["all-reduce operands"] = [
        len(m.group(1).split(", "))
        for m in re.finditer(r" all-reduce(?:-start)?\(([^)]*)\)", text)
    ]
    return count


def check_hlo(mesh):
    """The step slices its batch from the sharded epoch with no data movement:
    one all-reduce of the 3 gradients and the loss (XLA fuses them into one
    tuple all-reduce here), and no collective touching the data."""
    sharding = NamedSharding(mesh, P("data"))
    loader = ArrayLoader(data(), BATCH, seed=1, sharding=sharding, on_device=True)
    step = dp_step(mesh, 1, batches=False)
    state = fresh_state(NamedSharding(mesh, P()))
    text = step.lower(state, loader.device_epoch(1)).compile().as_text()
    count = collectives(text)
    assert 1 <= count["all-reduce"] <= 4, count  # fused, or one per gradient
    assert sum(count["all-reduce operands"]) == 4, count  # 3 grads + the loss
    for op in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        assert count[op] == 0, (op, count)
    # each device reads its own [7, 2, 4] block of the epoch: a local slice
    assert re.search(r"f32\[7,2,4\].* parameter\(", text), "epoch not sharded"
    assert "dynamic-slice" in text
    print("hlo " + json.dumps(count))
    print("ok hlo")


def check_errors(mesh):
    sharding = NamedSharding(mesh, P("data"))
    try:
        ArrayLoader(data(), 12, sharding=sharding)
    except BatchError as e:
        assert (
            "batch_size=12 (the global batch) does not divide into the 8 data shards"
            in str(e)
        ), e
    else:
        raise AssertionError("batch_size=12 on 8 data shards was accepted")
    print("ok errors")


def main():
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    check_errors(mesh)
    check_device_layout(mesh)
    check_hlo(mesh)
    for k in (1, 2):
        ref = reference(k)
        check_host_mode(mesh, k, ref)
        check_device_mode(mesh, k, ref)
    check_host_mode_loader_sharding(mesh)


if __name__ == "__main__":
    main()
