"""Loggers for `pztrain.fit`: a protocol of three methods, and two built-ins.

A logger receives records (see `pztrain.callbacks.Callback`) at log and eval
points only, already on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pztrain.records import jsonable

__all__ = ["JsonlLogger", "Logger", "TensorBoardLogger", "read_jsonl"]


@runtime_checkable
class Logger(Protocol):
    """What `pztrain.fit` calls on each logger."""

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """Records the run's hyperparameters (called once, at the start)."""

    def log_record(self, record: dict[str, Any]) -> None:
        """Records one log or eval point."""

    def close(self) -> None:
        """Flushes and releases files (called once, at the end)."""


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


def read_jsonl(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads the records a `JsonlLogger` wrote.

    A last line cut short (a run killed while writing it) is not a record and
    is left out; any other line that is not JSON is an error.
    """
    path = Path(run_dir) / "metrics.jsonl"
    text = path.read_text()
    lines = text.split("\n")
    complete, last = lines[:-1], lines[-1]  # ``last`` lacks its newline
    records = [json.loads(line) for line in complete if line]
    with contextlib.suppress(ValueError):
        records += [json.loads(last)] if last else []
    return records


class TensorBoardLogger:
    """Writes TensorBoard event files with tensorboardX (optional extra).

    Scalars are named ``<split>/<metric>``; hyperparameters are written once as
    text (``hparams``), which TensorBoard shows without a plugin.

    Args:
      run_dir: The directory for the event files.
    """

    def __init__(self, run_dir: str | os.PathLike):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(
                "TensorBoardLogger needs tensorboardX: pip install "
                "'pztrain[tensorboard]'."
            ) from None
        self.run_dir = Path(run_dir)
        self._writer = SummaryWriter(logdir=str(self.run_dir))

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        text = json.dumps(jsonable(hparams), indent=2, sort_keys=True)
        self._writer.add_text("hparams", f"```\n{text}\n```", global_step=0)

    def log_record(self, record: dict[str, Any]) -> None:
        for name, value in record["metrics"].items():
            self._writer.add_scalar(
                f"{record['split']}/{name}", value, global_step=record["step"]
            )

    def close(self) -> None:
        self._writer.close()
