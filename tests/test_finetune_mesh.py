"""Weights in on 8 simulated devices: the cases live in
``finetune_mesh_cases.py``, run with the suite's other 8-device cases in one
pytest subprocess (``tests/device_cases.py``)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # a subprocess on 8 devices


@pytest.mark.eight_devices("finetune_mesh_cases.py")
def test_finetune_mesh_cases_on_eight_devices(eight_device_cases):
    eight_device_cases.check(passed=3)
