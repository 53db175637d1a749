"""Batches: the batch rule, a deterministic resumable loader, and placement.

The loader's position is a function of the global step (DESIGN.md contract 5): the
order of epoch ``e`` depends only on ``(seed, e)``, and `ArrayLoader.iter_from_step`
starts anywhere, so resuming a run needs no iterator state. On a mesh
(``ArrayLoader(sharding=...)``) the global batches are the same; each process
yields its rows of them, and `put_batch` assembles the global arrays.

* `pztrain.data._batch`: the one batch rule (`check_batch`, `BatchError`);
* `pztrain.data._placement`: `put_batch`, `prefetch_to_device`, process rows;
* `pztrain.data._loader`: `ArrayLoader`, host batches and on-device epochs
  (`IndexedBatches`).
"""

from pztrain.data._batch import BatchError, check_batch, stack_batches
from pztrain.data._loader import ArrayLoader, IndexedBatches
from pztrain.data._placement import prefetch_to_device, put_batch

__all__ = [
    "ArrayLoader",
    "BatchError",
    "IndexedBatches",
    "check_batch",
    "prefetch_to_device",
    "put_batch",
    "stack_batches",
]
