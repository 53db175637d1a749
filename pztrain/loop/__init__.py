"""`fit` and `evaluate`: the training loop, as wiring over small pieces.

* `pztrain.loop._schedule`: where the host points of a run are (pure, no JAX);
* `pztrain.loop._sources`: the batch sources (host iterables with prefetch,
  on-device epochs) behind one interface;
* `pztrain.loop._hooks`: the callbacks as one ordered list, and the loop's one way
  to read the device;
* `pztrain.loop._evaluations`: named evaluations, checked, and run at their
  points;
* `pztrain.loop._eval_job`: `evaluate_checkpoints`, an evaluation job beside
  training;
* `pztrain.loop._reporting`: log and eval records, read late when nothing waits;
* `pztrain.loop._signals`: signals as a stop request read between calls;
* `pztrain.loop._stops`: what a run leaves when it ends early;
* `pztrain.loop._fit`: `fit` itself, and the loop over stretches of steps.
"""

from pztrain.loop._eval_job import evaluate_checkpoints
from pztrain.loop._evaluate import evaluate
from pztrain.loop._evaluations import Evaluation
from pztrain.loop._fit import fit
from pztrain.loop._resources import PEAK_FLOPS
from pztrain.records import History, LoopInfo

__all__ = [
    "PEAK_FLOPS",
    "Evaluation",
    "History",
    "LoopInfo",
    "evaluate",
    "evaluate_checkpoints",
    "fit",
]
