"""`eval_batches`: every example of an evaluation's data once, placed.

A loader's epoch holds full batches only (`pztrain.GrainLoader` always drops
a last partial batch; `pztrain.ArrayLoader` with ``drop_remainder=True``); an
evaluation reads those, then the loader's `StepLoader.rest`. On a mesh the
rest rarely splits evenly over the data shards, so it goes as two pieces: the
rows that split (sharded like every batch) and the few that do not
(replicated: any number of rows fits). No mask, no padding: the evaluation
weights each piece's metrics by its rows, and at most two more programs
compile (one per piece's shape).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pztrain.data._batch import check_batch
from pztrain.data._placement import data_shards, process_rows, put_batch
from pztrain.data._stepped import StepLoader

__all__ = ["eval_batches"]


def eval_batches(data: Iterable[Any]) -> Iterator[Any]:
    """The batches of one evaluation pass over ``data``, each checked, every
    example once.

    Args:
      data: A `pztrain.data.StepLoader` (its epoch 0, then its `rest`; with a
        ``sharding``, each batch placed on the mesh: the global arrays from
        every process's rows) or any iterable of batch dicts (as they are).

    Yields:
      Batch dicts: host arrays without a mesh, global `jax.Array` s on one.

    Raises:
      BatchError: for a bad batch (`pztrain.data.check_batch`).

    Example:
      >>> import numpy as np, pztrain
      >>> from pztrain.data import eval_batches
      >>> loader = pztrain.ArrayLoader({"x": np.arange(10.0)}, 4, shuffle=False)
      >>> loader.steps_per_epoch  # the training epoch: 2 full batches
      2
      >>> [b["x"].tolist() for b in pztrain.data.eval_batches(loader)]  # the rest
      [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """
    if not isinstance(data, StepLoader):
        for batch in data:
            check_batch(batch)
            yield batch
        return
    sharding = data.batch_sharding()
    for batch in data.epoch(0):
        check_batch(batch)
        yield batch if sharding is None else put_batch(batch, sharding)
    rest = data.rest(0)
    if rest is None:
        return
    check_batch(rest)
    if sharding is None:
        yield rest
        return
    yield from _split_rest(rest, sharding)


def _split_rest(rest: dict[str, Any], sharding: NamedSharding) -> Iterator[Any]:
    """``rest`` (every process holds all of it) on the mesh: the rows that
    split over the data shards sharded, the others replicated."""
    rows = check_batch(rest)
    even = rows - rows % data_shards(sharding)
    processes = 1 if sharding.is_fully_addressable else jax.process_count()
    if even % processes:  # cannot split among the processes: all replicated
        even = 0
    if even:
        start, stop = process_rows(even, _process_index(sharding), processes)
        yield put_batch({k: v[start:stop] for k, v in rest.items()}, sharding)
    if even < rows:
        replicated = NamedSharding(sharding.mesh, PartitionSpec())
        yield put_batch({k: v[even:] for k, v in rest.items()}, replicated)


def _process_index(sharding: NamedSharding) -> int:
    return 0 if sharding.is_fully_addressable else jax.process_index()
