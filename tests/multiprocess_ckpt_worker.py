"""One of two processes saving and restoring a sharded state (2 CPU devices each).

``python multiprocess_ckpt_worker.py PORT PROCESS_ID WORK_DIR``: joins JAX's
distributed runtime on 127.0.0.1, trains the FSDP MLP of sharded_ckpt_worker.py
for 3 steps on a mesh of the 4 global devices, saves the state, and restores it
into a fresh sharded state and into an abstract sharded target: every leaf must
have its target's sharding and the saved values. Prints ``OK`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded_ckpt_worker import (
    arrays,
    batches,
    make_state,
    sharded_state,
    shardings,
    step_for,
)

from pztrain.checkpoint import load_state, save_state


def global_batch(mesh, batch):
    sharding = NamedSharding(mesh, P("data"))
    rows = len(batch["x"]) // 2
    index = jax.process_index()
    mine = slice(index * rows, (index + 1) * rows)
    return {
        k: jax.make_array_from_process_local_data(sharding, v[mine], v.shape)
        for k, v in batch.items()
    }


def on_host(state) -> dict[str, np.ndarray]:
    out = {}
    for p, x in arrays(state):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[p] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return out


def check(restored, target, saved, what):
    want = dict(arrays(target))
    for p, x in arrays(restored):
        assert x.sharding == want[p].sharding, f"{what}: {p} has {x.sharding}"
    for p, x in on_host(restored).items():
        np.testing.assert_array_equal(x, saved[p], err_msg=f"{what}: {p}")


def main(port: int, process_id: int, work: Path) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        coordinator_bind_address=f"127.0.0.1:{port}",
    )
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = shardings(
        mesh, lambda x: P("data") if x.ndim and x.shape[0] % 4 == 0 else P()
    )
    step = step_for(specs, "data")
    state = sharded_state(specs)
    for batch in batches(3):
        state, _ = step(state, **global_batch(mesh, batch))
    save_state(work / "ckpt", state)
    saved = on_host(state)

    fresh = sharded_state(specs)
    check(load_state(work / "ckpt", fresh), fresh, saved, "sharded target")
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(make_state),
        specs,
    )
    check(load_state(work / "ckpt", abstract), abstract, saved, "abstract target")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    multihost_utils.sync_global_devices("multiprocess_ckpt_worker done")
    print("OK")
