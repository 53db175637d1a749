"""Batches from the host a block of steps at a time: what `pztrain.fit` reads a
`GrainLoader` through.

One host batch per step costs `fit` a transfer and a call of the step each
(about 0.2 ms a step here, a sixth of a small model's step). A block instead
holds the batches of ``BLOCK_STEPS`` consecutive steps, read in one call,
moved to the device in one transfer and laid out as
`pztrain.data.IndexedBatches`: the step takes its own batch from it, and the
block's steps run as one fused call, as with an
``ArrayLoader(on_device=True)``. Blocks start at multiples of their size
(step ``s`` is row ``s % size`` of its block), whatever step a run starts at.

The read-ahead is bounded by bytes, not steps: the blocks in flight (the one
the step reads, ``prefetch`` on the device, one being read and moved, and
those grain's workers keep ready) hold `BLOCK_BYTES` at most together, else
`fit` reads a step at a time. The records behind a block are read
`pztrain.data._reading.READ_BYTES` at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pztrain.data._device import IndexedBatches
from pztrain.data._placement import prefetch_to_device, put_batch

__all__ = ["BLOCK_BYTES", "BLOCK_STEPS", "StepBlocks", "block_sharding", "block_steps"]

BLOCK_STEPS = 32  # steps per block: the step's fusion (pztrain.step._fusion)
BLOCK_BYTES = 2**24  # all the blocks in flight together (this process's rows)


def block_steps(batch_bytes: int, steps_per_call: int, in_flight: int = 4) -> int:
    """Steps per block for batches of ``batch_bytes``, or 0 when blocks do not
    pay (``in_flight`` blocks would exceed `BLOCK_BYTES`: such batches make
    steps long next to a call's cost) or do not fit ``steps_per_call``.

    Example:
      >>> block_steps(33_000, 1), block_steps(33_000, 4), block_steps(2**20, 1)
      (32, 32, 0)
      >>> block_steps(100_000, 1), block_steps(100_000, 1, in_flight=8)
      (32, 0)
    """
    block = batch_bytes * BLOCK_STEPS
    if BLOCK_STEPS % steps_per_call or block * in_flight > BLOCK_BYTES:
        return 0
    return BLOCK_STEPS


class StepBlocks:
    """`pztrain.fit`'s batch source over blocks of steps (the loop's
    ``BatchSource``): ``stretch(step, stop)`` yields each block with the
    number of calls to run on it.

    Args:
      blocks: Host blocks from the block of ``start`` on: dicts of arrays
        ``[size, rows, ...]`` (this process's rows).
      start: The run's first step.
      size: Steps per block.
      batch_size: The global batch size.
      steps_per_call: Steps per call of the train step.
      prefetch: Blocks moved to the device ahead (0: none).
      sharding: The sharding of one batch fed to the step (``None``: the
        default device).
    """

    ended_pass = False
    ran_out = False

    def __init__(
        self,
        blocks: Iterator[dict[str, Any]],
        *,
        start: int,
        size: int,
        batch_size: int,
        steps_per_call: int,
        prefetch: int,
        sharding: Any,
    ):
        self._size, self._k, self._batch_size = size, steps_per_call, batch_size
        placed = block_sharding(sharding, steps_per_call)
        put = lambda block: put_batch(block, placed)  # noqa: E731
        self._blocks = (
            prefetch_to_device(blocks, prefetch, put=put)
            if prefetch
            else map(put, blocks)
        )
        self._first = (start // size - 1) * size  # the block held (none yet)
        self._held: IndexedBatches | None = None
        self._source = blocks

    def stretch(self, step: int, stop: float) -> Iterator[tuple[Any, int]]:
        while step < stop:
            while step >= self._first + self._size:
                arrays = next(self._blocks)
                self._first += self._size
                self._held = IndexedBatches(arrays, self._batch_size, self._size)
            end = min(self._first + self._size, stop)
            calls = max(int(end - step) // self._k, 1)
            yield self._held, calls
            step += calls * self._k

    def close(self) -> None:
        for it in (self._blocks, self._source):
            close = getattr(it, "close", None)
            if close is not None:  # a generator: its thread or workers stop
                close()


def block_sharding(sharding: Any, steps_per_call: int) -> Any:
    """The sharding of a block ``[size, batch, ...]`` from that of what the
    step takes: a batch (an unsharded block axis in front), or ``k`` stacked
    batches with ``steps_per_call=k > 1`` (already one in front)."""
    if sharding is None or steps_per_call > 1:
        return sharding

    def front(s: Any) -> Any:
        if isinstance(s, NamedSharding):
            return NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
        return s

    return jax.tree.map(front, sharding, is_leaf=lambda s: isinstance(s, NamedSharding))
