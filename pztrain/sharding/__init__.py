"""A state on a mesh: where each parameter's dimensions go, and sharded init.

* `pztrain.sharding._rules`: `ShardingRules` (parameter names and penzai named
  axes to mesh axes) and `param_specs`;
* `pztrain.sharding._state`: the state's shardings (`state_shardings`), a state
  built or moved onto a mesh (`sharded_initial_state`, `shard_state`), and a
  batch's sharding (`data_sharding`).
"""

from pztrain.sharding._rules import ShardingError, ShardingRules, param_specs
from pztrain.sharding._state import (
    data_sharding,
    shard_state,
    sharded_initial_state,
    state_shardings,
)

__all__ = [
    "ShardingError",
    "ShardingRules",
    "data_sharding",
    "param_specs",
    "shard_state",
    "sharded_initial_state",
    "state_shardings",
]
