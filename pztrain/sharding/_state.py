"""A `TrainState` on a mesh: where each array lives, and how it gets there.

One function answers "where does each array of the state live?"
(`state_shardings`); two make a state live there: `sharded_initial_state` builds
it directly sharded (traced with ``jax.eval_shape``, then one ``jax.jit`` with
``out_shardings``: the full model never sits on one device), `shard_state` moves
an existing one. `build_train_step(..., mesh=)` then keeps those shardings step
after step and splits each batch along the mesh's data axis (`data_sharding`).

Params go where `pztrain.sharding.ShardingRules` say; optimizer state follows
its params (``optax.tree_map_params``); everything else (the step, the key, the
model's other arrays, the loss function's state) is replicated, but for the
model's other arrays already split on the mesh (a frozen pretrained base read
straight onto it, `pztrain.finetune.load_pretrained`), which stay as they are.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from jax.sharding import PartitionSpec as P
  >>> from pztrain.sharding import ShardingRules
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> rules = ShardingRules(patterns=[("w$", P(None, "data"))])
  >>> state = sharded_initial_state(
  ...     lambda: TrainState.initial_state(
  ...         {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}, optax.adam(1e-3),
  ...         jax.random.key(0)),
  ...     mesh, rules)
  >>> state.params["w"].sharding.spec, state.step.sharding.spec
  (P(None, 'data'), P())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pztrain._tree import is_array, path_name
from pztrain.sharding._rules import (
    ShardingError,
    ShardingRules,
    mesh_axes,
    param_specs,
)
from pztrain.state import TrainState

__all__ = ["data_sharding", "shard_state", "sharded_initial_state", "state_shardings"]


def state_shardings(
    state: TrainState, mesh: Mesh, rules: ShardingRules | None = None
) -> TrainState:
    """The `TrainState` of `jax.sharding.NamedSharding` s for ``state`` on ``mesh``.

    Params by ``rules`` (replicated without rules: data parallel), optimizer
    state like its params, everything else replicated; an array of
    ``model_without_params`` already on ``mesh`` (a frozen base read onto it)
    keeps its sharding. ``state`` may be abstract (``jax.eval_shape`` output).

    Args:
      state: A `TrainState`, concrete or abstract.
      mesh: The device mesh.
      rules: How params are split (default: replicated).

    Returns:
      A `TrainState` with a ``NamedSharding`` in place of every array, usable as
      ``out_shardings`` of a ``jax.jit`` or as `build_train_step`'s
      ``state_shardings``.

    Raises:
      ShardingError: naming the parameter whose rule does not fit it or the mesh.

    Example:
      >>> from pztrain import ShardingRules, state_shardings, TrainState
      >>> import jax, jax.numpy as jnp, optax
      >>> s = TrainState.initial_state(
      ...     {"w": jnp.zeros((4, 2))}, optax.adam(0.1), jax.random.key(0))
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> out = state_shardings(s, mesh, ShardingRules(fsdp="data"))
      >>> tuple(out.params["w"].spec), tuple(out.opt_state[0].mu["w"].spec)
      (('data',), ('data',))
    """
    if not isinstance(state, TrainState):
        raise ShardingError(
            f"state_shardings needs a TrainState; got {type(state).__name__}."
        )
    specs = param_specs(state, mesh, rules)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state.params)
    params = jax.tree.unflatten(
        treedef, [NamedSharding(mesh, specs[path_name(p)]) for p, _ in flat]
    )
    replicated = NamedSharding(mesh, P())
    everything = jax.tree.map(lambda _: replicated, state.replace(params=None))
    rest = jax.tree.map(
        lambda x: _on_mesh_or(x, mesh, replicated), state.model_without_params
    )
    return everything.replace(
        params=params,
        opt_state=_opt_shardings(state, params, replicated),
        model_without_params=rest,
    )


def _on_mesh_or(x: Any, mesh: Mesh, replicated: NamedSharding) -> NamedSharding:
    """The sharding of ``x`` if it is already on ``mesh`` (a frozen base read
    straight onto it: gathering it would undo that), else ``replicated``."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding
    return replicated


def _opt_shardings(state: TrainState, params: Any, replicated: NamedSharding) -> Any:
    """Optimizer state leaves shaped like params follow them; others replicate."""
    try:
        return optax.tree_map_params(
            state.optimizer_def,
            lambda _, sharding: sharding,
            state.opt_state,
            params,
            transform_non_params=lambda _: replicated,
        )
    except Exception:  # an optimizer whose init rejects optax's placeholder
        return _opt_shardings_by_path(state.opt_state, state.params, params, replicated)


def _opt_shardings_by_path(opt_state, param_values, params, replicated) -> Any:
    """Each optimizer leaf whose key path ends with a param's and has its shape
    follows that param (the fallback of `_opt_shardings`)."""
    by_path = {
        tuple(p): (v.shape, s)
        for (p, v), s in zip(
            jax.tree_util.tree_flatten_with_path(param_values)[0],
            jax.tree.leaves(params),
            strict=True,
        )
    }

    def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        for start in range(len(path)):
            shape, sharding = by_path.get(tuple(path[start:]), (None, None))
            if sharding is not None and tuple(shape) == tuple(np.shape(leaf)):
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(one, opt_state)


# ----------------------------------------------------------------------------
# placing a state


def shard_state(
    state: TrainState,
    mesh_or_shardings: Mesh | TrainState,
    rules: ShardingRules | None = None,
) -> TrainState:
    """``state`` moved to a mesh (by ``rules``) or to given shardings.

    The arrays are copied, never aliased: donating the sharded state in a train
    step leaves the original state usable.

    Args:
      state: A concrete `TrainState`.
      mesh_or_shardings: A `jax.sharding.Mesh` (shardings from
        `state_shardings` with ``rules``), or a `TrainState` of shardings.
      rules: How params are split when a mesh is given.

    Returns:
      The state with every array where its sharding says.

    Example:
      >>> from pztrain import shard_state, TrainState
      >>> import jax, jax.numpy as jnp, optax
      >>> state = TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> sharded = shard_state(state, jax.make_mesh((1,), ("data",)))
      >>> sharded.params["w"].sharding.spec
      P()
    """
    state.check_not_donated("shard_state")
    if isinstance(mesh_or_shardings, Mesh):
        shardings = state_shardings(state, mesh_or_shardings, rules)
    else:
        shardings = mesh_or_shardings
    return jax.tree.map(_put, state, shardings)


def _put(x: Any, sharding: NamedSharding) -> Any:
    if not is_array(x):  # a module's own leaf (eqx.nn.MLP's activation, a flag)
        return x  # stays as it is, as on one device
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding, may_alias=False)
    # Several processes: each holds the whole value and keeps its own shards.
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def sharded_initial_state(
    make_state: Callable[[], TrainState],
    mesh: Mesh,
    rules: ShardingRules | None = None,
) -> TrainState:
    """Builds a `TrainState` directly sharded over ``mesh``.

    ``make_state`` is traced once (``jax.eval_shape``) to find the arrays and
    their shardings, then run under ``jax.jit`` with those ``out_shardings``:
    each device computes only its own shards, so a model too large for one
    device can be built.

    Args:
      make_state: Builds the state from nothing, e.g. ``lambda:
        TrainState.initial_state(build_model(key), optax.adam(1e-3), key)``.
        Everything it computes must be traceable (no host reads of arrays).
      mesh: The device mesh.
      rules: How params are split (default: replicated).

    Returns:
      The state, every array with its `state_shardings` sharding.

    Example:
      >>> from pztrain import sharded_initial_state, ShardingRules, TrainState
      >>> import jax, jax.numpy as jnp, optax
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> s = sharded_initial_state(
      ...     lambda: TrainState.initial_state(
      ...         {"w": jnp.ones((4, 2))}, optax.adam(0.1), jax.random.key(0)),
      ...     mesh, ShardingRules(fsdp="data"))
      >>> tuple(s.params["w"].sharding.spec), float(s.params["w"].sum())
      (('data',), 8.0)
    """
    # Arrays come out of eval_shape and jit; a module's other leaves (eqx.nn.MLP's
    # activation, a Python flag) are kept as make_state made them.
    made: dict[str, Any] = {}

    def make_arrays() -> list[Any]:
        leaves, made["treedef"] = jax.tree.flatten(make_state())
        made["others"] = [None if is_array(x) else x for x in leaves]
        return [x for x in leaves if is_array(x)]

    def whole(arrays: list[Any]) -> TrainState:
        found = iter(arrays)
        leaves = [next(found) if x is None else x for x in made["others"]]
        return jax.tree.unflatten(made["treedef"], leaves)

    abstract = whole(jax.eval_shape(make_arrays))
    if all(x is None for x in made["others"]):  # arrays alone: one trace of
        abstract = jax.eval_shape(make_state)  # make_state, cached by jit, so
        shardings = state_shardings(abstract, mesh, rules)  # every call gives
        return jax.jit(make_state, out_shardings=shardings)()  # one structure
    shardings = state_shardings(abstract, mesh, rules)
    out = [s for s, x in zip(jax.tree.leaves(shardings), made["others"], strict=True)
           if x is None]  # fmt: skip
    return whole(jax.jit(make_arrays, out_shardings=out)())


def data_sharding(
    mesh: Mesh, data_axis: str | tuple[str, ...] = "data", steps_per_call: int = 1
) -> NamedSharding:
    """The sharding of every batch leaf: examples split along ``data_axis``.

    With ``steps_per_call=k`` batches have a leading step axis, which stays
    whole: ``P(None, data_axis)``.

    Example:
      >>> import jax; from pztrain.sharding import data_sharding
      >>> data_sharding(jax.make_mesh((1,), ("data",)), steps_per_call=4).spec
      P(None, 'data')
    """
    for axis in mesh_axes(data_axis):
        if axis not in mesh.shape:
            raise ShardingError(
                f"data_axis={data_axis!r}: the mesh has axes {list(mesh.shape)}."
            )
    spec = P(data_axis) if steps_per_call == 1 else P(None, data_axis)
    return NamedSharding(mesh, spec)
