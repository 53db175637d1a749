"""Putting batches on devices: one device, a mesh, or one global array from the
rows each process holds.

`put_batch` is the one transfer `pztrain.fit` and `prefetch_to_device` use: a
batch goes straight to the devices of the step's batch sharding (one hop, no
stop on device 0), and when that sharding spans several processes each process
gives only its own rows (`jax.make_array_from_process_local_data`).
`process_rows` says which rows those are; `data_shards` how many pieces a
sharding cuts the batch axis into.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from pztrain._tree import named_leaves
from pztrain.data._batch import BatchError

__all__ = [
    "check_loader_sharding",
    "data_shards",
    "host_rows",
    "prefetch_to_device",
    "process_rows",
    "put_batch",
]


def put_batch(batch: Any, sharding: Any = None) -> Any:
    """Moves a batch to the devices of ``sharding`` in one transfer.

    Args:
      batch: A pytree of host arrays. When ``sharding`` spans several processes,
        each process passes only its rows; the global batch
        axis is the processes' rows in process order.
      sharding: ``None`` (the default device), one `jax.sharding.Sharding` for
        every leaf, or a pytree of them matching the batch. With one
        `jax.sharding.NamedSharding`, a leaf with fewer axes than its spec
        (e.g. a scalar) is replicated over the mesh.

    Returns:
      The batch as `jax.Array` s with those shardings (global arrays across
      processes).

    Example:
      >>> import numpy as np, jax; from pztrain import put_batch
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> batch = put_batch(
      ...     {"x": np.ones((4, 2)), "t": np.float32(2.0)},
      ...     NamedSharding(mesh, P("data")),
      ... )
      >>> batch["x"].sharding.spec, batch["t"].sharding.spec
      (P('data',), P())
    """
    if sharding is None:
        return jax.device_put(batch)
    if isinstance(sharding, NamedSharding):
        _check_divides(batch, sharding)
        sharding = jax.tree.map(lambda x: _fit_rank(sharding, x), batch)
    addressable = all(s.is_fully_addressable for s in jax.tree.leaves(sharding))
    if addressable:
        return jax.device_put(batch, sharding)
    return jax.make_array_from_process_local_data(sharding, batch)


def _check_divides(batch: Any, sharding: NamedSharding) -> None:
    """Refuses a leaf whose example axis does not split evenly over the data
    shards (each process's rows count ``process_count`` times)."""
    spec = tuple(sharding.spec)
    axis = next((i for i, entry in enumerate(spec) if entry is not None), None)
    if axis is None:
        return
    shards = data_shards(sharding, axis)
    rows = 1 if sharding.is_fully_addressable else jax.process_count()
    for name, leaf in named_leaves(batch):
        shape = getattr(leaf, "shape", ())
        if len(shape) > axis and (shape[axis] * rows) % shards:
            raise BatchError(
                f"batch[{name!r}] has {shape[axis] * rows} examples along axis "
                f"{axis}, which do not split evenly over the {shards} data shards "
                f"of {sharding.spec} on a mesh of shape {dict(sharding.mesh.shape)}. "
                f"Use a batch size that divides by {shards} (an ArrayLoader with "
                "drop_remainder=True keeps every batch whole)."
            )


def _fit_rank(sharding: NamedSharding, leaf: Any) -> NamedSharding:
    """``sharding``, or the replicated one for a leaf of fewer axes."""
    if len(getattr(leaf, "shape", ())) >= len(sharding.spec):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec())


def data_shards(sharding: NamedSharding, axis: int = 0) -> int:
    """Pieces ``sharding`` cuts array axis ``axis`` into (product of its mesh axes).

    Example:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> data_shards(NamedSharding(jax.make_mesh((1,), ("data",)), P("data")))
      1
    """
    spec = tuple(sharding.spec)
    names = spec[axis] if axis < len(spec) else None
    if names is None:
        return 1
    names = (names,) if isinstance(names, str) else tuple(names)
    return math.prod(sharding.mesh.shape[name] for name in names)


def process_rows(
    batch_size: int, process_index: int, process_count: int
) -> tuple[int, int]:
    """``(start, stop)``: the rows of a global batch process ``process_index``
    holds, its contiguous block out of ``process_count``.

    This is the layout `jax.make_array_from_process_local_data` assembles when
    the mesh's data axis runs over the processes in order (as `jax.make_mesh`
    lays devices out).

    Raises:
      BatchError: if ``batch_size`` does not divide by ``process_count``, or the
        index is out of range.

    Example:
      >>> [process_rows(8, p, 2) for p in range(2)]
      [(0, 4), (4, 8)]
    """
    if not 0 <= process_index < process_count:
        raise BatchError(
            f"process_index={process_index} is outside range({process_count}) "
            f"(process_count={process_count})."
        )
    if batch_size % process_count:
        raise BatchError(
            f"batch_size={batch_size} (the global batch) does not divide among "
            f"{process_count} processes; pass a multiple of {process_count}."
        )
    per = batch_size // process_count
    return process_index * per, (process_index + 1) * per


def check_loader_sharding(owner: str, sharding: Any, batch_size: int) -> None:
    """Checks a loader's ``sharding`` (the sharding of one global batch).

    Raises:
      BatchError: naming ``owner`` (the loader's class), unless ``sharding`` is
        ``None`` or a `jax.sharding.NamedSharding` that splits the batch axis
        into pieces that divide ``batch_size``.
    """
    if sharding is None:
        return
    if not isinstance(sharding, NamedSharding):
        raise BatchError(
            f"{owner}'s sharding must be a jax.sharding.NamedSharding of one "
            "batch (e.g. NamedSharding(mesh, P('data'))); got "
            f"{type(sharding).__name__}."
        )
    if not sharding.spec or sharding.spec[0] is None:
        raise BatchError(
            f"{owner}'s sharding {sharding.spec} must split the first axis of a "
            "batch (its examples), e.g. P('data'): pass the sharding of one batch, "
            "pztrain.sharding.data_sharding(mesh), also with steps_per_call."
        )
    shards = data_shards(sharding)
    if batch_size % shards:
        raise BatchError(
            f"batch_size={batch_size} (the global batch) does not divide into the "
            f"{shards} data shards of {sharding.spec} on a mesh of shape "
            f"{dict(sharding.mesh.shape)}; pass a multiple of {shards} (each shard "
            f"gets batch_size / {shards} rows)."
        )


def host_rows(
    batch_size: int, sharding: Any, index: int | None, count: int | None
) -> tuple[int, int]:
    """The rows of each global batch this process reads: its `process_rows`,
    with ``jax.process_index()`` / ``jax.process_count()`` as the defaults when
    there is a ``sharding`` (else process 0 of 1)."""
    if index is None:
        index = 0 if sharding is None else jax.process_index()
    if count is None:
        count = 1 if sharding is None else jax.process_count()
    return process_rows(batch_size, index, count)


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
      sharding: Where the batches go, as for `put_batch` (across processes:
        each batch holds this process's rows).
      put: Replaces ``put_batch(item, sharding)`` as the per-item transfer.

    Yields:
      The batches, as device arrays.

    Example:
      >>> import numpy as np; from pztrain.data import prefetch_to_device
      >>> [b["x"].sum().item() for b in prefetch_to_device([{"x": np.ones(3)}] * 2)]
      [3.0, 3.0]
    """
    if put is None:
        put = lambda item: put_batch(item, sharding)  # noqa: E731
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
