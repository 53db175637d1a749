"""The rows of a `Summary`: one `ParamRow` per array of the model, trainable or
left in ``model_without_params`` (frozen, state, constant or buffer)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from penzai.core import variables as pz_vars

from pztrain._tree import is_array, is_float_array, named_leaves, path_name
from pztrain.partition import NnxModel, ParamSlot

__all__ = ["ParamRow", "nnx_types", "rest_rows", "row"]

_VALUE_TYPES = (pz_vars.ParameterValue, pz_vars.StateVariableValue)


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """One array of the model in a `Summary`.

    Attributes:
      name: The parameter name (the key in ``state.params``; for an array left
        in ``model_without_params``, its penzai label or key path).
      shape: The array's shape.
      dtype: The dtype's name.
      count: The number of values.
      nbytes: The bytes it takes.
      kind: ``"trainable"`` (in ``state.params``), ``"frozen"`` (a penzai or
        NNX parameter left in the model, or a float array that the ``trainable``
        filter left out of another model), ``"state"`` (a penzai state variable,
        or a Flax NNX variable that is not an ``nnx.Param``), ``"constant"`` (an
        array a penzai model holds outside any variable: ``ConstantRescale``'s
        ``by``, an attention mask's ``masked_out_value``) or ``"buffer"`` (any
        other array, e.g. integer indices or a key).
      sharding: The ``PartitionSpec`` of a ``NamedSharding`` (``"P('data',
        None)"``), a description of another multi-device sharding, or ``None``.
      variable: A Flax NNX model's variable type (``"Param"``,
        ``"BatchStat"``, ``"RngKey"``, ``"RngCount"`` …), else ``None``; the
        table shows it after the kind: ``state (BatchStat)``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> state = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros((2, 3))}, optax.sgd(0.1), jax.random.key(0))
      >>> [(r.name, r.shape, r.kind, r.nbytes) for r in state.summary().rows]
      [('w', (2, 3), 'trainable', 24)]
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    nbytes: int
    kind: str
    sharding: str | None
    variable: str | None = None

    @property
    def kind_text(self) -> str:
        """The kind as the table shows it, with the variable type if any."""
        return self.kind if self.variable is None else f"{self.kind} ({self.variable})"


def _sharding(x: Any) -> str | None:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return str(sharding.spec)
    if sharding is None or len(sharding.device_set) == 1:
        return None
    return f"{type(sharding).__name__} over {len(sharding.device_set)} devices"


def row(name: str, x: Any, kind: str, variable: str | None = None) -> ParamRow:
    shape = tuple(int(d) for d in np.shape(x))
    count = int(np.prod(shape))
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # key<fry>: its key data
        dtype, itemsize = str(x.dtype), x.dtype.itemsize
    else:
        dtype, itemsize = np.dtype(x.dtype).name, np.dtype(x.dtype).itemsize
    return ParamRow(
        name, shape, dtype, count, count * itemsize, kind, _sharding(x), variable
    )


def value_rows(label: str, value: Any, kind: str) -> list[ParamRow]:
    """The arrays of a penzai parameter (or state) left in the rest, by label."""
    leaves = named_leaves(value, is_leaf=lambda x: isinstance(x, ParamSlot))
    return [
        row(label if len(leaves) == 1 else f"{label}/{name}", leaf, kind)
        for name, leaf in leaves
        if is_array(leaf)
    ]


def _variables() -> tuple[type, ...]:
    """Penzai v2 values, and v1 parameters if penzai v1 was imported."""
    v1 = sys.modules.get("penzai.deprecated.v1.nn.parameters")
    return _VALUE_TYPES + (() if v1 is None else (v1.Parameter,))


def nnx_rows(rest: NnxModel) -> list[ParamRow]:
    """The arrays of an NNX model's rest: frozen params and state, with types."""
    return [
        row(name, x, ("frozen" if param else "state"), kind)
        for name, kind, param, x in zip(
            rest.names, rest.types, rest.params, rest.values, strict=True
        )
        if is_array(x)
    ]


def nnx_types(rest: Any) -> dict[str, str]:
    """An NNX model's variable types by name (empty for other families)."""
    if not isinstance(rest, NnxModel):
        return {}
    return dict(zip(rest.names, rest.types, strict=True))


def _kind(leaf: Any, penzai: bool) -> str:
    """A plain array of the rest: in a penzai model a constant (``by`` of
    ``ConstantRescale``, ``masked_out_value`` …), else a frozen param (a float
    array the ``trainable`` filter left out) or a buffer."""
    if penzai:
        return "constant"
    return "frozen" if is_float_array(leaf) else "buffer"


def rest_rows(rest: Any) -> list[ParamRow]:
    """The arrays of ``model_without_params``: frozen params, state, buffers."""
    if isinstance(rest, NnxModel):
        return nnx_rows(rest)
    types = _variables()
    is_var = lambda x: isinstance(x, types)  # noqa: E731
    rows: list[ParamRow] = []
    labels: set[str] = set()
    penzai = isinstance(rest, pz.Struct)  # its params are variables
    for path, leaf in jax.tree_util.tree_flatten_with_path(rest, is_leaf=is_var)[0]:
        if not is_var(leaf):
            if is_array(leaf):
                rows.append(row(path_name(path) or "root", leaf, _kind(leaf, penzai)))
            continue
        label = str(getattr(leaf, "label", None) or leaf.name)
        if label not in labels:  # a shared variable, listed once
            labels.add(label)
            is_state = isinstance(leaf, pz_vars.StateVariableValue)
            rows += value_rows(label, leaf.value, "state" if is_state else "frozen")
    return rows
