"""The pure functions that train and eval steps jit.

Every one of them takes the same two named pytrees: a `Carry` (what a train step
updates; donated) and `Inputs` (what it reads). Inside: the step key is
``fold_in(root_rng, step)``, the params are merged into the model
(`pztrain.partition.RestSpec.bind`, given the key and the step's ``mode``), the
loss function runs under ``jax.value_and_grad`` and optax updates params and
optimizer state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._optax import optimizer_update
from pztrain._tree import describe, path_repr
from pztrain.data._batch import check_batch
from pztrain.metrics import check_metric_leaves
from pztrain.partition import RestSpec
from pztrain.step._mesh import NO_MESH, Layout
from pztrain.step._microbatches import accumulate, check_microbatches, first_microbatch
from pztrain.step._norms import with_grad_norms
from pztrain.step._types import Carry, Inputs, Static, StepOutputs

__all__ = ["aux_fn", "eval_fn", "flat", "grads_fn", "train_fn"]


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
        return _scan(one, carry, root_rng, inputs.rest, batch, static.rest.stateful)

    return run


def _scan(one, carry: Carry, root_rng, rest, batch, stateful: bool):
    """``(carry, new_rest, aux)`` of steps ``one`` in a ``lax.scan`` over the
    batch's leading axis, aux stacked. The rest's arrays are carried from step
    to step only when the steps update them (state variables); otherwise they
    are read, as the one step reads them, and ``new_rest`` is ``None``."""
    if not stateful:

        def body(carry, batch_slice):
            carry, _, aux = one(carry, root_rng, rest, batch_slice)
            return carry, aux

        carry, aux = jax.lax.scan(body, carry, batch)
        return carry, None, aux

    def carried(pair, batch_slice):
        carry, rest = pair
        carry, new_rest, aux = one(carry, root_rng, rest, batch_slice)
        return (carry, rest if new_rest is None else new_rest), aux

    (carry, rest), aux = jax.lax.scan(carried, (carry, rest), batch)
    return carry, rest, aux


def flat(run: StepFn) -> Callable[..., tuple[Any, ...]]:
    """A train function on four positional arguments, returning a tuple.

    ``(carry, root_rng, rest, batch) -> (carry, new_rest, aux)``: what a jitted
    train step is called with (the `Carry`, argument 0, is donated). Four
    arguments instead of one `Inputs` spare building a tuple per call.
    """

    def flat_run(carry: Carry, root_rng, rest, batch):
        return run(carry, Inputs(root_rng, rest, batch))

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
            out = fn(model=model, state=lfs, rng=rng, **batch)
            check_metric_leaves(out, "the eval step's metrics")
            return out

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
    check_metric_leaves(aux, "aux")
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
