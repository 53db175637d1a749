"""A Hugging Face dataset's columns as NumPy views of its Arrow memory.

``dataset[indices]`` formats each batch through Arrow and Python (about 6 µs a
row here). A dataset saved with ``save_to_disk`` is memory-mapped Arrow:
a column of fixed-shape numbers (a scalar, a list of one length, lists of
lists, ``Array2D``…) is one flat buffer per chunk, which NumPy views without
copying. `ArrowColumns` reads a batch as one gather from those views per
chunk, and gives the values the dtypes ``with_format("numpy")`` gives them
(integers as int64, floats as float32), so the batch is the one
``dataset[indices]`` returns. A dataset with anything else (nulls, strings,
ragged lists, a format with options) is read through ``dataset[indices]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ArrowColumns"]


class ArrowColumns:
    """The numeric columns of a Hugging Face ``datasets.Dataset``, gathered
    a batch at a time from NumPy views of its Arrow chunks.

    Build it with `of`; it pickles as the dataset (whose memory-mapped
    tables pickle as their files) and makes its views anew where it lands.
    """

    def __init__(self, dataset: Any, columns: list[str]):
        self.dataset = dataset
        self.columns = columns
        self._views: dict[str, _Chunks] | None = None
        self._indices: _Chunks | None = None

    @classmethod
    def of(cls, dataset: Any) -> ArrowColumns | None:
        """The columns of ``dataset`` (numpy format), or ``None`` if some
        column is not a fixed shape of numbers (or the format has options)."""
        fmt = dataset.format
        if fmt.get("format_kwargs") or fmt.get("output_all_columns"):
            return None
        columns = list(fmt.get("columns") or dataset.column_names)
        got = cls(dataset, columns)
        return got if got._open() else None

    def _open(self) -> bool:
        """Makes the views; ``False`` if a column cannot be viewed."""
        table = self.dataset.data.table  # a pyarrow Table (datasets' wrapper)
        views = {name: _Chunks.of(table.column(name)) for name in self.columns}
        if any(v is None for v in views.values()):
            return False
        indices = getattr(self.dataset, "_indices", None)  # select/shuffle/split
        self._indices = None if indices is None else _Chunks.of(indices.column(0))
        self._views = views
        return True

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The rows ``keys`` (in ``[0, len)``) of every column."""
        if self._views is None:
            self._open()
        assert self._views is not None
        if self._indices is not None:  # the dataset's rows are a mapping
            keys = self._indices.gather(keys).astype(np.int64)
        plans: dict[tuple[int, ...], _Plan] = {}  # columns chunked alike share one
        out = {}
        for name, column in self._views.items():
            plan = plans.get(column.layout)
            if plan is None:
                plan = plans[column.layout] = _Plan(column.starts, keys)
            out[name] = _numpy_format(column.gather(keys, plan))
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "columns": self.columns}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dataset"], state["columns"])


def _numpy_format(x: np.ndarray) -> np.ndarray:
    """The dtype ``with_format("numpy")`` gives a column's values."""
    if np.issubdtype(x.dtype, np.integer):
        return x.astype(np.int64, copy=False)
    if np.issubdtype(x.dtype, np.floating):
        return x.astype(np.float32, copy=False)
    return x


class _Plan:
    """Where keys fall among chunks starting at ``starts``: the keys sorted,
    and for each chunk the run of sorted keys it holds."""

    def __init__(self, starts: np.ndarray, keys: np.ndarray):
        self.order = np.argsort(keys, kind="stable")
        self.sorted = keys[self.order]
        self.bounds = [*np.searchsorted(self.sorted, starts[1:]).tolist(), len(keys)]


class _Chunks:
    """One column: a NumPy array ``[rows, ...]`` per Arrow chunk."""

    def __init__(self, views: list[np.ndarray]):
        self.views = views
        sizes = [len(v) for v in views]
        self.layout = tuple(sizes)
        self.starts = np.cumsum([0, *sizes])[:-1]
        self.item = views[0].shape[1:] if views else ()
        self.dtype = views[0].dtype if views else np.dtype(np.int64)

    @classmethod
    def of(cls, column: Any) -> _Chunks | None:
        views = [_view(chunk) for chunk in column.chunks if len(chunk)]
        if any(v is None for v in views):
            return None
        if len({(v.shape[1:], v.dtype) for v in views}) > 1:
            return None  # lists of another length in another chunk
        return cls(views)

    def gather(self, keys: np.ndarray, plan: _Plan | None = None) -> np.ndarray:
        """Rows ``keys`` (global row numbers), in that order: one gather per
        chunk over the keys it holds (in sorted order), put back in place."""
        if len(self.views) == 1:
            return self.views[0][keys]
        plan = _Plan(self.starts, keys) if plan is None else plan
        parts, first = [], 0
        runs = zip(self.views, self.starts.tolist(), plan.bounds, strict=True)
        for view, start, end in runs:
            if end > first:
                parts.append(view[plan.sorted[first:end] - start])
            first = end
        out = np.empty((len(keys), *self.item), self.dtype)
        out[plan.order] = np.concatenate(parts)
        return out


def _view(array: Any) -> np.ndarray | None:
    """A chunk as a NumPy array ``[rows, ...]`` without a copy (bools, packed
    as bits, are copied), or ``None`` if it is not a fixed shape of numbers."""
    import pyarrow as pa

    if array.null_count:
        return None
    kind = array.type
    if isinstance(kind, pa.ExtensionType):  # e.g. datasets' Array2D
        return _view(array.storage)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return array.to_numpy(zero_copy_only=True)
    if pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(kind):
        width = kind.list_size
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        ends = array.offsets.to_numpy()
        widths = np.diff(ends)
        if len(widths) == 0 or (widths != widths[0]).any():
            return None
        width = int(widths[0])
    else:
        return None
    inner = _view(array.flatten())
    if inner is None:
        return None
    return inner.reshape(len(array), width, *inner.shape[1:])
