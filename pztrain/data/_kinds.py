"""The kinds of data `pztrain.fit` and `pztrain.evaluate` take, told apart once.

* a `StepLoader` (`pztrain.ArrayLoader`, `pztrain.GrainLoader`): the batch of
  a step is a function of the step: resume anywhere, on any process count;
* a grain ``MapDataset`` ending in ``.batch(n)``: read as a `GrainLoader` in
  the dataset's own order;
* a grain ``IterDataset`` or ``DataLoader`` as train data: `SequentialData`,
  its iterator state kept with each checkpoint (exact resume, same process
  count);
* any other iterable of batch dicts, as it is.
"""

from __future__ import annotations

from typing import Any

import jax

from pztrain.data._batch import BatchError
from pztrain.data._bulk import is_hf_dataset
from pztrain.data._extras import loaded
from pztrain.data._grain import GrainLoader
from pztrain.data._sequential import SequentialData

__all__ = ["as_fit_data"]


def as_fit_data(data: Any, name: str, *, train: bool) -> Any:
    """``data`` (``fit``'s argument ``name``) as the loop reads it.

    Raises:
      TypeError: for a Hugging Face dataset (it needs a batch size: pass
        ``GrainLoader(dataset, batch_size)``).
      BatchError: for a grain ``MapDataset`` `GrainLoader` refuses (e.g. one
        not batched: no batch size).
    """
    if is_hf_dataset(data):
        raise TypeError(
            f"{name} is a {type(data).__name__} of rows; pass "
            "pztrain.GrainLoader(dataset, batch_size) (with "
            "dataset.with_format('numpy')): each process then reads its rows."
        )
    grain = loaded("grain")
    if grain is None:
        return data
    if isinstance(data, grain.MapDataset):
        try:
            return GrainLoader(
                data,
                shuffle=False,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            )
        except BatchError as e:
            raise BatchError(f"{name} (a grain.MapDataset): {e}") from None
    if train and isinstance(data, grain.IterDataset | grain.DataLoader):
        return SequentialData(data)
    return data
