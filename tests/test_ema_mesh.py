"""EMA and grad norms on 8 simulated devices: the cases live in
``ema_mesh_cases.py``, run in a pytest subprocess with ``XLA_FLAGS``, shared
with the suite's other 8-device cases (``device_cases.py``)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # a subprocess with 8 devices


@pytest.mark.eight_devices("ema_mesh_cases.py")
def test_ema_mesh_cases_on_eight_devices(eight_device_cases):
    eight_device_cases.check(passed=4)
