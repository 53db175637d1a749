"""One process of a run for ``test_stops_multiprocess.py``: stops and restarts.

``python stops_worker.py RUN_DIR PROCESS_ID NUM_PROCESSES PORT NUM_STEPS [SIGNAL]``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=<devices per process>``.

A ``data`` mesh over every device of every process, an FSDP-sharded state, a
mesh-aware `ArrayLoader` (each process feeds its rows), `Checkpoints` every 8
steps in ``RUN_DIR/ckpt`` with ``resume=True``, a JSONL log in ``RUN_DIR/log``,
an evaluation every 8 steps. ``SIGNAL`` is ``NAME@STEP@PROCESS`` (e.g.
``SIGTERM@8@1``): that process sends itself the signal at the log point of
that step, and from that step on every process sleeps a second at each log
point, so that the run outlasts JAX's preemption notice (polled once a second,
later on a loaded machine) by many log points.

At the end, process 0 writes the gathered params and optimizer state to
``RUN_DIR/final.npz``; every process writes ``RUN_DIR/out-<id>.json``: its
stop reason and step, and the pid that the lock files of ``ckpt`` and ``log``
named during the run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType

# the model, loss and evaluation of the multi-process fit tests
from multihost_fit_worker import eval_fn, loss_fn, make_state  # noqa: E402

import pztrain


class SignalAt(pztrain.Callback):
    """Sends ``sig`` to this process at the log point of ``step`` (if
    ``mine``); from that step on, every process sleeps ``pause`` seconds at
    each log point (a stop comes at the first call after the notice, so the
    sleep lasts only as long as the notice takes)."""

    def __init__(self, sig: int, step: int, mine: bool, pause: float = 1.0):
        self.sig, self.step, self.mine, self.pause = sig, step, mine, pause

    def on_log(self, state, record):
        if self.mine and record["step"] == self.step:
            os.kill(os.getpid(), self.sig)
        if record["step"] >= self.step:
            time.sleep(self.pause)


class LockSeen(pztrain.Callback):
    """The pids that the lock files name when the run starts."""

    def __init__(self, run_dir: str):
        self.run_dir, self.pids = run_dir, {}

    def on_train_start(self, state, info):
        for name in ("ckpt", "log"):
            path = os.path.join(self.run_dir, name, ".pztrain.lock")
            with open(path) as f:
                self.pids[name] = json.load(f)["pid"]


def main(run_dir: str, pid: int, num: int, port: int, steps: int, sig: str) -> None:
    if num > 1:
        address = f"127.0.0.1:{port}"
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num,
            process_id=pid,
            coordinator_bind_address=address,
        )
    rng = np.random.default_rng(0)
    data = {
        "x": rng.standard_normal((96, 8)).astype(np.float32),
        "y": rng.standard_normal((96, 4)).astype(np.float32),
    }
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    state = pztrain.sharded_initial_state(
        make_state, mesh, pztrain.ShardingRules(fsdp="data")
    )
    step = pztrain.build_train_step(loss_fn, mesh=mesh)
    loader = pztrain.ArrayLoader(data, 16, seed=3, sharding=step.batch_sharding)
    eval_data = pztrain.ArrayLoader(
        data, 32, shuffle=False, sharding=step.batch_sharding
    )
    lock_seen = LockSeen(run_dir)
    callbacks: list[pztrain.Callback] = [lock_seen]
    if sig:
        name, at, proc = sig.split("@")
        callbacks.append(SignalAt(signal.Signals[name], int(at), int(proc) == pid))
    state, history = pztrain.fit(
        state,
        step,
        loader,
        num_steps=steps,
        log_every=4,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=eval_data,
        eval_every=8,
        callbacks=callbacks,
        checkpoints=pztrain.Checkpoints(os.path.join(run_dir, "ckpt"), every_steps=8),
        resume=True,
        run_dir=os.path.join(run_dir, "log"),
        progress=False,
    )
    arrays = {f"params/{k}": v for k, v in state.params.items()}
    for i, leaf in enumerate(jax.tree.leaves(state.opt_state)):
        arrays[f"opt_state/{i}"] = leaf
    arrays = multihost_utils.process_allgather(arrays, tiled=True)
    if jax.process_index() == 0:
        np.savez(os.path.join(run_dir, "final.npz"), **jax.device_get(arrays))
    out = {
        "stop_reason": history.stop_reason,
        "step": int(state.step.addressable_data(0)),
        "lock_pids": lock_seen.pids,
        "pid": os.getpid(),
    }
    with open(os.path.join(run_dir, f"out-{pid}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]),
         args[5] if len(args) > 5 else "")  # fmt: skip
