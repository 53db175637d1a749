"""Batches: the batch rule, loaders resumable at any step, and placement.

A loader's position is a function of the global step (DESIGN.md contract 5):
`ArrayLoader` (arrays in memory) and `GrainLoader` (a random-access dataset on
disk, read through grain) give the batch of any step from the step alone, so
resuming a run needs no iterator state, and on another number of processes the
global batches stay the same: each process reads its rows of them, and
`put_batch` assembles the global arrays. A grain ``IterDataset`` given to
`pztrain.fit` is read in order instead, its iterator state kept with each
checkpoint.

* `pztrain.data._batch`: the one batch rule (`check_batch`, `BatchError`);
* `pztrain.data._placement`: `put_batch`, `prefetch_to_device`, process rows;
* `pztrain.data._stepped`: `StepLoader`, what both loaders promise;
* `pztrain.data._loader`: `ArrayLoader`, host batches and on-device epochs
  (`IndexedBatches`);
* `pztrain.data._grain`: `GrainLoader` (grain, ArrayRecord and Hugging Face
  datasets, through `BulkSource`; records decoded a batch at a time with a
  `RecordLayout`), read by `fit` a block of steps at a time
  (`pztrain.data._blocks`);
* `pztrain.data._eval`: `eval_batches`, every example of an evaluation once
  (a loader's last partial batch too, split over a mesh).
"""

from pztrain.data._batch import BatchError, check_batch, stack_batches
from pztrain.data._bulk import BulkSource
from pztrain.data._eval import eval_batches
from pztrain.data._grain import GrainLoader
from pztrain.data._loader import ArrayLoader, IndexedBatches
from pztrain.data._placement import prefetch_to_device, put_batch
from pztrain.data._records import RecordLayout
from pztrain.data._stepped import StepLoader

__all__ = [
    "ArrayLoader",
    "BatchError",
    "GrainLoader",
    "BulkSource",
    "IndexedBatches",
    "RecordLayout",
    "StepLoader",
    "check_batch",
    "eval_batches",
    "prefetch_to_device",
    "put_batch",
    "stack_batches",
]
