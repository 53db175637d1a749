"""Loggers that write files in the run directory: `JsonlLogger` and `CSVLogger`."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from pztrain.loggers._protocol import flat_hparams
from pztrain.records import THROUGHPUT_KEYS, jsonable, read_jsonl

__all__ = ["CSVLogger", "JsonlLogger"]


class JsonlLogger:
    """Writes ``metrics.jsonl`` (one JSON object per record) and ``hparams.json``.

    Appending is safe across resumed runs: records after ``resume_step`` (the
    step the run resumes from) are dropped from the file first, so a resumed run
    neither repeats nor skips a step. The file is rewritten atomically (a new
    file, flushed to disk, renamed over the old one): a run killed meanwhile
    leaves the old records or the new ones, never an empty file. Without
    ``resume_step``, a file that holds records is refused: another run's log
    is never mixed with this one's or cut.

    Args:
      run_dir: The directory (created if missing).
      resume_step: If given, keep only records with ``step <= resume_step``.
      drop_later: Whether the records after ``resume_step`` may be dropped (a
        run resumed from a checkpoint redoes them); if not, they are refused.

    Raises:
      ValueError: if ``metrics.jsonl`` holds records after ``resume_step`` (any,
        if it is ``None``) and they may not be dropped.

    Example:
      >>> import tempfile
      >>> d = tempfile.mkdtemp()
      >>> log = JsonlLogger(d)
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      >>> log.close()
      >>> read_jsonl(d)[0]["metrics"]
      {'loss': 0.5}
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        resume_step: int | None = None,
        drop_later: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if self.path.exists():
            records = read_jsonl(self.run_dir)
            later = [r for r in records if r["step"] > (resume_step or 0)]
            if later and (resume_step is None or not drop_later):
                raise ValueError(
                    f"{self.path} holds another run's log ({len(records)} records, "
                    f"up to step {records[-1]['step']}). Continue that run (fit(..., "
                    "resume=True) with its checkpoints), choose a new run_dir, or "
                    "move the file away."
                )
            kept = [r for r in records if r["step"] <= (resume_step or 0)]
            _replace_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        (self.run_dir / "hparams.json").write_text(
            json.dumps(jsonable(hparams), indent=2, sort_keys=True)
        )

    def log_record(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(jsonable(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _replace_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to a new file, flushes it to disk, renames it to ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    appended.

    Args:
      run_dir: The directory (created if missing).
      resume_step: If given, keep only rows with ``step <= resume_step`` of an
        existing ``metrics.csv`` (a run resumed from that step); without it, a
        file holding rows is refused.

    Raises:
      ValueError: if ``metrics.csv`` holds rows after ``resume_step`` (any, if
        it is ``None``).

    Example:
      >>> import tempfile, pathlib
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
    """

    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.csv"
        self._columns, self._rows = list(_CSV_FIRST), []
        if self.path.exists():
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                rows = list(reader)
                self._columns = list(reader.fieldnames or _CSV_FIRST)
            later = [r for r in rows if int(r["step"]) > (resume_step or 0)]
            if later and resume_step is None:
                raise ValueError(
                    f"{self.path} holds another run's log ({len(rows)} rows); pass "
                    "resume_step to continue it, choose a new run_dir, or move the "
                    "file away."
                )
            self._rows = [r for r in rows if int(r["step"]) <= (resume_step or 0)]
        self._rewrite()

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        rows = [{"name": k, "value": v} for k, v in flat_hparams(hparams).items()]
        text = io.StringIO()
        writer = csv.DictWriter(text, ["name", "value"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        _replace_atomically(self.run_dir / "hparams.csv", text.getvalue())

    def log_record(self, record: dict[str, Any]) -> None:
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

    def close(self) -> None:
        """Nothing to release: each record is written when logged."""

    def _writer(self, f: Any) -> csv.DictWriter:
        return csv.DictWriter(f, self._columns, lineterminator="\n")

    def _rewrite(self) -> None:
        text = io.StringIO()
        writer = self._writer(text)
        writer.writeheader()
        writer.writerows(self._rows)
        _replace_atomically(self.path, text.getvalue())
