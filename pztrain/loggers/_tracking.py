"""Loggers to experiment trackers, imported lazily: `MLflowLogger`, `WandbLogger`."""

from __future__ import annotations

import html
import os
import re
import time
from typing import Any

from pztrain.loggers._media import Image, Text, file_stem, key_hash, not_media
from pztrain.loggers._protocol import flat_hparams
from pztrain.records import THROUGHPUT_KEYS, jsonable

__all__ = ["MLflowLogger", "WandbLogger"]


class MLflowLogger:
    """Logs to an MLflow tracking store (optional extra ``mlflow``).

    One MLflow run per `pztrain.fit`: hyperparameters as params (flattened, see
    `flat_hparams`), metrics as ``<split>/<metric>`` at their step, the
    throughput as ``time/steps_per_sec``, ``time/examples_per_sec`` … (see
    `pztrain.records.THROUGHPUT_KEYS`). It
    uses an ``MlflowClient`` of its own, not MLflow's global active run.

    A resumed `pztrain.fit` continues an MLflow run given by ``run_id`` (the
    ``run_id`` of the logger of the run it resumes): its records go on at
    their steps. MLflow keeps every point it was sent, so the steps after the
    checkpoint that the interrupted run had logged are there twice in a
    metric's history, the resumed run's with the later timestamps.

    Args:
      experiment: The experiment's name (created if missing).
      run_name: The run's name (default: MLflow's).
      tracking_uri: Where the store is, e.g. ``"sqlite:///mlflow.db"`` or a
        server's URL (default: MLflow's, from ``MLFLOW_TRACKING_URI``).
      run_id: An existing run to continue (set running again) instead of a
        new one; ``experiment`` and ``run_name`` are then not used.

    Raises:
      ValueError: if ``run_id`` names no run of the store.

    Attributes:
      run_id: The MLflow run's id.

    Example:
      >>> import tempfile, unittest.mock, os; from pztrain.loggers import MLflowLogger
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
        run_id: str | None = None,
    ):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError(
                "MLflowLogger needs mlflow: pip install 'pztrain[mlflow]'."
            ) from None
        self._client = MlflowClient(tracking_uri=tracking_uri)
        if run_id is not None:
            self.run_id = _existing_run(self._client, run_id)
            return
        found = self._client.get_experiment_by_name(experiment)
        exp_id = (
            found.experiment_id
            if found is not None
            else self._client.create_experiment(experiment)
        )
        self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id

    def start_run(self, step: int, *, resumed: bool) -> None:
        """Nothing to prepare: records are logged at their steps, and MLflow
        keeps each point it was sent (`pztrain.fit` calls it at the start)."""

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

    def log_media(self, step: int, media: dict[str, Text | Image]) -> None:
        """Logs each text as an artifact ``media/<key>-<hash>-<step>.txt``
        (``log_text``; a slug and a hash of the key) and each image as
        MLflow's image of ``key`` at ``step`` (``log_image``: the run's Images
        tab, a slider over the steps; other characters than letters, digits,
        ``_-. /`` in the key become ``_``, and the key's hash follows them).

        Raises:
          TypeError: naming the key, for a value that is not `Text` or `Image`.
        """
        for key, value in media.items():
            if isinstance(value, Text):
                file = f"media/{file_stem(key)}-{step}.txt"
                self._client.log_text(self.run_id, value.text, file)
            elif isinstance(value, Image):
                name = _MLFLOW_NOT_IN_KEYS.sub("_", key)  # what MLflow takes
                if name != key:  # another key may become this name: not its images
                    name = f"{name}-{key_hash(key)}"
                pixels = value.to_uint8()
                self._client.log_image(self.run_id, pixels, key=name, step=step)
            else:
                raise not_media("MLflowLogger", key, value)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


_MLFLOW_NOT_IN_KEYS = re.compile(r"[^\w\-. /]")


def _existing_run(client: Any, run_id: str) -> str:
    """``run_id``, its run set running again.

    Raises:
      ValueError: naming the run id if the store has no such run.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as e:
        raise ValueError(
            f"MLflowLogger(run_id={run_id!r}): no such run in {client.tracking_uri} "
            f"({e.message}). Pass the run_id of a run of this tracking store, or "
            "no run_id for a new run."
        ) from None
    client.update_run(run_id, status="RUNNING")
    return run_id


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
      >>> from pztrain.loggers import WandbLogger
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

    def start_run(self, step: int, *, resumed: bool) -> None:
        """Nothing to prepare: records are logged at their steps (`pztrain.fit`
        calls it at the start)."""

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self.run.config.update(jsonable(hparams))

    def log_record(self, record: dict[str, Any]) -> None:
        values = {f"{record['split']}/{k}": v for k, v in record["metrics"].items()}
        for key in THROUGHPUT_KEYS:
            if key in record:
                values[f"time/{key}"] = record[key]
        self.run.log(values, step=record["step"])

    def log_media(self, step: int, media: dict[str, Text | Image]) -> None:
        """Logs each text as ``wandb.Html`` (preformatted) and each image as
        ``wandb.Image``, under its key at ``step``.

        Raises:
          TypeError: naming the key, for a value that is not `Text` or `Image`.
        """
        import wandb

        values: dict[str, Any] = {}
        for key, value in media.items():
            if isinstance(value, Text):
                page = f"<pre>{html.escape(value.text)}</pre>"
                values[key] = wandb.Html(page, inject=False, data_is_not_path=True)
            elif isinstance(value, Image):
                values[key] = wandb.Image(value.to_uint8())
            else:
                raise not_media("WandbLogger", key, value)
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
