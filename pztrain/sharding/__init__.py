"""A state on a mesh: where each parameter's dimensions go, and sharded init.

See `pztrain.sharding._rules` for the rules (`ShardingRules`) and the state's
shardings (`state_shardings`, `sharded_initial_state`, `shard_state`,
`data_sharding`).
"""

from pztrain.sharding._rules import (
    ShardingError,
    ShardingRules,
    data_sharding,
    param_specs,
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
