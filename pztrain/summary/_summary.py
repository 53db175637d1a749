"""`Summary` (a ``str`` that notebooks show as HTML tables) and `summarize`."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from treescope import rendering_parts

from pztrain._members import member_count
from pztrain._table import html_table, text_table
from pztrain._tree import named_leaves
from pztrain.summary._rows import ParamRow, nnx_types, rest_rows, row
from pztrain.summary._totals import human, key_text, totals

__all__ = ["Summary", "summarize"]

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
        title = "<br>".join(map(html.escape, self.title.splitlines()))
        return (
            f"<div><p>{title}</p>"
            + html_table(self._header, _row_cells(self.rows, sharded), "name")
            + html_table(_TOTAL_HEADER, self.totals, "contents")
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
      >>> import jax, jax.numpy as jnp, optax; from pztrain.summary import summarize
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
    types = nnx_types(rest)
    rows = [row(n, x, "trainable", types.get(n)) for n, x in named_leaves(state.params)]
    rows += rest_rows(rest)
    step = int(state.step)
    trained = [r for r in rows if r.kind == "trainable"]
    frozen = [r for r in rows if r.kind == "frozen"]
    count, nbytes = sum(r.count for r in trained), sum(r.nbytes for r in trained)
    title = (
        f"{type(state).__name__} at step {step}: {len(trained)} trainable "
        f"array{'' if len(trained) == 1 else 's'}, {count:,} values "
        f"({human(nbytes)}); {len(frozen)} frozen"
    )
    if frozen:
        frozen_count = sum(r.count for r in frozen)
        title += f" ({frozen_count:,} values)"
    title += _population_line(member_count(state.root_rng), count)
    return Summary(title, rows, totals(state), step, key_text(state.root_rng))


def _population_line(members: int | None, count: int) -> str:
    """A population's line under the title (every array has a member axis)."""
    if members is None:
        return ""
    return (
        f"\na population of {members} members: every shape starts with the "
        f"member axis ({count // members:,} values per member)"
    )
