"""An epoch of a dataset on the device: `IndexedBatches`, and the one copy of
the data that `ArrayLoader(on_device=True)` keeps there (`DeviceCopy`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

__all__ = ["DeviceCopy", "IndexedBatches"]


@dataclasses.dataclass(frozen=True)
class IndexedBatches:
    """One epoch of a dataset on device, already in that epoch's order.

    Each array is laid out ``[batches, batch_size, ...]``: row ``i`` of axis 0 is
    the ``i``-th batch of the epoch. Step ``s`` reads batch
    ``s % steps_per_epoch`` (``k`` consecutive batches with ``steps_per_call=k``),
    sliced inside the jitted step along axis 0: no per-step host work, no
    per-step transfer. A slice touches only its own rows (a per-step gather
    from the whole dataset would be costed by XLA as reading all of it). On a
    mesh the arrays are sharded ``P(None, data)``: every device holds its rows
    of every batch, so the slice is local to each device and moves no data.
    `ArrayLoader` with ``on_device=True`` makes one per epoch, permuting its
    device copy once; `pztrain.fit` reads a `GrainLoader` as one per block of
    32 steps (``steps_per_epoch`` then the block's length: step ``s`` is row
    ``s % 32`` of the block that holds it).

    A pytree: the arrays are its leaves, the two sizes are static.

    Attributes:
      arrays: Name → array ``[batches, batch_size, ...]`` of the epoch's
        examples in order; the last batch is padded if the examples do not
        fill it (only the first ``steps_per_epoch`` batches are read).
      batch_size: Examples per batch.
      steps_per_epoch: Batches in the epoch.

    Example:
      An epoch on the device, for ``train_step(state, batches)``:

      >>> import jax.numpy as jnp, numpy as np
      >>> from pztrain.data import ArrayLoader
      >>> loader = ArrayLoader({"x": np.arange(8)}, batch_size=4, shuffle=False,
      ...                      on_device=True)
      >>> batches = loader.device_epoch(0)
      >>> batches.arrays["x"].shape, batches.steps_per_epoch
      ((2, 4), 2)
      >>> batches.take(jnp.int32(3))["x"]  # step 3 reads batch 3 % 2
      Array([4, 5, 6, 7], dtype=int32)
    """

    arrays: dict[str, jax.Array]
    batch_size: int
    steps_per_epoch: int

    def take(self, step: jax.Array, count: int = 1) -> dict[str, jax.Array]:
        """The batch of ``step`` (``count`` batches stacked if ``count > 1``)."""
        start = step % self.steps_per_epoch
        if count == 1:
            cut = lambda v: jax.lax.dynamic_index_in_dim(v, start, keepdims=False)  # noqa: E731
        else:
            cut = lambda v: jax.lax.dynamic_slice_in_dim(v, start, count)  # noqa: E731
        return {k: cut(v) for k, v in self.arrays.items()}

    def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one batch (nothing runs on the device)."""
        return {
            k: jax.ShapeDtypeStruct((self.batch_size, *v.shape[2:]), v.dtype)
            for k, v in self.arrays.items()
        }


jax.tree_util.register_dataclass(
    IndexedBatches,
    data_fields=["arrays"],
    meta_fields=["batch_size", "steps_per_epoch"],
)


@jax.jit
def _permute(arrays: dict[str, jax.Array], idx: jax.Array) -> dict[str, jax.Array]:
    """Rows of ``[batches, batch_size, ...]`` arrays put in the order ``idx``
    (over the flattened rows)."""

    def one(v: jax.Array) -> jax.Array:
        flat = v.reshape(-1, *v.shape[2:])
        # idx is a permutation: in range and unique by construction, so "clip"
        # skips the out-of-bounds masking of the default mode.
        return jnp.take(flat, idx, axis=0, mode="clip", unique_indices=True).reshape(
            v.shape
        )

    return {k: one(v) for k, v in arrays.items()}


class DeviceCopy:
    """The examples of a dataset on the device, arranged one epoch at a time.

    Without a sharding, the arrays are moved to the device once; each new
    epoch then permutes the device copy into its order with one jitted gather
    (sending one int32 index per row), and the previous arrangement is
    dropped: one copy of the data stays on the device (two during the
    permutation). With a sharding (``P(None, data)`` over
    ``[batches, batch_size, ...]``), each new epoch is placed from the host:
    every device receives only its rows of every batch (its share of the data;
    no gather across devices), and each process sends only to its own devices.

    Args:
      arrays: Name → host array, examples first.
      batch_size: Examples per batch.
      sharding: The sharding of an epoch laid out ``[batches, batch_size,
        ...]``, or ``None`` (the default device).
    """

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        batch_size: int,
        sharding: NamedSharding | None,
    ):
        self._host = arrays
        self._batch_size = batch_size
        self._sharding = sharding
        self._n = len(next(iter(arrays.values())))
        self._rows = -(-self._n // batch_size) * batch_size  # the last one padded
        self._arrays: dict[str, jax.Array] | None = None
        self._order: np.ndarray | None = None  # the example each row holds
        self._epoch: int | None = None  # the epoch it is arranged for

    def epoch(self, epoch: int, order: np.ndarray | None) -> IndexedBatches:
        """The batches of ``epoch`` in ``order`` (``None``: the examples' own)."""
        if self._arrays is None or (order is not None and self._epoch != epoch):
            if self._sharding is not None:
                self._arrays = None  # drop the last epoch first
                self._arrays = self._place_sharded(order)
            elif self._arrays is None:
                self._arrays = self._place()
            if self._sharding is None and order is not None:
                self._rearrange(order)
            self._epoch = epoch
        return IndexedBatches(
            self._arrays, self._batch_size, self._n // self._batch_size
        )

    def _place(self) -> dict[str, jax.Array]:
        """The data on the device as ``[batches, batch_size, ...]``, padded."""
        self._order = np.arange(self._rows)  # padding rows: "examples" >= n
        ids = np.minimum(self._order, self._n - 1)
        shape = (-1, self._batch_size)
        return jax.device_put(
            {k: v[ids].reshape(*shape, *v.shape[1:]) for k, v in self._host.items()}
        )

    def _place_sharded(self, order: np.ndarray | None) -> dict[str, jax.Array]:
        """Epoch ``order`` on the mesh, each device's block read from the host."""
        order = np.arange(self._n) if order is None else order
        pad = self._rows - self._n  # pad < batch_size <= n
        ids = np.concatenate([order, order[:pad]]).reshape(-1, self._batch_size)

        def place(v: np.ndarray) -> jax.Array:
            shape = (*ids.shape, *v.shape[1:])
            return jax.make_array_from_callback(
                shape,
                self._sharding,
                lambda i: v[ids[i[:2]]][(slice(None),) * 2 + i[2:]],
            )

        # An explicit placement, which JAX's transfer guard counts as implicit.
        with jax.transfer_guard_host_to_device("allow"):
            return {k: place(v) for k, v in self._host.items()}

    def _rearrange(self, order: np.ndarray) -> None:
        """Permutes the device copy into ``order`` (padding rows last)."""
        order = np.concatenate([order, np.arange(self._n, self._rows)])
        # Row i of the device copy holds example self._order[i]; the rows
        # wanted are those holding order[0], order[1], ...
        where = np.empty_like(self._order)
        where[self._order] = np.arange(self._rows)
        # The index goes to the jitted gather as a NumPy array (jit's own
        # transfer: ~33 µs of CPU less than a jax.device_put), allowed by name
        # so that fit makes no unasked transfer (tests/test_transfer_guard.py).
        idx = where[order].astype(np.int32)
        with jax.transfer_guard_host_to_device("allow"):
            self._arrays = _permute(self._arrays, idx)
        self._order = order
