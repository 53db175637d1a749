"""`fit` over two real processes (JAX's distributed runtime on 127.0.0.1, gloo CPU
collectives, 2 devices each): a mesh-aware loader, FSDP, checkpoints, a SIGKILL
of both processes and ``resume=True`` end where one process with the same 4
devices ends; one log and one progress bar; `export_safetensors` gathers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_fit_worker.py"


def open_lines(run_log: Path) -> list[str]:
    return (run_log / "metrics.jsonl").read_text().splitlines()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    run_dir: Path, num: int, kill: int = 0, axes: str = "auto"
) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESH_AXES=axes)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // num}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(run_dir),
                str(i),
                str(num),
                str(port),
                str(kill),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_two_processes_killed_and_resumed_match_one_process(tmp_path, axes):
    one = _launch(tmp_path / "one", 1, axes=axes)
    assert one[0].returncode == 0, one[0].stderr[-3000:]
    want = np.load(tmp_path / "one" / "final.npz")

    run = tmp_path / "two"
    killed = _launch(run, 2, kill=20, axes=axes)
    for p in killed:
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert (run / "ckpt" / "16").is_dir()

    resumed = _launch(run, 2, axes=axes)
    for p in resumed:
        assert p.returncode == 0, p.stderr[-3000:]
    got = np.load(run / "final.npz")
    exported = safetensors.numpy.load_file(run / "params.safetensors")
    assert sorted(exported) == sorted(want.files)
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5)
        np.testing.assert_array_equal(exported[name], got[name])  # gathered whole

    # One log, written by process 0: every log point once, the killed stretch redone.
    lines = (run / "log" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train = [(r["step"], r["split"]) for r in records if r["split"] == "train"]
    assert train == [(s, "train") for s in range(4, 33, 4)]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [16, 32]
    one_log = [json.loads(line) for line in open_lines(tmp_path / "one" / "log")]
    want_evals = [r["metrics"]["loss"] for r in one_log if r["split"] == "eval"]
    np.testing.assert_allclose(
        [r["metrics"]["loss"] for r in evals], want_evals, rtol=1e-5
    )
    # Every process has the whole history and the state's shardings.
    for i in range(2):
        seen = json.loads((run / f"history-{i}.json").read_text())
        assert [s for s, split in seen["steps"] if split == "train"] == [20, 24, 28, 32]
        assert [s for s, split in seen["steps"] if split == "eval"] == [32]
        assert seen["w1"] == "P(None, 'data')"
    # One progress bar: process 0's.
    assert "32/32" in resumed[0].stderr
    assert "32/32" not in resumed[1].stderr
