"""`TensorBoardLogger` (the ``tensorboard`` extra: tensorboardX)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pztrain.loggers._protocol import flat_hparams
from pztrain.records import THROUGHPUT_KEYS

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger:
    """Writes TensorBoard event files with tensorboardX (optional extra).

    Scalars are named ``<split>/<metric>``, the throughput ``time/steps_per_sec``
    and ``time/examples_per_sec``. Hyperparameters go to TensorBoard's HParams
    tab, in this run's own event file (no sub-run): nested dicts are flattened
    (``"optimizer/lr"``), values that are not numbers, strings or bools are
    shown as text. At ``close`` the run's metrics are named to the tab, which
    shows the last value of each.

    Args:
      run_dir: The directory for the event files.

    Example:
      >>> import pathlib, tempfile
      >>> with tempfile.TemporaryDirectory() as d:
      ...     log = TensorBoardLogger(d)
      ...     log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      ...     log.close()
      ...     (events,) = pathlib.Path(d).glob("events.out.tfevents.*")
      ...     print(b"train/loss" in events.read_bytes())
      True
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
        self._hparams: dict[str, Any] | None = None
        self._tags: dict[str, None] = {}  # the metric tags, in order

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        from tensorboardX.summary import hparams as hparams_summary

        self._hparams = flat_hparams(hparams)
        _, start, _ = hparams_summary(self._hparams, {})
        self._writer.file_writer.add_summary(start)

    def log_record(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for name, value in record["metrics"].items():
            tag = f"{record['split']}/{name}"
            self._tags[tag] = None
            self._writer.add_scalar(tag, value, global_step=step)
        for key in THROUGHPUT_KEYS:
            if key in record:
                self._writer.add_scalar(f"time/{key}", record[key], global_step=step)

    def close(self) -> None:
        if self._hparams is not None:
            from tensorboardX.summary import hparams as hparams_summary

            experiment, _, end = hparams_summary(self._hparams, dict(self._tags))
            self._writer.file_writer.add_summary(experiment)
            self._writer.file_writer.add_summary(end)
        self._writer.close()
