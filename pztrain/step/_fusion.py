"""Fused calls: many calls of a step on batches that are on the device run as
fewer calls of one program that scans over their steps.

`pztrain.TrainStep.accumulate` with ``calls=n`` on `OnDeviceBatches` (what
`pztrain.fit` runs between two host points when its data is on the device)
runs ``n // c`` calls of a program of ``c`` times the step's steps, then the
rest one call at a time: at most two programs compile. On a dispatch-bound
model a call costs more than its steps, so this is most of the speed of a
hand-written ``lax.scan``. The keys, batches and metric sums are those of the
single calls (each step's key is ``fold_in(root_rng, step)``, its batch
``batches.take(step)``); on the CPU the results are bitwise those of the single
calls (`tests/test_fit_fusion.py`), elsewhere XLA may round a loop's body
differently. A stop flag is read between the fused calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FUSED_STEPS", "fused_calls"]

FUSED_STEPS = 32  # steps in one fused call, at most (its steps_per_call's multiple)


def fused_calls(batch: Any, calls: int, steps_per_call: int, jit: bool) -> int:
    """The calls of a step fused into one (``c``), or 0 for no fusion: only
    for batches on the device (not a dict), a jitted step, at least ``c``
    calls, and ``c > 1``.

    Example:
      >>> fused_calls(object(), calls=100, steps_per_call=1, jit=True)
      32
      >>> fused_calls(object(), calls=100, steps_per_call=8, jit=True)
      4
      >>> fused_calls({"x": 1}, calls=100, steps_per_call=1, jit=True)  # a dict
      0
    """
    chunk = FUSED_STEPS // steps_per_call
    if isinstance(batch, Mapping) or not jit or chunk < 2 or calls < chunk:
        return 0
    return chunk
