"""pztrain: a Penzai-style, pure-pytree trainer for JAX.

The core is an immutable `TrainState` pytree and `build_train_step`, which turns a
penzai-style loss function into a jitted ``(state, **batch) -> (state, aux)``
step.
"""

from pztrain import partition
from pztrain.partition import ApplyFnModel, ParamSlot, PartitionError
from pztrain.state import DonatedStateError, TrainState
from pztrain.step import (
    EvalFunction,
    EvalStep,
    LossFunction,
    StepOutputs,
    TrainStep,
    build_eval_step,
    build_train_step,
)

__version__ = "0.1.0"

__all__ = [
    "ApplyFnModel",
    "DonatedStateError",
    "EvalFunction",
    "EvalStep",
    "LossFunction",
    "ParamSlot",
    "PartitionError",
    "StepOutputs",
    "TrainState",
    "TrainStep",
    "build_eval_step",
    "build_train_step",
    "partition",
]
