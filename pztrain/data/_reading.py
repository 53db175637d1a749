"""What one process reads for one step of a random-access dataset.

Global batch ``s`` is a function of ``s``, the seed and the dataset's length:
epoch ``e = s // steps_per_epoch`` is a permutation of the examples (grain's
own shuffle, seeded per epoch), cut into batches of ``batch_size``. Each
process reads only its block of rows of that batch (`process_rows`), checks
every example (a flat dict of numeric arrays of one shape) and stacks them.

The examples are read at index ``e * n + i`` for example ``i`` in epoch ``e``
(a grain dataset of length ``n`` reads index ``j`` as ``j mod n``), so the
random transformations of a grain pipeline (``shuffle``, ``random_map``) draw
new values each epoch, and the same values whatever the process count.

`Rows` and `ReadCalls` are picklable: grain's worker processes run them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pztrain._tree import describe, describe_shape
from pztrain.data._batch import BatchError, stack_batches

__all__ = ["BatchTransform", "ReadCalls", "Rows", "stack_examples"]


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where a process's rows of each global batch come from.

    Attributes:
      examples: A grain ``MapDataset`` of examples (flat dicts of arrays), or
        a `pztrain.data.BulkSource` (a data source read a batch at a time);
        either reads with ``_getitems(positions)``.
      num_examples: Its length ``n`` (one epoch).
      batch_size: Examples per global batch.
      rows: This process's ``(start, stop)`` rows of each global batch.
      seed: Shuffle each epoch with this seed (``None``: the dataset's own
        order), as grain's ``MapDataset.shuffle(seed)`` does: place ``i`` of
        epoch ``e`` holds example ``index_shuffle(i, seed=seed + e)``.
      transform: ``(batch, positions) -> batch``, run on the stacked rows
        (`BatchTransform`), or ``None``.
    """

    examples: Any
    num_examples: int
    batch_size: int
    rows: tuple[int, int]
    seed: int | None = None
    transform: Any = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def positions(self, step: int, rows: tuple[int, int] | None = None) -> list[int]:
        """The indices ``e * n + i`` read for ``rows`` of global batch ``step``."""
        n = self.num_examples
        epoch, index = divmod(step, self.steps_per_epoch)
        start, stop = self.rows if rows is None else rows
        first = epoch * n + index * self.batch_size
        if self.seed is None:
            return list(range(first + start, first + stop))
        from grain.experimental import index_shuffle  # grain's shuffle, per index

        seed, last = (self.seed + epoch) % 2**32, n - 1
        first -= epoch * n
        return [
            epoch * n + index_shuffle(i, max_index=last, seed=seed, rounds=4)
            for i in range(first + start, first + stop)
        ]

    def read(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step``, read and stacked."""
        return self.read_at(self.positions(step))

    def read_at(self, positions: list[int]) -> dict[str, np.ndarray]:
        """The examples at ``positions``, read, stacked and transformed."""
        items = self.examples._getitems(positions)  # grain's batched read
        batch = stack_examples(items, positions, self.num_examples)
        if self.transform is None:
            return batch
        return BatchTransform(self.transform)(batch, positions)


@dataclasses.dataclass(frozen=True)
class BatchTransform:
    """A function on whole batches, its result checked.

    Attributes:
      fn: ``fn(batch, positions) -> batch``: ``batch`` a dict of arrays with a
        leading example axis, ``positions`` an int64 array of the index each
        row was read at (``e * n + i``: example ``i`` in epoch ``e``). It
        returns a dict of arrays with the same number of rows.
    """

    fn: Any

    def __call__(self, batch: dict, positions: Sequence[int]) -> dict:
        rows = len(positions)
        out = self.fn(batch, np.asarray(positions, np.int64))
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        if not isinstance(out, Mapping):
            raise BatchError(
                f"batch_transform {name} returned a {type(out).__name__}; it must "
                "return the batch: a dict of arrays, one row per example."
            )
        for key, value in out.items():
            shape = np.shape(value)
            if not shape or shape[0] != rows or not isinstance(key, str):
                raise BatchError(
                    f"batch_transform {name} returned {key!r} of shape {shape} for "
                    f"a batch of {rows} rows: each value needs its rows along the "
                    "first axis."
                )
        return {k: np.asarray(v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class ReadCalls:
    """Call ``c`` → the batches of steps ``first + c*k`` to ``first + c*k + k - 1``
    (stacked along a new leading axis if ``k > 1``).

    Attributes:
      rows: What to read.
      first: The global step of call 0.
      steps_per_call: ``k``.
    """

    rows: Rows
    first: int
    steps_per_call: int = 1

    def __call__(self, call: int) -> dict[str, np.ndarray]:
        k = self.steps_per_call
        start = self.first + int(call) * k
        if k == 1:
            return self.rows.read(start)
        return stack_batches([self.rows.read(s) for s in range(start, start + k)])


def stack_examples(
    items: Sequence[Any], positions: Sequence[int], num_examples: int
) -> dict[str, np.ndarray]:
    """Examples stacked into one batch, each checked.

    Raises:
      BatchError: naming the example (its index in the dataset) and the key:
        ``None`` (a filter dropped it), not a dict, a leaf that is not a
        numeric array, or another shape, dtype or set of keys than the first
        example of the batch.
    """
    stacked = _stacked(items)
    if stacked is not None:
        return stacked
    columns: list[dict[str, np.ndarray]] = []
    first = 0
    for item, position in zip(items, positions, strict=True):
        example = position % num_examples
        checked = _example(item, example)
        if columns:
            _same(checked, columns[0], example, first)
        else:
            first = example
        columns.append(checked)
    return {k: np.stack([c[k] for c in columns]) for k in columns[0]}


_ARRAYS = (np.ndarray, np.generic, bool, int, float)


def _stacked(items: Sequence[Any]) -> dict[str, np.ndarray] | None:
    """The batch, if the examples are plainly fine (the common case, checked
    in bulk); ``None`` if anything is off, for `stack_examples` to name it."""
    try:
        first = items[0]
        width = len(first)
        if not isinstance(first, dict) or any(len(e) != width for e in items):
            return None
        batch = {k: np.stack([e[k] for e in items]) for k in first}
    except (TypeError, ValueError, KeyError):
        return None
    for name, column in batch.items():
        value = first[name]
        if not isinstance(name, str) or not isinstance(value, _ARRAYS):
            return None
        if column.dtype != np.asarray(value).dtype:
            return None
        if not (jnp.issubdtype(column.dtype, jnp.number) or column.dtype == np.bool_):
            return None
    return batch


def _example(item: Any, index: int) -> dict[str, np.ndarray]:
    """One example as a flat dict of numeric NumPy arrays."""
    if item is None:
        raise BatchError(
            f"Example {index} is None: a random-access dataset needs an example at "
            "every index (a grain filter leaves None behind). Drop those examples "
            "when writing the data, or pass an IterDataset to fit (read in order)."
        )
    if not isinstance(item, Mapping):
        raise BatchError(
            f"Example {index} is a {type(item).__name__}, not a dict of arrays: "
            "map each record to one, e.g. dataset.map(lambda r: {'x': ..., 'y': "
            "...}) (records stored as bytes need decoding first)."
        )
    out = {}
    for name, value in item.items():
        if not isinstance(name, str):
            raise BatchError(
                f"Example {index} has the key {name!r}; keys are strings (the loss "
                "function's arguments)."
            )
        if not isinstance(value, _ARRAYS):
            raise BatchError(
                f"Example {index}[{name!r}] is a {describe(value)}, not an array: "
                "convert it in a .map (np.asarray; bytes with np.frombuffer). A "
                "flat dict of arrays is an example."
            )
        array = np.asarray(value)
        if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_):
            raise BatchError(
                f"Example {index}[{name!r}] has dtype {array.dtype}, not numbers or "
                "bools: encode it as numbers in a .map (e.g. token ids for text)."
            )
        out[name] = array
    return out


def _same(
    columns: dict[str, np.ndarray],
    like: dict[str, np.ndarray],
    index: int,
    first: int,
) -> None:
    """Example ``index`` has the keys, shapes and dtypes of example ``first``."""
    if columns.keys() != like.keys():
        raise BatchError(
            f"Example {index} has keys {sorted(columns)}, example {first} has "
            f"{sorted(like)}: every example needs the same keys."
        )
    for name, array in columns.items():
        want = like[name]
        if array.shape != want.shape or array.dtype != want.dtype:
            raise BatchError(
                f"Example {index}[{name!r}] is {describe(array)}, example {first}'s "
                f"is {describe_shape(want.shape, want.dtype)}: the examples of a "
                "batch need one shape and dtype. Pad or crop them in a .map (or "
                "pack sequences, on an IterDataset)."
            )
