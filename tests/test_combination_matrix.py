"""The combination matrix (DESIGN.md contract 9, "features meet"): runs over
the axes of `tests/combination_matrix.py` with every pair of values in at least
one row, each checked against what the guides promise (`tests/matrix_runs.py`).

A few rows run in the fast subset; every row runs in the full one. The
8-device rows (``matrix_eight_cases.py``) run in a subprocess (``XLA_FLAGS``
before jax is imported), with the suite's other 8-device cases.
"""

from __future__ import annotations

import pytest
from combination_matrix import (
    AXES,
    FAST,
    JOB_AXES,
    JOB_ROWS,
    ROWS,
    all_pairs,
    allowed,
    pairs_of,
    required_pairs,
    row_id,
)
from matrix_runs import run_job_row, run_row

ONE = [r for r in ROWS if r["devices"] == "1dev"]
EIGHT = [r for r in ROWS if r["devices"] == "8dev"]


def _param(row):
    marks = () if row_id(row) in FAST else (pytest.mark.slow,)
    return pytest.param(row, id=row_id(row), marks=marks)


@pytest.mark.parametrize("axes", [AXES, JOB_AXES], ids=["matrix", "evaluation_job"])
def test_rows_cover_every_pair_and_honour_the_constraints(axes):
    rows = all_pairs(axes)
    assert rows == all_pairs(axes)  # deterministic
    assert pairs_of(rows, list(axes)) >= required_pairs(axes)
    assert all(allowed(r) for r in rows)
    assert all(set(r) == set(axes) and r[a] in axes[a] for r in rows for a in r)
    assert len(rows) < _product(axes) / 3  # pairs, not the whole product


def test_a_constraint_is_honoured_and_its_pairs_still_covered():
    rows = [r for r in ROWS if r["data"] == "permember"]
    assert rows and all(r["members"] == "pop" for r in rows)
    assert (("data", "permember"), ("members", "solo")) not in required_pairs(AXES)
    ids = {row_id(r) for r in ROWS}
    assert len(ids) == len(ROWS) and len(FAST) <= 6 and FAST <= ids


def _product(axes):
    n = 1
    for values in axes.values():
        n *= len(values)
    return n


@pytest.mark.parametrize("row", [_param(r) for r in ONE])
def test_row(row, tmp_path):
    run_row(row, tmp_path)


@pytest.mark.slow
@pytest.mark.eight_devices("matrix_eight_cases.py")
@pytest.mark.parametrize("row", [pytest.param(r, id=row_id(r)) for r in EIGHT])
def test_row_on_eight_devices(row, eight_device_cases):
    eight_device_cases.check_case(f"test_row[{row_id(row)}]")


@pytest.mark.slow
@pytest.mark.parametrize("row", [pytest.param(r, id=row_id(r)) for r in JOB_ROWS])
def test_evaluation_job_row(row, tmp_path):
    run_job_row(row, tmp_path)
