"""Batches: a deterministic, resumable in-memory loader, and adapters.

The loader's position is a function of the global step (DESIGN.md contract 5): the
order of epoch ``e`` depends only on ``(seed, e)``, and `ArrayLoader.iter_from_step`
starts anywhere, so resuming a run needs no iterator state.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._batch import BatchError, check_batch, stack_batches

__all__ = [
    "ArrayLoader",
    "BatchError",
    "IndexedBatches",
    "check_batch",
    "prefetch_to_device",
    "stack_batches",
]


@dataclasses.dataclass(frozen=True)
class IndexedBatches:
    """One epoch of a dataset on device, already in that epoch's order.

    Step ``s`` reads batch ``i = s % steps_per_epoch`` of the epoch: the
    ``batch_size`` rows from row ``i * batch_size`` (``k`` consecutive batches
    with ``steps_per_call=k``), sliced inside the jitted step: no per-step host
    work and no per-step transfer. Each step reads one contiguous slice: XLA
    treats a slice as touching only its own rows, whereas a per-step gather from
    the whole dataset is costed as reading all of it, and on CPU a dataset over
    512 KiB then has every step's gather split across threads (several µs of
    thread hand-off per step for a few rows). `ArrayLoader` with
    ``on_device=True`` makes one per epoch, permuting its device copy once.

    A pytree: the arrays are its leaves, the two sizes are static.

    Attributes:
      arrays: Name → array of all examples, in this epoch's order (leading axis:
        examples).
      batch_size: Examples per batch.
      steps_per_epoch: Batches in the epoch (the examples past
        ``steps_per_epoch * batch_size`` are not read).
    """

    arrays: dict[str, jax.Array]
    batch_size: int
    steps_per_epoch: int

    def take(self, step: jax.Array, count: int = 1) -> dict[str, jax.Array]:
        """The batch of ``step`` (``count`` batches stacked if ``count > 1``)."""
        start = (step % self.steps_per_epoch) * self.batch_size
        size = count * self.batch_size

        def cut(v: jax.Array) -> jax.Array:
            rows = jax.lax.dynamic_slice_in_dim(v, start, size, axis=0)
            if count == 1:
                return rows
            return rows.reshape(count, self.batch_size, *v.shape[1:])

        return {k: cut(v) for k, v in self.arrays.items()}

    def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one batch (nothing runs on the device)."""
        return {
            k: jax.ShapeDtypeStruct((self.batch_size, *v.shape[1:]), v.dtype)
            for k, v in self.arrays.items()
        }


jax.tree_util.register_dataclass(
    IndexedBatches,
    data_fields=["arrays"],
    meta_fields=["batch_size", "steps_per_epoch"],
)


_ORDER_BYTES = 1 << 20  # budget for epoch orders made ahead (`ArrayLoader.order`)


@jax.jit
def _permute(arrays: dict[str, jax.Array], idx: jax.Array) -> dict[str, jax.Array]:
    # idx is a permutation: in range and unique by construction, so "clip"
    # skips the out-of-bounds masking of the default mode.
    return {
        k: jnp.take(v, idx, axis=0, mode="clip", unique_indices=True)
        for k, v in arrays.items()
    }


class ArrayLoader:
    """Batches over a dict of equally long arrays, resumable at any step.

    Args:
      arrays: Name → array; all share their first axis (the examples).
      batch_size: Examples per batch.
      shuffle: Shuffle each epoch with ``np.random.default_rng([seed, epoch])``.
      seed: The shuffling seed.
      drop_remainder: Drop the last partial batch of each epoch (the default:
        every batch then has one shape and the step compiles once).
      on_device: Keep the arrays on the device and give `pztrain.fit` one
        `IndexedBatches` per epoch (the device copy is permuted once per
        epoch), so that the step slices its own batch: no per-step host work.
        For data that fits in device memory twice (during the permutation);
        needs ``drop_remainder=True``.

    Raises:
      BatchError: if the arrays are not a dict of equally long numeric arrays
        (naming the column), hold no examples, or ``batch_size`` exceeds the
        data with ``drop_remainder=True``.

    Example:
      >>> import numpy as np
      >>> loader = ArrayLoader({"x": np.arange(10)}, batch_size=4, shuffle=False)
      >>> loader.steps_per_epoch
      2
      >>> [b["x"].tolist() for b in loader.epoch(0)]
      [[0, 1, 2, 3], [4, 5, 6, 7]]
      >>> loader.batch_at(3)["x"].tolist()  # epoch 1, batch 1
      [4, 5, 6, 7]
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
    ):
        if not _is_int(batch_size) or batch_size < 1:
            raise BatchError(f"batch_size must be an int >= 1; got {batch_size!r}.")
        self.arrays = _columns(arrays)
        self.num_examples = check_batch(self.arrays)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.on_device = on_device
        self._device_arrays: dict[str, jax.Array] | None = None
        self._device_order: np.ndarray | None = None  # example held by each row
        self._device_epoch: int | None = None  # the epoch it is arranged for
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

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

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

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The batch that global step ``step`` trains on."""
        epoch, index = divmod(step, self.steps_per_epoch)
        idx = self.order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        return {k: v[idx] for k, v in self.arrays.items()}

    def device_epoch(self, epoch: int) -> IndexedBatches:
        """The batches of ``epoch``, as `IndexedBatches` on the device.

        The arrays are moved to the device once. Each new epoch then permutes the
        device copy into its order with one jitted gather (sending one int32
        index per example); the previous arrangement is dropped, so one copy of
        the data stays on the device (two during the permutation).
        """
        if self._device_arrays is None:
            self._device_arrays = jax.device_put(self.arrays)
            self._device_order = np.arange(self.num_examples)
        if self.shuffle and self._device_epoch != epoch:
            order = self.order(epoch)
            # Row i of the device copy holds example _device_order[i]; the rows
            # wanted are those holding order[0], order[1], ...
            where = np.empty_like(self._device_order)
            where[self._device_order] = np.arange(self.num_examples)
            # The index goes to the jitted gather as a NumPy array: jit's own
            # transfer is much cheaper than a separate jax.device_put.
            idx = where[order].astype(np.int32)
            self._device_arrays = _permute(self._device_arrays, idx)
            self._device_order, self._device_epoch = order, epoch
        return IndexedBatches(
            self._device_arrays, self.batch_size, self.steps_per_epoch
        )

    def epoch(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of one epoch (for evaluation: one pass over the data)."""
        order = self.order(epoch)
        for i in range(self.steps_per_epoch):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            yield {k: v[idx] for k, v in self.arrays.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self.epoch(0)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def iter_from_step(
        self, step: int, steps_per_call: int = 1
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches from global step ``step`` on, endlessly.

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
            idx = order[index * self.batch_size : (index + 1) * self.batch_size]
            index += 1
            batch = {k: v[idx] for k, v in self.arrays.items()}
            if steps_per_call == 1:
                yield batch
                continue
            pending.append(batch)
            if len(pending) == steps_per_call:
                yield stack_batches(pending)
                pending = []


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _columns(arrays: Any) -> dict[str, np.ndarray]:
    """`ArrayLoader`'s arrays as NumPy arrays, checked column by column."""
    if not hasattr(arrays, "keys"):  # a dict, or what dict() reads as one
        raise BatchError(
            "ArrayLoader takes a dict name -> array (e.g. {'x': x, 'y': y}; the "
            f"names are the loss function's arguments); got {type(arrays).__name__}."
        )
    columns = {}
    for name, value in dict(arrays).items():
        if not isinstance(name, str):
            raise BatchError(
                "ArrayLoader's column names must be strings (the loss function's "
                f"arguments); got {name!r}."
            )
        columns[name] = _column(name, value)
    if not columns:
        raise BatchError("ArrayLoader needs at least one column; got an empty dict.")
    if all(c.shape[:1] == (0,) for c in columns.values()):
        name, column = next(iter(columns.items()))
        raise BatchError(
            f"ArrayLoader got 0 examples (column {name!r} has shape "
            f"{list(column.shape)}); pass at least one example."
        )
    return columns


def _column(name: str, value: Any) -> np.ndarray:
    if value is None or isinstance(value, Mapping):
        got = "None" if value is None else f"a {type(value).__name__}"
        raise BatchError(
            f"Column {name!r} is {got}; ArrayLoader takes one array per name (a "
            "flat dict of arrays)."
        )
    try:
        column = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise BatchError(
            f"Column {name!r} is not a rectangular array ({e}); give every example "
            "the same shape (pad them)."
        ) from None
    if not (jnp.issubdtype(column.dtype, jnp.number) or column.dtype == np.bool_):
        raise BatchError(
            f"Column {name!r} has dtype {column.dtype}, not numbers or bools; "
            "encode it as numbers first (e.g. token ids for strings): only "
            "numeric arrays enter jit."
        )
    return column


_DONE = object()


def prefetch_to_device(
    iterator: Iterable[Any],
    size: int = 2,
    sharding: Any = None,
    *,
    put: Any = None,
) -> Iterator[Any]:
    """Moves batches to the device in a background thread, ``size`` ahead.

    The host prepares and transfers the next batches while the device computes.
    An exception raised by the source is re-raised here, in order.

    Args:
      iterator: Batches (pytrees of arrays).
      size: How many batches to keep ready.
      sharding: Optional sharding for ``jax.device_put``.
      put: Replaces ``jax.device_put(item, sharding)`` as the per-item transfer.

    Yields:
      The batches, as device arrays.

    Example:
      >>> import numpy as np
      >>> [b["x"].sum().item() for b in prefetch_to_device([{"x": np.ones(3)}] * 2)]
      [3.0, 3.0]
    """
    if put is None:
        put = lambda item: jax.device_put(item, sharding)  # noqa: E731
    q: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def work():
        try:
            for item in iterator:
                if stop.is_set():
                    return
                q.put(put(item))
            q.put(_DONE)
        except BaseException as e:  # re-raised in the consumer
            q.put(e)

    thread = threading.Thread(target=work, daemon=True, name="pztrain-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.01)
