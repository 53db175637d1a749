"""A Hugging Face ``datasets.Dataset`` as a grain data source.

`HFSource` is the one adapter: grain reads a dataset with a NumPy format
through it, a batch of rows in one call (``dataset[indices]``, Arrow's bulk
read, ~15× faster than one row at a time here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pztrain.data._batch import BatchError
from pztrain.data._extras import loaded

__all__ = ["HFSource", "is_hf_dataset"]


def is_hf_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.Dataset`` (or its streaming kind)."""
    datasets = loaded("datasets")
    if datasets is None:
        return False
    return isinstance(data, datasets.Dataset | datasets.IterableDataset)


class HFSource:
    """A ``datasets.Dataset`` with a NumPy format as a grain random-access source.

    Args:
      dataset: A ``datasets.Dataset`` formatted ``"numpy"`` (its rows are dicts
        of NumPy values).

    Raises:
      BatchError: for a streaming ``datasets.IterableDataset`` (no random
        access) or a dataset without a NumPy format, naming the fix.
    """

    def __init__(self, dataset: Any):
        datasets = loaded("datasets")
        if isinstance(dataset, datasets.IterableDataset):
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
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.dataset[int(index)]

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        columns = self.dataset[[int(i) for i in indices]]
        return [{k: v[j] for k, v in columns.items()} for j in range(len(indices))]

    def __repr__(self) -> str:
        return f"HFSource({len(self)} rows, columns {self.dataset.column_names})"
