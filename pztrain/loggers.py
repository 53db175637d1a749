"""Loggers for `pztrain.fit`: a protocol of three methods, and the built-ins.

A logger receives records (see `pztrain.callbacks.Callback`) at log and eval
points only, already on the host.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pztrain.records import THROUGHPUT_KEYS, jsonable, read_jsonl

__all__ = [
    "CSVLogger",
    "JsonlLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "flat_hparams",
    "read_jsonl",
]


@runtime_checkable
class Logger(Protocol):
    """What `pztrain.fit` calls on each logger.

    Example:
      >>> class PrintLogger:  # any object with the three methods: fit(loggers=[...])
      ...     def log_hparams(self, hparams): print("hparams", hparams)
      ...     def log_record(self, record): print(record["step"], record["metrics"])
      ...     def close(self): pass
      >>> isinstance(PrintLogger(), Logger)
      True
      >>> PrintLogger().log_record({"step": 10, "metrics": {"loss": 0.5}})
      10 {'loss': 0.5}
    """

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


def flat_hparams(hparams: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Hyperparameters as one flat dict of numbers, strings and bools.

    Nested dicts become ``"outer/inner"`` keys; other values (lists, ``None``,
    objects) become their JSON text.

    Example:
      >>> flat_hparams({"opt": {"lr": 0.1, "b": (0.9, 0.99)}, "seed": None})
      {'opt/lr': 0.1, 'opt/b': '[0.9, 0.99]', 'seed': 'null'}
    """
    flat: dict[str, Any] = {}
    for key, value in jsonable(hparams).items():
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{prefix}{key}/"))
        elif isinstance(value, bool | int | float | str):
            flat[prefix + key] = value
        else:
            flat[prefix + key] = json.dumps(value)
    return flat


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


class MLflowLogger:
    """Logs to an MLflow tracking store (optional extra ``mlflow``).

    One MLflow run per `pztrain.fit`: hyperparameters as params (flattened, see
    `flat_hparams`), metrics as ``<split>/<metric>`` at their step, the
    throughput as ``time/steps_per_sec``, ``time/examples_per_sec`` … (see
    `pztrain.records.THROUGHPUT_KEYS`). It
    uses an ``MlflowClient`` of its own, not MLflow's global active run.

    Args:
      experiment: The experiment's name (created if missing).
      run_name: The run's name (default: MLflow's).
      tracking_uri: Where the store is, e.g. ``"sqlite:///mlflow.db"`` or a
        server's URL (default: MLflow's, from ``MLFLOW_TRACKING_URI``).

    Attributes:
      run_id: The MLflow run's id.

    Example:
      >>> import tempfile, unittest.mock
      >>> from mlflow.tracking import MlflowClient
      >>> with (tempfile.TemporaryDirectory() as d,  # a local store, if allowed:
      ...       unittest.mock.patch.dict(os.environ, MLFLOW_ALLOW_FILE_STORE="1")):
      ...     uri = f"file://{d}/mlruns"
      ...     log = MLflowLogger("demo", tracking_uri=uri)
      ...     log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      ...     log.close()
      ...     print(MlflowClient(uri).get_run(log.run_id).data.metrics)
      {'train/loss': 0.5}
    """

    def __init__(
        self,
        experiment: str = "pztrain",
        *,
        run_name: str | None = None,
        tracking_uri: str | None = None,
    ):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError(
                "MLflowLogger needs mlflow: pip install 'pztrain[mlflow]'."
            ) from None
        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        exp_id = (
            found.experiment_id
            if found is not None
            else self._client.create_experiment(experiment)
        )
        self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in flat_hparams(hparams).items()]
        self._client.log_batch(self.run_id, params=params)

    def log_record(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        values = {f"{record['split']}/{k}": v for k, v in record["metrics"].items()}
        for key in THROUGHPUT_KEYS:
            if key in record:
                values[f"time/{key}"] = record[key]
        ms, step = int(time.time() * 1000), record["step"]
        metrics = [Metric(k, float(v), ms, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class WandbLogger:
    """Logs to Weights & Biases (optional extra ``wandb``), online or offline.

    One W&B run per `pztrain.fit`, held by this logger (``reinit="create_new"``:
    not W&B's global run): hyperparameters as the run's config, metrics as
    ``<split>/<metric>`` at their step, the throughput as ``time/steps_per_sec``
    and ``time/examples_per_sec``. ``mode="offline"`` writes the run under
    ``dir`` for a later ``wandb sync``.

    Args:
      project: The W&B project.
      name: The run's name (default: W&B's).
      dir: The directory for W&B's files (default: W&B's, ``./wandb``).
      mode: ``"online"``, ``"offline"`` or ``"disabled"`` (default: W&B's).
      **init_kwargs: Passed to ``wandb.init`` (e.g. ``tags``, ``group``).

    Attributes:
      run: The ``wandb.Run``.

    Example:
      >>> log = WandbLogger("demo", mode="disabled")  # nothing written or sent
      >>> log.log_hparams({"lr": 0.1})
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      >>> log.run.config["lr"], log.run.summary["train/loss"]
      (0.1, 0.5)
      >>> log.close()
    """

    def __init__(
        self,
        project: str = "pztrain",
        *,
        name: str | None = None,
        dir: str | os.PathLike | None = None,
        mode: str | None = None,
        **init_kwargs: Any,
    ):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "WandbLogger needs wandb: pip install 'pztrain[wandb]'."
            ) from None
        self.run = wandb.init(
            project=project,
            name=name,
            dir=None if dir is None else str(dir),
            mode=mode,
            reinit="create_new",
            **init_kwargs,
        )

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self.run.config.update(jsonable(hparams))

    def log_record(self, record: dict[str, Any]) -> None:
        values = {f"{record['split']}/{k}": v for k, v in record["metrics"].items()}
        for key in THROUGHPUT_KEYS:
            if key in record:
                values[f"time/{key}"] = record[key]
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()
