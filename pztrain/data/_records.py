"""`RecordLayout`: examples of fixed-shape arrays as ``bytes`` records, and a
batch of records back as arrays with one ``np.frombuffer``.

A record holds one example's fields back to back (a NumPy structured dtype,
little-endian, no padding). Decoding a batch joins its records and views them
as that dtype: no Python per record, so `pztrain.GrainLoader` reads an
ArrayRecord file at the speed of its reads (``decode=layout``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pztrain.data._batch import BatchError

__all__ = ["RecordLayout"]


class RecordLayout:
    """The byte layout of an example of fixed-shape arrays, one record each.

    Args:
      fields: Name → ``(dtype, shape)`` of each array of an example, in order
        (``shape`` ``()`` for a scalar); or a NumPy structured dtype.

    Attributes:
      dtype: The structured dtype of one record (little-endian).
      record_size: Bytes per record.

    Raises:
      BatchError: for a field that is not numbers or bools.

    Example:
      Write the examples as records (here into a list; an
      ``ArrayRecordWriter(path, "group_size:1")`` takes them one by one), and
      turn a batch of records back into arrays in one go:

      >>> import numpy as np; from pztrain.data import RecordLayout
      >>> data = {"x": np.arange(6, dtype=np.float32).reshape(3, 2),
      ...         "y": np.array([7, 8, 9], np.int32)}
      >>> layout = RecordLayout.like(data)
      >>> layout
      RecordLayout({'x': ('float32', (2,)), 'y': ('int32', ())})
      >>> records = layout.encode(data)
      >>> len(records), layout.record_size
      (3, 12)
      >>> batch = layout.decode([records[2], records[0]])
      >>> batch["x"].tolist(), batch["y"].tolist()
      ([[4.0, 5.0], [0.0, 1.0]], [9, 7])
    """

    def __init__(self, fields: Mapping[str, tuple[Any, Sequence[int]]] | np.dtype):
        if isinstance(fields, np.dtype):
            if fields.names is None:
                raise BatchError(
                    f"RecordLayout needs named fields; got the dtype {fields}: "
                    "pass {'x': (dtype, shape), ...} or a structured dtype."
                )
            fields = {n: (fields[n].base, fields[n].shape) for n in fields.names}
        spec = []
        for name, (dtype, shape) in fields.items():
            dtype = np.dtype(dtype)
            if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
                raise BatchError(
                    f"RecordLayout field {name!r} has dtype {dtype}, not numbers "
                    "or bools: encode it as numbers (e.g. token ids for text)."
                )
            spec.append((name, dtype.newbyteorder("<"), tuple(shape)))
        self.dtype = np.dtype(spec)
        self.record_size = self.dtype.itemsize

    @classmethod
    def like(cls, arrays: Mapping[str, Any]) -> RecordLayout:
        """The layout of the examples of ``arrays`` (name → array, examples
        along the first axis)."""
        return cls(
            {k: (np.asarray(v).dtype, np.shape(v)[1:]) for k, v in arrays.items()}
        )

    def encode(self, arrays: Mapping[str, Any]) -> list[bytes]:
        """One record per example of ``arrays`` (name → array, examples first).

        Raises:
          BatchError: naming the field whose keys, shape or example count
            differ from the layout's.
        """
        if set(arrays) != set(self.dtype.names):
            raise BatchError(
                f"RecordLayout.encode got fields {sorted(arrays)}; the layout has "
                f"{sorted(self.dtype.names)}."
            )
        n = len(next(iter(arrays.values())))
        table = np.empty(n, self.dtype)
        for name in self.dtype.names:
            value, want = np.asarray(arrays[name]), self.dtype[name].shape
            if value.shape != (n, *want):
                raise BatchError(
                    f"RecordLayout.encode: {name!r} has shape {value.shape}; the "
                    f"layout wants {n} examples of shape {want}: {(n, *want)}."
                )
            table[name] = value
        data, size = table.tobytes(), self.record_size
        return [data[i : i + size] for i in range(0, n * size, size)]

    def decode(self, records: Sequence[bytes] | np.ndarray) -> dict[str, np.ndarray]:
        """A batch of records (``bytes`` each, or a uint8 array of one record
        per row) as arrays with a leading example axis.

        Raises:
          BatchError: if the records' total size is not a whole number of
            records of this layout (naming both sizes).
        """
        if isinstance(records, np.ndarray):
            data = np.ascontiguousarray(records).tobytes()
        else:
            data = b"".join(records)
        if len(data) != len(records) * self.record_size:
            sizes = sorted({len(r) for r in records})[:3] if len(records) else []
            raise BatchError(
                f"RecordLayout.decode: {len(records)} records of {sizes} bytes, "
                f"but this layout's records are {self.record_size} bytes "
                f"({self!r}): decode with the layout the records were written with."
            )
        table = np.frombuffer(data, self.dtype)
        return {
            name: table[name].astype(self.dtype[name].base.newbyteorder("="))
            for name in self.dtype.names
        }

    __call__ = decode  # GrainLoader(..., decode=layout)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordLayout) and other.dtype == self.dtype

    def __hash__(self) -> int:
        return hash(self.dtype)

    def __repr__(self) -> str:
        fields = {
            n: (str(self.dtype[n].base.newbyteorder("=")), self.dtype[n].shape)
            for n in self.dtype.names
        }
        return f"RecordLayout({fields})"
