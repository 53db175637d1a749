"""Rules from parameter names to mesh axes: `ShardingRules` and `param_specs`.

The rules name mesh axes for parameter dimensions, the way logical axis rules do
in Flax and MaxText:

- ``axes``: penzai named axes to mesh axes, e.g. ``{"features_out": "model"}``
  (a penzai v2 parameter's ``NamedArray`` says which dimension is which);
- ``patterns``: regexes searched in parameter names (``"layers/0/weight"``, the
  keys of ``TrainState.params``) to a `jax.sharding.PartitionSpec`, for dict,
  equinox and Flax-style models;
- ``fsdp``: a mesh axis over which every other parameter is split along its
  largest dimension that divides (fully sharded data parallel).

A Flax NNX param's own annotation (``nnx.with_partitioning``, ``out_sharding``
metadata: `pztrain.partition.annotated_specs`) names mesh axes for it: it comes
after ``patterns`` and before the other rules.

A dimension that does not divide by its mesh axes stays replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from penzai.core import named_axes

from pztrain._tree import named_leaves
from pztrain.partition import ParamSlot, annotated_specs
from pztrain.state import TrainState

__all__ = ["MeshAxes", "ShardingError", "ShardingRules", "mesh_axes", "param_specs"]

MeshAxes = str | tuple[str, ...] | None
"""The mesh axes one dimension is split over: one name, several, or none."""


class ShardingError(ValueError):
    """Sharding rules or a mesh that do not fit the state.

    Example:
      >>> from pztrain import ShardingError
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> s = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros(4)}, optax.sgd(0.1), jax.random.key(0))
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> try:
      ...     pztrain.state_shardings(s, mesh, pztrain.ShardingRules(fsdp="model"))
      ... except ShardingError as err:
      ...     print(err)
      ShardingRules(fsdp='model') names a mesh axis the mesh does not have (['data']).
    """


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axes split each parameter's dimensions.

    For each parameter the first rule that applies wins: a matching
    ``patterns`` entry, then a Flax NNX param's own sharding annotation, then
    the penzai named ``axes`` it has, then ``fsdp``; with none, the parameter
    is replicated.

    Attributes:
      axes: Penzai named axis → mesh axis (or axes, or ``None``), for params
        that are ``NamedArray`` values of penzai v2 ``Parameter`` s.
      patterns: ``(regex, spec)`` pairs; the regex is searched in the
        parameter's name, ``spec`` is a `jax.sharding.PartitionSpec` (or a
        tuple of mesh axes per dimension) for its dimensions.
      fsdp: A mesh axis splitting every parameter no other rule placed, along
        its largest dimension that divides by the axis size.

    Example:
      >>> from pztrain import ShardingRules
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


def mesh_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one dimension's entry, as a tuple (``None``: none)."""
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
        for axis in mesh_axes(entry):
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
        axes = tuple(a for a in mesh_axes(entry) if a not in used)
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
      >>> from pztrain import ShardingRules, TrainState
      >>> from pztrain.sharding import param_specs
      >>> import jax, jax.numpy as jnp, optax
      >>> state = TrainState.initial_state({"w": jnp.ones((4, 2))},
      ...                                  optax.sgd(0.1), jax.random.key(0))
      >>> param_specs(state, jax.make_mesh((1,), ("data",)),
      ...             ShardingRules(fsdp="data"))
      {'w': P('data',)}
    """
    rules = rules or ShardingRules()
    named = _named_axes(state.model_without_params)
    annotated = annotated_specs(state.model_without_params)
    specs = {}
    for name, x in named_leaves(state.params):
        shape = tuple(x.shape)
        if name in annotated and not _pattern_matches(rules, name):
            specs[name] = _annotated(name, shape, annotated[name], mesh)
        else:
            axis_names = named[name](len(shape)) if name in named else None
            specs[name] = rules.spec(name, shape, axis_names, mesh)
    return specs


def _pattern_matches(rules: ShardingRules, name: str) -> bool:
    return any(p.search(name) for p, _ in rules._compiled)  # type: ignore[attr-defined]


def _annotated(name: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> P:
    """The spec a param's own sharding annotation gives, on ``mesh``."""
    for axis in (a for entry in spec for a in mesh_axes(entry)):
        if axis not in mesh.shape:
            raise ShardingError(
                f"Parameter {name!r} is annotated with sharding {tuple(spec)} "
                f"(nnx.with_partitioning / out_sharding), which names mesh axis "
                f"{axis!r}; the mesh has {list(mesh.shape)}. Name the mesh's "
                "axes (or set flax's logical axis rules when building the "
                "model), or give the parameter a ShardingRules pattern."
            )
    return _fitted(_checked_spec(name, shape, spec, mesh), shape, mesh)
