"""Placing a checkpoint's tensors on their devices: each piece in the form
XLA:CPU places fastest (adopted without a copy, or left to its own transposing
copy), so `load_pretrained` copies each byte once after reading it."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from pztrain.finetune._place import (
    ADOPT_BYTES,
    ALIGN,
    aligned_empty,
    box_of,
    device_layout,
)


def _misaligned(shape: tuple[int, ...]) -> np.ndarray:
    raw = np.zeros(np.prod(shape) * 4 + ALIGN + 16, np.uint8)
    start = -raw.ctypes.data % ALIGN + 16
    x = raw[start : start + np.prod(shape) * 4].view(np.float32).reshape(shape)
    x[...] = np.arange(x.size).reshape(shape)
    return x


def test_a_piece_in_an_aligned_buffer_is_adopted_by_xla_without_a_copy():
    x = aligned_empty((8, 16), np.float32)
    x[...] = np.arange(128).reshape(8, 16)
    assert x.ctypes.data % ALIGN == 0 and x.flags.c_contiguous
    assert device_layout(x, np.float32) is x
    placed = jax.device_put(x, jax.devices()[0])
    assert placed.unsafe_buffer_pointer() == x.ctypes.data  # no copy made
    np.testing.assert_array_equal(np.asarray(placed), x)


def test_a_large_misaligned_piece_is_copied_once_converting_on_the_way():
    x = _misaligned((256, 256))
    assert x.ctypes.data % ALIGN and x.nbytes >= ADOPT_BYTES
    same = device_layout(x, np.float32)
    assert same.ctypes.data % ALIGN == 0 and same.flags.c_contiguous
    np.testing.assert_array_equal(same, x)
    half = device_layout(x, ml_dtypes.bfloat16)
    assert half.dtype == ml_dtypes.bfloat16 and half.ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(half, x.astype(ml_dtypes.bfloat16))
    small = _misaligned((8, 16))  # XLA:CPU's own copy is as quick
    assert device_layout(small, np.float32) is small


def test_a_transposed_piece_is_left_to_xla_unless_devices_share_it():
    x = np.arange(128, dtype=np.float32).reshape(16, 8).T
    assert device_layout(x, np.float32) is x  # XLA:CPU's copy transposes it
    half = device_layout(x, ml_dtypes.bfloat16)  # converted in its own order
    assert not half.flags.c_contiguous
    np.testing.assert_array_equal(half, x.astype(ml_dtypes.bfloat16))
    shared = device_layout(x, np.float32, shared=True)  # one buffer for all
    assert shared.flags.c_contiguous and shared.ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(shared, x)


def test_the_box_a_process_holds_covers_its_devices_pieces():
    device = jax.devices()[0]
    one = jax.sharding.SingleDeviceSharding(device)
    assert box_of(one, (3, 5)) == ((0, 3), (0, 5))
    assert box_of(one, (0, 5)) == ((0, 0), (0, 5))
