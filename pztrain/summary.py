"""The state at a glance: `summarize` (``state.summary()``) and treescope's view.

`summarize` lists every array of the model, one row each (name, shape, dtype,
count, bytes, trainable / frozen / state / constant / buffer with a Flax NNX variable's
type, and the sharding when a state is placed on a mesh), then the totals of
each part of the state, the step and the key. Typed PRNG key arrays show as
``key<fry>`` with the bytes of their key data. The result, a `Summary`, is a
``str`` (``print(state.summary())``) that a notebook shows as an HTML table.
Treescope's own view of a state is `pztrain._treescope.readable_treescope`.
"""

from __future__ import annotations

import dataclasses
import html
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.core import variables as pz_vars
from treescope import rendering_parts

from pztrain._optax import states_of
from pztrain._table import html_table, text_table
from pztrain._tree import describe, is_array, is_float_array, named_leaves, path_name
from pztrain.ema import EmaState
from pztrain.partition import NnxModel, ParamSlot

__all__ = [
    "ParamRow",
    "Summary",
    "optimizer_state_types",
    "summarize",
]

# The fields of TrainState itself; any other dataclass field is a subclass's.
BASE_FIELDS = (
    "step",
    "root_rng",
    "params",
    "model_without_params",
    "opt_state",
    "loss_fn_state",
    "optimizer_def",
)
# Leaves of an optimizer state that are not states (MaskedNode: a masked param).
_NOT_STATES = (int, float, complex, str, optax.MaskedNode)
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


def _row(name: str, x: Any, kind: str, variable: str | None = None) -> ParamRow:
    shape = tuple(int(d) for d in np.shape(x))
    count = int(np.prod(shape))
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # key<fry>: its key data
        dtype, itemsize = str(x.dtype), x.dtype.itemsize
    else:
        dtype, itemsize = np.dtype(x.dtype).name, np.dtype(x.dtype).itemsize
    return ParamRow(
        name, shape, dtype, count, count * itemsize, kind, _sharding(x), variable
    )


def _value_rows(label: str, value: Any, kind: str) -> list[ParamRow]:
    """The arrays of a penzai parameter (or state) left in the rest, by label."""
    leaves = named_leaves(value, is_leaf=lambda x: isinstance(x, ParamSlot))
    return [
        _row(label if len(leaves) == 1 else f"{label}/{name}", leaf, kind)
        for name, leaf in leaves
        if is_array(leaf)
    ]


def _variables() -> tuple[type, ...]:
    """Penzai v2 values, and v1 parameters if penzai v1 was imported."""
    v1 = sys.modules.get("penzai.deprecated.v1.nn.parameters")
    return _VALUE_TYPES + (() if v1 is None else (v1.Parameter,))


def _nnx_rows(rest: NnxModel) -> list[ParamRow]:
    """The arrays of an NNX model's rest: frozen params and state, with types."""
    return [
        _row(name, x, ("frozen" if param else "state"), kind)
        for name, kind, param, x in zip(
            rest.names, rest.types, rest.params, rest.values, strict=True
        )
        if is_array(x)
    ]


def _nnx_types(rest: Any) -> dict[str, str]:
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


def _rest_rows(rest: Any) -> list[ParamRow]:
    """The arrays of ``model_without_params``: frozen params, state, buffers."""
    if isinstance(rest, NnxModel):
        return _nnx_rows(rest)
    types = _variables()
    is_var = lambda x: isinstance(x, types)  # noqa: E731
    rows: list[ParamRow] = []
    labels: set[str] = set()
    penzai = isinstance(rest, pz.Struct)  # its params are variables
    for path, leaf in jax.tree_util.tree_flatten_with_path(rest, is_leaf=is_var)[0]:
        if not is_var(leaf):
            if is_array(leaf):
                rows.append(_row(path_name(path) or "root", leaf, _kind(leaf, penzai)))
            continue
        label = str(getattr(leaf, "label", None) or leaf.name)
        if label not in labels:  # a shared variable, listed once
            labels.add(label)
            is_state = isinstance(leaf, pz_vars.StateVariableValue)
            rows += _value_rows(label, leaf.value, "state" if is_state else "frozen")
    return rows


def optimizer_state_types(opt_state: Any) -> str:
    """The type names of an optax state, nested as the state is.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> optimizer_state_types(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
      '(ScaleByAdamState, EmptyState)'
      >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> optimizer_state_types(tx.init(jnp.zeros(2)))
      'InjectStatefulHyperparamsState((EmptyState, EmptyState))'
    """
    return _types(opt_state) or type(opt_state).__name__


def _types(x: Any) -> str | None:
    if x is None or is_array(x) or isinstance(x, _NOT_STATES):
        return None
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # an optax NamedTuple state
        inner = [t for t in map(_types, x) if t]
        name = type(x).__name__
        return f"{name}({', '.join(inner)})" if inner else name
    if isinstance(x, list | tuple):
        return f"({', '.join(t or '-' for t in map(_types, x))})"
    if isinstance(x, dict):
        inner = {k: t for k, t in ((k, _types(v)) for k, v in x.items()) if t}
        if not inner:
            return None
        return "{" + ", ".join(f"{k}: {t}" for k, t in inner.items()) + "}"
    return type(x).__name__


def _human(nbytes: int) -> str:
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"


def _key_text(key: Any) -> str:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return f"{jax.random.key_impl(key)} key, shape {tuple(key.shape)}"
    return f"legacy raw key {describe(key)} (jax.random.PRNGKey)"


def _total(part: str, tree: Any, detail: str) -> tuple[str, ...]:
    arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")]
    count = sum(int(np.prod(np.shape(x))) for x in arrays)
    nbytes = sum(int(x.nbytes) for x in arrays)
    per_device = _human(_per_device(arrays))
    return (part, f"{len(arrays):,}", f"{count:,}", _human(nbytes), per_device, detail)


def _per_device(arrays: Sequence[Any]) -> int:
    """Bytes of ``arrays`` on the most loaded device (a host array: all of it)."""
    load: dict[Any, int] = {}
    host = 0
    for x in arrays:
        sharding = getattr(x, "sharding", None)
        if sharding is None or not np.size(x):
            host += int(x.nbytes)
            continue
        shard = int(np.prod(sharding.shard_shape(x.shape))) * x.nbytes // np.size(x)
        for device in sharding.device_set:
            load[device] = load.get(device, 0) + shard
    return host + max(load.values(), default=0)


def _field_detail(value: Any) -> str:
    if (
        is_array(value)
        and np.shape(value) == ()
        and not jnp.issubdtype(value.dtype, jax.dtypes.prng_key)
    ):
        return f"{describe(value)} = {np.asarray(value).item()!r}"
    if is_array(value):
        return describe(value)
    text = repr(value) if not jax.tree.leaves(value) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _ema_total(opt_state: Any) -> list[tuple[str, ...]]:
    """The row of the EMA params (part of ``opt_state``), if it keeps them."""
    found = states_of(opt_state, EmaState)
    if len(found) != 1:
        return []
    updates = int(np.asarray(found[0].count))
    detail = f"in opt_state (with_ema), {updates:,} updates"
    return [_total("  ema_params", found[0].ema_params, detail)]


def _totals(state: Any) -> list[tuple[str, ...]]:
    lfs = state.loss_fn_state
    totals = [
        _total("params", state.params, ""),
        _total("model_without_params", state.model_without_params, ""),
        _total("opt_state", state.opt_state, optimizer_state_types(state.opt_state)),
        *_ema_total(state.opt_state),
        _total("loss_fn_state", lfs, _field_detail(lfs)),
    ]
    for field in dataclasses.fields(state):
        if field.name not in BASE_FIELDS:
            value = getattr(state, field.name)
            totals.append(_total(field.name, value, _field_detail(value)))
    return totals


# ----------------------------------------------------------------------------
# the table


_ROW_HEADER = ("name", "shape", "dtype", "count", "bytes", "kind")
_TOTAL_HEADER = ("part", "arrays", "values", "bytes", "per device", "contents")


def _row_cells(rows: Sequence[ParamRow], sharded: bool) -> list[tuple[str, ...]]:
    cells = []
    for r in rows:
        cell = (
            r.name,
            str(r.shape),
            r.dtype,
            f"{r.count:,}",
            f"{r.nbytes:,}",
            r.kind_text,
        )
        cells.append(cell + ((r.sharding or "-",) if sharded else ()))
    return cells


class Summary(str):
    """The text of ``state.summary()``: a ``str`` that notebooks show as HTML.

    ``print(summary)``: the text table; in a notebook, HTML tables (`_repr_html_`).

    Attributes:
      title: The first line (state type, step, trainable and frozen sizes).
      rows: One `ParamRow` per array of the model.
      totals: ``(part, arrays, values, bytes, per device, contents)`` per part
        of the state, as text (``per device``: on the most loaded device).
      step: The step, read from the device.
      key: The root key's implementation and shape.

    Example:
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> summary = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.key(0)).summary()
      >>> summary.title
      'TrainState at step 0: 1 trainable array, 3 values (12 B); 0 frozen'
      >>> summary.totals[0][:4], isinstance(summary, str)
      (('params', '1', '3', '12 B'), True)
    """

    title: str
    rows: tuple[ParamRow, ...]
    totals: tuple[tuple[str, ...], ...]
    step: int
    key: str

    def __new__(cls, title, rows, totals, step, key) -> Summary:
        sharded = any(r.sharding for r in rows)
        header = _ROW_HEADER + (("sharding",) if sharded else ())
        text = "\n".join(
            [
                title,
                "",
                text_table(header, _row_cells(rows, sharded), "name"),
                "",
                text_table(_TOTAL_HEADER, totals, "contents"),
                "",
                f"step: {step}",
                f"key:  {key}",
            ]
        )
        self = super().__new__(cls, text)
        self.title, self.rows, self.totals = title, tuple(rows), tuple(totals)
        self.step, self.key = step, key
        self._header = header
        return self

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope shows the text table (and, after it, the HTML tables)."""
        del path, subtree_renderer
        return rendering_parts.text(str(self))

    def _repr_html_(self) -> str:
        sharded = len(self._header) > len(_ROW_HEADER)
        return (
            f"<div><p>{html.escape(self.title)}</p>"
            + html_table(self._header, _row_cells(self.rows, sharded))
            + html_table(_TOTAL_HEADER, self.totals)
            + f"<p>step: {self.step}<br>key: {html.escape(self.key)}</p></div>"
        )


def summarize(state: Any) -> Summary:
    """The state at a glance: ``state.summary()``.

    One row per array of the model, then the totals of ``params``,
    ``model_without_params``, ``opt_state`` (with its optax state types),
    ``loss_fn_state`` and each field a subclass adds, the step and the key.
    Reads the step (and scalar subclass fields) from the device.

    Args:
      state: A ``TrainState``.

    Returns:
      A `Summary`: the text table, shown as HTML in a notebook.

    Raises:
      pztrain.DonatedStateError: if a train step consumed the state.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from pztrain.state import TrainState
      >>> model = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
      >>> state = TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
      >>> print(summarize(state))  # doctest: +NORMALIZE_WHITESPACE
      TrainState at step 0: 2 trainable arrays, 9 values (36 B); 0 frozen
      <BLANKLINE>
      name  shape   dtype    count  bytes  kind
      ----  ------  -------  -----  -----  ---------
      b     (3,)    float32      3     12  trainable
      w     (2, 3)  float32      6     24  trainable
      <BLANKLINE>
      part                  arrays  values  bytes  per device  contents
      --------------------  ------  ------  -----  ----------  ------------------------
      params                     2       9   36 B        36 B
      model_without_params       0       0    0 B         0 B
      opt_state                  0       0    0 B         0 B  (EmptyState, EmptyState)
      loss_fn_state              0       0    0 B         0 B  None
      <BLANKLINE>
      step: 0
      key:  threefry2x32 key, shape ()
    """
    state.check_not_donated("state.summary()")
    rest = state.model_without_params
    types = _nnx_types(rest)
    rows = [
        _row(n, x, "trainable", types.get(n)) for n, x in named_leaves(state.params)
    ]
    rows += _rest_rows(rest)
    step = int(state.step)
    trained = [r for r in rows if r.kind == "trainable"]
    frozen = [r for r in rows if r.kind == "frozen"]
    count, nbytes = sum(r.count for r in trained), sum(r.nbytes for r in trained)
    title = (
        f"{type(state).__name__} at step {step}: {len(trained)} trainable "
        f"array{'' if len(trained) == 1 else 's'}, {count:,} values "
        f"({_human(nbytes)}); {len(frozen)} frozen"
    )
    if frozen:
        frozen_count = sum(r.count for r in frozen)
        title += f" ({frozen_count:,} values)"
    return Summary(title, rows, _totals(state), step, _key_text(state.root_rng))
