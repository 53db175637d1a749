"""`BulkSource`: a data source read a batch of records per call, and the check
of Hugging Face datasets.

grain reads a ``MapDataset`` built on a data source one record at a time
unless the source has a batched read (``_getitems``). `BulkSource` gives
grain, and `pztrain.GrainLoader`, the fastest batched read each common source
has:

* a Hugging Face ``datasets.Dataset`` (numpy format): its numeric columns as
  NumPy views of the memory-mapped Arrow data, one gather a batch
  (`pztrain.data._arrow`); other columns through ``dataset[indices]``,
  Arrow's bulk read (~15× faster than a row at a time here);
* ``grain.sources.ArrayRecordDataSource``: one reader call per file and batch
  (`pztrain.data._array_record`);
* a NumPy array such as a memory-mapped ``.npy`` file: fancy indexing;
* any other source: its ``__getitems__`` if it has one, else ``[i]`` per record.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from pztrain.data._array_record import ArrayRecordFiles
from pztrain.data._arrow import ArrowColumns
from pztrain.data._batch import BatchError
from pztrain.data._extras import loaded

__all__ = ["BulkSource", "is_hf_dataset"]


def is_hf_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.Dataset`` (or its streaming kind)."""
    datasets = loaded("datasets")
    if datasets is None:
        return False
    return isinstance(data, datasets.Dataset | datasets.IterableDataset)


class BulkSource:
    """A random-access data source for grain, read a batch at a time.

    Use it as ``grain.MapDataset.source(BulkSource(source))``; `pztrain.GrainLoader`
    wraps a source it is given directly in one.

    Args:
      source: A Hugging Face ``datasets.Dataset`` with a NumPy format (rows
        come out as dicts of NumPy values), a ``grain.sources.ArrayRecordDataSource``
        (``bytes`` records), a NumPy array (rows; e.g. a memory-mapped ``.npy``
        file), or any data source with ``len()`` and ``[i]`` (its
        ``__getitems__``, if it has one, reads a batch).

    Raises:
      BatchError: for a streaming ``datasets.IterableDataset`` (no random
        access) or a Hugging Face dataset without a NumPy format, naming the
        fix.

    Example:
      >>> import grain, numpy as np; from pztrain.data import BulkSource
      >>> ds = grain.MapDataset.source(BulkSource([b"a", b"b", b"c"]))
      >>> ds[4]  # grain reads index i as i mod len
      b'b'
      >>> BulkSource(np.arange(10).reshape(5, 2)).read([4, 0, 6])  # one call
      array([[8, 9],
             [0, 1],
             [2, 3]])
    """

    def __init__(self, source: Any):
        self._hf = is_hf_dataset(source)
        if self._hf:
            _check_hf(source)
        self.source = source
        self._fast = _fast_reader(source)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[int(index)]

    def read(self, indices: Sequence[int] | np.ndarray) -> Any:
        """The records at ``indices`` (index ``i`` read as ``i mod len``), in
        one call: a dict of columns for a Hugging Face dataset, an array of
        rows for a NumPy array, else a list of records."""
        keys = np.asarray(indices, np.int64) % len(self.source)
        if self._fast is not None:
            return self._fast.read(keys)
        if self._hf:
            return self.source[keys.tolist()]
        if isinstance(self.source, np.ndarray):  # e.g. a memory-mapped file
            return np.asarray(self.source[keys])  # plain rows, not a memmap
        if hasattr(self.source, "__getitems__"):
            return self.source.__getitems__(keys.tolist())
        return [self.source[i] for i in keys.tolist()]

    def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
        """grain's batched read: the records at ``indices``, as a list."""
        got = self.read(indices)
        if isinstance(got, dict):  # columns: one dict per row
            return [{k: v[j] for k, v in got.items()} for j in range(len(indices))]
        return list(got)

    def __repr__(self) -> str:
        return f"BulkSource({self.source!r})"

    def __getstate__(self) -> dict[str, Any]:
        """A memory-mapped file travels to grain's workers as its name (NumPy
        would pickle its whole contents)."""
        state = dict(self.__dict__)
        if _whole_memmap(self.source):
            m = self.source
            order = "F" if m.flags.f_contiguous and not m.flags.c_contiguous else "C"
            state["source"] = _MappedFile(
                m.filename, m.dtype.str, m.offset, m.shape, order
            )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["source"], _MappedFile):
            state["source"] = state["source"].open()
        self.__dict__.update(state)


def _fast_reader(source: Any) -> ArrowColumns | ArrayRecordFiles | None:
    """A faster batched read of ``source`` than its own, if there is one."""
    if is_hf_dataset(source):
        return ArrowColumns.of(source)
    return ArrayRecordFiles.of(source)


def _whole_memmap(x: Any) -> bool:
    """A ``np.memmap`` of a file that holds its own mapping (not a view)."""
    return (
        isinstance(x, np.memmap)
        and x.filename is not None
        and isinstance(x.base, mmap.mmap)
    )


class _MappedFile(NamedTuple):
    filename: str
    dtype: str
    offset: int
    shape: tuple[int, ...]
    order: str

    def open(self) -> np.memmap:
        return np.memmap(
            self.filename, self.dtype, "r", self.offset, self.shape, self.order
        )


def _check_hf(dataset: Any) -> None:
    if isinstance(dataset, loaded("datasets").IterableDataset):
        raise BatchError(
            "A datasets.IterableDataset streams its rows in order: GrainLoader "
            "needs random access. Load the dataset without streaming=True (a "
            "datasets.Dataset, memory-mapped from disk)."
        )
    kind = dataset.format["type"]
    if kind != "numpy":
        raise BatchError(
            f"The datasets.Dataset has format {kind!r} (rows of Python "
            "objects); give it a NumPy format: dataset.with_format('numpy')."
        )
