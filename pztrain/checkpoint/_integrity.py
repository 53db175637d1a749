"""Checksums: what a save stores and a load verifies, for every array.

A save stores the xxh3-64 checksum of each array's C-ordered bytes in the
checkpoint's JSON (the ``"xxh3_64"`` lists). A load reads the arrays through
orbax (whatever its on-disk layout) and then checks each one's shape, dtype and
checksum against the JSON, before anything uses it: a flipped bit, a truncated,
missing, replaced or re-described file is a `CheckpointError` naming the array.
Checkpoints saved before checksums existed have none and are not verified; an
array this process cannot see whole (sharded across processes) is not either.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import xxhash

from pztrain._tree import describe_shape, is_array
from pztrain.checkpoint._metadata import CHECKSUM, CheckpointError
from pztrain.checkpoint._targets import key_impl, target_of

__all__ = [
    "StoredArray",
    "as_written",
    "checksum",
    "checksums",
    "corrupt",
    "from_written",
    "verify",
]

_LOAD_ANOTHER = "Load another checkpoint (resuming skips this one)."
_PARALLEL_BYTES = 64 * 2**20  # above this, arrays are hashed on threads


class StoredArray(NamedTuple):
    """One array of an item, as the JSON (checked against the target) describes it.

    Attributes:
      label: How errors name it: ``"parameter 'w'"``, ``"state array .step"``.
      key: Its key in the item (``"0"``, ``"1"``, …).
      target: Its shape and dtype (and sharding: ``None`` for the host) once
        restored.
      checksum: The checksum stored at save, or ``None`` (not verified).
      key_impl: For a PRNG key array, its implementation (`jax.random.key_impl`).
    """

    label: str
    key: str
    target: jax.ShapeDtypeStruct
    checksum: str | None
    key_impl: Any = None

    @classmethod
    def like(cls, label: str, key: str, x: Any, checksum: str | None) -> StoredArray:
        """An array restored into the place and type of ``x`` (see `target_of`;
        a PRNG key array of its implementation)."""
        target = target_of(x, host=True)
        is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return cls(label, key, target, checksum, key_impl(x) if is_key else None)


def checksum(x: Any) -> str | None:
    """xxh3-64 of an array's bytes in C order, as 16 hex digits.

    PRNG key arrays are hashed through their key data. ``None`` for an array
    this process cannot see whole (sharded across processes).

    Example:
      >>> import numpy as np
      >>> checksum(np.zeros(2, np.float32)) == checksum(np.zeros(2, np.float32))
      True
    """
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            return None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        with jax.transfer_guard_device_to_host("allow"):
            x = np.asarray(x)  # no copy for an array on the CPU
    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def checksums(arrays: Sequence[Any]) -> list[str | None]:
    """`checksum` of each array (on several threads for many bytes: xxhash
    releases the GIL)."""
    nbytes = sum(np.size(x) * np.dtype(_host_dtype(x)).itemsize for x in arrays)
    threads = min(len(arrays), os.cpu_count() or 1, 8)
    if nbytes < _PARALLEL_BYTES or threads < 2:
        return [checksum(x) for x in arrays]
    with ThreadPoolExecutor(threads, thread_name_prefix="pztrain-checksum") as pool:
        return list(pool.map(checksum, arrays))


def _host_dtype(x: Any) -> Any:
    return np.uint32 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x.dtype


def verify(root: Path, item: str, arrays: list[StoredArray], restored: dict) -> None:
    """Checks the restored arrays' shapes, dtypes and checksums.

    Raises:
      CheckpointError: naming the array and its directory, if one differs.
    """
    for a in arrays:
        x = restored.get(a.key)
        want = describe_shape(a.target.shape, str(a.target.dtype))
        got = describe_shape(np.shape(x), str(x.dtype)) if is_array(x) else None
        if got != want:
            where = f"{a.label} ({root / item / a.key})"
            raise corrupt(root, f"{where} was read as {got}, not {want}")
    checked = [a for a in arrays if a.checksum is not None]
    found = checksums([restored[a.key] for a in checked])
    for a, got in zip(checked, found, strict=True):
        if got is not None and got != a.checksum:
            raise corrupt(
                root,
                f"{a.label} ({root / item / a.key}) does not match the checksum "
                f"stored when it was saved ({CHECKSUM} {a.checksum}, read {got}): "
                "its bytes changed on disk",
            )


def as_written(target: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The array as stored: a PRNG key array is written as its key data."""
    if not jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key):
        return target
    data = jax.eval_shape(
        jax.random.key_data, jax.ShapeDtypeStruct(target.shape, target.dtype)
    )
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=target.sharding)


def from_written(a: StoredArray, x: Any) -> Any:
    """``x`` as read (key data for a PRNG key array, unless orbax wrapped it
    already) in the type of ``a``."""
    if a.key_impl is None or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return jax.random.wrap_key_data(x, impl=a.key_impl)


def corrupt(root: Path, detail: str) -> CheckpointError:
    """The error of a checkpoint whose files are damaged or were changed."""
    return CheckpointError(
        f"Checkpoint {root} is incomplete or corrupt: {detail}. {_LOAD_ANOTHER}"
    )
