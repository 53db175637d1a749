"""EMA and grad norms on 8 simulated devices: the cases live in
``ema_mesh_cases.py``, run in a pytest subprocess with ``XLA_FLAGS``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess with 8 devices

ROOT = Path(__file__).resolve().parents[1]


def test_ema_mesh_cases_on_eight_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "ema_mesh_cases.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "4 passed" in result.stdout and "failed" not in result.stdout
