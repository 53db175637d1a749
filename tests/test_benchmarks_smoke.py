"""The benchmarks run to completion (a smoke test: their timings are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: int) -> str:
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_step_benchmark_quick_mode_completes():
    # the collector off only: "--gc both" times every round twice (on, off)
    out = _run("benchmarks/step_bench.py", "--quick", "--gc", "off", timeout=600)
    assert "Steps/s relative to the raw jit baseline" in out
    for name in ("W0", "W1", "W3s"):
        assert name in out
    assert "pztrain fit" in out
    assert "pztrain's program alone" in out


def test_checkpoint_benchmark_completes():
    out = _run(
        "benchmarks/checkpoint_bench.py",
        "--params",
        "2000000",
        "--trials",
        "1",
        timeout=300,
    )
    assert "numpy+fsync" in out and "asynchronous" in out


def test_mesh_benchmark_quick_mode_completes():
    out = _run("benchmarks/mesh_bench.py", "--quick", timeout=600)
    for layout in ("data parallel", "FSDP"):
        for kind in ("Auto", "Explicit"):
            assert f"| {layout}, {kind} |" in out


def test_data_benchmark_quick_mode_completes():
    # --quick's one round, shorter: 100 steps a trial over 4096 examples
    args = ("--rounds", "1", "--steps", "100", "--log-every", "50")
    out = _run("benchmarks/data_bench.py", *args, "--examples", "4096", timeout=900)
    assert "| ArrayRecord, decode=RecordLayout, 1 workers |" in out
    assert "arrays on the device" in out
    assert "target: the fast path >= 0.90x" in out


def test_ema_benchmark_completes():
    out = _run(
        "benchmarks/ema_bench.py",
        "--workloads",
        "W0",
        "--rounds",
        "3",
        "--calls",
        "5",
        timeout=300,
    )
    assert "pztrain_ema/raw_ema" in out and "target pztrain_ema/raw_ema" in out


def test_nnx_benchmark_completes():
    out = _run(
        "benchmarks/nnx_bench.py",
        "--rounds",
        "3",
        "--trial-seconds",
        "0.02",
        "--dropout",
        "0.1",
        timeout=300,
    )
    for key in ("functional", "functional_leaves", "pztrain", "nnx_optimizer"):
        assert f"\n{key} " in out
    assert "pztrain / functional_leaves" in out


def test_population_benchmark_quick_mode_completes():
    out = _run("benchmarks/population_bench.py", "--quick", timeout=300)
    for section in ("W0 K=16", "W0 K=64", "W1 K=16", "fit W0 K=16"):
        assert f"### {section}:" in out
    for column in ("K separate pztrain runs", "pztrain population", "pztrain.fit"):
        assert f"| {column} |" in out
    assert "| minimal hand-written jit(vmap): no counter, no keys |" in out
    assert "### Memory of the population step" in out
    assert "### Targets" in out and "population / separate" in out
    assert "population / hand_min" in out


def test_population_cpu_benchmark_completes():
    args = ("W0", "4", "--rounds", "4", "--calls", "3")
    out = _run("benchmarks/population_cpu.py", *args, timeout=300)
    for column in ("hand_min", "population", "population_no_aux"):
        assert f"| {column} |" in out


def test_lora_benchmark_quick_mode_completes():
    out = _run("benchmarks/lora_bench.py", "--quick", timeout=900)
    assert "adapters' optimizer state / full's" in out
    assert "bytes read by load_pretrained" in out
    assert "LoRA step, pztrain / hand-written" in out
