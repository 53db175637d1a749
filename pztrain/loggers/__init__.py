"""Loggers for `pztrain.fit`: a protocol of three methods (and an optional
``start_run``, which continues a resumed run's log), and the built-ins.

A logger receives records (see `pztrain.callbacks.Callback`) at log and eval
points only, already on the host.

* `pztrain.loggers._protocol`: `Logger` and `flat_hparams`;
* `pztrain.loggers._media`: `Text`, `Image`, `split_media` and `log_media`:
  text and images, for the loggers that have ``log_media(step, media)``;
* `pztrain.loggers._files`: `JsonlLogger`, `read_media`, and the file loggers'
  paths;
* `pztrain.loggers._csv`: `CSVLogger`;
* `pztrain.loggers._tensorboard`: `TensorBoardLogger`;
* `pztrain.loggers._tracking`: `MLflowLogger` and `WandbLogger`.
"""

from pztrain.loggers._csv import CSVLogger
from pztrain.loggers._files import JsonlLogger, read_media
from pztrain.loggers._media import Image, Text, log_media, split_media
from pztrain.loggers._protocol import Logger, flat_hparams
from pztrain.loggers._tensorboard import TensorBoardLogger
from pztrain.loggers._tracking import MLflowLogger, WandbLogger
from pztrain.records import read_jsonl

__all__ = [
    "CSVLogger",
    "Image",
    "JsonlLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "Text",
    "WandbLogger",
    "flat_hparams",
    "log_media",
    "read_jsonl",
    "read_media",
    "split_media",
]
