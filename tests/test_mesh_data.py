"""Mesh-aware batches: put_batch, each process's rows, sharded on-device epochs.

The multi-device checks run in one subprocess on 8 simulated CPU devices
(tests/mesh_data_worker.py); the row selection of several processes is checked
here with the process index and count given explicitly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pztrain.data import ArrayLoader, BatchError, put_batch
from pztrain.loop import fit
from pztrain.state import TrainState
from pztrain.step import build_train_step

HERE = Path(__file__).resolve().parent


def _data(n=40):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(n, 3)).astype(np.float32),
        "y": np.arange(n, dtype=np.int32),
    }


def _sharding():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, P("data"))


@pytest.mark.slow
def test_on_8_devices_mesh_batches_match_one_device():
    """DP over 8 devices, host and on-device loaders, k=1 and k=2: 20 steps equal
    one device within 1e-5; batches arrive sharded over the mesh; the compiled
    step has one gradient all-reduce and no collective on the data; a batch size
    that does not divide over the data shards is refused."""
    env = dict(
        os.environ,
        PYTHONPATH=str(HERE.parent),
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
    )
    out = subprocess.run(
        [sys.executable, str(HERE / "mesh_data_worker.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    done = {line[3:] for line in out.stdout.splitlines() if line.startswith("ok ")}
    assert done == {
        "errors",
        "device_layout",
        "hlo",
        "host_mode_k1",
        "host_mode_k2",
        "device_mode_k1",
        "device_mode_k2",
        "host_mode_loader_sharding",
    }
    (hlo,) = [line for line in out.stdout.splitlines() if line.startswith("hlo ")]
    count = json.loads(hlo[4:])
    assert count["all-gather"] == count["collective-permute"] == 0
    assert count["all-to-all"] == 0 and count["all-reduce"] >= 1


@pytest.mark.parametrize("shuffle", [True, False])
def test_processes_rows_partition_every_global_batch(shuffle):
    """Process p of n yields block p of each global batch: together, in process
    order, the blocks are the batch a single process sees."""
    whole = ArrayLoader(_data(), 8, seed=4, shuffle=shuffle)
    parts = [
        ArrayLoader(
            _data(),
            8,
            seed=4,
            shuffle=shuffle,
            sharding=_sharding(),
            process_index=p,
            process_count=4,
        )
        for p in range(4)
    ]
    for step in (0, 3, 5, 11):
        got = [part.batch_at(step)["y"] for part in parts]
        assert all(len(rows) == 2 for rows in got)
        np.testing.assert_array_equal(np.concatenate(got), whole.batch_at(step)["y"])
    iters = [part.iter_from_step(7, steps_per_call=2) for part in parts]
    want = whole.iter_from_step(7, steps_per_call=2)
    for _ in range(4):
        got = [next(it)["x"] for it in iters]
        assert got[0].shape == (2, 2, 3)
        np.testing.assert_array_equal(np.concatenate(got, axis=1), next(want)["x"])
    epochs = zip(*(p.epoch(2) for p in parts), strict=True)
    for got, want in zip(epochs, whole.epoch(2), strict=True):
        np.testing.assert_array_equal(np.concatenate([g["y"] for g in got]), want["y"])


def test_process_defaults_come_from_jax():
    loader = ArrayLoader(_data(), 8, sharding=_sharding())
    assert jax.process_count() == 1
    assert loader.batch_at(0)["y"].shape == (8,)


def test_mesh_loader_errors():
    with pytest.raises(
        BatchError,
        match=re.escape("batch_size=9 (the global batch) does not divide among 2"),
    ):
        ArrayLoader(_data(), 9, sharding=_sharding(), process_index=0, process_count=2)
    with pytest.raises(BatchError, match=re.escape("process_index=2 is outside")):
        ArrayLoader(_data(), 8, sharding=_sharding(), process_index=2, process_count=2)
    with pytest.raises(BatchError, match="must be a jax.sharding.NamedSharding"):
        ArrayLoader(_data(), 8, sharding=P("data"))
    with pytest.raises(BatchError, match=re.escape("use drop_remainder=True")):
        ArrayLoader(_data(), 8, sharding=_sharding(), drop_remainder=False)


def test_put_batch_places_every_leaf_and_replicates_scalars():
    sharding = _sharding()
    batch = put_batch({"x": np.ones((4, 3)), "t": np.float32(0.5)}, sharding)
    assert batch["x"].sharding == sharding
    assert batch["t"].sharding.spec == P()
    stacked = NamedSharding(sharding.mesh, P(None, "data"))
    got = put_batch({"x": np.ones((2, 4, 3))}, stacked)
    assert got["x"].sharding == stacked
    plain = put_batch({"x": np.ones(3)})
    assert plain["x"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_loader_batch_sharding_adds_the_steps_axis():
    loader = ArrayLoader(_data(), 8, sharding=_sharding())
    assert loader.batch_sharding() == _sharding()
    assert loader.batch_sharding(3).spec == P(None, "data")
    assert ArrayLoader(_data(), 8).batch_sharding(3) is None


def _loss(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_fit_puts_batches_on_the_loaders_sharding(prefetch):
    """Without a batch sharding on the step, the loader's places the batches,
    with prefetching or without."""
    seen = []
    step = build_train_step(_loss)
    accumulate = step.accumulate

    def recording(state, sums, batch, calls=1, **kw):
        seen.append(batch["x"].sharding)
        return accumulate(state, sums, batch, calls=calls, **kw)

    step.accumulate = recording
    state = TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.key(0)
    )
    loader = ArrayLoader(_data(), 8, sharding=_sharding())
    fit(state, step, loader, num_steps=3, prefetch=prefetch, progress=False)
    assert seen == [_sharding()] * 3
