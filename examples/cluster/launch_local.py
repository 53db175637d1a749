"""Starts N processes of ``train.py`` on this machine, as a cluster would.

Run: ``python examples/cluster/launch_local.py --num-processes 2
--devices-per-process 2 -- --run-dir runs/cluster``: the arguments after
``--`` go to every process. Each process gets the variables the Kubernetes
recipe sets (``PZTRAIN_COORDINATOR`` = a free loopback port,
``PZTRAIN_NUM_PROCESSES``, ``PZTRAIN_PROCESS_ID``), so ``train.py`` joins JAX's
distributed runtime by the same code path as on a cluster; on CPUs the
processes' collectives go through gloo. ``--devices-per-process`` simulates
that many CPU devices in each process (``XLA_FLAGS``).

Each output line is prefixed with its process (``[0] ...``). A SIGTERM or
SIGINT to the launcher goes to every process: a preemption, which ``fit``
answers with a checkpoint. If a process fails, the others are stopped (as a
cluster's scheduler would). The launcher's exit code is the first non-zero code
of its processes (3: stopped before the end), or 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parent / "train.py"
GRACE = 60  # seconds the others get to stop after a process failed


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, num: int, coordinator: str, devices: int | None) -> dict:
    """Process ``i``'s environment: this one's, plus who it is."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(
        PZTRAIN_COORDINATOR=coordinator,
        PZTRAIN_NUM_PROCESSES=str(num),
        PZTRAIN_PROCESS_ID=str(i),
    )
    if devices is not None:
        flag = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    return env


def relay(i: int, stream, lock: threading.Lock) -> None:
    """Prints process ``i``'s output, each line prefixed with ``[i]``."""
    for line in stream:
        with lock:
            sys.stdout.write(f"[{i}] {line}")
            sys.stdout.flush()


def launch(
    num: int, train_args: list[str], devices: int | None = None, script=TRAIN
) -> int:
    """Runs ``num`` processes of ``script`` and waits for them all; returns
    the first non-zero exit code (a signal's: 128 + its number), or 0."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *train_args],
            env=process_env(i, num, coordinator, devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,  # a terminal's Ctrl-C reaches them once, through us
        )
        for i in range(num)
    ]

    def forward(signum, frame):  # a preemption of the launcher: of them all
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    lock = threading.Lock()
    relays = [
        threading.Thread(target=relay, args=(i, p.stdout, lock), daemon=True)
        for i, p in enumerate(procs)
    ]
    for t in relays:
        t.start()
    try:
        codes = wait_all(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for t in relays:
            t.join(timeout=5)
    failed = [128 - c if c < 0 else c for c in codes if c != 0]  # -15: 143
    if failed:
        print(f"launch_local: exit codes {codes}", file=sys.stderr)
    return failed[0] if failed else 0


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Waits for every process. Once one fails, the others get SIGTERM, then
    SIGKILL after `GRACE` seconds (else they would wait for the failed one in
    their next collective until JAX's heartbeat timeout)."""
    pending = list(procs)
    while pending:
        time.sleep(0.2)
        ended = [p for p in pending if p.poll() is not None]
        pending = [p for p in pending if p not in ended]
        if any(p.returncode != 0 for p in ended):
            for p in pending:
                p.terminate()
            for p in pending:
                try:
                    p.wait(timeout=GRACE)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            pending = []
    return [p.returncode for p in procs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s [-h] [--num-processes N] [--devices-per-process D] "
        "-- TRAIN_ARGS...",
    )
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument(
        "--devices-per-process",
        type=int,
        help="simulated CPU devices in each process (default: as XLA_FLAGS says)",
    )
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    if args.num_processes < 1:
        parser.error(f"--num-processes must be >= 1; got {args.num_processes}")
    return launch(args.num_processes, argv[cut + 1 :], args.devices_per_process)


if __name__ == "__main__":
    sys.exit(main())
