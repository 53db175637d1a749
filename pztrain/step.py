"""Train and eval steps: pure functions of a `TrainState` and a batch.

`build_train_step` returns a `TrainStep`, callable as ``(state, **batch) -> (state,
aux)``. Inside one ``jax.jit``: the step key is ``fold_in(root_rng, step)``, the
params are merged into the model, the loss function runs under
``jax.value_and_grad``, and optax updates params and optimizer state.

What crosses the jit boundary per call is arrays only: the step, the key, the
params dict, the optimizer and loss-function states, the arrays left in
``model_without_params`` and the batch. The static structure of the model is
flattened once per ``model_without_params`` object and closed over, so a penzai
model's Python-level flattening is not paid on every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pztrain import metrics, partition
from pztrain.data import IndexedBatches
from pztrain.state import DonatedStateError, TrainState, optimizer_update

__all__ = [
    "EvalFunction",
    "EvalStep",
    "LossFunction",
    "StepOutputs",
    "TrainStep",
    "build_eval_step",
    "build_train_step",
]


class LossFunction(Protocol):
    """The loss-function contract, penzai's unchanged."""

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


class EvalFunction(Protocol):
    """The eval-function contract: like `LossFunction`, returning metrics only."""

    def __call__(self, *, model: Any, state: Any, rng: jax.Array, **batch: Any) -> Any:
        """Returns a pytree of metrics for ``model`` on one batch."""


class StepOutputs(NamedTuple):
    """What `TrainStep.compute_grads` returns.

    Attributes:
      loss: The scalar loss.
      loss_fn_state: The loss function's new state.
      aux: The loss function's aux output.
      grads: Gradients of the loss with respect to ``state.params``.
    """

    loss: jax.Array
    loss_fn_state: Any
    aux: Any
    grads: Any


# ----------------------------------------------------------------------------
# the model without params, split into arrays and static structure (cached)


@dataclasses.dataclass(frozen=True)
class _RestSpec:
    """The static part of ``model_without_params``: treedef + non-array leaves."""

    treedef: Any
    static: tuple[tuple[int, Any], ...]  # (position, value) of non-array leaves
    stateful: bool  # holds penzai v2 state variables

    def build(self, dynamic: list[Any]) -> Any:
        leaves = list(dynamic)
        for i, value in self.static:
            leaves.insert(i, value)
        return self.treedef.unflatten(leaves)

    def dynamic_of(self, rest: Any) -> list[Any]:
        leaves = jax.tree.leaves(rest)
        static = {i for i, _ in self.static}
        return [x for i, x in enumerate(leaves) if i not in static]


def _analyze_rest(rest: Any) -> tuple[_RestSpec, list[Any]]:
    leaves, treedef = jax.tree.flatten(rest)
    static, dynamic = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array | np.ndarray):
            dynamic.append(leaf)
        else:
            static.append((i, leaf))
    return _RestSpec(treedef, tuple(static), partition.has_state_vars(rest)), dynamic


class _RestCache:
    """Remembers the split of the last ``model_without_params`` seen (by identity)."""

    def __init__(self, make_fn: Callable[[_RestSpec, Any], Callable[..., Any]]):
        self._make_fn = make_fn
        self._fns: dict[tuple[_RestSpec, Any], Callable[..., Any]] = {}
        self._key: tuple[Any, Any] | None = None
        self.spec: _RestSpec | None = None
        self.stateful = False  # spec.stateful, read on the per-step path
        self.dynamic: list[Any] = []
        self.fn: Callable[..., Any] | None = None

    def lookup(self, rest: Any, optimizer_def: Any) -> None:
        key = self._key
        if key is not None and key[0] is rest and key[1] is optimizer_def:
            return
        spec, dynamic = _analyze_rest(rest)
        fn_key = (spec, optimizer_def)
        if fn_key not in self._fns:
            self._fns[fn_key] = self._make_fn(spec, optimizer_def)
        self._key, self.spec, self.dynamic = (rest, optimizer_def), spec, dynamic
        self.stateful = spec.stateful
        self.fn = self._fns[fn_key]

    def remember(self, rest: Any, optimizer_def: Any, dynamic: list[Any]) -> None:
        """Records a new rest object built from ``dynamic`` with the same spec."""
        self._key, self.dynamic = (rest, optimizer_def), dynamic


# ----------------------------------------------------------------------------
# checks that run while tracing (free at run time)


def _leaf_desc(x: Any) -> str:
    return f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"


def _check_batch(batch: dict[str, Any], steps_per_call: int) -> None:
    leading: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        shape = np.shape(leaf)
        if steps_per_call > 1:
            if not shape or shape[0] != steps_per_call:
                raise ValueError(
                    f"With steps_per_call={steps_per_call} every batch leaf needs a "
                    f"leading axis of {steps_per_call} (one slice per step); "
                    f"batch[{name!r}] has shape {list(shape)}. Stack "
                    f"{steps_per_call} batches along a new axis 0."
                )
        elif shape:
            leading[name] = shape[0]
    if len(set(leading.values())) > 1:
        raise ValueError(
            "Batch leaves must share their leading (batch) axis; got "
            + ", ".join(f"{k}: {v}" for k, v in leading.items())
            + "."
        )


def _check_loss_output(out: Any, loss_fn_state: Any) -> tuple[Any, Any, Any]:
    if not isinstance(out, tuple) or len(out) != 3:
        if isinstance(out, tuple):
            got = f"a tuple of length {len(out)}"
        elif hasattr(out, "shape"):
            got = f"a {_leaf_desc(out)} array"
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
    want, got_def = jax.tree.structure(loss_fn_state), jax.tree.structure(new_state)
    if want != got_def:
        raise ValueError(
            "The loss function's new_state must have the structure of the "
            f"loss_fn_state it was given; expected {want}, got {got_def}."
        )
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(loss_fn_state)[0],
        jax.tree.leaves(new_state),
        strict=True,
    ):
        if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"The loss function's new_state{jax.tree_util.keystr(path)} is "
                f"{_leaf_desc(b)} but loss_fn_state holds {_leaf_desc(a)}; keep "
                "shapes and dtypes fixed across steps."
            )
    return loss, new_state, aux


# ----------------------------------------------------------------------------
# the pure step


def _loss(loss_fn, spec: _RestSpec, params, rest_dyn, lfs, rng, batch):
    """``(loss, (new_lfs, aux, new_rest_dyn))`` of the merged model on ``batch``.

    ``new_rest_dyn`` holds the rest's new arrays if state variables changed.
    """
    rest = spec.build(rest_dyn)
    if spec.stateful:
        rest = partition.thaw_state_vars(rest)
    model = partition.merge(params, rest)
    out = loss_fn(model=model, state=lfs, rng=rng, **batch)
    loss, new_lfs, aux = _check_loss_output(out, lfs)
    new_rest_dyn = None
    if spec.stateful:
        new_rest_dyn = spec.dynamic_of(partition.freeze_state_vars(rest))
    return loss, (new_lfs, aux, new_rest_dyn)


def _grads(loss_fn, spec: _RestSpec, params, rest_dyn, lfs, rng, batch):
    """Loss, aux, new state and grads; the new rest arrays if state vars changed."""

    def loss_of(params):
        return _loss(loss_fn, spec, params, rest_dyn, lfs, rng, batch)

    (loss, (new_lfs, aux, new_rest_dyn)), grads = jax.value_and_grad(
        loss_of, has_aux=True
    )(params)
    return loss, new_lfs, aux, new_rest_dyn, grads


def _train_step_fn(loss_fn, spec, optimizer_def, steps_per_call, accumulate=False):
    """The pure function that a `TrainStep` jits for one model structure.

    With ``accumulate``, it takes and returns `pztrain.metrics.MetricSums` in
    place of returning ``aux``: the metrics of every step are summed on device.
    """

    def one(step, root_rng, params, opt_state, lfs, rest_dyn, acc, batch):
        rng = jax.random.fold_in(root_rng, step)
        loss, new_lfs, aux, new_rest_dyn, grads = _grads(
            loss_fn, spec, params, rest_dyn, lfs, rng, batch
        )
        new_params, new_opt_state = optimizer_update(
            optimizer_def, grads, opt_state, params
        )
        if accumulate:
            acc, aux = metrics.add(acc, loss, aux, step), None
        new_dyn = new_rest_dyn if spec.stateful else None
        return (step + 1, new_params, new_opt_state, new_lfs, new_dyn, acc), aux

    def fn(step, root_rng, params, opt_state, lfs, rest_dyn, acc, batch):
        if isinstance(batch, IndexedBatches):
            batch = batch.take(step, steps_per_call)
        _check_batch(batch, steps_per_call)
        if steps_per_call == 1:
            return one(step, root_rng, params, opt_state, lfs, rest_dyn, acc, batch)

        def body(carry, batch_slice):
            step, params, opt_state, lfs, dyn, acc = carry
            out, aux = one(
                step, root_rng, params, opt_state, lfs, dyn, acc, batch_slice
            )
            return (*out[:4], out[4] if spec.stateful else dyn, out[5]), aux

        carry = (step, params, opt_state, lfs, rest_dyn, acc)
        carry, aux = jax.lax.scan(body, carry, batch)
        if not spec.stateful:
            carry = (*carry[:4], None, carry[5])
        return carry, aux

    return fn


def _stretch_fn(loss_fn, spec, optimizer_def, steps_per_call):
    """`pztrain.fit`'s accumulating step: the step counter rides in the sums.

    ``(root_rng, params, opt_state, lfs, rest_dyn, carry, batch) -> (params,
    opt_state, lfs, carry)``, where ``carry`` is `pztrain.metrics.MetricSums`
    carrying the step. On CPU each buffer in or out of a jitted call costs
    about a microsecond of dispatch, a few percent of a small model's step.
    """
    fn = _train_step_fn(loss_fn, spec, optimizer_def, steps_per_call, accumulate=True)

    def stretch(root_rng, params, opt_state, lfs, rest_dyn, carry, batch):
        acc, step = metrics.split_step(carry)
        (step, params, opt_state, lfs, _, acc), _ = fn(
            step, root_rng, params, opt_state, lfs, rest_dyn, acc, batch
        )
        return params, opt_state, lfs, metrics.with_step(acc, step)

    return stretch


def _shapes_key(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)


def _batch_arg(batches: Any, batch: dict[str, Any]) -> Any:
    if batches is None:
        return batch
    if batch or not isinstance(batches, IndexedBatches):
        raise TypeError(
            "Pass the batch as keyword arguments (train_step(state, x=..., y=...)) "
            "or one pztrain.data.IndexedBatches positionally, not both; got "
            f"{type(batches).__name__} and keys {sorted(batch)}."
        )
    return batches


def _fast_replace(
    state: TrainState, step: Any, params: Any, opt_state: Any, lfs: Any, **more: Any
) -> TrainState:
    """``state.replace(...)`` of what a step changes, without ``__init__``.

    The per-step hot path: the new state's ``__dict__`` is filled directly.
    """
    new = object.__new__(type(state))
    fields = new.__dict__
    fields.update(state.__dict__)
    fields["step"] = step
    fields["params"] = params
    fields["opt_state"] = opt_state
    fields["loss_fn_state"] = lfs
    if more:
        fields.update(more)
    return new


def _donation_error(state: TrainState, err: Exception) -> None:
    try:
        state.check_not_donated("train_step(state, ...)")
    except DonatedStateError as donated:
        raise donated from err


class TrainStep:
    """A built train step: ``train_step(state, **batch) -> (state, aux)``.

    Build it with `build_train_step`. Besides the call, it exposes the pieces of a
    step: `compute_grads` (loss, aux and grads without applying them) and `lower`
    (the lowered jitted step, e.g. for ``.compile().memory_analysis()``).

    Attributes:
      loss_fn: The loss function.
      jit: Whether the step is jitted.
      donate: Whether params, optimizer state and loss-function state are donated.
      steps_per_call: Steps fused in one call (a ``lax.scan``).
    """

    def __init__(
        self,
        loss_fn: LossFunction,
        *,
        jit: bool,
        donate: bool,
        steps_per_call: int,
        state_shardings: Any,
        batch_shardings: Any,
    ):
        self.loss_fn = loss_fn
        self.jit = jit
        self.donate = donate
        self.steps_per_call = steps_per_call
        self._state_shardings = state_shardings
        self._batch_shardings = batch_shardings
        self._cache = _RestCache(self._make)
        self._acc_cache = _RestCache(self._make_accumulating)
        self._stretch_cache = _RestCache(self._make_stretch)
        self._grads_cache = _RestCache(self._make_grads)
        self._metric_names: dict[Any, list[str]] = {}

    def _jit_kwargs(self, accumulate: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.donate:
            kwargs["donate_argnums"] = (0, 2, 3, 4, 6) if accumulate else (0, 2, 3, 4)
        sh = self._state_shardings
        if sh is not None or self._batch_shardings is not None:
            p = getattr(sh, "params", None)
            o = getattr(sh, "opt_state", None)
            f = getattr(sh, "loss_fn_state", None)
            b = self._batch_shardings
            kwargs["in_shardings"] = (None, None, p, o, f, None, None, b)
            kwargs["out_shardings"] = ((None, p, o, f, None, None), None)
        return kwargs

    def _make(self, spec: _RestSpec, optimizer_def: Any, accumulate=False):
        fn = _train_step_fn(
            self.loss_fn, spec, optimizer_def, self.steps_per_call, accumulate
        )
        return jax.jit(fn, **self._jit_kwargs(accumulate)) if self.jit else fn

    def _make_accumulating(self, spec: _RestSpec, optimizer_def: Any):
        return self._make(spec, optimizer_def, accumulate=True)

    def _make_stretch(self, spec: _RestSpec, optimizer_def: Any):
        fn = _stretch_fn(self.loss_fn, spec, optimizer_def, self.steps_per_call)
        if not self.jit:
            return fn
        kwargs: dict[str, Any] = {}
        if self.donate:
            kwargs["donate_argnums"] = (1, 2, 3, 5)
        full = self._jit_kwargs(accumulate=True)
        if "in_shardings" in full:  # the same, without the step's entries
            ins, (outs, _) = full["in_shardings"], full["out_shardings"]
            kwargs["in_shardings"] = ins[1:]
            kwargs["out_shardings"] = (*outs[1:4], outs[5])
        return jax.jit(fn, **kwargs)

    def _make_grads(self, spec: _RestSpec, optimizer_def: Any) -> Callable[..., Any]:
        del optimizer_def

        def fn(step, root_rng, params, lfs, rest_dyn, batch):
            _check_batch(batch, 1)
            rng = jax.random.fold_in(root_rng, step)
            loss, lfs, aux, _, grads = _grads(
                self.loss_fn, spec, params, rest_dyn, lfs, rng, batch
            )
            return StepOutputs(loss, lfs, aux, grads)

        return jax.jit(fn) if self.jit else fn

    def __call__(
        self, state: TrainState, batches: IndexedBatches | None = None, /, **batch: Any
    ) -> tuple[TrainState, Any]:
        """Runs ``steps_per_call`` optimizer steps on ``batch``.

        Args:
          state: The current state. With donation on, its arrays are consumed:
            keep using the returned state.
          batches: Instead of ``**batch``: `pztrain.data.IndexedBatches` on
            device, from which the step takes the batch of its own step.
          **batch: Batch arrays; with ``steps_per_call=k`` each has a leading
            axis ``k``.

        Returns:
          ``(new_state, aux)``; with ``steps_per_call=k`` the aux leaves are
          stacked along a leading axis ``k``.
        """
        if batches is not None:
            batch = _batch_arg(batches, batch)
        out = self._call(self._cache, state, None, batch)
        return out[0], out[2]

    def accumulate(
        self,
        state: TrainState,
        sums: metrics.MetricSums,
        batches: IndexedBatches | None = None,
        /,
        **batch: Any,
    ) -> tuple[TrainState, metrics.MetricSums]:
        """Like calling the step, but adds the metrics to on-device ``sums``.

        The loss and every scalar leaf of ``aux`` are summed inside the same
        jitted call (`pztrain.metrics`); nothing is read back to the host. Start
        from `metric_sums`. ``sums`` is donated along with the state.
        """
        return self._accumulate(state, sums, _batch_arg(batches, batch))

    def _accumulate(
        self, state: TrainState, sums: metrics.MetricSums, batch: Any
    ) -> tuple[TrainState, metrics.MetricSums]:
        """`accumulate` with the batch (a dict or `IndexedBatches`) as one value.

        `pztrain.fit` calls this between log points: like ``__call__`` it has a
        lean path for the common case (same model structure as the last call,
        no state variables), the per-step hot path of the loop.
        """
        new_state, sums, _ = self._call(self._acc_cache, state, sums, batch)
        return new_state, sums

    def _accumulate_calls(
        self,
        state: TrainState,
        carry: metrics.MetricSums,
        batches: IndexedBatches,
        calls: int,
    ) -> tuple[TrainState, metrics.MetricSums]:
        """``calls`` accumulating calls on one `IndexedBatches` (fit's inner loop).

        ``carry`` is `pztrain.metrics.MetricSums` that carries the step, equal
        to ``state.step`` (`pztrain.metrics.with_step`). The calls pass the
        state's arrays straight from one to the next, with the step inside the
        sums (one buffer less each way per call); the new `TrainState` is built
        once, at the end, with its step read out of the sums by one more call.
        """
        if calls < 1:
            return state, carry
        cache = self._stretch_cache
        cache.lookup(state.model_without_params, state.optimizer_def)
        if cache.spec.stateful:  # the model's arrays change with every call
            sums, _ = metrics._split_step(carry)
            for _ in range(calls):
                state, sums, _ = self._call(self._acc_cache, state, sums, batches)
            return state, metrics._with_step(sums, state.step)
        fn, dyn, root = cache.fn, cache.dynamic, state.root_rng
        try:
            params, opt_state, lfs, carry = fn(
                root,
                state.params,
                state.opt_state,
                state.loss_fn_state,
                dyn,
                carry,
                batches,
            )
        except (RuntimeError, ValueError) as err:
            _donation_error(state, err)
            raise
        for _ in range(calls - 1):
            params, opt_state, lfs, carry = fn(
                root, params, opt_state, lfs, dyn, carry, batches
            )
        step = metrics._step_of(carry)
        return _fast_replace(state, step, params, opt_state, lfs), carry

    def _call(self, cache: _RestCache, state: TrainState, sums: Any, batch: Any):
        """One call of the jitted step: ``(new_state, sums, aux)``.

        The per-step hot path, kept lean for the common case (the same model
        structure as the last call, no state variables); anything else goes
        through `_run`.
        """
        key, fields = cache._key, state.__dict__
        if (
            key is not None
            and key[0] is fields["model_without_params"]
            and key[1] is fields["optimizer_def"]
            and not cache.stateful
        ):
            try:  # `_args` and `_fast_replace`, written out: the per-step path
                (step, params, opt_state, lfs, _, sums), aux = cache.fn(
                    fields["step"],
                    fields["root_rng"],
                    fields["params"],
                    fields["opt_state"],
                    fields["loss_fn_state"],
                    cache.dynamic,
                    sums,
                    batch,
                )
            except (RuntimeError, ValueError) as err:
                _donation_error(state, err)
                raise
            new_state = object.__new__(type(state))
            new_fields = new_state.__dict__
            new_fields.update(fields)
            new_fields["step"] = step
            new_fields["params"] = params
            new_fields["opt_state"] = opt_state
            new_fields["loss_fn_state"] = lfs
            return new_state, sums, aux
        return self._run(cache, state, sums, batch)

    def metric_sums(
        self, state: TrainState, batches: IndexedBatches | None = None, /, **batch: Any
    ) -> metrics.MetricSums:
        """Zero sums for the metrics this step produces on ``batch``.

        The metric names come from tracing the loss function once, forward only
        (``jax.eval_shape``); nothing runs on the device.
        """
        cache = self._cache
        cache.lookup(state.model_without_params, state.optimizer_def)
        batch = _batch_arg(batches, batch)
        if isinstance(batch, IndexedBatches):
            batch = batch.batch_shapes()
        elif self.steps_per_call > 1:  # the metrics of one step, from one slice
            batch = jax.tree.map(lambda x: x[0], batch)
        args = self._args(cache, state, None, batch)
        key = (cache.spec, state.optimizer_def, _shapes_key(args))
        if key not in self._metric_names:
            loss_fn, spec = self.loss_fn, cache.spec

            def aux_of(step, root_rng, params, opt_state, lfs, rest_dyn, sums, batch):
                del opt_state, sums
                rng = jax.random.fold_in(root_rng, step)
                return _loss(loss_fn, spec, params, rest_dyn, lfs, rng, batch)[1][1]

            aux = jax.eval_shape(aux_of, *args)
            self._metric_names[key] = metrics.metric_names(aux)
        return metrics.zeros(self._metric_names[key])

    @staticmethod
    def _args(cache, state, sums, batch):
        return (
            state.step,
            state.root_rng,
            state.params,
            state.opt_state,
            state.loss_fn_state,
            cache.dynamic,
            sums,
            batch,
        )

    def _run(self, cache, state, sums, batch):
        rest = state.model_without_params
        cache.lookup(rest, state.optimizer_def)
        try:
            out, aux = cache.fn(*self._args(cache, state, sums, batch))
        except (RuntimeError, ValueError) as err:
            _donation_error(state, err)
            raise
        step, params, opt_state, lfs, new_dyn, sums = out
        if new_dyn is not None:
            rest = cache.spec.build(new_dyn)
            cache.remember(rest, state.optimizer_def, new_dyn)
        new_state = _fast_replace(
            state, step, params, opt_state, lfs, model_without_params=rest
        )
        return new_state, sums, aux

    def compute_grads(self, state: TrainState, **batch: Any) -> StepOutputs:
        """Loss, new loss-function state, aux and grads for one batch; no update.

        Uses the same key as the step would (``fold_in(root_rng, step)``) and
        donates nothing. Apply the grads with ``state.apply_gradients(grads)``.
        """
        cache = self._grads_cache
        cache.lookup(state.model_without_params, None)
        return cache.fn(
            state.step,
            state.root_rng,
            state.params,
            state.loss_fn_state,
            cache.dynamic,
            batch,
        )

    def lower(
        self, state: TrainState, batches: IndexedBatches | None = None, /, **batch: Any
    ) -> jax.stages.Lowered:
        """Lowers the jitted step for ``state`` and ``batch`` (nothing runs).

        The batch is given as in a call: keyword arrays or one
        `pztrain.data.IndexedBatches`.
        """
        if not self.jit:
            raise ValueError("lower() needs a jitted step: build it with jit=True.")
        batch = _batch_arg(batches, batch)
        cache = self._cache
        cache.lookup(state.model_without_params, state.optimizer_def)
        return cache.fn.lower(*self._args(cache, state, None, batch))


def build_train_step(
    loss_fn: LossFunction,
    *,
    jit: bool = True,
    donate: bool | None = None,
    steps_per_call: int = 1,
    state_shardings: Any = None,
    batch_shardings: Any = None,
) -> TrainStep:
    """Builds a train step for ``loss_fn`` (penzai's loss-function contract).

    Donation is on by default with ``jit=True``: the step reuses the buffers of
    the step counter, params, optimizer state and loss-function state it is
    given, so memory holds one copy of them. The old state is then consumed;
    using it again raises `pztrain.DonatedStateError`.
    ``TrainState.initial_state`` copies the model's arrays, so the model you
    built is never donated. Pass ``donate=False`` to keep old states alive (e.g.
    to compare two steps).

    Args:
      loss_fn: ``loss_fn(*, model, state, rng, **batch) -> (loss, new_state,
        aux)``.
      jit: Whether to ``jax.jit`` the step (``False`` runs eagerly, for
        debugging).
      donate: Donate step counter, params, optimizer state and loss-function
        state (default: the value of ``jit``).
      steps_per_call: Fuse this many steps into one call with ``lax.scan``;
        every batch leaf then has a leading axis of this size, and the keys are
        those of as many single steps.
      state_shardings: Optional object with ``params``, ``opt_state`` and
        ``loss_fn_state`` attributes holding shardings (e.g. a `TrainState` of
        shardings) for the jitted step's inputs and outputs.
      batch_shardings: Optional shardings for the batch dict.

    Returns:
      A `TrainStep`.

    Raises:
      ValueError: for ``steps_per_call < 1`` or ``donate=True`` without jit.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> def loss_fn(*, model, state, rng, x, y):
      ...     loss = jnp.mean((x * model["w"] - y) ** 2)
      ...     return loss, state, {"loss": loss}
      >>> state = TrainState.initial_state({"w": jnp.array(0.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> train_step = build_train_step(loss_fn)
      >>> for _ in range(50):
      ...     state, aux = train_step(state, x=jnp.ones(4), y=2 * jnp.ones(4))
      >>> round(float(state.params["w"]), 3)
      2.0
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}.")
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise ValueError(f"steps_per_call must be an int >= 1; got {steps_per_call!r}.")
    if donate is None:
        donate = jit
    if donate and not jit:
        raise ValueError("donate=True needs jit=True (only jitted calls donate).")
    return TrainStep(
        loss_fn,
        jit=jit,
        donate=donate,
        steps_per_call=steps_per_call,
        state_shardings=state_shardings,
        batch_shardings=batch_shardings,
    )


class EvalStep:
    """A built eval step: ``eval_step(state, **batch) -> metrics``.

    The key is ``fold_in(fold_in(root_rng, step), 1)``: fixed for a given state,
    and distinct from the train key of the same step. Nothing is donated and the
    state is not changed (penzai v2 state-variable updates are dropped).

    Attributes:
      eval_fn: The eval function.
      jit: Whether the step is jitted.
    """

    def __init__(self, eval_fn: EvalFunction, *, jit: bool):
        self.eval_fn = eval_fn
        self.jit = jit
        self._cache = _RestCache(self._make)

    def _make(self, spec: _RestSpec, optimizer_def: Any) -> Callable[..., Any]:
        del optimizer_def
        eval_fn = self.eval_fn

        def fn(step, root_rng, params, lfs, rest_dyn, batch):
            _check_batch(batch, 1)
            rng = jax.random.fold_in(jax.random.fold_in(root_rng, step), 1)
            rest = spec.build(rest_dyn)
            if spec.stateful:
                rest = partition.thaw_state_vars(rest)
            model = partition.merge(params, rest)
            return eval_fn(model=model, state=lfs, rng=rng, **batch)

        return jax.jit(fn) if self.jit else fn

    def __call__(self, state: TrainState, **batch: Any) -> Any:
        """Returns ``eval_fn``'s metrics for ``state`` on ``batch``."""
        cache = self._cache
        cache.lookup(state.model_without_params, None)
        try:
            return cache.fn(
                state.step,
                state.root_rng,
                state.params,
                state.loss_fn_state,
                cache.dynamic,
                batch,
            )
        except (RuntimeError, ValueError) as err:
            _donation_error(state, err)
            raise


def build_eval_step(eval_fn: EvalFunction, *, jit: bool = True) -> EvalStep:
    """Builds an eval step: ``eval_fn(*, model, state, rng, **batch) -> metrics``.

    Args:
      eval_fn: Returns a pytree of metrics (usually a dict of scalars).
      jit: Whether to ``jax.jit`` it.

    Returns:
      An `EvalStep`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> def eval_fn(*, model, state, rng, x):
      ...     return {"mean": jnp.mean(x * model["w"])}
      >>> state = TrainState.initial_state({"w": jnp.array(2.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> float(build_eval_step(eval_fn)(state, x=jnp.ones(3))["mean"])
      2.0
    """
    if not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable; got {type(eval_fn).__name__}.")
    return EvalStep(eval_fn, jit=jit)
