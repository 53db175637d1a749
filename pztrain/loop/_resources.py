"""Before the first step: the step's memory against the device's, and the peak
FLOPs that turn the step's FLOPs into a model FLOPs utilization (MFU).

Both come from the compiled step (`pztrain.TrainStep.cost`), which `fit` asks
for before its first call; JAX then reuses that compilation for the call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax

from pztrain.step import StepCost
from pztrain.step._cost import human_bytes

__all__ = ["PEAK_FLOPS", "check_memory", "peak_flops", "step_devices"]

_log = logging.getLogger("pztrain")

PEAK_FLOPS: dict[str, float] = {
    # Dense bfloat16 peak per device (one chip, or one GPU), from the vendors'
    # data sheets; keyed by ``jax.Device.device_kind``.
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
}
"""Known accelerators' peak FLOPs per device; ``fit(peak_flops=...)`` for others."""

_said_no_memory = False


def _capacity(device: Any) -> int | None:
    """The bytes a device can hold, if it says (CPUs do not)."""
    stats = device.memory_stats()
    return None if not stats else stats.get("bytes_limit")


def check_memory(cost: StepCost, devices: Sequence[Any]) -> None:
    """Refuses to start a step that cannot fit in its devices' memory.

    Raises:
      MemoryError: naming the need, the capacity and the knobs to try.
    """
    global _said_no_memory
    local = [d for d in devices if d.process_index == jax.process_index()]
    capacity = _capacity(local[0]) if local else None
    if capacity is None:
        if not _said_no_memory:
            _log.debug(
                "%s reports no memory capacity: the step's %s is not checked "
                "against it.",
                devices[0].device_kind,
                cost.memory,
            )
            _said_no_memory = True
        return
    if cost.memory.total > capacity:
        raise MemoryError(
            f"The train step needs {cost.memory}, but each "
            f"{devices[0].device_kind} holds {human_bytes(capacity)}. Split the "
            "params and optimizer state over more devices "
            "(ShardingRules(fsdp='data') with build_train_step(mesh=...)), run "
            "smaller micro-batches (build_train_step(microbatches=...)), or "
            "compute in bfloat16 (pztrain.precision.mixed_precision)."
        )


def peak_flops(devices: Sequence[Any], given: float | None) -> float | None:
    """The devices' peak FLOPs per second together: ``given`` (per device), or
    the known figure for their kind (`PEAK_FLOPS`), or ``None``."""
    per_device = given if given is not None else PEAK_FLOPS.get(devices[0].device_kind)
    return None if per_device is None else per_device * len(devices)


def step_devices(train_step: Any) -> list[Any]:
    """The devices a train step runs on: its mesh's, or the default device."""
    mesh = getattr(train_step, "mesh", None)
    return list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
