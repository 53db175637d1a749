"""Sharding a `TrainState` over a mesh: rules from parameter names to mesh axes.

One function answers "where does each array of the state live?"
(`state_shardings`); two make a state live there: `sharded_initial_state` builds
it directly sharded (traced with ``jax.eval_shape``, then one ``jax.jit`` with
``out_shardings``: the full model never sits on one device), `shard_state` moves
an existing one. `build_train_step(..., mesh=)` then keeps those shardings step
after step and splits each batch along the mesh's data axis.

The rules (`ShardingRules`) name mesh axes for parameter dimensions, the way
logical axis rules do in Flax and MaxText:

- ``axes``: penzai named axes to mesh axes, e.g. ``{"features_out": "model"}``
  (a penzai v2 parameter's ``NamedArray`` says which dimension is which);
- ``patterns``: regexes searched in parameter names (``"layers/0/weight"``, the
  keys of ``TrainState.params``) to a `jax.sharding.PartitionSpec`, for dict,
  equinox and Flax-style models;
- ``fsdp``: a mesh axis over which every other parameter is split along its
  largest dimension that divides (fully sharded data parallel).

A dimension that does not divide by its mesh axes stays replicated. Optimizer
state follows its params (``optax.tree_map_params``); everything else (the step,
the key, the model's other arrays, the loss function's state) is replicated.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from jax.sharding import PartitionSpec as P
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

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai.core import named_axes

from pztrain._tree import named_leaves, path_name
from pztrain.partition import ParamSlot
from pztrain.state import TrainState

__all__ = [
    "ShardingError",
    "ShardingRules",
    "data_sharding",
    "param_specs",
    "shard_state",
    "sharded_initial_state",
    "state_shardings",
]

MeshAxes = str | tuple[str, ...] | None
"""The mesh axes one dimension is split over: one name, several, or none."""


class ShardingError(ValueError):
    """Sharding rules or a mesh that do not fit the state."""


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axes split each parameter's dimensions.

    For each parameter the first rule that applies wins: a matching
    ``patterns`` entry, then the penzai named ``axes`` it has, then ``fsdp``;
    with none, the parameter is replicated.

    Attributes:
      axes: Penzai named axis → mesh axis (or axes, or ``None``), for params
        that are ``NamedArray`` values of penzai v2 ``Parameter`` s.
      patterns: ``(regex, spec)`` pairs; the regex is searched in the
        parameter's name, ``spec`` is a `jax.sharding.PartitionSpec` (or a
        tuple of mesh axes per dimension) for its dimensions.
      fsdp: A mesh axis splitting every parameter no other rule placed, along
        its largest dimension that divides by the axis size.

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> ShardingRules(axes={"features_out": "model"},
      ...               patterns=[("embed", P("model", None))], fsdp="data").fsdp
      'data'
    """

    axes: Mapping[str, MeshAxes] = dataclasses.field(default_factory=dict)
    patterns: Sequence[tuple[str, Any]] = ()
    fsdp: str | None = None

    def __post_init__(self) -> None:
        compiled = []
        for i, entry in enumerate(self.patterns):
            if not (isinstance(entry, tuple | list) and len(entry) == 2):
                raise ShardingError(
                    f"ShardingRules.patterns[{i}] is {entry!r}; give (regex, "
                    "PartitionSpec) pairs."
                )
            try:
                compiled.append((re.compile(entry[0]), P(*entry[1])))
            except (re.error, TypeError) as e:
                raise ShardingError(
                    f"ShardingRules.patterns[{i}] = {entry!r} is not a (regex, "
                    f"PartitionSpec) pair: {e}"
                ) from None
        object.__setattr__(self, "_compiled", tuple(compiled))

    def spec(
        self,
        name: str,
        shape: tuple[int, ...],
        axis_names: Sequence[str] | None,
        mesh: Mesh,
    ) -> P:
        """The `PartitionSpec` of parameter ``name`` (of ``shape``) on ``mesh``.

        ``axis_names``: the penzai name of each dimension (``None`` where
        unnamed), or ``None`` for a parameter without named axes.
        """
        for pattern, spec in self._compiled:  # type: ignore[attr-defined]
            if pattern.search(name):
                return _fitted(_checked_spec(name, shape, spec, mesh), shape, mesh)
        if axis_names is not None and any(a in self.axes for a in axis_names):
            spec = P(*(self.axes.get(a) if a else None for a in axis_names))
            return _fitted(_checked_spec(name, shape, spec, mesh), shape, mesh)
        if self.fsdp is not None:
            return _fsdp_spec(shape, self.fsdp, mesh)
        return P()


def _axes_of(entry: MeshAxes) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _checked_spec(name: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> P:
    if len(spec) > len(shape):
        raise ShardingError(
            f"Parameter {name!r} has {len(shape)} dimensions {list(shape)}, but its "
            f"sharding rule gives {len(spec)}: {spec}. Give one entry per dimension."
        )
    for entry in spec:
        for axis in _axes_of(entry):
            if axis not in mesh.shape:
                raise ShardingError(
                    f"The sharding rule of parameter {name!r} names mesh axis "
                    f"{axis!r}; the mesh has {list(mesh.shape)}."
                )
    return spec


def _fitted(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` with each mesh axis used once, and dimensions that do not divide
    by their mesh axes replicated."""
    used: set[str] = set()
    out = []
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    for dim, entry in zip(shape, padded, strict=True):
        axes = tuple(a for a in _axes_of(entry) if a not in used)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or dim % size:
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _fsdp_spec(shape: tuple[int, ...], axis: str, mesh: Mesh) -> P:
    if axis not in mesh.shape:
        raise ShardingError(
            f"ShardingRules(fsdp={axis!r}) names a mesh axis the mesh does not have "
            f"({list(mesh.shape)})."
        )
    size = mesh.shape[axis]
    fits = [i for i, d in enumerate(shape) if d % size == 0 and d >= size]
    if not fits:
        return P()
    best = max(fits, key=lambda i: (shape[i], -i))
    return P(*([None] * best + [axis]))


# ----------------------------------------------------------------------------
# the state's shardings


def _named_axes(model_without_params: Any) -> dict[str, Callable[[int], tuple]]:
    """For each named-array parameter, its dimensions' penzai axis names (``None``
    where positional), as a function of the parameter's number of dimensions."""
    found: dict[str, Callable[[int], tuple]] = {}

    def visit(x: Any) -> bool:
        slot = getattr(x, "data_array", None)
        if not isinstance(slot, ParamSlot):
            return False
        if isinstance(x, named_axes.NamedArray):
            names = tuple(x.named_axes)
            found[slot.name] = lambda ndim: (None,) * (ndim - len(names)) + names
        elif isinstance(x, named_axes.NamedArrayView):
            dims = dict(x.data_axis_for_name)
            found[slot.name] = lambda ndim: tuple(
                next((a for a, d in dims.items() if d == i), None) for i in range(ndim)
            )
        return True

    jax.tree.leaves(model_without_params, is_leaf=visit)
    return found


def param_specs(
    state: TrainState, mesh: Mesh, rules: ShardingRules | None = None
) -> dict[str, P]:
    """The `PartitionSpec` of each parameter, by name, under ``rules``.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> state = TrainState.initial_state({"w": jnp.ones((4, 2))},
      ...                                  optax.sgd(0.1), jax.random.key(0))
      >>> param_specs(state, jax.make_mesh((1,), ("data",)),
      ...             ShardingRules(fsdp="data"))
      {'w': P('data',)}
    """
    rules = rules or ShardingRules()
    named = _named_axes(state.model_without_params)
    return {
        name: rules.spec(
            name,
            tuple(x.shape),
            named[name](len(x.shape)) if name in named else None,
            mesh,
        )
        for name, x in named_leaves(state.params)
    }


def state_shardings(
    state: TrainState, mesh: Mesh, rules: ShardingRules | None = None
) -> TrainState:
    """The `TrainState` of `jax.sharding.NamedSharding` s for ``state`` on ``mesh``.

    Params by ``rules`` (replicated without rules: data parallel), optimizer
    state like its params, everything else replicated. ``state`` may be
    abstract (``jax.eval_shape`` output).

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
    return everything.replace(
        params=params, opt_state=_opt_shardings(state, params, replicated)
    )


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
    """
    abstract = jax.eval_shape(make_state)
    shardings = state_shardings(abstract, mesh, rules)
    return jax.jit(make_state, out_shardings=shardings)()


def data_sharding(
    mesh: Mesh, data_axis: str | tuple[str, ...] = "data", steps_per_call: int = 1
) -> NamedSharding:
    """The sharding of every batch leaf: examples split along ``data_axis``.

    With ``steps_per_call=k`` batches have a leading step axis, which stays
    whole: ``P(None, data_axis)``.

    Example:
      >>> import jax
      >>> data_sharding(jax.make_mesh((1,), ("data",)), steps_per_call=4).spec
      P(None, 'data')
    """
    for axis in _axes_of(data_axis):
        if axis not in mesh.shape:
            raise ShardingError(
                f"data_axis={data_axis!r}: the mesh has axes {list(mesh.shape)}."
            )
    spec = P(data_axis) if steps_per_call == 1 else P(None, data_axis)
    return NamedSharding(mesh, spec)
