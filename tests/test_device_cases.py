"""The suite's shared subprocess for cases on simulated devices
(``device_cases.py``) reports each case: a failure fails the test that stands
for its file, naming the case; a file none of whose cases ran fails too."""

from __future__ import annotations

import pytest
from device_cases import run_cases

pytestmark = pytest.mark.slow  # a pytest subprocess

CASES = """
import jax


def test_two_devices():
    assert jax.device_count() == 2


def test_fails():
    assert 1 + 1 == 3, "the sum is wrong"
"""


def test_each_case_is_reported_and_a_failure_named(tmp_path):
    cases = tmp_path / "two_cases.py"
    cases.write_text(CASES)
    empty = tmp_path / "empty_cases.py"
    empty.write_text("")
    out = run_cases([str(cases), str(empty)], tmp_path, devices=2)
    two = out[str(cases)]
    assert two.cases["test_two_devices"] is None  # passed, on 2 devices
    assert "the sum is wrong" in two.cases["test_fails"]
    two.check_case("test_two_devices")
    with pytest.raises(AssertionError, match="1 of .*two_cases.py failed"):
        two.check()
    with pytest.raises(AssertionError, match="the sum is wrong"):
        two.check_case("test_fails")
    with pytest.raises(AssertionError, match="test_missing of .* did not run"):
        two.check_case("test_missing")
    with pytest.raises(AssertionError, match="no case of .*empty_cases.py ran"):
        out[str(empty)].check()
