"""The batch rule, shared by the loaders, `pztrain.fit` and the step's trace.

A batch is a dict of arrays (nested dicts allowed) whose leaves share one leading
batch axis; with ``steps_per_call=k`` every leaf carries a leading axis of ``k``
first (one slice per step), then the batch axis. Data that is batched, stacked or
counted by examples (loaders, `pztrain.fit`, `pztrain.evaluate`) needs that axis on
every leaf; a train step also takes leaves without one (e.g. a scalar
temperature), passed to the loss function as they are. A loader's columns
(`loader_columns`) are a flat dict of numeric arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._tree import named_leaves

__all__ = ["BatchError", "check_batch", "loader_columns", "stack_batches"]


class BatchError(ValueError):
    """A batch is not a dict of arrays with one shared leading axis.

    Example:
      >>> from pztrain import BatchError
      >>> from pztrain.data import check_batch
      >>> import numpy as np
      >>> try:
      ...     check_batch({"x": np.zeros((4, 2)), "y": np.zeros(3)})
      ... except BatchError as e:
      ...     print(e)
      Batch leaves must share their leading (batch) axis; got x: 4, y: 3.
    """


def check_batch(
    batch: Any,
    expected_keys: Iterable[str] | None = None,
    *,
    steps_per_call: int = 1,
    scalars: bool = False,
    members: int | None = None,
) -> int | None:
    """Checks one batch and returns its size; on tracers too (the step's trace).

    Args:
      batch: A dict of arrays.
      expected_keys: Keys every batch must have (e.g. those of the first batch).
      steps_per_call: With ``k > 1``, every leaf has a leading axis ``k`` before
        its batch axis.
      scalars: Allow leaves without a batch axis, and no leaves at all (as a
        train step does: its loss function may need no batch).
      members: One batch per member of a population of ``members``: every
        leaf has a leading member axis of that length before the others, and
        the size returned is a member's batch.

    Returns:
      The batch-axis length shared by the leaves (``None`` if none has one).

    Raises:
      BatchError: naming the missing key, the non-array, ``None`` or axis-less
        leaf, the leaves whose batch axes differ, or a leaf of a batch of zero
        examples (an empty batch is an error, not a step on nothing).

    Example:
      >>> import numpy as np; from pztrain.data import check_batch
      >>> check_batch({"x": np.zeros((4, 2)), "y": np.zeros(4)})
      4
      >>> check_batch({"x": np.zeros((2, 4, 3))}, steps_per_call=2)
      4
      >>> check_batch({"x": np.zeros((3, 4, 2))}, members=3)  # 3 batches of 4
      4
    """
    if not isinstance(batch, Mapping):
        raise BatchError(
            f"A batch must be a dict of arrays (passed to the step as keyword "
            f"arguments); got {type(batch).__name__}."
        )
    _check_keys(batch, expected_keys)
    leaves = named_leaves(dict(batch), is_leaf=_is_none)  # None is no pytree leaf
    if not leaves and not scalars:
        raise BatchError("A batch needs at least one array.")
    sizes: dict[str, int] = {}
    for name, leaf in leaves:
        _check_leaf(name, leaf, scalars)
        shape = _member_axis(name, np.shape(leaf), members)
        size = _batch_axis(name, shape, steps_per_call, scalars)
        if size is not None:
            sizes[name] = size
    return _shared_size(sizes)


_ARRAYS = (np.ndarray, jax.Array, np.generic)
_NUMBERS = (bool, int, float, complex)


def _is_none(x: Any) -> bool:
    return x is None


def _check_leaf(name: str, leaf: Any, scalars: bool) -> None:
    if leaf is None:
        raise BatchError(
            f"batch[{name!r}] is None; give it an array or drop the key (the "
            "loss function would get None)."
        )
    # A train step also takes Python numbers: jit makes them scalars.
    if not isinstance(leaf, _ARRAYS + (_NUMBERS if scalars else ())):
        raise BatchError(
            f"batch[{name!r}] is a {type(leaf).__name__}, not an array; convert "
            "it with np.asarray (strings and Python objects cannot enter jit)."
        )


def _shared_size(sizes: dict[str, int]) -> int | None:
    """The batch size all leaves share (``None`` if no leaf has a batch axis)."""
    if len(set(sizes.values())) > 1:
        raise BatchError(
            "Batch leaves must share their leading (batch) axis; got "
            + ", ".join(f"{k}: {v}" for k, v in sizes.items())
            + "."
        )
    name, size = next(iter(sizes.items()), (None, None))
    if size == 0:
        raise BatchError(
            f"The batch has 0 examples (batch[{name!r}] has batch axis 0); every "
            "batch needs at least one: skip empty batches (a mean over none is NaN)."
        )
    return size


def _check_keys(batch: Mapping[str, Any], expected: Iterable[str] | None) -> None:
    if expected is None:
        return
    missing = sorted(set(expected) - set(batch))
    if missing:
        raise BatchError(
            f"Batch is missing key(s) {missing}; it has {sorted(batch)}. Every "
            "batch needs the same keys."
        )


def _member_axis(
    name: str, shape: tuple[int, ...], members: int | None
) -> tuple[int, ...]:
    """``shape`` without its leading member axis (``members`` long)."""
    if members is None:
        return shape
    if not shape or shape[0] != members:
        raise BatchError(
            f"With one batch per member every batch leaf has a leading member "
            f"axis of {members} (the population's size); batch[{name!r}] has "
            f"shape {list(shape)}. Stack one batch per member on axis 0."
        )
    return shape[1:]


def _batch_axis(
    name: str, shape: tuple[int, ...], steps_per_call: int, scalars: bool
) -> int | None:
    if steps_per_call > 1:
        if not shape or shape[0] != steps_per_call:
            raise BatchError(
                f"With steps_per_call={steps_per_call} every batch leaf needs a "
                f"leading axis of {steps_per_call} (one slice per step); "
                f"batch[{name!r}] has shape {list(shape)}. Stack "
                f"{steps_per_call} batches along a new axis 0."
            )
        shape = shape[1:]
    if not shape and scalars:
        return None
    if not shape:
        raise BatchError(
            f"batch[{name!r}] is a scalar; batch leaves need a leading batch axis."
        )
    return shape[0]


def stack_batches(batches: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Stacks batches along a new leading axis (for ``steps_per_call > 1``).

    Example:
      >>> import numpy as np; from pztrain.data import check_batch, stack_batches
      >>> batch = stack_batches([{"x": np.zeros((4, 2))}, {"x": np.ones((4, 2))}])
      >>> batch["x"].shape, check_batch(batch, steps_per_call=2)
      ((2, 4, 2), 4)
    """
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def loader_columns(arrays: Any) -> dict[str, np.ndarray]:
    """`pztrain.data.ArrayLoader`'s arrays as NumPy arrays, checked column by
    column (a flat dict name -> numeric array, at least one example)."""
    if not hasattr(arrays, "keys"):  # a dict, or what dict() reads as one
        raise BatchError(
            "ArrayLoader takes a dict name -> array (e.g. {'x': x, 'y': y}; the "
            f"names are the loss function's arguments); got {type(arrays).__name__}."
        )
    columns = {}
    for name, value in dict(arrays).items():
        if not isinstance(name, str):
            raise BatchError(
                "ArrayLoader's column names must be strings (the loss function's "
                f"arguments); got {name!r}."
            )
        columns[name] = _loader_column(name, value)
    if not columns:
        raise BatchError("ArrayLoader needs at least one column; got an empty dict.")
    if all(c.shape[:1] == (0,) for c in columns.values()):
        name, column = next(iter(columns.items()))
        raise BatchError(
            f"ArrayLoader got 0 examples (column {name!r} has shape "
            f"{list(column.shape)}); pass at least one example."
        )
    return columns


def _loader_column(name: str, value: Any) -> np.ndarray:
    if value is None or isinstance(value, Mapping):
        got = "None" if value is None else f"a {type(value).__name__}"
        raise BatchError(
            f"Column {name!r} is {got}; ArrayLoader takes one array per name (a "
            "flat dict of arrays)."
        )
    try:
        column = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise BatchError(
            f"Column {name!r} is not a rectangular array ({e}); give every example "
            "the same shape (pad them)."
        ) from None
    if not (jnp.issubdtype(column.dtype, jnp.number) or column.dtype == np.bool_):
        raise BatchError(
            f"Column {name!r} has dtype {column.dtype}, not numbers or bools; "
            "encode it as numbers first (e.g. token ids for strings): only "
            "numeric arrays enter jit."
        )
    return column
