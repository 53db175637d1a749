"""The combination matrix's 8-device rows (`tests/combination_matrix.py`),
run by ``test_combination_matrix.py`` in the suite's subprocess on 8 simulated
devices (``device_cases.py``: ``XLA_FLAGS`` must be set before jax is imported).
"""

from __future__ import annotations

import jax
import pytest
from combination_matrix import ROWS, row_id
from matrix_runs import run_row

EIGHT = [r for r in ROWS if r["devices"] == "8dev"]


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("row", [pytest.param(r, id=row_id(r)) for r in EIGHT])
def test_row(row, tmp_path):
    run_row(row, tmp_path)
