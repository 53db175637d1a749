"""The figures the guides state in prose hold.

A figure in a guide is either asserted by one of the page's own code blocks
(``tests/test_docs_snippets.py`` runs them) or checked here; the others are
measured figures that live in ``benchmarks/README.md``, not in the guides.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pztrain

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"


def _says(page: str, text: str) -> None:
    prose = re.sub(r"\s+", " ", (GUIDES / page).read_text())
    assert text in prose, (
        f"docs/guides/{page} no longer says {text!r}: update this test"
    )


def test_progress_bar_is_paced_every_fifth_of_a_second():
    _says("fit.md", "paced about every 0.2 s")
    seconds = inspect.signature(pztrain.ProgressBar).parameters["seconds"]
    assert seconds.default == 0.2


def test_fit_prefetches_two_batches():
    _says("data.md", "(`fit(..., prefetch=2)`)")
    assert inspect.signature(pztrain.fit).parameters["prefetch"].default == 2


def test_the_bad_input_table_has_over_a_hundred_mistakes():
    _says("checkpoints.md", "one table of over a hundred mistakes")
    source = (ROOT / "tests" / "reliability" / "test_bad_inputs.py").read_text()
    tree = ast.parse(source)
    cases = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "CASES" for t in node.targets)
    )
    assert isinstance(cases, ast.List) and len(cases.elts) > 100, len(cases.elts)


def test_bf16_compute_tracks_f32_within_half_a_percent():
    _says("precision.md", "stay within 0.5% of the float32 run's initial loss")
    source = (ROOT / "tests" / "test_precision.py").read_text()
    assert "assert 0 < gap.max() < 0.005 * f32[0]" in source
    assert "f32, _ = _losses(_mse, _mlp(), 100, batch)" in source  # 100 steps


def test_elastic_restarts_are_the_topologies_the_test_runs():
    _says("stops.md", "1 × 1 and 2 × 1, and one written by 1 × 4 resumes on 2 × 2")
    _says("stops.md", "each within 1e-5 of the uninterrupted run")
    source = (ROOT / "tests" / "test_stops_multiprocess.py").read_text()
    for pair in [
        '(1, 4): copy_run(tmp_path / "2x2"',
        '(1, 1): copy_run(tmp_path / "2x2"',
        '(2, 1): copy_run(tmp_path / "2x2"',
        '(2, 2): copy_run(tmp_path / "1x4"',
    ]:
        assert pair in source, pair
    assert "def assert_close(got: dict, want: dict, atol=1e-5)" in source
