"""One training script for one process or many: the digits MLP, data parallel
over every device of every process, with checkpoints and ``resume=True``.

Run it as it is on one machine::

    python examples/cluster/train.py --run-dir runs/cluster

and unchanged on many: `connect` reads the environment, calls
``jax.distributed.initialize`` when this is one of several processes, and the
rest of the script is the same code on every process (JAX's multi-controller
model). The launchers next to it start it: ``launch_local.py`` (N processes on
this machine), ``slurm.sbatch``, ``k8s-indexed-job.yaml`` and ``tpu_vm.sh``.

Where the processes come from, in the order `distributed_args` tries them:

1. ``--coordinator HOST:PORT --num-processes N --process-id I``, or the
   variables ``PZTRAIN_COORDINATOR``, ``PZTRAIN_NUM_PROCESSES`` and
   ``PZTRAIN_PROCESS_ID`` (or Kubernetes' ``JOB_COMPLETION_INDEX`` for the id):
   explicit arguments (the local launcher and the Kubernetes Job).
2. ``--auto-detect``: ``jax.distributed.initialize()`` with no arguments; JAX
   finds the cluster itself (the workers of a Cloud TPU VM slice).
3. A SLURM step of several tasks (``srun``: ``SLURM_NTASKS`` > 1 and
   ``SLURM_PROCID``): no arguments either; JAX reads SLURM's variables.
4. Otherwise: one process.

The run directory must be one directory that every process sees (shared
storage on a cluster): checkpoints in ``<run-dir>/ckpt``, the JSON-lines log in
``<run-dir>/log``. Started again on the same directory (a requeued job, a
replaced pod), the run goes on from its newest checkpoint. SIGTERM (a
scheduler's preemption or time limit) stops every process at the same step
with a checkpoint; the script then exits with code 3, "stopped before the end:
run the same command again".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models import simple_mlp
from sklearn.datasets import load_digits

import pztrain

COORDINATOR = "PZTRAIN_COORDINATOR"  # HOST:PORT of process 0's coordinator
NUM_PROCESSES = "PZTRAIN_NUM_PROCESSES"
PROCESS_ID = "PZTRAIN_PROCESS_ID"
K8S_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in an Indexed Job's pods
STOPPED = 3  # the exit code of a run stopped by a signal before its end


def distributed_args(
    environ: Mapping[str, str],
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto_detect: bool = False,
) -> dict[str, Any] | None:
    """The keyword arguments for ``jax.distributed.initialize``, or ``None``
    when this is the only process. Reads nothing but its arguments.

    Args:
      environ: The environment (``os.environ``).
      coordinator: ``HOST:PORT`` of process 0's coordinator (a flag), else
        ``PZTRAIN_COORDINATOR``.
      num_processes: How many processes (a flag), else ``PZTRAIN_NUM_PROCESSES``.
      process_id: This process, from 0 (a flag), else ``PZTRAIN_PROCESS_ID``,
        else ``JOB_COMPLETION_INDEX``.
      auto_detect: Let JAX find the cluster (``{}``: no arguments).

    Returns:
      ``None`` (one process), ``{}`` (JAX detects the cluster) or the explicit
      arguments.

    Raises:
      ValueError: explicit arguments that are incomplete or out of range.

    Example:
      >>> distributed_args({})  # nothing says there are others: one process
      >>> distributed_args({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
      {}
      >>> distributed_args({"PZTRAIN_COORDINATOR": "job-0.job:1234",
      ...                   "PZTRAIN_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "1"})
      {'coordinator_address': 'job-0.job:1234', 'num_processes': 2, 'process_id': 1, \
'cluster_detection_method': 'deactivate'}
    """
    coordinator = coordinator or environ.get(COORDINATOR) or None
    num = num_processes if num_processes is not None else environ.get(NUM_PROCESSES)
    pid = process_id if process_id is not None else environ.get(PROCESS_ID)
    pid = pid if pid is not None else environ.get(K8S_INDEX)
    if coordinator is not None or num is not None:
        return _explicit(coordinator, num, pid)
    if auto_detect:
        return {}
    if int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ:
        return {}  # srun's tasks: JAX reads SLURM's variables
    return None


def _explicit(coordinator, num, pid) -> dict[str, Any] | None:
    """Checked explicit arguments (``None`` for a single process)."""
    try:
        num = int(num) if num is not None else None
        pid = int(pid) if pid is not None else None
    except ValueError as e:
        raise ValueError(
            f"the number of processes and the process id must be integers: {e}"
        ) from None
    if num is None:
        raise ValueError(
            f"the coordinator is {coordinator!r} but the number of processes is "
            f"not given: pass --num-processes or set {NUM_PROCESSES}."
        )
    if num < 1:
        raise ValueError(f"the number of processes must be >= 1; got {num}.")
    if num == 1:
        return None
    if coordinator is None or ":" not in coordinator:
        raise ValueError(
            f"{num} processes need the coordinator's HOST:PORT (process 0's "
            f"address); got {coordinator!r}: pass --coordinator or set {COORDINATOR}."
        )
    if pid is None or not 0 <= pid < num:
        raise ValueError(
            f"{num} processes need this process's id in 0..{num - 1}; got {pid!r}: "
            f"pass --process-id or set {PROCESS_ID} (or {K8S_INDEX})."
        )
    args = {
        "coordinator_address": coordinator,
        "num_processes": num,
        "process_id": pid,
        # every argument is given: no cluster detection (nor its API calls)
        "cluster_detection_method": "deactivate",
    }
    host = coordinator.rsplit(":", 1)[0]
    if host == "localhost" or host.startswith("127."):
        # one machine: the coordinator listens on loopback only, not on every
        # interface (JAX's default)
        args["coordinator_bind_address"] = coordinator
    return args


def connect(args: argparse.Namespace) -> dict[str, Any] | None:
    """Joins JAX's distributed runtime if `distributed_args` says this is one
    of several processes; returns the arguments it used (``None``: alone)."""
    kwargs = distributed_args(
        os.environ,
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        auto_detect=args.auto_detect,
    )
    if kwargs is not None:
        jax.distributed.initialize(**kwargs)
    return kwargs


def check_platform(wanted: str | None, found: str) -> None:
    """Refuses to train on ``found`` (``jax.default_backend()``) when the job
    asked for ``wanted``: without JAX's GPU build, JAX runs on the CPU, with
    only a warning in the job's output.

    Example:
      >>> check_platform("gpu", "gpu"); check_platform(None, "cpu")
      >>> check_platform("gpu", "cpu")
      Traceback (most recent call last):
      SystemExit: --platform gpu: JAX runs on cpu here. Install JAX's build for \
gpu in the job's environment (pip install -e ".[cuda]" for NVIDIA GPUs, \
".[tpu]" on TPU VMs), or leave --platform out to train on cpu.
    """
    if wanted is not None and wanted != found:
        raise SystemExit(
            f"--platform {wanted}: JAX runs on {found} here. Install JAX's build "
            f"for {wanted} in the job's environment (pip install -e "
            '".[cuda]" for NVIDIA GPUs, ".[tpu]" on TPU VMs), or leave --platform '
            f"out to train on {found}."
        )


def loss_fn(*, model, state, rng, images, labels):
    images = images + 0.05 * jax.random.normal(rng, images.shape)  # input noise
    logits = logits_of(model, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, images, labels):
    del state, rng
    logits = logits_of(model, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def logits_of(model, images):
    out = model(pz.nx.wrap(images).tag("batch", "features"))
    return out.untag("batch", "features").unwrap()


def digits(seed: int = 0):
    """The bundled digits: 1,437 training and 360 validation images. Every
    process holds them all; each loader yields only its process's rows."""
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    train, valid = np.split(order, [1437])
    return [{"images": x[p], "labels": y[p]} for p in (train, valid)]


class Report(pztrain.Callback):
    """One line per process at the start (the step a resumed run starts
    from), and train and eval lines from process 0."""

    def __init__(self, label: str):
        self.label = label

    def on_train_start(self, state, info):
        step = int(state.step)
        how = "resumed from a checkpoint at" if step else "starting at"
        print(f"{self.label}: {how} step {step}", flush=True)

    @pztrain.callbacks.record_only
    def on_log(self, state, record):
        if jax.process_index() == 0:
            print(f"step {record['step']}: loss {record['metrics']['loss']:.4f}")

    def on_eval_end(self, state, record):
        if jax.process_index() == 0:
            m = record["metrics"]
            print(f"step {record['step']}: eval accuracy {m['accuracy']:.4f}")


def main(args: argparse.Namespace) -> int:
    connect(args)  # before anything else touches the devices
    check_platform(args.platform, jax.default_backend())
    n = jax.device_count()  # every process's devices
    label = f"process {jax.process_index()} of {jax.process_count()}"
    print(f"{label}: {jax.local_device_count()} of {n} devices", flush=True)

    # Data parallel: one mesh axis over every device; the params are
    # replicated (ShardingRules(fsdp="data") would shard them too).
    mesh = jax.make_mesh((n,), ("data",))
    state = pztrain.sharded_initial_state(
        lambda: pztrain.TrainState.initial_state(
            simple_mlp.MLP.from_config(
                name="mlp",
                init_base_rng=jax.random.key(args.seed),
                feature_sizes=[64, 128, 10],
            ),
            optax.adam(args.lr),
            jax.random.key(args.seed),
        ),
        mesh,
    )
    train_step = pztrain.build_train_step(loss_fn, mesh=mesh)
    batches = train_step.batch_sharding  # each process feeds only its rows
    train, valid = digits(args.seed)
    eval_batch = len(valid["labels"]) // n * n  # splits evenly over the devices
    state, history = pztrain.fit(
        state,
        train_step,
        pztrain.ArrayLoader(train, args.batch_size, seed=args.seed, sharding=batches),
        num_steps=args.steps,
        log_every=args.log_every,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=pztrain.ArrayLoader(
            valid, eval_batch, shuffle=False, sharding=batches
        ),
        eval_every=args.eval_every,
        checkpoints=pztrain.Checkpoints(
            os.path.join(args.run_dir, "ckpt"), every_steps=args.save_every
        ),
        resume=True,  # a restarted job goes on from its newest checkpoint
        run_dir=os.path.join(args.run_dir, "log"),
        callbacks=[Report(label)],
        progress=False,  # a cluster's logs are files: no progress bar
    )
    step = int(state.step)
    if history.stop_reason in ("preempted", "interrupted"):
        print(f"{label}: {history.stop_reason} at step {step}", flush=True)
        return STOPPED
    print(f"{label}: done at step {step}", flush=True)
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="shared by every process")
    parser.add_argument("--steps", type=int, default=600, help="in all")
    parser.add_argument("--batch-size", type=int, default=64, help="global")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--platform",
        choices=["cpu", "gpu", "tpu"],
        help="refuse to train unless JAX runs on it (default: wherever it runs)",
    )
    cluster = parser.add_argument_group("processes (default: from the environment)")
    cluster.add_argument("--coordinator", help="HOST:PORT of process 0")
    cluster.add_argument("--num-processes", type=int)
    cluster.add_argument("--process-id", type=int)
    cluster.add_argument(
        "--auto-detect",
        action="store_true",
        help="jax.distributed.initialize() without arguments (Cloud TPU VMs)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse()))
