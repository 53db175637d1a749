"""Reading a checkpoint's array files without trusting them.

An array item (``params``, ``state``) is a directory of orbax's zarr arrays, one
sub-directory per array (``params/0/.zarray`` and its chunk files ``0``,
``0.0``, …) with orbax's list of them in ``_METADATA``. Before any data is
read, `check_files` makes sure that:

* ``_METADATA`` lists exactly the arrays of the JSON, each as a plain array, and
  no orbax aggregate file (``checkpoint``, msgpack) is there to supply values;
* each ``.zarray`` has the JSON's shape and dtype, uncompressed (so nothing is
  ever cast from another dtype);
* every chunk file exists inside the checkpoint (not through a link out of
  it) with exactly the bytes the chunk needs.

An array bound for the host or one device is then read here (`read`), straight
from the chunk files just checked, which is faster than orbax's read; others
(sharded over several devices or processes) are left to orbax. Each array is
compared with the checksum stored at save (`checksum`: xxh3-64 of the array's
C-ordered bytes, the JSON's ``"xxh3_64"`` lists) before it is placed, or, when
orbax read it, by `verify`. Checkpoints saved before checksums existed have none
and are not verified. Every failure here is a `CheckpointError` (the files are
damaged or were changed), never a `CheckpointMismatchError`.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import xxhash

from pztrain.checkpoint._metadata import CHECKSUM, CheckpointError
from pztrain.checkpoint._targets import key_impl, target_of
from pztrain._tree import describe_shape, is_array

__all__ = [
    "Layout",
    "StoredArray",
    "as_written",
    "check_files",
    "checksum",
    "checksums",
    "from_written",
    "read",
    "reads_directly",
    "verify",
]

_AGGREGATE_FILE = "checkpoint"  # orbax's msgpack of values; pztrain never writes it
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
_LOAD_ANOTHER = "Load another checkpoint (resuming skips this one)."
_ALIGN = 64  # bytes
_POPULATE_BYTES = 2**20
_PARALLEL_BYTES = 64 * 2**20  # above this, arrays are read and hashed on threads


class StoredArray(NamedTuple):
    """One array of an item, as the JSON (checked against the target) describes it.

    Attributes:
      label: How errors name it: ``"parameter 'w'"``, ``"state array .step"``.
      key: Its key in the item (``"0"``, ``"1"``, …), its sub-directory's name.
      target: Its shape and dtype (and sharding) once restored.
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


class Layout(NamedTuple):
    """An array's checked files: as written (key data for a PRNG key array).

    Attributes:
      shape: The array's shape as written.
      dtype: Its dtype as written.
      chunks: The shape of a chunk.
      files: Each chunk's grid index and file (links resolved).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    files: list[tuple[tuple[int, ...], Path]]


# ----------------------------------------------------------------------------
# checksums


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
    """`checksum` of each array (on several threads for many bytes)."""
    nbytes = sum(np.size(x) * np.dtype(_host_dtype(x)).itemsize for x in arrays)
    return _map(checksum, arrays, nbytes)


def _map(fn: Any, items: Sequence[Any], nbytes: int) -> list[Any]:
    """``fn`` over ``items``, on several threads when there are enough bytes
    for it to pay (xxhash and file reads release the GIL)."""
    threads = min(len(items), os.cpu_count() or 1, 8)
    if nbytes < _PARALLEL_BYTES or threads < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="pztrain-checkpoint") as pool:
        return list(pool.map(fn, items))


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
            raise _corrupt(root, f"{where} was read as {got}, not {want}")
    checked = [a for a in arrays if a.checksum is not None]
    found = checksums([restored[a.key] for a in checked])
    for a, got in zip(checked, found, strict=True):
        _check_sum(root, item, a, got)


def _check_sum(root: Path, item: str, a: StoredArray, found: str | None) -> None:
    if a.checksum is not None and found is not None and found != a.checksum:
        raise _corrupt(
            root,
            f"{a.label} ({root / item / a.key}) does not match the checksum stored "
            f"when it was saved ({CHECKSUM} {a.checksum}, read {found}): its bytes "
            "changed on disk",
        )


# ----------------------------------------------------------------------------
# reading


def reads_directly(target: jax.ShapeDtypeStruct) -> bool:
    """Whether `read` places the array: on the host or on one device here."""
    sharding = target.sharding
    return sharding is None or (
        sharding.is_fully_addressable and len(sharding.device_set) == 1
    )


def read(
    root: Path, item: str, arrays: list[StoredArray], layouts: dict[str, Layout]
) -> dict[str, Any]:
    """Reads arrays from their checked files, verifies them and places them.

    Args:
      root: The checkpoint directory.
      item: ``"params"`` or ``"state"``.
      arrays: Arrays whose targets `reads_directly`.
      layouts: Their files, from `check_files`.

    Returns:
      Each array by key: NumPy for a host target, else a JAX array.

    Raises:
      CheckpointError: naming the array, if its bytes fail their checksum or a
        file changed while it was read.
    """

    def one(a: StoredArray) -> Any:
        host = _assemble(root, a, layouts[a.key])
        _check_sum(root, item, a, checksum(host))
        return _place(host, a)

    nbytes = sum(math.prod(layouts[a.key].shape) for a in arrays)
    return dict(zip([a.key for a in arrays], _map(one, arrays, nbytes), strict=True))


def _assemble(root: Path, a: StoredArray, layout: Layout) -> np.ndarray:
    """The array as written, from its chunk files (one read per chunk)."""
    out = _aligned_empty(layout.shape, layout.dtype)
    if layout.chunks == layout.shape:  # one chunk: read straight into the array
        _read_into(root, a, layout.files[0][1], out)
        return out
    block = np.empty(layout.chunks, layout.dtype)
    for index, file in layout.files:
        _read_into(root, a, file, block)
        where = tuple(
            slice(i * c, min((i + 1) * c, n))
            for i, c, n in zip(index, layout.chunks, layout.shape, strict=True)
        )
        out[where] = block[tuple(slice(0, s.stop - s.start) for s in where)]
    return out


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array at a 64-byte boundary, which JAX on the CPU takes
    over without a copy. A large one gets its pages mapped in one call
    (``MAP_POPULATE``, Linux): touching fresh pages one at a time cost more than
    reading the file where memory was tight."""
    nbytes = math.prod(shape) * dtype.itemsize
    populate = getattr(mmap, "MAP_POPULATE", None)
    if populate is not None and nbytes >= _POPULATE_BYTES:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
        pages = mmap.mmap(-1, nbytes, flags=flags)
        return np.frombuffer(pages, np.uint8).view(dtype).reshape(shape)
    buffer = np.empty(nbytes + _ALIGN, np.uint8)
    start = -buffer.ctypes.data % _ALIGN
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


def _read_into(root: Path, a: StoredArray, file: Path, out: np.ndarray) -> None:
    try:
        with open(file, "rb") as f:
            found = f.readinto(out.reshape(-1).view(np.uint8))
    except OSError as e:
        raise _corrupt(root, f"cannot read {file}, a file of {a.label} ({e})") from None
    if found != out.nbytes:
        raise _corrupt(root, f"{file}, a file of {a.label}, changed while read")


def _place(host: np.ndarray, a: StoredArray) -> Any:
    """The array where its target is: the host, or one device."""
    if a.target.sharding is None:
        return host
    return from_written(a, jax.device_put(host, a.target.sharding))


def from_written(a: StoredArray, x: Any) -> Any:
    """``x`` as read (key data for a PRNG key array, unless orbax wrapped it
    already) in the type of ``a``."""
    if a.key_impl is None or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return jax.random.wrap_key_data(x, impl=a.key_impl)


# ----------------------------------------------------------------------------
# files


def check_files(
    root: Path, item: str, arrays: list[StoredArray], count: int
) -> dict[str, Layout]:
    """Checks an item's files before any array data is read.

    Args:
      root: The checkpoint directory.
      item: ``"params"`` or ``"state"``.
      arrays: The arrays about to be read.
      count: How many arrays the JSON says the item holds.

    Returns:
      Each array's `Layout`, by key.

    Raises:
      CheckpointError: naming the file (and the array) that is not what pztrain
        wrote.
    """
    _check_listing(root, root / item, count)
    top = root.resolve()
    return {a.key: _check_array(root, top, root / item / a.key, a) for a in arrays}


def _check_listing(root: Path, directory: Path, count: int) -> None:
    """``_METADATA`` lists ``count`` plain arrays; no aggregate file."""
    if (directory / _AGGREGATE_FILE).exists():
        raise CheckpointError(
            f"Checkpoint {root} is refused: {directory / _AGGREGATE_FILE} is an "
            "orbax aggregate file, which pztrain never writes and orbax would take "
            "array values from. Delete it if you trust the rest of the checkpoint; "
            "otherwise load another checkpoint (resuming skips this one)."
        )
    listing = directory / "_METADATA"
    tree = _read_json(root, listing).get("tree_metadata")
    entries = list(tree.values()) if isinstance(tree, dict) else []
    keys = [_array_key(entry) for entry in entries]
    if None in keys or sorted(keys) != sorted(map(str, range(count))):
        raise _corrupt(
            root,
            f"{listing} does not list the {count} plain arrays of its JSON (it has "
            f"{len(entries)} entries, {len(keys) - keys.count(None)} of them plain "
            "arrays)",
        )


def _array_key(entry: Any) -> str | None:
    """The key of a ``_METADATA`` entry that orbax reads as a plain array."""
    if not isinstance(entry, dict):
        return None
    value, key = entry.get("value_metadata"), entry.get("key_metadata")
    if (
        not isinstance(value, dict)
        or value.get("value_type") not in _ARRAY_TYPES
        or value.get("skip_deserialize")
        or not isinstance(key, list)
        or len(key) != 1
        or not isinstance(key[0], dict)
    ):
        return None
    found = key[0].get("key")
    return found if isinstance(found, str) else None


def _check_array(root: Path, top: Path, directory: Path, a: StoredArray) -> Layout:
    """The array's ``.zarray`` and chunk files are what its save wrote."""
    written = as_written(a.target)
    shape, dtype = tuple(written.shape), np.dtype(written.dtype)
    zarray = _inside(root, top, directory / ".zarray", a)
    spec = _read_json(root, zarray)
    want = {
        "zarr_format": 2,
        "shape": list(shape),
        "dtype": dtype.str if dtype.isbuiltin == 1 else dtype.name,
        "compressor": None,
        "filters": None,
        "order": "C",
        "dimension_separator": ".",
    }
    spec.setdefault("dimension_separator", ".")  # zarr's default
    wrong = [k for k, v in want.items() if spec.get(k, "?") != v]
    chunks = spec.get("chunks")
    if not _is_chunk_shape(chunks, shape):
        wrong.append("chunks")
    if wrong:
        said = ", ".join(f"{k} {spec.get(k)!r}" for k in wrong)
        needed = ", ".join(
            f"{k} {want.get(k, 'within ' + str(shape))!r}" for k in wrong
        )
        json_says = describe_shape(a.target.shape, str(a.target.dtype))
        raise _corrupt(
            root,
            f"{zarray}, the description of {a.label}, says {said}, where the JSON's "
            f"{json_says} needs {needed}",
        )
    size = math.prod(chunks) * dtype.itemsize
    grid = [range(math.ceil(n / c)) for n, c in zip(shape, chunks, strict=True)]
    files = []
    for index in itertools.product(*grid):
        chunk = directory / (".".join(map(str, index)) or "0")
        real = _inside(root, top, chunk, a)
        try:
            found = real.stat().st_size
        except OSError:
            raise _corrupt(root, f"{chunk}, a file of {a.label}, is missing") from None
        if found != size:
            raise _corrupt(
                root,
                f"{chunk}, a file of {a.label}, has {found} bytes, not the {size} of "
                "its chunk",
            )
        files.append((index, real))
    return Layout(shape, dtype, tuple(chunks), files)


def _inside(root: Path, top: Path, file: Path, a: StoredArray) -> Path:
    """``file`` with links resolved, if it stays inside the checkpoint."""
    real = Path(os.path.realpath(file))
    if not real.is_relative_to(top):
        raise CheckpointError(
            f"Checkpoint {root} is refused: {file}, a file of {a.label}, leads to "
            f"{real}, outside the checkpoint, and pztrain reads only files inside "
            "it. Copy the data in if you trust it; otherwise load another "
            "checkpoint (resuming skips this one)."
        )
    return real


def as_written(target: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The array as stored: a PRNG key array is written as its key data."""
    if not jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key):
        return target
    data = jax.eval_shape(
        jax.random.key_data, jax.ShapeDtypeStruct(target.shape, target.dtype)
    )
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=target.sharding)


def _is_chunk_shape(chunks: Any, shape: tuple[int, ...]) -> bool:
    if not isinstance(chunks, list) or len(chunks) != len(shape):
        return False
    return all(
        isinstance(c, int) and 0 < c <= n for c, n in zip(chunks, shape, strict=True)
    )


def _read_json(root: Path, file: Path) -> dict:
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _corrupt(root, f"cannot read {file} ({e})") from None
    if not isinstance(found, dict):
        raise _corrupt(root, f"{file} is not what orbax writes")
    return found


def _corrupt(root: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {root} is incomplete or corrupt: {detail}. {_LOAD_ANOTHER}"
    )
