"""What one process reads for a run of steps of a random-access dataset.

Global batch ``s`` is a function of ``s``, the seed and the dataset's length:
epoch ``e = s // steps_per_epoch`` is a permutation of the examples seeded
from ``(seed, e)`` (`pztrain.data._order`), cut into batches of
``batch_size``. Each process reads only its block of rows of that batch
(`process_rows`), checks the examples (a flat dict of numeric arrays of one
shape) and stacks them.

The examples are read at index ``e * n + i`` for example ``i`` in epoch ``e``
(a grain dataset of length ``n`` reads index ``j`` as ``j mod n``), so the
random transformations of a grain pipeline (``shuffle``, ``random_map``) draw
new values each epoch, and the same values whatever the process count.

The rows of several steps are read in few calls to the source (`Rows.read_steps`):
one permutation over all their places, then batched reads and decodes of at
most `READ_BYTES` of records each (`Rows.bounded`: a block of 32 steps of
64 KiB records would otherwise hold 128 MiB of records at once for a
decoded block of half a megabyte). `Rows`, `ReadCalls` and `ReadBlocks` are
picklable: grain's worker processes run them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pztrain._tree import describe, describe_shape
from pztrain.data._batch import BatchError
from pztrain.data._bulk import BulkSource
from pztrain.data._order import grain_order, shuffled

__all__ = [
    "READ_BYTES",
    "BatchTransform",
    "ReadBlocks",
    "ReadCalls",
    "Rows",
    "record_bytes",
    "stack_examples",
]

READ_BYTES = 2**23  # records (as read, and as decoded) per call to the source


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where a process's rows of each global batch come from.

    Attributes:
      examples: A grain ``MapDataset`` of examples (flat dicts of arrays), read
        with ``_getitems(positions)``; or a `pztrain.data.BulkSource`, read
        with ``read(positions)`` (records, or a dict of columns).
      num_examples: Its length ``n`` (one epoch).
      batch_size: Examples per global batch.
      rows: This process's ``(start, stop)`` rows of each global batch.
      seed: Shuffle each epoch with this seed (``None``: the dataset's own
        order): place ``i`` of epoch ``e`` holds example ``permute(i)`` keyed
        by ``(seed, e)``.
      transform: ``(batch, positions) -> batch``, run on the stacked rows of
        each step (`BatchTransform`), or ``None``.
      decode: ``records -> batch``: turns what the source returns for a run of
        rows (a list of records) into a dict of arrays, or ``None``.
      order: ``"feistel"`` (`pztrain.data._order.shuffled`) or ``"grain"``
        (grain's ``index_shuffle`` of place ``i`` seeded ``seed + e``).
      read_rows: Rows read per call to the source, at most (``None``: all
        the rows asked for at once); see `bounded`.
    """

    examples: Any
    num_examples: int
    batch_size: int
    rows: tuple[int, int]
    seed: int | None = None
    transform: Any = None
    decode: Any = None
    order: str = "feistel"
    read_rows: int | None = None

    def bounded(self, batch: Mapping[str, np.ndarray]) -> Rows:
        """These rows read `READ_BYTES` at a time, at most (one step's rows at
        least), from the size of a record as the source returns it (record 0)
        and of a row of ``batch`` as decoded.

        Example:
          >>> import numpy as np
          >>> from pztrain.data._reading import Rows
          >>> rows = Rows([b"x" * 2**20] * 64, 64, 8, (0, 8))
          >>> rows.bounded({"x": np.zeros((8, 4))}).read_rows  # 1 MiB records
          8
        """
        step_rows = max(self.rows[1] - self.rows[0], 1)
        decoded = sum(np.asarray(v).nbytes for v in batch.values()) // step_rows
        row = max(record_bytes(_first_record(self.examples)), decoded, 1)
        rows = max(READ_BYTES // row, step_rows)
        return dataclasses.replace(self, read_rows=rows)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def positions(
        self, steps: Sequence[int] | np.ndarray, rows: tuple[int, int] | None = None
    ) -> np.ndarray:
        """The indices ``e * n + i`` read for ``rows`` of each global batch in
        ``steps``: int64 ``[len(steps), rows]``, all at once."""
        start, stop = self.rows if rows is None else rows
        epochs, index = np.divmod(np.asarray(steps, np.int64), self.steps_per_epoch)
        places = (index * self.batch_size)[:, None] + np.arange(start, stop)
        return self.at_places(np.broadcast_to(epochs[:, None], places.shape), places)

    def at_places(self, epochs: np.ndarray, places: np.ndarray) -> np.ndarray:
        """The index ``e * n + i`` read for each place of its epoch ``e``
        (``i`` the example the epoch's order puts there)."""
        n = self.num_examples
        if self.seed is not None and self.order == "grain":
            places = grain_order(places, n, (self.seed + epochs) % 2**32)
        elif self.seed is not None:
            places = shuffled(places, epochs, n, self.seed)
        return epochs * n + places

    def read(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step``, read and stacked."""
        return {k: v[0] for k, v in self.read_steps([step]).items()}

    def read_steps(self, steps: Sequence[int]) -> dict[str, np.ndarray]:
        """This process's rows of each global batch in ``steps``, read in one
        call and stacked ``[len(steps), rows, ...]``."""
        positions = self.positions(steps)
        batch = self.read_at(positions.reshape(-1))
        rows = positions.shape[1]
        if self.transform is not None:
            each = [
                BatchTransform(self.transform)(
                    {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}, p
                )
                for i, p in enumerate(positions)
            ]
            return {k: np.stack([b[k] for b in each]) for k in each[0]}
        return {
            k: v.reshape(len(positions), rows, *v.shape[1:]) for k, v in batch.items()
        }

    def read_rest(self, epoch: int) -> dict[str, np.ndarray] | None:
        """The examples of ``epoch`` past its last full batch (all of them,
        whatever ``rows``), read and transformed; ``None`` if there are none."""
        first = self.steps_per_epoch * self.batch_size
        if first == self.num_examples:
            return None
        places = np.arange(first, self.num_examples, dtype=np.int64)
        positions = self.at_places(np.full_like(places, epoch), places)
        batch = self.read_at(positions)
        if self.transform is None:
            return batch
        return BatchTransform(self.transform)(batch, positions)

    def read_at(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The examples at ``positions``, read ``read_rows`` at a time and
        stacked."""
        size = self.read_rows or len(positions)
        if len(positions) <= size:
            return self._read_once(positions)
        parts = [
            self._read_once(positions[i : i + size])
            for i in range(0, len(positions), size)
        ]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _read_once(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The examples at ``positions``, read in one call and stacked."""
        if isinstance(self.examples, BulkSource):
            got = self.examples.read(positions)
        else:  # a grain pipeline: its own batched read, example by example
            got = self.examples._getitems(positions.tolist())  # grain's
        if self.decode is not None:
            return BatchTransform(self.decode, "decode")(got, positions)
        if isinstance(got, Mapping):  # columns (a Hugging Face dataset)
            stacked = _checked_columns(got, len(positions))
            if stacked is not None:
                return stacked
            got = [{k: v[j] for k, v in got.items()} for j in range(len(positions))]
        return stack_examples(got, positions, self.num_examples)


@dataclasses.dataclass(frozen=True)
class BatchTransform:
    """A function that returns a batch, its result checked.

    Attributes:
      fn: ``fn(batch, positions) -> batch``: ``batch`` a dict of arrays with a
        leading example axis, ``positions`` an int64 array of the index each
        row was read at (``e * n + i``: example ``i`` in epoch ``e``). It
        returns a dict of arrays with the same number of rows. With ``role``
        ``"decode"``: ``fn(records) -> batch``, records as the source gives
        them.
      role: The argument of `pztrain.GrainLoader` it came from.
    """

    fn: Any
    role: str = "batch_transform"

    def __call__(self, batch: Any, positions: Sequence[int]) -> dict:
        rows = len(positions)
        if self.role == "decode":
            out = self.fn(batch)
        else:
            out = self.fn(batch, np.asarray(positions, np.int64))
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        if not isinstance(out, Mapping):
            raise BatchError(
                f"{self.role} {name} returned a {type(out).__name__}; it must "
                "return the batch: a dict of arrays, one row per example."
            )
        for key, value in out.items():
            shape = np.shape(value)
            if not shape or shape[0] != rows or not isinstance(key, str):
                raise BatchError(
                    f"{self.role} {name} returned {key!r} of shape {shape} for "
                    f"a batch of {rows} rows: each value needs its rows along the "
                    "first axis."
                )
        out = {k: np.asarray(v) for k, v in out.items()}
        for key, value in out.items():
            if not (jnp.issubdtype(value.dtype, jnp.number) or value.dtype == np.bool_):
                raise BatchError(
                    f"{self.role} {name} returned {key!r} of dtype {value.dtype}, "
                    "not numbers or bools: encode it as numbers (e.g. token ids)."
                )
        return out


@dataclasses.dataclass(frozen=True)
class ReadCalls:
    """Call ``c`` → the batches of steps ``first + c*k`` to ``first + c*k + k - 1``
    (stacked along a new leading axis if ``k > 1``), read in one call.

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
        return self.rows.read_steps(range(start, start + k))


@dataclasses.dataclass(frozen=True)
class ReadBlocks:
    """Call ``c`` → block ``b = first_block + c``: the batches of steps
    ``b * size`` to ``b * size + size - 1`` stacked ``[size, rows, ...]``, read
    in one call. Steps before ``start`` are not read: their places hold a
    copy of the first batch read (no step trains on them).

    Attributes:
      rows: What to read.
      start: The first step wanted.
      size: Steps per block.
    """

    rows: Rows
    start: int
    size: int

    def __call__(self, call: int) -> dict[str, np.ndarray]:
        first = (self.start // self.size + int(call)) * self.size
        skip = max(self.start - first, 0)
        got = self.rows.read_steps(range(first + skip, first + self.size))
        if not skip:
            return got
        return {k: np.concatenate([v[:1].repeat(skip, 0), v]) for k, v in got.items()}


def record_bytes(record: Any) -> int:
    """The bytes of a record or example as read: ``bytes``, arrays, and dicts,
    lists or tuples of them (anything else: its ``sys.getsizeof``).

    Example:
      >>> import numpy as np
      >>> from pztrain.data._reading import record_bytes
      >>> record_bytes(b"abcd"), record_bytes({"x": np.zeros(3), "y": [b"ab"]})
      (4, 26)
    """
    if isinstance(record, bytes | bytearray | memoryview):
        return len(record)
    if isinstance(record, np.ndarray | np.generic):
        return int(record.nbytes)
    if isinstance(record, Mapping):
        return sum(record_bytes(v) for v in record.values())
    if isinstance(record, list | tuple):
        return sum(record_bytes(v) for v in record)
    return sys.getsizeof(record)


def _first_record(examples: Any) -> Any:
    """Record 0 as the dataset's source returns it (before any ``.map``)."""
    if isinstance(examples, BulkSource):
        return examples.read([0])
    root = examples
    while getattr(root, "parents", None):
        root = root.parents[0]
    return root[0]


def _checked_columns(columns: Mapping[str, Any], rows: int) -> dict | None:
    """The columns as a batch, if each is a numeric array of ``rows`` rows
    under a string key; ``None`` if not (for `stack_examples` to name the
    example at fault)."""
    out = {}
    for name, value in columns.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray):
            return None
        if not value.shape or value.shape[0] != rows:
            return None
        if not (jnp.issubdtype(value.dtype, jnp.number) or value.dtype == np.bool_):
            return None
        out[name] = value
    return out


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
        # np.array stacks a list of small arrays 3-10x faster than np.stack
        batch = {k: np.array([e[k] for e in items]) for k in first}
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
            "decode the records a batch at a time with GrainLoader(..., "
            "decode=...) (e.g. a pztrain.data.RecordLayout), or map each record to "
            "one, e.g. dataset.map(lambda r: {'x': ..., 'y': ...})."
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
