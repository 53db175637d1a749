"""`GrainLoader`: a random-access dataset read through grain, resumable at any
step and on any number of processes.

The batch of global step ``s`` is a pure function of ``s``, the seed and the
dataset's length (`pztrain.data._reading`), so `pztrain.fit` starts it at any
step with no iterator state, and a run resumed on another process count sees
the same global batches: only the rows each process reads change. `fit`
reads it a block of steps at a time (`pztrain.data._blocks`).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from pztrain.data._batch import BatchError
from pztrain.data._blocks import StepBlocks, block_steps
from pztrain.data._bulk import BulkSource, read_in_batches
from pztrain.data._extras import import_extra, quiet_grain_flags, worker_init
from pztrain.data._order import ORDERS
from pztrain.data._placement import check_loader_sharding, host_rows
from pztrain.data._reading import ReadBlocks, ReadCalls, Rows
from pztrain.data._records import RecordLayout
from pztrain.data._stepped import StepLoader

__all__ = ["GrainLoader"]

# What a failing worker's error adds: a worker starts by importing the user's
# program, so a script without a __main__ guard trains again in each worker.
WORKER_NOTE = (
    "pztrain.GrainLoader(workers=...): each worker process starts by importing "
    "your program's main module. A script that trains at import (no `if __name__ "
    '== "__main__":` guard around the training) starts a second run in every '
    "worker, which then fails: put the training under that guard, or use workers=0."
)

# Arrays smaller than this go from grain's workers pickled, larger ones through
# shared memory: measured here, a new shared-memory block costs 0.7 ms for 32 KiB
# (0.3 ms pickled); the two break even near 256 KiB.
_MIN_SHM_BYTES = 2**18


class GrainLoader(StepLoader):
    """Batches from a random-access dataset: any step, any process count.

    Epoch ``e`` is a permutation of the examples drawn from ``(seed, e)``
    (``shuffle=True``; a Feistel network computed a batch at a time, see
    ``order``) or their order, cut into global batches of ``batch_size`` (a
    last partial batch is dropped; an evaluation reads it too, `rest`). Each
    process reads only its rows of every global batch (its block, in process
    order); reading, decoding and the
    dataset's own transformations (``.map``, ``.random_map``) run in
    ``workers`` grain worker processes, ahead of the step. `pztrain.fit`
    reads small batches 32 steps at a time (one read, one transfer, one fused
    call of the step); larger ones a step at a time.

    Args:
      dataset: A data source (``len`` and ``[i]``, e.g.
        ``grain.sources.ArrayRecordDataSource``), read a batch of records per
        call (`pztrain.data.BulkSource`); a Hugging Face ``datasets.Dataset``
        with a NumPy format (``dataset.with_format("numpy")``), read as NumPy
        views of its memory-mapped columns; or a ``grain.MapDataset`` of
        examples (flat dicts of arrays), or one ending in
        ``.batch(batch_size)`` (read as its examples, so that each process
        reads only its rows), its ``.map`` run per example. Its data source
        is read a batch of records per call (a copy of the pipeline built on
        a `pztrain.data.BulkSource`, the same examples at every index); a
        warning, once, says why when it cannot be, and the fix.
      batch_size: The global batch (over all devices and processes); read
        from the dataset's ``.batch(...)`` if ``None``.
      shuffle: Shuffle each epoch. Either way, the dataset is read at index
        ``e * len + i`` in epoch ``e``, so grain's own ``shuffle`` and
        ``random_map`` in the dataset draw anew each epoch.
      seed: The shuffle's seed, in ``[0, 2**32)``.
      workers: grain worker processes reading ahead (``mp_prefetch``); 0
        reads in `pztrain.fit`'s prefetch thread. Workers start in a few
        seconds (each imports the program's main module: keep a script's
        training under ``if __name__ == "__main__":``).
      worker_buffer: Reads each worker keeps ready.
      sharding: For a mesh: the `jax.sharding.NamedSharding` of one batch
        (as `pztrain.ArrayLoader`'s); each process then reads its rows.
      process_index: This process (default ``jax.process_index()`` with a
        ``sharding``, else 0).
      process_count: The processes sharing each batch (default
        ``jax.process_count()`` with a ``sharding``, else 1).
      decode: Turns a run of records, as the source returns them (a list of
        ``bytes`` for ArrayRecord), into a dict of arrays with one row per
        record: a `pztrain.data.RecordLayout` (one ``np.frombuffer`` for the
        whole run), a NumPy structured dtype (its layout), or a function. It
        gets the records of several steps at once. With ``workers`` it is
        pickled: a module-level function or object.
      batch_transform: ``fn(batch, positions) -> batch``, run in the workers
        on each batch of this process's rows once they are stacked (and
        decoded): ``batch`` a dict of arrays with a leading example axis,
        ``positions`` the index each row was read at (``e * len + i``, what
        grain's ``map_with_index`` gets), so augmentation drawn from it is
        the same on any process count. Vectorised NumPy here costs once per
        batch what a per-example ``.map`` costs per example. With ``workers``
        it is pickled: a module-level function or object.
      order: The shuffle: ``"feistel"`` (the default, a Feistel permutation
        computed a batch at a time) or ``"grain"`` (grain's ``index_shuffle``,
        one Python call per example: the order of pztrain 0.2, to resume the
        runs it checkpointed). `pztrain.fit` keeps the order's name with each
        checkpoint and refuses to resume one saved with another order, or
        before the name was kept, unless ``order`` is given explicitly.

    Raises:
      BatchError: naming the index, key or size at fault: examples that are
        not flat dicts of numeric arrays or differ in shape (the whole first
        batch is read and checked here, every batch when read), a dataset
        shorter than one global batch or endless, one batched with another
        batch size, an ``IterDataset``, a Hugging Face dataset without a NumPy
        format, a ``decode`` whose output is not one row per record.
      ImportError: if grain is not installed (the ``data`` extra).

    Example:
      >>> from pztrain import GrainLoader
      >>> import grain, numpy as np
      >>> ds = grain.MapDataset.range(10).map(lambda i: {"x": np.float32(i)})
      >>> loader = GrainLoader(ds, batch_size=4, shuffle=False)
      >>> loader.steps_per_epoch
      2
      >>> loader.batch_at(3)["x"].tolist()  # epoch 1, batch 1
      [4.0, 5.0, 6.0, 7.0]
      >>> half = GrainLoader(ds, 4, process_index=1, process_count=2)  # shuffled
      >>> half.example_ids(0)  # global batch 0, whatever the process count
      [2, 3, 7, 0]
      >>> half.batch_at(0)["x"].tolist()  # process 1 of 2 reads its rows only
      [7.0, 0.0]

      Records of fixed-shape arrays, decoded a batch at a time:

      >>> from pztrain import GrainLoader
      >>> from pztrain.data import RecordLayout
      >>> import numpy as np
      >>> layout = RecordLayout({"x": ("float32", (2,)), "y": ("int32", ())})
      >>> records = layout.encode({"x": np.ones((8, 2)), "y": np.arange(8)})
      >>> loader = GrainLoader(records, 4, decode=layout)  # a list is a source
      >>> batch = loader.batch_at(0)
      >>> batch["x"].shape, batch["y"].dtype
      ((4, 2), dtype('int32'))
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        workers: int = 0,
        worker_buffer: int = 2,
        sharding: NamedSharding | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        decode: Any = None,
        batch_transform: Any = None,
        order: str | None = None,
    ):
        grain = import_extra("grain")
        examples, batched = _examples(grain, dataset)
        examples = _batched_reads(grain, examples)
        batch_size = _batch_size(batch_size, batched)
        n = _length(examples, batch_size)
        _check_options(seed, workers, worker_buffer)
        check_loader_sharding("GrainLoader", sharding, batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_examples = n
        self.shuffle = shuffle
        self.seed = seed
        self.workers = workers
        self.worker_buffer = worker_buffer
        self.sharding = sharding
        self.order = _order(order)  # None: the default, checked on resume
        self.decode = _decoder(decode)
        self.batch_transform = _function("batch_transform", batch_transform)
        self._rows = Rows(
            examples,
            n,
            batch_size,
            host_rows(batch_size, sharding, process_index, process_count),
            seed if shuffle else None,
            self.batch_transform,
            self.decode,
            self.data_order(),
        )
        first = self._rows.read(0)  # the whole first batch, checked
        self._rows = self._rows.bounded(first)  # reads of READ_BYTES at most
        self._batch_bytes = sum(v.nbytes for v in first.values())

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (full ones)."""
        return self._rows.steps_per_epoch

    def example_ids(self, step: int) -> list[int]:
        """The dataset indices of global batch ``step`` (every process's rows).

        A function of ``step``, the seed and the dataset's length only: the
        same whatever the process count.
        """
        positions = self._rows.positions([step], (0, self.batch_size))[0]
        return (positions % self.num_examples).tolist()

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The batch that global step ``step`` trains on (this process's rows),
        read here (no workers)."""
        return self._rows.read(step)

    def epoch(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of one epoch, in order (for evaluation: one pass)."""
        first = epoch * self.steps_per_epoch
        return self._stream(ReadCalls(self._rows, first), self.steps_per_epoch)

    def rest(self, epoch: int = 0) -> dict[str, np.ndarray] | None:
        """The examples of ``epoch`` that no full batch holds (every process
        reads all of them), for an evaluation to count; ``None`` if none."""
        return self._rows.read_rest(epoch)

    def iter_from_step(
        self, step: int, steps_per_call: int = 1
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches from global step ``step`` on, endlessly (this process's rows).

        With ``steps_per_call=k`` each item stacks the batches of ``k``
        consecutive steps along a new leading axis (read in one call).
        """
        return self._stream(ReadCalls(self._rows, step, steps_per_call), sys.maxsize)

    def fit_source(
        self, start: int, steps_per_call: int, prefetch: int, sharding: Any
    ) -> Any:
        """Blocks of 32 steps from step ``start`` (read ahead, each a few
        batches in one piece), or ``None`` (a step at a time) when the
        blocks in flight would hold more than ``BLOCK_BYTES`` together."""
        in_flight = prefetch + 2 + self.workers * self.worker_buffer
        size = block_steps(self._batch_bytes, steps_per_call, in_flight)
        if not size:
            return None
        if sharding is None:
            sharding = self.batch_sharding(steps_per_call)
        return StepBlocks(
            self._stream(ReadBlocks(self._rows, start, size), sys.maxsize),
            start=start,
            size=size,
            batch_size=self.batch_size,
            steps_per_call=steps_per_call,
            prefetch=prefetch,
            sharding=sharding,
        )

    def data_order(self) -> str:
        """The shuffle's name (``order``, else ``"feistel"``), kept with each
        checkpoint."""
        return self.order or ORDERS[0]

    def _stream(self, read: Any, calls: int) -> Iterator[dict[str, np.ndarray]]:
        """``read(0), read(1), ...`` for ``calls`` calls: here, or by grain in
        its worker processes if ``workers`` (they stop when this ends)."""
        if not self.workers:
            yield from map(read, range(calls))
            return
        grain = import_extra("grain")
        ds = grain.MapDataset.range(calls).map(read)
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
        quiet_grain_flags()
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=self.workers, per_worker_buffer_size=self.worker_buffer
            ),
            worker_init_fn=functools.partial(worker_init, os.getpid()),
        )
        options = grain.experimental.DatasetOptions(min_shm_size=_MIN_SHM_BYTES)
        iterator = iter(grain.experimental.WithOptionsIterDataset(ds, options))
        try:
            yield from iterator
        except RuntimeError as e:  # e.g. "Worker process was terminated ..."
            if "worker" in str(e).lower():
                e.add_note(WORKER_NOTE)
            raise
        finally:
            iterator.close()

    def __repr__(self) -> str:
        return (
            f"GrainLoader({self.num_examples} examples, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, workers={self.workers})"
        )


def _order(order: Any) -> str | None:
    if order is not None and order not in ORDERS:
        raise BatchError(
            f'order must be one of {list(ORDERS)}; got {order!r} ("grain" resumes '
            "runs checkpointed by pztrain 0.2 in their own order)."
        )
    return order


def _decoder(decode: Any) -> Any:
    """``decode`` as a function of a run of records (a dtype as its layout)."""
    if isinstance(decode, np.dtype):
        return RecordLayout(decode)
    return _function("decode", decode, "records -> batch")


def _function(name: str, fn: Any, form: str = "(batch, positions) -> batch") -> Any:
    if fn is not None and not callable(fn):
        raise BatchError(f"{name} must be a function {form}; got {type(fn).__name__}.")
    return fn


def _examples(grain: Any, dataset: Any) -> tuple[Any, Any]:
    """``(examples, batched)``: the examples as a ``MapDataset``, and the
    ``.batch(...)`` that ended ``dataset`` (``None`` if none did)."""
    if isinstance(dataset, grain.IterDataset | grain.DataLoader):
        raise BatchError(
            f"GrainLoader needs random access; got a grain {type(dataset).__name__} "
            "(e.g. from .to_iter_dataset()), read in order: it cannot start at a "
            "step, nor be split anew over another number of processes. Pass the "
            "grain.MapDataset (before .to_iter_dataset(); its .shuffle() is "
            "reseeded each epoch). Or pass the IterDataset itself to fit as "
            "train_data: its iterator state is saved with each checkpoint and "
            "resumes exactly, on the same number of processes only."
        )
    if isinstance(dataset, BulkSource):
        return dataset, None
    if not isinstance(dataset, grain.MapDataset):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise BatchError(
                "GrainLoader takes a grain.MapDataset, a datasets.Dataset or a data "
                f"source with len() and [i]; got {type(dataset).__name__}."
            )
        return BulkSource(dataset), None  # read a batch at a time, as grain would
    chain = _chain(dataset)
    batches = [d for d in chain if type(d).__name__ == "BatchMapDataset"]
    if not batches:
        return dataset, None
    if batches[0] is not dataset or len(batches) > 1:
        raise BatchError(
            f"The dataset is batched ({batches[-1]}) before its last step "
            f"({dataset}); GrainLoader batches the examples itself, so that each "
            "process reads only its rows: end the pipeline with .batch(batch_size), "
            "or drop .batch."
        )
    return dataset.parents[0], dataset


def _batched_reads(grain: Any, examples: Any) -> Any:
    """A grain pipeline as read a batch of records per call (its source
    through a `BulkSource`), or as it is with a warning saying why not."""
    if not isinstance(examples, grain.MapDataset):
        return examples
    pipeline, reason = read_in_batches(examples)
    if reason is not None:
        warnings.warn(
            f"GrainLoader reads {examples} one record per call: {reason}",
            UserWarning,
            stacklevel=3,
        )
    return pipeline


def _chain(dataset: Any) -> list[Any]:
    """``dataset`` and its ancestors, nearest first (first parents only)."""
    chain = [dataset]
    while chain[-1].parents:
        chain.append(chain[-1].parents[0])
    return chain


def _batch_size(batch_size: Any, batched: Any) -> int:
    given = batched._batch_size if batched is not None else None  # grain's field
    if batch_size is None and given is None:
        raise BatchError(
            "GrainLoader needs the global batch size: pass batch_size=..., or end "
            "the dataset with .batch(batch_size)."
        )
    if batch_size is None:
        batch_size = given
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise BatchError(f"batch_size must be an int >= 1; got {batch_size!r}.")
    if batch_size < 1:
        raise BatchError(f"batch_size must be an int >= 1; got {batch_size!r}.")
    if given is not None and given != batch_size:
        raise BatchError(
            f"The dataset is batched with .batch({given}) but batch_size={batch_size}: "
            f"drop the dataset's .batch({given}), or pass batch_size={given}."
        )
    return batch_size


def _length(examples: Any, batch_size: int) -> int:
    n = len(examples)
    if n >= sys.maxsize:
        raise BatchError(
            "The dataset is endless (.repeat() without num_epochs); GrainLoader "
            "makes the epochs itself: pass the dataset without .repeat()."
        )
    if n < batch_size:
        raise BatchError(
            f"The dataset holds {n} examples, fewer than one global batch of "
            f"batch_size={batch_size}: pass batch_size <= {n}, or more data."
        )
    return n


def _check_options(seed: Any, workers: Any, worker_buffer: Any) -> None:
    for name, value, low, high in (
        ("seed", seed, 0, 2**32 - 1),
        ("workers", workers, 0, None),
        ("worker_buffer", worker_buffer, 1, None),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < low
            or (high is not None and value > high)
        ):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise BatchError(f"{name} must be an int {bound}; got {value!r}.")
