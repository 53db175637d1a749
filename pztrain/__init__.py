"""pztrain: a Penzai-style, pure-pytree trainer for JAX.

The core is an immutable `TrainState` pytree and `build_train_step`, which turns a
penzai-style loss function into a jitted ``(state, **batch) -> (state, aux)``
step. `fit` runs the loop around them: data, on-device metrics, evaluation,
callbacks and loggers.
"""

from pztrain import (
    callbacks,
    checkpoint,
    data,
    ema,
    finetune,
    groups,
    loggers,
    metric_states,
    metrics,
    monitors,
    partition,
    population,
    precision,
    sharding,
    summary,
)
from pztrain._version import __version__ as __version__
from pztrain.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    NanPolicy,
    PopulationBasedTraining,
    ProgressBar,
)
from pztrain.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    Checkpoints,
    DirectoryInUseError,
    export_safetensors,
    import_safetensors,
    load_from_checkpoint,
    load_params,
    load_state,
    read_metadata,
    save_params,
    save_state,
)
from pztrain.data import ArrayLoader, BatchError, GrainLoader, put_batch
from pztrain.ema import with_ema
from pztrain.loggers import JsonlLogger, TensorBoardLogger
from pztrain.loop import Evaluation, evaluate, evaluate_checkpoints, fit
from pztrain.partition import ApplyFnModel, ParamSlot, PartitionError
from pztrain.population import (
    PopulationError,
    make_population,
    member,
    members,
    population_size,
    stack_members,
)
from pztrain.precision import mixed_precision
from pztrain.records import History, LoopInfo, Stop
from pztrain.sharding import (
    ShardingError,
    ShardingRules,
    shard_state,
    sharded_initial_state,
    state_shardings,
)
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

__all__ = [
    "ApplyFnModel",
    "ArrayLoader",
    "BatchError",
    "Callback",
    "CheckpointError",
    "CheckpointMismatchError",
    "Checkpoints",
    "DirectoryInUseError",
    "DonatedStateError",
    "EarlyStopping",
    "EvalFunction",
    "EvalStep",
    "Evaluation",
    "GrainLoader",
    "History",
    "JsonlLogger",
    "LearningRateMonitor",
    "LoopInfo",
    "LossFunction",
    "NanPolicy",
    "ParamSlot",
    "PartitionError",
    "PopulationBasedTraining",
    "PopulationError",
    "ProgressBar",
    "ShardingError",
    "ShardingRules",
    "StepOutputs",
    "Stop",
    "TensorBoardLogger",
    "TrainState",
    "TrainStep",
    "build_eval_step",
    "build_train_step",
    "callbacks",
    "checkpoint",
    "data",
    "ema",
    "finetune",
    "evaluate",
    "evaluate_checkpoints",
    "export_safetensors",
    "fit",
    "groups",
    "import_safetensors",
    "load_from_checkpoint",
    "load_params",
    "load_state",
    "loggers",
    "make_population",
    "member",
    "members",
    "metric_states",
    "metrics",
    "mixed_precision",
    "monitors",
    "partition",
    "population",
    "population_size",
    "precision",
    "put_batch",
    "read_metadata",
    "save_params",
    "save_state",
    "shard_state",
    "sharded_initial_state",
    "sharding",
    "stack_members",
    "state_shardings",
    "summary",
    "with_ema",
]
