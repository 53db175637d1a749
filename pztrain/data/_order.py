"""The order of a `GrainLoader`'s epochs: a keyed permutation of ``[0, n)``
evaluated for a whole batch at once.

Place ``i`` of epoch ``e`` holds example ``permute(i)``, a bijection of
``[0, n)`` drawn from ``(seed, e)``: a Feistel network over the smallest
power of two ``>= n`` (its two halves mixed in turn by a 64-bit hash of the
other half and a round key), walked along its cycle until the result falls
below ``n`` (cycle walking: the walk stays inside ``[0, n)`` and so is a
bijection of it). Each place is computed on its own, so a batch's examples
cost a few NumPy operations over the batch and no table of ``n`` entries is
ever built; the result is a function of ``(seed, e, n)`` alone, the same on
any machine and process count.

``ORDERS`` names the orders a loader can use: ``"feistel"`` (this one) and
``"grain"`` (grain's ``index_shuffle`` per example, seeded ``seed + e``: the
order `GrainLoader` used before; kept so that old runs resume exactly).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ORDERS", "ROUNDS", "epoch_keys", "grain_order", "permute", "shuffled"]

ORDERS = ("feistel", "grain")
ROUNDS = 6  # Feistel rounds (each mixes one half into the other)

_U64 = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive values
_M1, _M2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # a 64-bit finaliser's constants


def _mix(z: np.ndarray) -> np.ndarray:
    """A 64-bit hash, elementwise (a bijection of uint64 with full avalanche)."""
    z = z ^ (z >> _U64(33))
    z = z * _U64(_M1)
    z = z ^ (z >> _U64(33))
    z = z * _U64(_M2)
    return z ^ (z >> _U64(33))


def epoch_keys(seed: int, epochs: np.ndarray) -> np.ndarray:
    """The round keys of ``(seed, e)`` for each epoch ``e``: uint64
    ``[len(epochs), ROUNDS]``.

    Example:
      >>> keys = epoch_keys(0, np.array([0, 1, 0]))
      >>> keys.shape, bool((keys[0] == keys[2]).all()), bool((keys[0] == keys[1]).any())
      ((3, 6), True, False)
    """
    with np.errstate(over="ignore"):
        base = _mix(np.full(1, seed, _U64) * _U64(_GOLDEN) + _U64(1))
        per_epoch = _mix(base ^ (np.asarray(epochs, np.int64).astype(_U64) + _U64(1)))
        rounds = np.arange(1, ROUNDS + 1, dtype=_U64) * _U64(_GOLDEN)
        return _mix(per_epoch[:, None] + rounds[None, :])


def permute(places: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """``permute(i)`` for each place ``i`` in ``[0, n)``: int64, same shape.

    Args:
      places: Integers in ``[0, n)``, any shape.
      n: The size of the permuted range (the dataset's length), ``>= 1``.
      keys: The ``ROUNDS`` uint64 round keys of one epoch (a row of
        `epoch_keys`).

    Example:
      A permutation of ``range(10)``, a pure function of the keys:

      >>> keys = epoch_keys(seed=3, epochs=np.array([0]))[0]
      >>> order = permute(np.arange(10), 10, keys)
      >>> sorted(order.tolist()) == list(range(10))
      True
      >>> bool((permute(np.arange(10), 10, keys) == order).all())
      True
    """
    places = np.asarray(places, np.int64)
    x = places.reshape(-1).astype(_U64)
    wide = math.isqrt(n - 1) + 1  # the grid [0, wide) x [0, tall) covers [0, n)
    tall = -(-n // wide)
    x = _feistel(x, keys, wide, tall)
    out = x >= _U64(n)
    while out.any():  # cycle walking (rare: the grid holds < n + wide cells)
        todo = np.flatnonzero(out)
        x[todo] = walked = _feistel(x[todo], keys, wide, tall)
        out[todo] = walked >= _U64(n)
    return x.astype(np.int64).reshape(places.shape)


def _feistel(x: np.ndarray, keys: np.ndarray, wide: int, tall: int) -> np.ndarray:
    """One pass of the network over ``[0, wide * tall)``: ``x`` as the pair
    ``(x // tall, x % tall)``, whose two parts take turns, each shifted (mod
    its range) by a hash of the other and the round's key: a bijection of the
    grid whatever the hash."""
    high, low = np.divmod(x, _U64(tall))
    with np.errstate(over="ignore"):
        for r in range(ROUNDS):
            if r % 2 == 0:
                high = _add_mod(high, _hash(low, keys[r], wide), wide)
            else:
                low = _add_mod(low, _hash(high, keys[r], tall), tall)
    return high * _U64(tall) + low


def _hash(v: np.ndarray, key: np.uint64, size: int) -> np.ndarray:
    """A keyed hash of ``v`` (values below ``2**32``) into ``[0, size)``: two
    64-bit multiplies with an xor-shift between them (a hash finaliser's
    steps), the top 32 bits scaled to ``size`` by a multiply-shift."""
    h = v ^ key
    h *= _U64(_M1)
    h ^= h >> _U64(29)
    h *= _U64(_M2)
    h >>= _U64(32)
    h *= _U64(size)
    h >>= _U64(32)
    return h


def _add_mod(a: np.ndarray, b: np.ndarray, size: int) -> np.ndarray:
    """``(a + b) % size`` for ``a, b`` in ``[0, size)``: ``a + b - size``
    wraps round to a huge value unless ``a + b >= size``."""
    s = a + b
    return np.minimum(s, s - _U64(size))


def shuffled(places: np.ndarray, epochs: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The example at each place of its epoch: ``permute`` keyed by
    ``(seed, epoch)``, place by place (``places`` and ``epochs`` of one shape).

    Example:
      >>> shuffled(np.arange(5), np.zeros(5, int), 5, seed=0).tolist()  # epoch 0
      [3, 2, 0, 4, 1]
      >>> shuffled(np.arange(5), np.ones(5, int), 5, seed=0).tolist()  # epoch 1
      [2, 0, 1, 3, 4]
    """
    places = np.asarray(places, np.int64)
    epochs = np.broadcast_to(np.asarray(epochs, np.int64), places.shape)
    first = epochs.flat[0] if epochs.size else 0
    if (epochs == first).all():  # the common case: one epoch
        return permute(places, n, epoch_keys(seed, np.array([first]))[0])
    out = np.empty_like(places)
    for epoch in np.unique(epochs):
        here = epochs == epoch
        out[here] = permute(places[here], n, epoch_keys(seed, np.array([epoch]))[0])
    return out


def grain_order(places: np.ndarray, n: int, seeds: np.ndarray) -> np.ndarray:
    """grain's ``index_shuffle`` of each place, seeded per place (the order of
    ``order="grain"``): one call per example, about 6 µs each."""
    from grain.experimental import index_shuffle

    places = np.asarray(places, np.int64)
    seeds = np.broadcast_to(seeds, places.shape)
    out = [
        index_shuffle(int(i), max_index=n - 1, seed=int(s), rounds=4)
        for i, s in zip(places.reshape(-1), seeds.reshape(-1), strict=True)
    ]
    return np.asarray(out, np.int64).reshape(places.shape)
