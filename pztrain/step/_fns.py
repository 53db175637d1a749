"""The pure functions that train and eval steps jit.

Every one of them takes the same two named pytrees: a `Carry` (what a train step
updates; donated) and `Inputs` (what it reads). Inside: the step key is
``fold_in(root_rng, step)``, the params are merged into the model
(`pztrain.partition.RestSpec.bind`, given the key and the step's ``mode``), the
loss function runs under ``jax.value_and_grad`` and optax updates params and
optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._optax import optimizer_update
from pztrain._tree import describe, path_repr
from pztrain.data._batch import check_batch
from pztrain.metrics import MetricSums
from pztrain.partition import RestSpec
from pztrain.step._mesh import NO_MESH, Layout
from pztrain.step._microbatches import accumulate, check_microbatches, first_microbatch
from pztrain.step._norms import with_grad_norms

__all__ = [
    "Carry",
    "LossFunction",
    "Inputs",
    "OnDeviceBatches",
    "Static",
    "StepOutputs",
    "aux_fn",
    "eval_fn",
    "flat",
    "grads_fn",
    "key_data",
    "train_fn",
]


class LossFunction(Protocol):
    """The loss-function contract, penzai's unchanged.

    Example:
      >>> def loss_fn(*, model, state, rng, x):  # state: a count of calls
      ...     return jnp.mean((x - model["w"]) ** 2), state + 1, {"w": model["w"]}
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
      >>> class Cycle(NamedTuple):  # a pytree: step s takes row s % 3 of xs
      ...     xs: jax.Array
      ...     def take(self, step, count=1): return {"x": self.xs[step % 3]}
      ...     def batch_shapes(self): return {"x": jax.ShapeDtypeStruct((2,), "f4")}
      >>> jax.jit(Cycle.take)(Cycle(jnp.arange(6.0).reshape(3, 2)), 4)["x"]  # step 4
      Array([2., 3.], dtype=float32)
    """

    def take(self, step: jax.Array, count: int) -> dict[str, jax.Array]:
        """The batch of ``step`` (``count`` consecutive ones stacked if > 1)."""

    def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one batch."""


class Carry(NamedTuple):
    """What one call of a train step updates; a jitted step donates it.

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


@dataclasses.dataclass(frozen=True)
class Static:
    """What a compiled step closes over, besides the optimizer.

    Attributes:
      rest: The static part of ``model_without_params``.
      key_impl: The root key's PRNG implementation (``"threefry2x32"``, …), or
        ``None`` for a legacy ``uint32`` key (``jax.random.PRNGKey``).
    """

    rest: RestSpec
    key_impl: str | None

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
      >>> import optax, pztrain
      >>> def loss_fn(*, model, state, rng):
      ...     return jnp.sum(model["w"] ** 2), state, {}
      >>> st = pztrain.TrainState.initial_state(
      ...     {"w": jnp.ones(2)}, optax.sgd(0.1), jax.random.key(0))
      >>> pztrain.build_train_step(loss_fn).compute_grads(st).grads  # d/dw sum(w**2)
      {'w': Array([2., 2.], dtype=float32)}
    """

    loss: jax.Array
    loss_fn_state: Any
    aux: Any
    grads: Any


StepFn = Callable[[Carry, Inputs], Any]


def train_fn(
    loss_fn,
    static: Static,
    optimizer_def,
    steps_per_call: int,
    microbatches: int = 1,
    mode: str | None = "train",
    layout: Layout = NO_MESH,
    grad_norms: str | None = None,
) -> StepFn:
    """``(carry, inputs) -> (carry, new_rest, aux)``: ``steps_per_call`` steps.

    ``new_rest`` holds the rest's new arrays when the model has state variables
    (else ``None``). ``aux`` is ``None`` when the carry holds metric sums (the
    metrics went into them); with ``steps_per_call=k`` its leaves are stacked
    along a leading axis ``k``. With ``microbatches=m > 1`` each step's loss,
    grads and aux come from `pztrain.step._microbatches.accumulate`. On a mesh
    (``layout``, see `pztrain.step._mesh`) the loss sees the params in their
    compute layout and the optimizer gets grads in their storage layout.
    ``mode`` is the mode the model runs in (`pztrain.partition.RestSpec.bind`).
    ``grad_norms`` adds grad norms to the aux (`pztrain.step._norms`).
    """

    def one(carry: Carry, root_rng, rest, batch) -> tuple[Carry, Any, Any]:
        rng = jax.random.fold_in(root_rng, carry.step)  # the contract's key
        loss, lfs, aux, new_rest, grads = _grads(
            loss_fn, static.rest, mode, carry, rest, rng, batch, microbatches, layout
        )
        aux = with_grad_norms(aux, grads, grad_norms)
        params, opt_state = optimizer_update(
            optimizer_def, grads, carry.opt_state, carry.params
        )
        sums = carry.sums
        if sums is not None:
            sums, aux = sums.add(loss, aux, carry.step), None
        return Carry(carry.step + 1, params, opt_state, lfs, sums), new_rest, aux

    def run(carry: Carry, inputs: Inputs):
        batch = _batch_of(inputs.batch, carry.step, steps_per_call)
        root_rng = static.root_rng(inputs.root_rng)
        if steps_per_call == 1:
            return one(carry, root_rng, inputs.rest, batch)

        def body(pair, batch_slice):
            carry, rest = pair
            carry, new_rest, aux = one(carry, root_rng, rest, batch_slice)
            return (carry, rest if new_rest is None else new_rest), aux

        (carry, rest), aux = jax.lax.scan(body, (carry, inputs.rest), batch)
        return carry, rest if static.rest.stateful else None, aux

    return run


def flat(run: StepFn) -> Callable[..., tuple[Any, ...]]:
    """A train function on flat positional arguments, returning a flat tuple.

    ``(step, params, opt_state, loss_fn_state, sums, root_rng, rest, batch) ->
    (step, params, opt_state, loss_fn_state, sums, new_rest, aux)``: what a
    jitted train step is called with (arguments 0 to 4 are donated). Tuples
    cost less to build and to take apart per call than the named ones.
    """

    def flat_run(step, params, opt_state, loss_fn_state, sums, root_rng, rest, batch):
        carry = Carry(step, params, opt_state, loss_fn_state, sums)
        carry, new_rest, aux = run(carry, Inputs(root_rng, rest, batch))
        return (*carry, new_rest, aux)

    return flat_run


def grads_fn(
    loss_fn,
    static: Static,
    microbatches: int = 1,
    mode: str | None = "train",
    layout: Layout = NO_MESH,
) -> StepFn:
    """``(carry, inputs) -> StepOutputs`` for one batch; nothing is updated.

    With ``microbatches=m > 1``: the means over ``m`` micro-batches, as a step.
    """

    def run(carry: Carry, inputs: Inputs) -> StepOutputs:
        batch = _batch_of(inputs.batch, carry.step, 1)
        rng = jax.random.fold_in(static.root_rng(inputs.root_rng), carry.step)
        loss, lfs, aux, _, grads = _grads(
            loss_fn,
            static.rest,
            mode,
            carry,
            inputs.rest,
            rng,
            batch,
            microbatches,
            layout,
        )
        return StepOutputs(loss, lfs, aux, grads)

    return run


def eval_fn(
    fn, static: Static, mode: str | None = "eval", layout: Layout = NO_MESH
) -> StepFn:
    """``(carry, inputs) -> metrics``, with key ``fold_in(fold_in(root_rng, step), 1)``.

    The model runs in ``mode``. State-variable updates are dropped: evaluating
    changes nothing.
    """

    def run(carry: Carry, inputs: Inputs) -> Any:
        batch = _batch_of(inputs.batch, carry.step, 1)
        rng = jax.random.fold_in(static.root_rng(inputs.root_rng), carry.step)
        rng = jax.random.fold_in(rng, 1)

        def metrics(params, rest, lfs, rng, batch):
            model, _ = static.rest.bind(params, rest, rng, mode)
            return fn(model=model, state=lfs, rng=rng, **batch)

        params = layout.compute(carry.params)
        return layout.user(metrics)(
            params, inputs.rest, carry.loss_fn_state, rng, batch
        )

    return run


def aux_fn(
    loss_fn,
    static: Static,
    microbatches: int = 1,
    mode: str | None = "train",
    layout: Layout = NO_MESH,
    grad_norms: str | None = None,
) -> StepFn:
    """``(carry, inputs) -> aux`` of the loss alone: forward only, no gradient.

    For `jax.eval_shape`: the metric names of a step, without tracing its
    backward pass (on the first micro-batch with ``microbatches > 1``; with
    ``grad_norms``, the norms' names from the params standing for the grads).
    """

    def run(carry: Carry, inputs: Inputs) -> Any:
        batch = _batch_of(inputs.batch, carry.step, 1)
        if microbatches > 1:
            batch = first_microbatch(batch, microbatches)
        rng = jax.random.fold_in(static.root_rng(inputs.root_rng), carry.step)

        def aux_of(params, rest, lfs, rng, batch):
            model, _ = static.rest.bind(params, rest, rng, mode)
            out = loss_fn(model=model, state=lfs, rng=rng, **batch)
            aux = _check_loss_output(out, lfs)[2]
            return with_grad_norms(aux, params, grad_norms)

        params = layout.compute(carry.params)
        return layout.user(aux_of)(params, inputs.rest, carry.loss_fn_state, rng, batch)

    return run


def _batch_of(batch: Any, step: jax.Array, count: int) -> dict[str, Any]:
    """The batch of ``step`` (``count`` stacked), checked while tracing."""
    if not isinstance(batch, Mapping):
        batch = batch.take(step, count)
    check_batch(batch, steps_per_call=count, scalars=True)
    return batch


def _grads(loss_fn, spec: RestSpec, mode, carry: Carry, rest, rng, batch, m, layout):
    """``(loss, new_loss_fn_state, aux, new_rest, grads)`` of one step, the
    grads in the params' (storage) layout. Micro-batches run per device on a
    mesh (`pztrain.step._mesh.MeshLayout.per_device`)."""
    params = layout.compute(carry.params)
    bind = functools.partial(spec.bind, mode=mode)
    if m == 1:
        out = _loss_and_grads(
            loss_fn, bind, params, layout, carry.loss_fn_state, rest, rng, batch
        )
    else:

        def micro(layout, params, lfs, rest, rng, batch):
            one = functools.partial(_loss_and_grads, loss_fn, bind, params, layout)
            return accumulate(one, lfs, rest, rng, batch, m, layout.zeros)

        check_microbatches(batch, m, layout.data_shards)  # the global shapes
        run = layout.per_device(micro)
        out = run(params, carry.loss_fn_state, rest, rng, batch)
    return (*out[:4], layout.store(out[4], carry.params))


def _loss_and_grads(loss_fn, bind, params, layout, loss_fn_state, rest, rng, batch):
    """``(loss, new_loss_fn_state, aux, new_rest, grads)`` on one (micro-)batch,
    the grads in the layout of ``params``; ``bind`` is the rest spec's, with
    the step's mode."""

    def loss_of(params, rest, loss_fn_state, rng, batch):
        model, new_rest = bind(params, rest, rng)
        out = loss_fn(model=model, state=loss_fn_state, rng=rng, **batch)
        loss, lfs, aux = _check_loss_output(out, loss_fn_state)
        return loss, (lfs, aux, new_rest())

    run = layout.user(loss_of)
    (loss, (lfs, aux, new_rest)), grads = jax.value_and_grad(run, has_aux=True)(
        params, rest, loss_fn_state, rng, batch
    )
    return loss, lfs, aux, new_rest, grads


# ----------------------------------------------------------------------------
# checks that run while tracing (free at run time)


def _check_loss_output(out: Any, loss_fn_state: Any) -> tuple[Any, Any, Any]:
    if not isinstance(out, tuple) or len(out) != 3:
        if isinstance(out, tuple):
            got = f"a tuple of length {len(out)}"
        elif hasattr(out, "shape"):
            got = f"a {describe(out)} array"
        else:
            got = type(out).__name__
        raise TypeError(
            "The loss function must return a 3-tuple (loss, new_state, aux); got "
            f"{got}. Return (loss, state, {{}}) if you have no state or aux."
        )
    loss, new_state, aux = out
    if np.shape(loss) != ():
        raise ValueError(
            f"The loss must be a scalar; got shape {list(np.shape(loss))}. Reduce it "
            "(e.g. jnp.mean) before returning."
        )
    if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise TypeError(
            f"The loss must be a floating-point scalar; got {jnp.result_type(loss)}."
        )
    _check_new_state(loss_fn_state, new_state)
    return loss, new_state, aux


def _check_new_state(loss_fn_state: Any, new_state: Any) -> None:
    want, got = jax.tree.structure(loss_fn_state), jax.tree.structure(new_state)
    if want != got:
        raise ValueError(
            "The loss function's new_state must have the structure of the "
            f"loss_fn_state it was given; expected {want}, got {got}."
        )
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(loss_fn_state)[0],
        jax.tree.leaves(new_state),
        strict=True,
    ):
        if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"The loss function's new_state{path_repr(path)} is "
                f"{describe(b)} but loss_fn_state holds {describe(a)}; keep "
                "shapes and dtypes fixed across steps."
            )
