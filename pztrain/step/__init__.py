"""Train and eval steps: pure functions of a `TrainState` and a batch.

`build_train_step` returns a `TrainStep`, callable as ``(state, **batch) -> (state,
aux)``; `build_eval_step` an `EvalStep`.

* `pztrain.step._build`: `build_train_step`;
* `pztrain.step._types`: the `LossFunction` contract, `OnDeviceBatches`, and the
  ``Carry``, ``Inputs`` and `StepOutputs` a step's programs take and give;
* `pztrain.step._train`: `TrainStep` (the host side: one hot path per call);
* `pztrain.step._call_batch`: the batch of a call, on the step's mesh;
* `pztrain.step._eval`: `EvalStep`;
* `pztrain.step._fns`: the pure functions that are jitted, on a ``Carry`` and
  ``Inputs``;
* `pztrain.step._programs`: compiled programs per model structure and optimizer;
* `pztrain.step._microbatches`: gradient accumulation inside the step;
* `pztrain.step._mesh`: a step on a mesh (storage and compute layouts);
* `pztrain.step._cost`: a compiled step's FLOPs and memory per device;
* `pztrain.step._notes`: the inputs named on an error raised inside a step;
* `pztrain.step._nonfinite`: the first NaN named, by re-running one step
  (replayed from a checkpoint when the params already took it).
"""

from pztrain.step._build import LossFunction, build_train_step
from pztrain.step._cost import StepCost, StepMemory
from pztrain.step._eval import EvalFunction, EvalStep, build_eval_step
from pztrain.step._nonfinite import (
    NonFinite,
    explain_in_run,
    find_nonfinite,
    replay_to_first,
)
from pztrain.step._train import TrainStep
from pztrain.step._types import OnDeviceBatches, StepOutputs

__all__ = [
    "EvalFunction",
    "EvalStep",
    "LossFunction",
    "NonFinite",
    "OnDeviceBatches",
    "StepCost",
    "StepMemory",
    "StepOutputs",
    "TrainStep",
    "build_eval_step",
    "build_train_step",
    "explain_in_run",
    "find_nonfinite",
    "replay_to_first",
]
