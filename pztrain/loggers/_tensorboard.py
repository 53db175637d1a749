"""`TensorBoardLogger` (the ``tensorboard`` extra: tensorboardX)."""

from __future__ import annotations

import os
import time
from typing import Any

from pztrain.loggers._files import log_directory
from pztrain.loggers._media import Image, Text, not_media
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
    shows the last value of each. Text and images (`log_media`) go to the
    Text and Images tabs, under their names.

    A resumed run goes on in a new event file of the same directory that
    supersedes the steps after the one it resumes from: `start_run` (which
    `pztrain.fit` calls) writes TensorBoard's restart marker (a ``SessionLog``
    ``START`` at the next step), and TensorBoard drops the older events from
    that step on, so each step shows the values of the run that went on.

    Args:
      run_dir: The directory for the event files (created if missing; not a
        file, nor a name ending in ``.csv``, ``.jsonl`` or ``.json``).

    Raises:
      ValueError: if ``run_dir`` is a file or has a log file's suffix.

    Example:
      >>> import pathlib, tempfile; from pztrain import TensorBoardLogger
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
            import tensorboardX  # noqa: F401 - checked here, used when writing
        except ImportError:
            raise ImportError(
                "TensorBoardLogger needs tensorboardX: pip install "
                "'pztrain[tensorboard]'."
            ) from None
        self.run_dir = log_directory(run_dir, "TensorBoardLogger")
        self._writer: Any = None  # made at the first event
        self._purge_step: int | None = None
        self._hparams: dict[str, Any] | None = None
        self._tags: dict[str, None] = {}  # the metric tags, in order

    def start_run(self, step: int, *, resumed: bool) -> None:
        """Starts a run at ``step``: if ``resumed``, its events supersede the
        ones after ``step`` (`pztrain.fit` calls it before the first record).
        """
        self.close()
        self._purge_step = step + 1 if resumed else None
        self._hparams, self._tags = None, {}

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        from tensorboardX.summary import hparams as hparams_summary

        self._hparams = flat_hparams(hparams)
        _, start, _ = hparams_summary(self._hparams, {})
        self._events().file_writer.add_summary(start)

    def log_record(self, record: dict[str, Any]) -> None:
        step, writer = record["step"], self._events()
        for name, value in record["metrics"].items():
            tag = f"{record['split']}/{name}"
            self._tags[tag] = None
            writer.add_scalar(tag, value, global_step=step)
        for key in THROUGHPUT_KEYS:
            if key in record:
                writer.add_scalar(f"time/{key}", record[key], global_step=step)

    def log_media(self, step: int, media: dict[str, Text | Image]) -> None:
        """Writes each text (``add_text``) and image (``add_image``) at ``step``.

        Raises:
          TypeError: naming the key, for a value that is not `Text` or `Image`.
        """
        writer = self._events()
        for key, value in media.items():
            if isinstance(value, Text):
                writer.add_text(key, value.text, global_step=step)
            elif isinstance(value, Image):
                pixels = value.to_uint8()
                formats = "HW" if pixels.ndim == 2 else "HWC"
                writer.add_image(key, pixels, global_step=step, dataformats=formats)
            else:
                raise not_media("TensorBoardLogger", key, value)

    def close(self) -> None:
        if self._hparams is not None:
            from tensorboardX.summary import hparams as hparams_summary

            experiment, _, end = hparams_summary(self._hparams, dict(self._tags))
            self._events().file_writer.add_summary(experiment)
            self._events().file_writer.add_summary(end)
            self._hparams = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _events(self) -> Any:
        """The ``SummaryWriter`` (a new event file after `start_run` or `close`)."""
        if self._writer is None:
            from tensorboardX import SummaryWriter

            # tensorboardX names a file by the second (and truncates a file of
            # that name): the nanoseconds keep two files of one second apart,
            # in the order they were made
            self._writer = SummaryWriter(
                logdir=str(self.run_dir),
                purge_step=self._purge_step,
                filename_suffix=f".{time.time_ns() % 10**9:09d}",
            )
        return self._writer
