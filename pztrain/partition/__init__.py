"""Split a model into named trainable arrays and the rest, and merge them back.

A model of any supported family is split once, when the training state is built:

* the **params**: a flat ``dict[str, jax.Array]`` of the trainable arrays, keyed by
  parameter name;
* the **rest** (``TrainState.model_without_params``): the model itself with a
  `ParamSlot` in place of each trainable array. Frozen arrays, integer arrays and
  static Python values stay in the rest.

`merge` puts the arrays back into their slots. Because every family is reduced to
"a pytree with slots", one merge serves all of them; only naming differs:

======================  ===================================================
family                  parameter names
======================  ===================================================
penzai v2               the ``pz.Parameter`` label (``"mlp/Affine_0/Linear.weights"``)
penzai v1 (deprecated)  the ``pz.nn.Parameter`` name
Flax NNX                the ``nnx.Param``'s path (``"l1/kernel"``)
equinox, other pytrees  the key path, ``/``-separated (``"layers/0/weight"``)
======================  ===================================================

A parameter whose value holds one array (a plain array or a penzai
``NamedArray``) is named by its label or name alone; one whose value is a pytree of
several arrays gets one name per array: ``"<label>/<key path inside the value>"``.

**Penzai v2 state variables** (``pz.StateVariable``, e.g. counters or running
statistics) are not parameters. They are kept, frozen, inside the rest
(``model_without_params``); the train step unfreezes them for the loss function
and stores their new values back into ``model_without_params`` of the returned
state, so their updates persist from step to step.

**Flax NNX models** (``nnx.Module``): the float ``nnx.Param`` arrays are the
params; every other variable (``nnx.BatchStat``, the rng streams' ``RngKey`` and
``RngCount``, ``nnx.Cache``, a user's ``nnx.Variable`` subclasses) is the model's
state, kept in `NnxModel` (``model_without_params``) and updated by the step the
same way. Each step reseeds the model's rng streams from its key
(`reseed_streams`) and runs the model in train mode; eval steps in eval mode
(see ``build_train_step(mode=...)``). flax is imported only for NNX models
(extra ``nnx``).
"""

from pztrain.partition._model import (
    ApplyFnModel,
    NnxModel,
    ParamSlot,
    PartitionError,
    Trainable,
    annotated_specs,
    merge,
    model_state,
    to_user_model,
    with_model_state,
)
from pztrain.partition._nnx import MODES, nnx_variables, reseed_streams
from pztrain.partition._rest import RestSpec, split_rest
from pztrain.partition._split import family_of, param_values, split

__all__ = [
    "MODES",
    "ApplyFnModel",
    "NnxModel",
    "ParamSlot",
    "PartitionError",
    "RestSpec",
    "Trainable",
    "annotated_specs",
    "family_of",
    "merge",
    "model_state",
    "nnx_variables",
    "param_values",
    "reseed_streams",
    "split",
    "split_rest",
    "to_user_model",
    "with_model_state",
]
