"""A grain ``IterDataset`` or ``DataLoader`` as `pztrain.fit`'s train data: read
in order, its iterator state kept with each checkpoint.

Such data cannot start at a step (packing, filters and window shuffles make
batch ``s`` depend on what came before), so resume needs the iterator's
state. `SequentialData` records the state after every batch it hands to the
step; `state_dict` gives the state of the last one (every process's, in a
multi-process run) for `pztrain.Checkpoints` to store in the checkpoint's
JSON, and `load_state_dict` puts it back, refusing another process count.
The states are grain's own, encoded as grain's orbax handler encodes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from pztrain.data._batch import BatchError, check_batch, stack_batches
from pztrain.data._extras import import_extra

__all__ = ["SequentialData"]


class SequentialData:
    """A grain ``IterDataset`` or ``DataLoader`` read in order, resumable exactly
    on the same number of processes.

    Each pass is one ``iter(data)``; passes repeat while the run goes on (an
    endless dataset is one pass). Across processes each process's data yields
    its rows of every global batch (split the data with grain's
    ``ShardOptions`` or a slice per process).

    Args:
      data: A ``grain.IterDataset`` or ``grain.DataLoader`` of batch dicts.

    Attributes:
      position: The iterator state after the last batch handed to the step
        (grain's JSON), or ``None`` before the first.
    """

    def __init__(self, data: Any):
        self.data = data
        self.position: str | None = None
        self._resume: str | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def items(self, steps_per_call: int = 1) -> Iterator[tuple[Any, bool, str]]:
        """``(batch, ends_pass, state)`` from the loaded position on: each batch
        (``k`` stacked with ``steps_per_call=k``), whether it ends a pass, and
        the iterator state right after it."""
        resume, self._resume = self._resume, None
        while True:
            got = False
            for (batch, state), last in _with_last(self._pass(resume, steps_per_call)):
                got = True
                yield batch, last, state
            if not got and resume is None:
                return  # an empty pass: the data ran out
            resume = None  # a pass resumed at its end yields nothing: next pass

    def _pass(self, resume: str | None, k: int) -> Iterator[tuple[Any, str]]:
        iterator = iter(self.data)
        try:
            if resume is not None:
                _set_state(iterator, resume)
            group: list[Any] = []
            keys = None
            for batch in iterator:
                check_batch(batch, keys)
                keys = keys or list(batch)
                group.append(batch)
                if len(group) == k:
                    stacked = group[0] if k == 1 else stack_batches(group)
                    yield stacked, _get_state(iterator)
                    group = []
        finally:
            if hasattr(iterator, "close"):
                iterator.close()

    def track(self, items: Iterator[tuple[Any, bool, str]]) -> Iterator[tuple]:
        """``(batch, ends_pass)`` of ``items``, noting each one's state in
        `position` as the step takes it (after any prefetching)."""
        for batch, ends_pass, state in items:
            self.position = state
            yield batch, ends_pass

    def state_dict(self) -> dict[str, Any] | None:
        """Every process's `position` (a collective across processes: every
        process calls it at the same point), or ``None`` before the first batch."""
        if self.position is None:
            return None
        states = _gathered(self.position)
        return {"process_count": len(states), "iterators": states}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Resumes at ``saved`` (a `state_dict`): the next pass starts there.

        Raises:
          BatchError: if ``saved`` was written by another number of processes.
        """
        count = jax.process_count()
        if saved["process_count"] != count:
            raise BatchError(
                f"train_data is a grain {type(self.data).__name__}, read in order: "
                f"its iterator state was saved by {saved['process_count']} "
                f"process(es) and this run has {count}. A sequential source "
                "resumes exactly on the same number of processes only. To resume "
                "on another number, train from random-access data: "
                "pztrain.GrainLoader(map_dataset, batch_size) (a grain.MapDataset, "
                "or a datasets.Dataset with a NumPy format), whose batches are a "
                "function of the step."
            )
        self.position = self._resume = saved["iterators"][jax.process_index()]

    def __repr__(self) -> str:
        return f"SequentialData({self.data})"


def _with_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)``, looking one item ahead."""
    previous = next(items, _NONE)
    if previous is _NONE:
        return
    for item in items:
        yield previous, False
        previous = item
    yield previous, True


_NONE = object()


def _get_state(iterator: Any) -> str:
    """The iterator's state as text (JSON for a dataset iterator; a
    ``DataLoader``'s state is JSON bytes already)."""
    state = iterator.get_state()
    return state.decode() if isinstance(state, bytes) else json.dumps(state)


def _set_state(iterator: Any, text: str) -> None:
    grain = import_extra("grain")
    if isinstance(iterator, grain.DatasetIterator):
        iterator.set_state(json.loads(text))
    else:
        iterator.set_state(text.encode())


def _gathered(text: str) -> list[str]:
    """``text`` of every process, in process order."""
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [bytes(row[:size]).decode() for row, size in zip(rows, sizes, strict=True)]
