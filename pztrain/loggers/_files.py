"""Loggers that write files: `JsonlLogger` and `CSVLogger`, and the rules of
their paths (`log_file`, `log_directory`).

A file logger takes a directory (its file gets the default name there:
``metrics.jsonl``, ``metrics.csv``) or a file name with its suffix; its
hyperparameters go beside the file. The file is opened when the run starts
(`start_run`, which `pztrain.fit` calls with the step it starts from), or at the
first record: a log that holds records after that step is cut back to it for a
resumed run, and refused otherwise (another run's log is never mixed with this
one's or cut). Every rewrite is atomic: a new file, flushed to disk, renamed
over the old one.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from pztrain.loggers._protocol import flat_hparams
from pztrain.records import THROUGHPUT_KEYS, jsonable

__all__ = ["CSVLogger", "JsonlLogger", "log_directory", "log_file"]

_LOG_SUFFIXES = (".csv", ".jsonl", ".json")  # never made into directories


def log_file(path: str | os.PathLike, name: str, who: str) -> Path:
    """The file a logger given ``path`` writes: ``path`` itself if it ends in
    the suffix of ``name`` (the default file name), else ``path / name``.

    Raises:
      ValueError: naming ``path`` and what to pass instead, if it is a file of
        another kind, or ends in another log suffix, or if the file to write is
        a directory. Nothing has been written then.

    Example:
      >>> log_file("run", "metrics.csv", "CSVLogger").as_posix()
      'run/metrics.csv'
      >>> log_file("run/train.csv", "metrics.csv", "CSVLogger").as_posix()
      'run/train.csv'
    """
    path, suffix = Path(path), Path(name).suffix
    file = path if path.suffix == suffix else log_directory(path, who, name) / name
    if file.is_dir():
        raise ValueError(
            f"{who}({str(path)!r}): {file} is a directory, not a {suffix} file. "
            "Remove or rename it, or pass another path."
        )
    return file


def log_directory(path: str | os.PathLike, who: str, name: str | None = None) -> Path:
    """``path`` as the directory of a logger's files (``name``: its default
    file name, if it also takes one).

    Raises:
      ValueError: if ``path`` is a file, or ends in a log file's suffix
        (``.csv``, ``.jsonl``, ``.json``): no directory gets such a name.
    """
    path = Path(path)
    takes = (
        "a directory"
        if name is None
        else f"a directory ({name} is written in it) or a file name ending in "
        f"{Path(name).suffix}"
    )
    if path.suffix in _LOG_SUFFIXES:
        raise ValueError(
            f"{who}({str(path)!r}): {path.name!r} names a {path.suffix} file, but "
            f"{who} takes {takes}."
        )
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{who}({str(path)!r}): {path} is a file, not a directory; {who} "
            f"takes {takes}."
        )
    return path


def _beside(file: Path, default: str, name: str) -> Path:
    """Where a log's hyperparameters go: ``name`` beside the log if it has the
    ``default`` name, else ``<log's stem>.<name>``."""
    return file.with_name(name if file.name == default else f"{file.stem}.{name}")


def _kept(path: Path, entries: list[dict], step: int, resumed: bool, kind: str):
    """The entries of a log up to ``step``; later ones only if ``resumed``.

    Raises:
      ValueError: the log holds entries after ``step`` and the run does not
        resume (another run's log), naming the file and what to do.
    """
    if not resumed and any(e["step"] > step for e in entries):
        raise ValueError(
            f"{path} holds another run's log ({len(entries)} {kind}, up to step "
            f"{max(e['step'] for e in entries)}). Continue that run (fit(..., "
            "resume=True) with its checkpoints), pass another path, or move the "
            "file away."
        )
    return [e for e in entries if e["step"] <= step]


def _not_a_log(path: Path, who: str, why: str) -> ValueError:
    return ValueError(
        f"{path} is not a log that {who} writes ({why}). Pass another path, or "
        "move the file away."
    )


class JsonlLogger:
    """Writes ``metrics.jsonl`` (one JSON object per record) and ``hparams.json``.

    Continues a resumed run's log: `pztrain.fit` calls `start_run` with the step it
    starts from, and the records after it are dropped from the file when the
    run resumes from a checkpoint (it redoes them), so a resumed run neither
    repeats nor skips a step. A log that holds records after the start step is
    refused otherwise: another run's log is never mixed with this one's or cut.
    The file is rewritten atomically (a new file, flushed to disk, renamed over
    the old one): a run killed meanwhile leaves the old records or the new
    ones, never an empty file.

    Args:
      run_dir: A directory (created if missing; ``metrics.jsonl`` is written
        in it) or a file name ending in ``.jsonl``. The hyperparameters go beside
        it: ``hparams.json``, or ``<name>.hparams.json`` for a file named
        otherwise than ``metrics.jsonl``.
      resume_step: If given, the log is opened at once, keeping only records
        with ``step <= resume_step`` (``start_run(resume_step, resumed=drop_later)``);
        otherwise at `start_run` or at the first record.
      drop_later: Whether the records after ``resume_step`` may be dropped (a
        run resumed from a checkpoint redoes them); if not, they are refused.

    Attributes:
      path: The log file.
      run_dir: Its directory.
      hparams_path: Where the hyperparameters go.

    Raises:
      ValueError: if ``run_dir`` is a file of another kind (named), or the log
        holds records after ``resume_step`` that may not be dropped.

    Example:
      >>> import tempfile
      >>> from pztrain.loggers import read_jsonl
      >>> d = tempfile.mkdtemp()
      >>> log = JsonlLogger(d)
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      >>> log.close()
      >>> read_jsonl(d)[0]["metrics"]
      {'loss': 0.5}
      >>> log.start_run(0, resumed=True)  # a run resumed from step 0 redoes 1
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.25}})
      >>> log.close()
      >>> [r["metrics"] for r in read_jsonl(d)]
      [{'loss': 0.25}]
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        resume_step: int | None = None,
        drop_later: bool = True,
    ):
        self.path = log_file(run_dir, "metrics.jsonl", "JsonlLogger")
        self.run_dir = self.path.parent
        self.hparams_path = _beside(self.path, "metrics.jsonl", "hparams.json")
        self._file: Any = None  # opened at the first record
        self._started, self._kept = False, None
        if resume_step is not None:
            self.start_run(resume_step, resumed=drop_later)
            self._open()

    def start_run(self, step: int, *, resumed: bool) -> None:
        """Starts the log of a run that starts at ``step`` (`pztrain.fit` calls
        it before the first record; without it, the first record starts a
        fresh log, and a record after `close` goes on with the same one).

        The file is checked here and cut back at the first record or
        hyperparameters, so that when a logger of the run refuses its log,
        every file is left as it was.

        Args:
          step: The step the run starts from. Records up to it are kept.
          resumed: Whether the run resumes from its checkpoint at ``step``
            after it went on past it: the records after ``step`` are redone,
            so they are dropped. Otherwise (a fresh run, or ``fit(state, ...)``
            going on from ``state.step``) they are another run's: refused.

        Raises:
          ValueError: the log holds records after ``step`` and ``resumed`` is
            false, or the file is not such a log (nothing is written then).
        """
        self.close()
        self._file, self._kept = None, None
        if self.path.exists():
            self._kept = _kept(self.path, self._read(), step, resumed, "records")
        self._started = True

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self._open()
        self.hparams_path.write_text(
            json.dumps(jsonable(hparams), indent=2, sort_keys=True)
        )

    def log_record(self, record: dict[str, Any]) -> None:
        self._open()
        self._file.write(json.dumps(jsonable(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _open(self) -> None:
        """The file, ready to append to: a fresh log if `start_run` was not
        called, cut back to the start step, or the same again after `close`."""
        if not self._started:
            self.start_run(0, resumed=False)
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._kept is not None:
                text = "".join(json.dumps(r) + "\n" for r in self._kept)
                _replace_atomically(self.path, text)
                self._kept = None
            self._file = self.path.open("a")
        elif self._file.closed:
            self._file = self.path.open("a")

    def _read(self) -> list[dict[str, Any]]:
        """The records of the file (a last line cut short by a kill is none)."""
        *complete, last = self.path.read_text().split("\n")
        records = []
        for i, line in enumerate([*complete, last]):
            try:
                record = json.loads(line) if line else None
            except ValueError as e:
                if i == len(complete):  # the last line, cut short: not a record
                    break
                raise _not_a_log(
                    self.path, "JsonlLogger", f"line {i + 1}: {e}"
                ) from None
            if record is None:
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                why = f"line {i + 1} is no record with an integer 'step'"
                raise _not_a_log(self.path, "JsonlLogger", why)
            records.append(record)
        return records


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
      >>> CSVLogger(d + "/metrics.csv").path == log.path  # a file name: that file
      True
    """

    def __init__(
        self, run_dir: str | os.PathLike, *, resume_step: int | None = None
    ) -> None:
        self.path = log_file(run_dir, "metrics.csv", "CSVLogger")
        self.run_dir = self.path.parent
        self.hparams_path = _beside(self.path, "metrics.csv", "hparams.csv")
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
        self._rows = _kept(self.path, rows, step, resumed, "rows")
        self._columns, self._started, self._written = columns, True, False

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self._open()
        rows = [{"name": k, "value": v} for k, v in flat_hparams(hparams).items()]
        text = io.StringIO()
        writer = csv.DictWriter(text, ["name", "value"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        _replace_atomically(self.hparams_path, text.getvalue())

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
            raise _not_a_log(self.path, "CSVLogger", why)
        for i, row in enumerate(rows):
            try:
                row["step"] = int(row["step"])
            except (TypeError, ValueError):
                why = f"row {i + 1} has step {row['step']!r}"
                raise _not_a_log(self.path, "CSVLogger", why) from None
        return columns, rows

    def _writer(self, f: Any) -> csv.DictWriter:
        return csv.DictWriter(f, self._columns, lineterminator="\n")

    def _rewrite(self) -> None:
        text = io.StringIO()
        writer = self._writer(text)
        writer.writeheader()
        writer.writerows(self._rows)
        _replace_atomically(self.path, text.getvalue())
