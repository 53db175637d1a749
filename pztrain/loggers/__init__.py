"""Loggers for `pztrain.fit`: a protocol of three methods (and an optional
``start_run``, which continues a resumed run's log), and the built-ins.

A logger receives records (see `pztrain.callbacks.Callback`) at log and eval
points only, already on the host.

* `pztrain.loggers._protocol`: `Logger` and `flat_hparams`;
* `pztrain.loggers._files`: `JsonlLogger` and `CSVLogger`, and their paths;
* `pztrain.loggers._tensorboard`: `TensorBoardLogger`;
* `pztrain.loggers._tracking`: `MLflowLogger` and `WandbLogger`.
"""

from pztrain.loggers._files import CSVLogger, JsonlLogger
from pztrain.loggers._protocol import Logger, flat_hparams
from pztrain.loggers._tensorboard import TensorBoardLogger
from pztrain.loggers._tracking import MLflowLogger, WandbLogger
from pztrain.records import read_jsonl

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
