"""The examples run end to end on the bundled digits data (reduced size)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_functional_loop_learns_digits():
    accuracy = _load("functional_loop").main(epochs=3)
    assert accuracy > 0.85


def test_digits_example_with_fit(tmp_path):
    # The main job as README runs it (its default epochs): README says the test
    # accuracy is above 0.97.
    accuracy = _load("digits").main(run_dir=str(tmp_path / "run"), progress=False)
    assert accuracy > 0.97
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"eval"') >= 4


def test_nnx_digits_example_trains_evaluates_and_reloads(tmp_path, capsys):
    accuracy = _load("nnx_digits").main(
        epochs=3, run_dir=str(tmp_path / "run"), progress=False, compare=False
    )
    assert accuracy > 0.9
    out = capsys.readouterr().out
    assert "state (BatchStat)" in out and "state (RngKey)" in out
    reloaded = float(
        out.split("reloaded into a fresh CNN: test accuracy")[1].split()[0]
    )
    assert abs(reloaded - accuracy) < 1e-3  # batch statistics came back


def test_many_devices_example_on_eight_simulated_devices():
    """The example sets XLA_FLAGS before jax is imported: a subprocess."""
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "many_devices.py", "--epochs", "3"],
        cwd=EXAMPLES,
        env=dict(os.environ, PYTHONPATH=str(EXAMPLES.parent)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 8 devices" in result.stdout
    assert "P(None, 'model')" in result.stdout  # the penzai axis rule applied
    accuracy = float(result.stdout.split("test accuracy")[-1])
    assert accuracy > 0.9
