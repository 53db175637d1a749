"""Data from disk at scale, in real subprocesses: SIGKILL and resume with grain
data, grain's worker processes, a run resumed on another process count, and a
dataset larger than the memory the training process uses."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pztrain

pytestmark = pytest.mark.slow  # subprocesses, grain worker processes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grain_multihost_worker as multihost  # noqa: E402
import grain_worker  # noqa: E402


def _run(script: str, *args, timeout=300, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), **(env or {}))
    return subprocess.run(
        [sys.executable, str(HERE / script), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("kind", ["grain", "iter"])
def test_sigkill_then_resume_on_grain_data_is_bitwise_identical(tmp_path, kind):
    data = tmp_path / "data.array_record"
    grain_worker.write_records(str(data), 96)
    full = _run("grain_worker.py", tmp_path / "full", data, kind)
    assert full.returncode == 0, full.stderr[-3000:]
    run = tmp_path / "run"
    killed = _run("grain_worker.py", run, data, kind, 10)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert max(int(p.name) for p in (run / "ckpt").iterdir() if p.name.isdigit()) == 8
    if kind == "grain":  # its grain worker ends with the killed process
        pids = [int(p) for p in (run / "workers").read_text().split()]
        assert len(pids) == 2  # the run's own check of the first batch, the worker
        deadline = time.monotonic() + 20
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, pids))
    resumed = _run("grain_worker.py", run, data, kind)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = np.load(tmp_path / "full" / "final.npz"), np.load(run / "final.npz")
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # The log: every point once, the killed stretch redone with the same values.
    got, want = _records(run), _records(tmp_path / "full")
    assert [r["step"] for r in got] == list(range(2, 25, 2))
    assert [r["metrics"]["loss"] for r in got] == [r["metrics"]["loss"] for r in want]


def test_grain_workers_read_in_other_processes_and_stop_with_fit(tmp_path):
    code = f"""
import multiprocessing, os, sys
import grain, numpy as np
sys.path.insert(0, {str(HERE)!r})
import test_grain_data as t
import pztrain

def with_pid(e):
    return {{**e, "pid": np.int64(os.getpid())}}

if __name__ == "__main__":
    ds = t.examples().map(with_pid)
    plain = pztrain.GrainLoader(ds, 8, seed=2)
    workers = pztrain.GrainLoader(ds, 8, seed=2, workers=2)
    got = workers.iter_from_step(3, steps_per_call=2)
    for call in range(5):
        batch = next(got)
        want = [plain.batch_at(s) for s in (3 + 2 * call, 4 + 2 * call)]
        np.testing.assert_array_equal(batch["x"], np.stack([w["x"] for w in want]))
        assert os.getpid() not in batch["pid"].tolist(), "read in this process"
    got.close()
    assert multiprocessing.active_children() == []
    loader = pztrain.GrainLoader(t.examples(), 8, seed=2, workers=2)
    state, _ = pztrain.fit(t._state(), t.STEP, loader, num_steps=30, log_every=10,
                           progress=False, loggers=[])
    assert multiprocessing.active_children() == [], "fit left grain workers behind"
    print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_grain_worker_errors_reach_fit_with_the_example_named(tmp_path):
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {str(HERE)!r})
import test_grain_data as t
import pztrain

def late_ragged(e):
    return {{**e, "x": e["x"][:3]}} if e["id"] == 30 else e

if __name__ == "__main__":
    loader = pztrain.GrainLoader(t.examples().map(late_ragged), 8, shuffle=False,
                                 workers=1)
    try:
        pztrain.fit(t._state(), t.STEP, loader, num_steps=10, progress=False,
                    loggers=[])
    except pztrain.BatchError as e:
        print(e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # the example it is compared with: the first of what was read with it
    assert re.match(r"Example 30\['x'\] is float32\[3\], example \d+'s is", out.stdout)


def test_ctrl_c_to_the_process_group_stops_fit_and_leaves_the_workers_quiet(tmp_path):
    # A terminal's Ctrl-C (and a notebook's interrupt) signals the whole group.
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(HERE)!r})
import test_grain_data as t
import pztrain

class CtrlC(pztrain.Callback):
    def on_log(self, state, record):
        if record["step"] == 20:
            os.killpg(os.getpgid(0), signal.SIGINT)

if __name__ == "__main__":
    loader = pztrain.GrainLoader(t.examples(), 8, seed=2, workers=1)
    state, history = pztrain.fit(t._state(), t.STEP, loader, num_steps=10_000,
                                 log_every=10, progress=False, loggers=[],
                                 callbacks=[CtrlC()])
    print(history.stop_reason, int(state.step))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        start_new_session=True,  # its own process group, this test outside it
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "interrupted 20"
    assert "KeyboardInterrupt" not in out.stderr, out.stderr[-3000:]


def _launch(run_dir: Path, num: int, kill: int, tag: str) -> list:
    """``num`` processes of ``grain_multihost_worker.py`` over 4 devices in all."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // num}"
    worker = str(HERE / "grain_multihost_worker.py")
    args = [str(run_dir), None, str(num), str(port), str(kill), tag]
    procs = [
        subprocess.Popen(
            [sys.executable, worker, *args[:1], str(i), *args[2:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num)
    ]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
        done = [(p.returncode, err) for p, err in zip(procs, errors, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    want = -signal.SIGKILL if kill else 0
    for code, err in done:
        assert code == want, err[-3000:]
    return done


def _reads(run_dir: Path, tag: str, num: int) -> list[list[int]]:
    """The example ids each process read for its steps, in order. A lone
    process first reads the batch of the given state's step once ahead, to
    check it before anything is written (before a resume): left out."""
    reads = [
        [int(i) for i in (run_dir / f"reads-{tag}-{p}.txt").read_text().split()]
        for p in range(num)
    ]
    if num == 1:
        reads[0] = reads[0][multihost.BATCH :]  # the look-ahead
    return reads


def _global_batches(reads: list[list[int]], start: int, stop: int) -> dict:
    """Global batch of each step from ``start`` to ``stop``: every process's
    block of it (each read its rows step after step), in process order."""
    per = multihost.BATCH // len(reads)
    return {
        s: [i for r in reads for i in r[(s - start) * per : (s - start + 1) * per]]
        for s in range(start, stop)
    }


def test_resumed_on_another_process_count_the_global_batches_stay(tmp_path):
    loader = pztrain.GrainLoader(multihost.dataset(), multihost.BATCH, seed=5)
    want = {s: loader.example_ids(s) for s in range(multihost.NUM_STEPS)}

    _launch(tmp_path / "one", 1, 0, "all")
    assert _global_batches(_reads(tmp_path / "one", "all", 1), 0, 32) == want
    reference = np.load(tmp_path / "one" / "final.npz")

    for first, then in ((2, 1), (1, 2)):
        run = tmp_path / f"{first}-then-{then}"
        _launch(run, first, 20, "killed")  # the last checkpoint: step 16
        _launch(run, then, 0, "resumed")
        before, after = _reads(run, "killed", first), _reads(run, "resumed", then)
        assert _global_batches(before, 0, 16) == {s: want[s] for s in range(16)}
        assert _global_batches(after, 16, 32) == {s: want[s] for s in range(16, 32)}
        # Each process read only its rows: its block of every global batch, a
        # few steps read ahead. SIGKILL may land while a read-ahead thread is
        # half-way through a block, so the killed run's reads are a prefix.
        for reads, start, killed in ((before, 0, True), (after, 16, False)):
            per = multihost.BATCH // len(reads)
            for p, got in enumerate(reads):
                if not killed:
                    assert len(got) % per == 0  # whole blocks
                steps = range(start, start + -(-len(got) // per))
                mine = [
                    i
                    for s in steps
                    for i in loader.example_ids(s)[p * per : (p + 1) * per]
                ]
                assert got == mine[: len(got)]
        final = np.load(run / "final.npz")
        for name in reference.files:
            np.testing.assert_allclose(final[name], reference[name], atol=1e-5)


def test_a_dataset_four_times_the_training_process_memory_trains(tmp_path):
    import grain_memory_worker as memory

    data = tmp_path / "big.array_record"
    records = 24576  # 1.5 GiB of 64 KiB records
    try:
        memory.write(str(data), records)
        size = data.stat().st_size
        out = _run("grain_memory_worker.py", data, 0, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        data.unlink(missing_ok=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["steps"] == records // memory.BATCH  # one epoch
    assert got["examples"] == records  # every example once
    assert np.isfinite(got["loss"])
    peak = got["rss_mib"] * 2**20
    assert size >= 4 * peak, (size / 2**20, got)
