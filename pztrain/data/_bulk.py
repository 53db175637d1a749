"""`BulkSource`: a data source that grain reads a batch of records from in one
call, and the check of Hugging Face datasets.

grain reads a ``MapDataset`` built on a data source one record at a time
unless the source has a batched read (``_getitems``). Two common sources have
one under another name: a Hugging Face ``datasets.Dataset`` (``dataset[indices]``,
Arrow's bulk read: ~15× faster than a row at a time here),
``grain.sources.ArrayRecordDataSource`` (``__getitems__``, parallel reads:
~2–3× faster than one call per record here) and a NumPy array such as a
memory-mapped ``.npy`` file (fancy indexing). `BulkSource` gives grain those.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

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
        come out as dicts of NumPy values), a NumPy array (rows), or any data
        source with ``len()`` and ``[i]`` (its ``__getitems__``, if it has
        one, reads a batch).

    Raises:
      BatchError: for a streaming ``datasets.IterableDataset`` (no random
        access) or a Hugging Face dataset without a NumPy format, naming the
        fix.

    Example:
      >>> import grain
      >>> ds = grain.MapDataset.source(BulkSource([b"a", b"b", b"c"]))
      >>> ds[4]  # grain reads index i as i mod len
      b'b'
    """

    def __init__(self, source: Any):
        if is_hf_dataset(source):
            _check_hf(source)
        self.source = source
        self._hf = is_hf_dataset(source)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[int(index)]

    def _getitems(self, indices: Sequence[int]) -> Sequence[Any]:
        n = len(self.source)
        keys = [int(i) % n for i in indices]  # index i as i mod len, as grain's
        if self._hf:
            columns = self.source[keys]
            return [{k: v[j] for k, v in columns.items()} for j in range(len(keys))]
        if hasattr(self.source, "__getitems__"):
            return self.source.__getitems__(keys)
        if isinstance(self.source, np.ndarray):  # e.g. a memory-mapped file
            return list(np.asarray(self.source[keys]))  # plain rows, not memmaps
        return [self.source[i] for i in keys]

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
