"""Host arrays onto their devices with one copy: each device's piece of a
tensor is made once, in the target's layout and dtype, in host memory that
XLA:CPU takes over instead of copying it again.

XLA:CPU adopts a C-contiguous host buffer whose data starts on a 64-byte
boundary (NumPy's own allocations start on 16); any other array it copies into
a buffer of its own. So the transpose or dtype conversion a mapping needs is
done once, straight into such a buffer, and an array that already is one (a
row block of a tensor read in the target's layout) is placed as it is.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

__all__ = ["ALIGN", "aligned_empty", "box_of", "device_layout", "place"]

ALIGN = 64  # bytes: the alignment XLA:CPU needs to adopt a host buffer


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `ALIGN`
    boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def device_layout(x: np.ndarray, dtype: Any) -> np.ndarray:
    """``x`` as ``dtype`` in a buffer XLA:CPU can adopt: ``x`` itself when it
    is one, else one copy (transpose and conversion in the same pass)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype and x.flags.c_contiguous and x.ctypes.data % ALIGN == 0:
        return x
    out = aligned_empty(x.shape, dtype)
    np.copyto(out, x, casting="unsafe")
    return out


@functools.lru_cache(maxsize=256)
def box_of(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """The box of a ``shape`` array this process's devices hold: a ``(start,
    stop)`` per axis (``(0, 0)`` on each axis when they hold none of it)."""
    indices = sharding.addressable_devices_indices_map(shape).values()
    ranges = [_ranges(index, shape) for index in indices]
    if not ranges:
        return tuple((0, 0) for _ in shape)
    return tuple(
        (min(r[a][0] for r in ranges), max(r[a][1] for r in ranges))
        for a in range(len(shape))
    )


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def place(
    region: np.ndarray,
    got: tuple[tuple[int, int], ...],
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    dtype: Any,
) -> jax.Array:
    """The ``shape`` array on ``sharding`` whose box ``got`` (one holding
    `box_of` it) is ``region``: each distinct device piece made once by
    `device_layout` (replicas share it) and adopted by XLA:CPU without a copy.
    """
    pieces: dict[tuple, np.ndarray] = {}

    def piece(index: tuple[slice, ...]) -> np.ndarray:
        r = _ranges(index, shape)
        if r not in pieces:
            rel = tuple(
                slice(lo - g, hi - g) for (lo, hi), (g, _) in zip(r, got, strict=True)
            )
            pieces[r] = device_layout(region[rel], dtype)
        return pieces[r]

    return jax.make_array_from_callback(shape, sharding, piece)
