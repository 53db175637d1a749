"""Sharding rules, sharded init, mesh train steps and the loop's APIs on
meshes, on 8 simulated devices.

The cases live in ``mesh_cases.py``, ``explicit_mesh_cases.py`` and
``explicit_api_cases.py``: the device count must be set before jax is imported,
so they run in a pytest subprocess with ``XLA_FLAGS``, shared with the suite's
other 8-device cases (``device_cases.py``)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

CASES = ["mesh_cases.py", "explicit_mesh_cases.py", "explicit_api_cases.py"]


@pytest.mark.parametrize(
    "cases", [pytest.param(c, marks=pytest.mark.eight_devices(c)) for c in CASES]
)
def test_mesh_cases_on_eight_devices(cases, eight_device_cases):
    assert eight_device_cases.file == cases
    eight_device_cases.check()
