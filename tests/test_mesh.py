"""Sharding rules, sharded init, mesh train steps and the loop's APIs on
meshes, on 8 simulated devices.

The cases live in ``mesh_cases.py``, ``explicit_mesh_cases.py`` and
``explicit_api_cases.py``: the device count must be set before jax is imported,
so each file runs in a pytest subprocess with ``XLA_FLAGS``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "cases", ["mesh_cases.py", "explicit_mesh_cases.py", "explicit_api_cases.py"]
)
def test_mesh_cases_on_eight_devices(cases):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / cases),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
