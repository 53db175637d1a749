"""What a step's programs take and give: the loss-function contract, batches kept
on the device, the two pytrees every program takes (`Carry`, donated, and
`Inputs`), what a compiled step closes over (`Static`) and `StepOutputs`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from pztrain.metrics import MetricSums
from pztrain.partition import RestSpec

__all__ = [
    "Carry",
    "Inputs",
    "LossFunction",
    "OnDeviceBatches",
    "Static",
    "StepOutputs",
    "carry_of",
    "key_data",
]


class LossFunction(Protocol):
    """The loss-function contract, penzai's unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss_fn(*, model, state, rng, x):  # state: a count of calls
      ...     return jnp.mean((x - model["w"]) ** 2), state + 1, {"w": model["w"]}
      ...
      >>> loss_fn(model={"w": 1.0}, state=0, rng=jax.random.key(0), x=jnp.ones(3))
      (Array(0., dtype=float32), 1, {'w': 1.0})
    """

    def __call__(
        self, *, model: Any, state: Any, rng: jax.Array, **batch: Any
    ) -> tuple[jax.Array, Any, Any]:
        """Computes the loss of ``model`` on one batch.

        Args:
          model: The model with its current params merged in.
          state: ``TrainState.loss_fn_state`` (``None`` if unused).
          rng: This step's key, ``jax.random.fold_in(root_rng, step)``.
          **batch: The batch arrays, as keyword arguments.

        Returns:
          ``(loss, new_state, aux)``: a float scalar, a new state with the
          structure of ``state``, and any pytree (usually a dict of scalar
          metrics).
        """


class OnDeviceBatches(Protocol):
    """Batches kept on the device, from which each step takes its own.

    `pztrain.data.IndexedBatches` is one. Give it to a step positionally instead
    of keyword arrays: ``train_step(state, batches)``.

    Example:
      >>> from typing import NamedTuple
      >>> import jax, jax.numpy as jnp
      >>> class Cycle(NamedTuple):  # a pytree: step s takes row s % 3 of xs
      ...     xs: jax.Array
      ...     def take(self, step, count=1): return {"x": self.xs[step % 3]}
      ...     def batch_shapes(self): return {"x": jax.ShapeDtypeStruct((2,), "f4")}
      ...
      >>> jax.jit(Cycle.take)(Cycle(jnp.arange(6.0).reshape(3, 2)), 4)["x"]  # step 4
      Array([2., 3.], dtype=float32)
    """

    def take(self, step: jax.Array, count: int) -> dict[str, jax.Array]:
        """The batch of ``step`` (``count`` consecutive ones stacked if > 1)."""

    def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one batch."""


@dataclasses.dataclass(frozen=True)
class Carry:
    """What one call of a train step updates; a jitted step donates it.

    A pytree flattened by JAX's C++ dataclass support and passed to the jitted
    step as one argument: measured on a dispatch-bound step (W0 of
    ``benchmarks/step_bench.py``), one such argument costs 2–4 µs a call less
    than its five fields as separate arguments or a tuple, and a frozen
    dataclass about 1 µs less than one with slots.

    Attributes:
      step: The step counter (int32 scalar).
      params: The trainable params.
      opt_state: The optimizer state (``None`` where it is not needed).
      loss_fn_state: The loss function's state.
      sums: On-device metric sums to add each step's metrics to, or ``None``
        (the step then returns its aux).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_fn_state: Any
    sums: MetricSums | None = None


jax.tree_util.register_dataclass(
    Carry,
    data_fields=["step", "params", "opt_state", "loss_fn_state", "sums"],
    meta_fields=[],
)


def carry_of(step: Any, params: Any, opt_state: Any, lfs: Any, sums: Any) -> Carry:
    """``Carry(step, params, opt_state, lfs, sums)`` for the per-call path: its
    fields filled directly (a frozen dataclass's ``__init__`` costs about
    0.4 µs more a call on CPU)."""
    carry = _new(Carry)
    fields = carry.__dict__
    fields["step"], fields["params"], fields["opt_state"] = step, params, opt_state
    fields["loss_fn_state"], fields["sums"] = lfs, sums
    return carry


_new = object.__new__


@dataclasses.dataclass(frozen=True)
class Static:
    """What a compiled step closes over, besides the optimizer.

    Attributes:
      rest: The static part of ``model_without_params``.
      key_impl: The root key's PRNG implementation (``"threefry2x32"``, …), or
        ``None`` for a legacy ``uint32`` key (``jax.random.PRNGKey``).
      members: A population's member count (the root key's leading axis), or
        ``None`` for one run: the programs then map over the members.
      spread: Whether the population's members are split over several
        devices (`pztrain.population.shard_members`).
    """

    rest: RestSpec
    key_impl: str | None
    members: int | None = None
    spread: bool = False

    def root_rng(self, data: jax.Array) -> jax.Array:
        """The root key, from the raw data that crossed ``jax.jit``."""
        if self.key_impl is None:
            return data
        return jax.random.wrap_key_data(data, impl=self.key_impl)


def key_data(key: jax.Array) -> tuple[jax.Array, str | None]:
    """A key's raw ``uint32`` data and its implementation (see `Static`).

    A typed key array (``jax.random.key``) is flattened through a Python
    callback on every jitted call (about 2 µs on CPU); its raw data is not, so
    the steps take the data and rebuild the key inside.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key), str(jax.random.key_impl(key))
    return key, None


class Inputs(NamedTuple):
    """What one call of a step reads and leaves as it was.

    Attributes:
      root_rng: The base key's raw data (`key_data`); step ``s`` uses
        ``fold_in(root_rng, s)``.
      rest: The arrays of ``model_without_params`` (`pztrain.partition.split_rest`).
      batch: A dict of arrays, or `OnDeviceBatches` (each step takes its own).
    """

    root_rng: jax.Array
    rest: list[Any]
    batch: Any


class StepOutputs(NamedTuple):
    """What `pztrain.TrainStep.compute_grads` returns.

    Attributes:
      loss: The scalar loss.
      loss_fn_state: The loss function's new state.
      aux: The loss function's aux output.
      grads: Gradients of the loss with respect to ``state.params``.

    Example:
      >>> import optax, pztrain, jax, jax.numpy as jnp
      >>> def loss_fn(*, model, state, rng):
      ...     return jnp.sum(model["w"] ** 2), state, {}
      ...
      >>> st = pztrain.TrainState.initial_state(
      ...     {"w": jnp.ones(2)}, optax.sgd(0.1), jax.random.key(0))
      >>> pztrain.build_train_step(loss_fn).compute_grads(st).grads  # d/dw sum(w**2)
      {'w': Array([2., 2.], dtype=float32)}
    """

    loss: jax.Array
    loss_fn_state: Any
    aux: Any
    grads: Any
