"""`CSVLogger`: a wide table of the records, rewritten atomically when a
record brings a new metric or a resumed run cuts it back."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from pztrain.loggers._files import (
    beside_log,
    kept_entries,
    log_file,
    not_a_log,
    replace_atomically,
)
from pztrain.loggers._protocol import flat_hparams
from pztrain.records import THROUGHPUT_KEYS, jsonable

__all__ = ["CSVLogger"]

_CSV_FIRST = ("step", "epoch", "split", "time", *THROUGHPUT_KEYS)


class CSVLogger:
    """Writes ``metrics.csv`` (one row per record) and ``hparams.csv``.

    Wide format, as spreadsheets and pandas expect: the columns are ``step``,
    ``epoch``, ``split``, ``time``, the throughput
    (`pztrain.records.THROUGHPUT_KEYS`), then each metric in the order it first
    appeared; a train and an eval metric of one name share a column (``split`` tells
    the rows apart), and a cell a record has no value for is empty. When a record
    brings a new metric, the whole file is rewritten atomically with the wider
    header (a new file, flushed, renamed over the old one); otherwise a row is
    appended. A resumed run's log goes on as `JsonlLogger` 's does: the rows
    after the step it resumes from are dropped, another run's rows refused.

    Args:
      run_dir: A directory (created if missing; ``metrics.csv`` is written in
        it) or a file name ending in ``.csv``. The hyperparameters go beside
        it: ``hparams.csv``, or ``<name>.hparams.csv`` for a file named
        otherwise than ``metrics.csv``.
      resume_step: If given, the log is opened at once, keeping only the rows
        with ``step <= resume_step`` (a run resumed from that step); otherwise
        at `start_run` (`pztrain.fit` calls it) or at the first record.

    Attributes:
      path: The log file.
      run_dir: Its directory.
      hparams_path: Where the hyperparameters go.

    Raises:
      ValueError: if ``run_dir`` is a file of another kind (named), or the log
        holds rows after ``resume_step``.

    Example:
      >>> import tempfile, pathlib; from pztrain.loggers import CSVLogger
      >>> d = tempfile.mkdtemp()
      >>> log = CSVLogger(d)
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      >>> log.log_record({"step": 1, "split": "eval", "metrics": {"acc": 0.9}})
      >>> log.close()
      >>> lines = pathlib.Path(d, "metrics.csv").read_text().splitlines()
      >>> lines[0].split(",")[:5], lines[0].split(",")[-2:]
      (['step', 'epoch', 'split', 'time', 'steps_per_sec'], ['loss', 'acc'])
      >>> lines[1:]
      ['1,,train,,,,,,,0.5,', '1,,eval,,,,,,,,0.9']
      >>> CSVLogger(d + "/metrics.csv").path == log.path  # a file name: that file
      True
    """

    def __init__(
        self, run_dir: str | os.PathLike, *, resume_step: int | None = None
    ) -> None:
        self.path = log_file(run_dir, "metrics.csv", "CSVLogger")
        self.run_dir = self.path.parent
        self.hparams_path = beside_log(self.path, "metrics.csv", "hparams.csv")
        self._columns: list[str] = list(_CSV_FIRST)
        self._rows: list[dict[str, Any]] = []
        self._started = self._written = False
        if resume_step is not None:
            self.start_run(resume_step, resumed=True)
            self._open()

    def start_run(self, step: int, *, resumed: bool) -> None:
        """Starts the log of a run that starts at ``step``: the rows after it
        dropped if ``resumed``, else refused (see `JsonlLogger.start_run`);
        the file is rewritten at the first record or hyperparameters.

        Raises:
          ValueError: the log holds rows after ``step`` and ``resumed`` is
            false, or the file is not such a log (nothing is written then).
        """
        columns, rows = list(_CSV_FIRST), []
        if self.path.exists():
            columns, rows = self._read()
        self._rows = kept_entries(self.path, rows, step, resumed, "rows")
        self._columns, self._started, self._written = columns, True, False

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self._open()
        rows = [{"name": k, "value": v} for k, v in flat_hparams(hparams).items()]
        text = io.StringIO()
        writer = csv.DictWriter(text, ["name", "value"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        replace_atomically(self.hparams_path, text.getvalue())

    def log_record(self, record: dict[str, Any]) -> None:
        self._open()
        row = {k: record[k] for k in _CSV_FIRST if k in record}
        row.update(jsonable(record["metrics"]))
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        if new:
            self._columns += new
            self._rewrite()
            return
        with self.path.open("a", newline="") as f:
            self._writer(f).writerow(row)

    def _open(self) -> None:
        """The file as the run starts it (a fresh log if `start_run` was not
        called), written once."""
        if not self._started:
            self.start_run(0, resumed=False)
        if not self._written:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._rewrite()
            self._written = True

    def close(self) -> None:
        """Nothing to release: each record is written when logged."""

    def _read(self) -> tuple[list[str], list[dict[str, Any]]]:
        """The file's columns and rows (steps as numbers)."""
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or _CSV_FIRST)
        if "step" not in columns:
            why = f"its header {columns[:4]} has no 'step' column"
            raise not_a_log(self.path, "CSVLogger", why)
        for i, row in enumerate(rows):
            try:
                row["step"] = int(row["step"])
            except (TypeError, ValueError):
                why = f"row {i + 1} has step {row['step']!r}"
                raise not_a_log(self.path, "CSVLogger", why) from None
        return columns, rows

    def _writer(self, f: Any) -> csv.DictWriter:
        return csv.DictWriter(f, self._columns, lineterminator="\n")

    def _rewrite(self) -> None:
        text = io.StringIO()
        writer = self._writer(text)
        writer.writeheader()
        writer.writerows(self._rows)
        replace_atomically(self.path, text.getvalue())
