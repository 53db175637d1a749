"""Batches: a deterministic, resumable in-memory loader, and adapters.

The loader's position is a function of the global step (DESIGN.md contract 5): the
order of epoch ``e`` depends only on ``(seed, e)``, and `ArrayLoader.iter_from_step`
starts anywhere, so resuming a run needs no iterator state. On a mesh
(``ArrayLoader(sharding=...)``) the global batches are the same; each process
yields its rows of them, and `put_batch` assembles the global arrays.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from pztrain.data._batch import BatchError, check_batch, loader_columns, stack_batches
from pztrain.data._device import DeviceCopy, IndexedBatches
from pztrain.data._placement import check_loader_sharding, host_rows
from pztrain.data._stepped import StepLoader

__all__ = ["ArrayLoader", "IndexedBatches"]


_ORDER_BYTES = 1 << 20  # budget for epoch orders made ahead (`ArrayLoader.order`)


class ArrayLoader(StepLoader):
    """Batches over a dict of equally long arrays, resumable at any step.

    Args:
      arrays: Name → array; all share their first axis (the examples).
      batch_size: Examples per batch: the global batch, over all devices and
        processes.
      shuffle: Shuffle each epoch with ``np.random.default_rng([seed, epoch])``.
      seed: The shuffling seed.
      drop_remainder: Drop the last partial batch of each epoch (the default:
        every batch then has one shape and the step compiles once). An
        evaluation reads it all the same (`rest`, `pztrain.data.eval_batches`).
      on_device: Keep the arrays on the device and give `pztrain.fit` one
        `IndexedBatches` per epoch (the device copy is permuted once per
        epoch), so that the step slices its own batch: no per-step host work.
        For data that fits in device memory twice (during the permutation;
        on a mesh, each device holds only its share); needs
        ``drop_remainder=True``.
      sharding: For a mesh: the `jax.sharding.NamedSharding` of one batch, its
        spec naming the mesh axes the batch axis is split over (e.g.
        ``NamedSharding(mesh, P("data"))``); ``batch_size`` must divide by the
        number of those shards. On the host, each process then yields only
        its rows of every global batch (its contiguous block, in process
        order), for `put_batch` to assemble; on the device, each epoch is
        placed sharded ``P(None, data)`` from the host, every device holding
        only its rows of every batch (its share of the data). The batches are
        the same as without a mesh: the order depends on ``(seed, epoch)``
        alone.
      process_index: This process (default ``jax.process_index()`` with a
        ``sharding``, else 0).
      process_count: The processes sharing each batch (default
        ``jax.process_count()`` with a ``sharding``, else 1).

    Raises:
      BatchError: if the arrays are not a dict of equally long numeric arrays
        (naming the column), hold no examples, ``batch_size`` exceeds the
        data with ``drop_remainder=True``, or does not divide by the data
        shards or processes.

    Example:
      >>> import numpy as np; from pztrain import ArrayLoader
      >>> loader = ArrayLoader({"x": np.arange(10)}, batch_size=4, shuffle=False)
      >>> loader.steps_per_epoch
      2
      >>> [b["x"].tolist() for b in loader.epoch(0)]
      [[0, 1, 2, 3], [4, 5, 6, 7]]
      >>> loader.batch_at(3)["x"].tolist()  # epoch 1, batch 1
      [4, 5, 6, 7]
      >>> half = ArrayLoader({"x": np.arange(10)}, batch_size=4, shuffle=False,
      ...                    process_index=1, process_count=2)
      >>> half.batch_at(0)["x"].tolist()  # process 1's rows of the batch
      [2, 3]
    """

    def __init__(
        self,
        arrays: Mapping[str, Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        on_device: bool = False,
        sharding: NamedSharding | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if not _is_int(batch_size) or batch_size < 1:
            raise BatchError(f"batch_size must be an int >= 1; got {batch_size!r}.")
        self.arrays = loader_columns(arrays)
        self.num_examples = check_batch(self.arrays)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.on_device = on_device
        self.sharding = sharding
        self._device: DeviceCopy | None = None  # the data on the device
        self._orders: dict[int, np.ndarray] = {}  # epoch orders made ahead
        if on_device and not drop_remainder:
            raise BatchError(
                "on_device=True stacks an epoch's batches, so all must have one "
                "shape: use drop_remainder=True."
            )
        if drop_remainder and batch_size > self.num_examples:
            raise BatchError(
                f"batch_size={batch_size} exceeds the {self.num_examples} examples; "
                "with drop_remainder=True no batch would be made."
            )
        check_loader_sharding("ArrayLoader", sharding, batch_size)
        if sharding is not None and not drop_remainder:
            raise BatchError(
                "ArrayLoader with a sharding splits every batch evenly over the data "
                "shards, so all batches must be full: use drop_remainder=True."
            )
        self._rows = host_rows(batch_size, sharding, process_index, process_count)

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def _epoch_sharding(self) -> NamedSharding | None:
        return self.batch_sharding(steps_per_call=2)

    def order(self, epoch: int) -> np.ndarray:
        """The example order of ``epoch``: a function of ``(seed, epoch)`` only.

        Returns a read-only array. Orders are made a few epochs at a time when
        they are small (up to 8 epochs within 1 MiB): called once per epoch in
        between training steps, NumPy's generator runs several times slower than
        in a run of calls, which counts when epochs last a few milliseconds.
        """
        if not self.shuffle:
            return np.arange(self.num_examples)
        got = self._orders.get(epoch)
        if got is None:
            ahead = int(np.clip(_ORDER_BYTES // (8 * max(self.num_examples, 1)), 1, 8))
            block = {e: self._make_order(e) for e in range(epoch, epoch + ahead)}
            self._orders = block  # one assignment: safe with the prefetch thread
            got = block[epoch]
        return got

    def _make_order(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
        order.flags.writeable = False
        return order

    def _batch(self, order: np.ndarray, index: int) -> dict[str, np.ndarray]:
        """This process's rows of batch ``index`` of the epoch in ``order``."""
        start, stop = self._rows
        first = index * self.batch_size
        idx = order[first + start : first + stop]
        return {k: v[idx] for k, v in self.arrays.items()}

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The batch that global step ``step`` trains on (this process's rows)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return self._batch(self.order(epoch), index)

    def device_epoch(self, epoch: int) -> IndexedBatches:
        """The batches of ``epoch``, as `IndexedBatches` on the device (one
        copy of the data stays there, for every epoch)."""
        if self._device is None:
            self._device = DeviceCopy(
                self.arrays, self.batch_size, self._epoch_sharding()
            )
        order = self.order(epoch) if self.shuffle else None
        return self._device.epoch(epoch, order)

    def epoch(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of one epoch (for evaluation: one pass over the data)."""
        order = self.order(epoch)
        for i in range(self.steps_per_epoch):
            yield self._batch(order, i)

    def rest(self, epoch: int = 0) -> dict[str, np.ndarray] | None:
        """The examples of ``epoch`` that no batch holds (its last partial
        batch, with ``drop_remainder=True``), all of them on every process,
        for an evaluation to count; ``None`` if there are none."""
        first = self.steps_per_epoch * self.batch_size
        if first >= self.num_examples:
            return None
        idx = self.order(epoch)[first:]
        return {k: v[idx] for k, v in self.arrays.items()}

    def iter_from_step(
        self, step: int, steps_per_call: int = 1
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches from global step ``step`` on, endlessly (this process's rows).

        With ``steps_per_call=k`` each item stacks the batches of ``k``
        consecutive steps along a new leading axis.
        """
        if steps_per_call > 1 and not self.drop_remainder:
            raise BatchError(
                "steps_per_call > 1 stacks batches, so all must have one shape: "
                "use drop_remainder=True."
            )
        return self._iter_from_step(step, steps_per_call)

    def _iter_from_step(self, step: int, steps_per_call: int):
        per_epoch = self.steps_per_epoch
        epoch, index = divmod(step, per_epoch)
        order = self.order(epoch)
        pending: list[dict[str, np.ndarray]] = []
        while True:
            if index == per_epoch:
                epoch, index = epoch + 1, 0
                order = self.order(epoch)
            batch = self._batch(order, index)
            index += 1
            if steps_per_call == 1:
                yield batch
                continue
            pending.append(batch)
            if len(pending) == steps_per_call:
                yield stack_batches(pending)
                pending = []


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
