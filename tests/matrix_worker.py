"""Runs combination-matrix rows on 8 simulated devices, for
``test_combination_matrix.py`` (``XLA_FLAGS`` must be set before jax is imported).

``python matrix_worker.py OUT.json ROW_ID ...`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: writes
``{row_id: "ok" or the traceback}``.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import jax
from combination_matrix import ROWS, row_id
from matrix_runs import run_row

jax.config.update("jax_numpy_rank_promotion", "raise")
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # as conftest.py does
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(out: str, ids: list[str]) -> None:
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"
    rows = {row_id(r): r for r in ROWS}
    results = {}
    for name in ids:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                run_row(rows[name], Path(tmp))
                results[name] = "ok"
            except BaseException:  # noqa: BLE001  reported to the test, row by row
                results[name] = traceback.format_exc()
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
