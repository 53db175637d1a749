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

A pipeline written as grain teaches it, ``grain.MapDataset.source(source)
.map(decode)``, reads through grain's batched chain (``_getitems``: each
transformation takes its parent's batch and maps it example by example) down
to its source, which grain then reads a record per call unless the source has
grain's own batched read (``ArrayRecordDataSource`` has ``__getitems__``, not
grain's ``_getitems``). `read_in_batches` gives `pztrain.GrainLoader` the same
pipeline over ``BulkSource(source)``: the user's nodes copied and re-linked,
the user's dataset left as it was (and grain's per-record read metrics left
out, as for a source given directly).
"""

from __future__ import annotations

import copy
import mmap
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from pztrain.data._array_record import ArrayRecordFiles
from pztrain.data._arrow import ArrowColumns
from pztrain.data._batch import BatchError
from pztrain.data._extras import import_extra, loaded

__all__ = ["BulkSource", "is_hf_dataset", "read_in_batches"]

# grain's transformations that pass a batched read down to their one parent
# and hold it only as their parent: a copy re-links to another parent.
_RELINKED = frozenset(
    {
        "MapMapDataset",
        "RandomMapMapDataset",
        "MapWithIndexMapDataset",
        "FilterMapDataset",
        "ShuffleMapDataset",
        "SliceMapDataset",
        "RepeatMapDataset",
        "_WithSeedMapDataset",
    }
)

_FIX = (
    "To read it a batch at a time, build the pipeline on "
    "grain.MapDataset.source(pztrain.data.BulkSource(source)) and put its "
    "steps in grain's .map, .random_map, .map_with_index or .filter."
)


def is_hf_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.Dataset`` (or its streaming kind)."""
    datasets = loaded("datasets")
    if datasets is None:
        return False
    return isinstance(data, datasets.Dataset | datasets.IterableDataset)


class BulkSource:
    """A random-access data source for grain, read a batch at a time.

    Use it as ``grain.MapDataset.source(BulkSource(source))``; `pztrain.GrainLoader`
    wraps a source it is given directly in one, and reads a pipeline built on
    ``grain.MapDataset.source(source)`` as if built on one (`read_in_batches`).

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

    @property
    def batched(self) -> bool:
        """Whether `read` reads the records in one call (else ``[i]`` each)."""
        return (
            self._fast is not None
            or self._hf
            or isinstance(self.source, np.ndarray)
            or hasattr(self.source, "__getitems__")
        )

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


def read_in_batches(dataset: Any) -> tuple[Any, str | None]:
    """A grain ``MapDataset`` read a batch at a time, or why it cannot be.

    Returns ``(pipeline, reason)``. A chain of grain's own transformations
    (``.map``, ``.random_map``, ``.map_with_index``, ``.filter``,
    ``.shuffle``, ``.slice``, ``.repeat``, ``.seed``) over a data source that
    grain reads a record per call but `BulkSource` reads in batches comes back
    copied onto ``grain.MapDataset.source(BulkSource(source))``: the same
    transformations, seeds and indices, so the same example at every index.
    Otherwise ``dataset`` itself, with ``reason`` ``None`` if it reads in
    batches already or has nothing to gain (a range, a list in memory), else
    what makes grain read it a record per call, and the fix.

    Example:
      >>> import grain, numpy as np
      >>> from pztrain.data._bulk import read_in_batches
      >>> records = np.arange(4) * 10  # grain reads it [i] by [i]
      >>> ds = grain.MapDataset.source(records).map(lambda r: r + 1)
      >>> batched, reason = read_in_batches(ds)
      >>> print(batched.parents[0], reason)
      SourceMapDataset(source=BulkSource) None
      >>> batched._getitems([1, 6]), ds._getitems([1, 6])
      ([np.int64(11), np.int64(21)], [np.int64(11), np.int64(21)])
    """
    chain = [dataset]
    while len(chain[-1].parents) == 1:
        chain.append(chain[-1].parents[0])
    root = chain[-1]
    if root.parents:  # mix, zip, concatenate
        return dataset, _several(root)
    if not _grain_node(root, {"SourceMapDataset"}):
        return dataset, None  # computed (a range, the user's own dataset)
    bulk, reason = _bulk_of(root._source)  # grain's field: the data source
    if bulk is None or _large_records(root._source):
        return dataset, reason
    for node in chain[:-1]:
        if not _grain_node(node, _RELINKED):
            return dataset, (
                f"{node} ({type(node).__name__}) is not one of grain's own "
                f"transformations, which pztrain copies onto a batched read. {_FIX}"
            )
    parent = import_extra("grain").MapDataset.source(bulk)
    # grain's field: a source node records a histogram sample and sizes every
    # record of a read (prometheus_client, which orbax brings: a fifth of this
    # read's CPU); pztrain reads the source itself here, as it does a source
    # given directly, which grain's metrics do not see either.
    parent._record_metrics = False
    for node in reversed(chain[:-1]):
        node = copy.copy(node)  # the user's node stays on the user's pipeline
        node.__dict__.pop("_stats", None)  # grain's statistics: made anew
        node._parents = (parent,)  # grain's field: its one parent
        parent = node
    return parent, None


LARGE_RECORD = 16 * 1024
"""Bytes of a record from which a pipeline is read as grain reads it: a batched
read gains little beside the bytes, and would hold a whole batch of them at once
(a 1.5 GiB dataset of 64 KiB records trains within a quarter of its size)."""


def _large_records(source: Any) -> bool:
    """Whether ``source``'s first record is bytes of `LARGE_RECORD` or more."""
    try:
        first = source[0]
    except Exception:  # an empty or unreadable source: grain will say
        return False
    return isinstance(first, bytes | bytearray) and len(first) >= LARGE_RECORD


def _grain_node(node: Any, names: set[str] | frozenset[str]) -> bool:
    kind = type(node)
    return kind.__name__ in names and kind.__module__.startswith("grain.")


def _bulk_of(source: Any) -> tuple[BulkSource | None, str | None]:
    """``source`` read through a `BulkSource` if that reads it in batches and
    grain would not; else ``None`` and what stands in the way (``None`` if
    nothing is lost: grain's batched read, a sequence in memory)."""
    if hasattr(source, "_getitems") or isinstance(source, Sequence):
        return None, None
    try:
        bulk = BulkSource(source)
    except BatchError as e:
        return None, str(e)
    if bulk.batched:
        return bulk, None
    return None, (
        f"its data source, a {type(source).__name__}, reads one record per call: "
        "give it a __getitems__(indices) method that reads them in one call."
    )


def _several(node: Any) -> str | None:
    """Why a dataset over several datasets (mix, zip, concatenate) is read a
    record per call, if a source below it could be read in batches."""
    todo, sources = [node], []
    while todo:
        d = todo.pop()
        todo.extend(d.parents)
        if _grain_node(d, {"SourceMapDataset"}):
            sources.append(d._source)  # grain's field: the data source
    if not any(_bulk_of(s) != (None, None) for s in sources):
        return None
    return (
        f"it combines several datasets ({node}), and pztrain copies single "
        f"chains only onto a batched read. {_FIX.replace('the pipeline', 'each')}"
    )


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
