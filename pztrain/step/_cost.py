"""What a compiled step costs: its memory per device and its FLOPs, known
before the first step runs (XLA's ``memory_analysis`` and ``cost_analysis``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["StepCost", "StepMemory", "cost_of", "human_bytes", "shapes_key"]


class StepMemory(NamedTuple):
    """The memory one call of a compiled step needs on each device, in bytes.

    Attributes:
      arguments: The inputs (the state, the batch).
      outputs: The outputs.
      temporaries: Everything else the step holds while it runs (activations,
        gradients, optimizer temporaries).
      aliased: Outputs written over donated inputs (counted once, in
        ``arguments``).

    Example:
      What ``train_step.memory(state, **batch)`` returns (here made by hand):

      >>> from pztrain.step import StepMemory
      >>> memory = StepMemory(arguments=2048, outputs=2048, temporaries=512,
      ...                     aliased=2048)
      >>> memory.total
      2560
      >>> print(memory)  # doctest: +NORMALIZE_WHITESPACE
      2.5 KiB per device (arguments 2.0 KiB, outputs 2.0 KiB, temporaries 512 B,
      donated and reused 2.0 KiB)
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int

    @property
    def total(self) -> int:
        """What the step needs at once: arguments, outputs and temporaries,
        the donated buffers counted once."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    def __str__(self) -> str:
        return (
            f"{human_bytes(self.total)} per device (arguments "
            f"{human_bytes(self.arguments)}, outputs {human_bytes(self.outputs)}, "
            f"temporaries {human_bytes(self.temporaries)}, donated and reused "
            f"{human_bytes(self.aliased)})"
        )


class StepCost(NamedTuple):
    """What one call of a compiled step costs.

    Attributes:
      flops: Floating-point operations per call, over all devices (XLA's count
        for one device's program times the number of devices).
      memory: The memory per device (`StepMemory`).
      devices: How many devices run the step.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from pztrain import TrainState, build_train_step
      >>> def loss_fn(*, model, state, rng, x):
      ...     return jnp.mean(x @ model["w"]), state, {}
      ...
      >>> state = TrainState.initial_state({"w": jnp.ones((64, 32))},
      ...                                  optax.sgd(0.1), jax.random.key(0))
      >>> cost = build_train_step(loss_fn).cost(state, x=jnp.ones((16, 64)))
      >>> cost.flops >= 2 * 16 * 64 * 32, cost.devices  # at least the matmul
      (True, 1)
    """

    flops: float
    memory: StepMemory
    devices: int


def cost_of(compiled: Any, devices: int) -> StepCost:
    """The `StepCost` of a compiled program run on ``devices`` devices.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(lambda a, b: a @ b)
      >>> cost = cost_of(f.lower(jnp.ones((8, 4)), jnp.ones((4, 2))).compile(), 1)
      >>> cost.flops >= 2 * 8 * 4 * 2, cost.memory.arguments
      (True, 160)
    """
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list | tuple):  # one per computation in older JAX
        analysis = analysis[0] if analysis else {}
    memory = compiled.memory_analysis()
    return StepCost(
        flops=float(analysis.get("flops", 0.0)) * devices,
        memory=StepMemory(
            arguments=int(memory.argument_size_in_bytes),
            outputs=int(memory.output_size_in_bytes),
            temporaries=int(memory.temp_size_in_bytes),
            aliased=int(memory.alias_size_in_bytes),
        ),
        devices=devices,
    )


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``.

    Example:
      >>> human_bytes(3 * 2**30)
      '3.0 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def shapes_key(tree: Any) -> tuple[Any, ...]:
    """A hashable key of a pytree's structure, shapes and dtypes (the costs of a
    step are cached by it: one compilation per batch shape)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)
