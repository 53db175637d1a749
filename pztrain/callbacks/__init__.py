"""Callbacks for `pztrain.fit`: a few optional hooks, and the built-ins.

A callback subclasses `Callback` and overrides the hooks it needs. Hooks run only at
host points (log, eval and epoch points, and the steps `Callback.on_advance` asks for),
where the loop is already on the host: a callback adds no device sync of its own.

* `pztrain.callbacks._base`: `Callback` and `record_only`;
* `pztrain.callbacks._early_stopping`: `EarlyStopping`;
* `pztrain.callbacks._learning_rate`: `LearningRateMonitor`;
* `pztrain.callbacks._nan_policy`: `NanPolicy`;
* `pztrain.callbacks._progress`: `ProgressBar`;
* `pztrain.callbacks._pbt`: `PopulationBasedTraining` (populations);
* `pztrain.callbacks._bar`: the bar's tqdm helpers (tqdm is an optional extra).
"""

from pztrain.callbacks._base import Callback, record_only
from pztrain.callbacks._early_stopping import EarlyStopping
from pztrain.callbacks._learning_rate import LearningRateMonitor
from pztrain.callbacks._nan_policy import NanPolicy
from pztrain.callbacks._pbt import PopulationBasedTraining
from pztrain.callbacks._progress import ProgressBar
from pztrain.records import Stop

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "NanPolicy",
    "PopulationBasedTraining",
    "ProgressBar",
    "Stop",
    "record_only",
]
