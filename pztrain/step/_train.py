"""Train and eval steps: pure functions of a `TrainState` and a batch.

`build_train_step` returns a `TrainStep`, callable as ``(state, **batch) -> (state,
aux)``. One call runs one jitted function (`pztrain.step._fns.train_fn`) on two
named pytrees: a ``Carry`` (step, params, optimizer and loss-function states,
optional metric sums), donated, and ``Inputs`` (key, ``model_without_params``'s
arrays, batch). The model's static structure is split off once per
``model_without_params`` (`pztrain.partition.split_rest`) and closed over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pztrain._members import member_count
from pztrain.metrics import MetricSums, metric_names, metric_state_shapes
from pztrain.sharding import data_sharding
from pztrain.sharding._rules import mesh_axes
from pztrain.state import TrainState
from pztrain.state._donation import raise_if_donated
from pztrain.state._parts import check_opt_state
from pztrain.state._state import check_state
from pztrain.state._struct import after_step, replaced
from pztrain.step._call_batch import on_mesh, one_batch, two_batches
from pztrain.step._cost import StepCost, StepMemory, cost_of, shapes_key
from pztrain.step._fusion import fused_calls
from pztrain.step._members import check_counter, one_member, placed_as_members
from pztrain.step._mesh import NO_MESH, MeshLayout
from pztrain.step._notes import note_inputs
from pztrain.step._programs import (
    Found,
    Programs,
    TrainPrograms,
    args_of,
    flat_args,
    jit_options,
    train_programs,
)
from pztrain.step._types import LossFunction, Static, StepOutputs, carry_of

__all__ = ["TrainStep"]


class _GoOn:
    """A stop flag that never asks to stop."""

    requested = False


_GO_ON = _GoOn()


class TrainStep:
    """A built train step: ``train_step(state, **batch) -> (state, aux)``.

    Build it with `build_train_step`. Besides the call: `accumulate` (steps that
    add their metrics to on-device sums instead of returning aux, what
    `pztrain.fit` runs), `compute_grads` (loss, aux and grads without applying
    them) and `lower` (the lowered jitted step, e.g. for
    ``.compile().memory_analysis()``).

    Attributes:
      loss_fn: The loss function.
      jit: Whether the step is jitted.
      donate: Whether what a call updates (its ``Carry``) is donated.
      steps_per_call: Steps fused in one call (a ``lax.scan``).
      microbatches: Gradient accumulation: each step splits every batch leaf's
        example axis into this many micro-batches (strided: micro-batch ``i``
        holds examples ``i, i + m, …``; key ``fold_in(step_key, i)``), scans
        over them in order (loss-function state and state variables threaded)
        and applies their mean grads in one update. The loss and float aux
        scalars are averaged, integer ones summed, aux arrays concatenated back
        in batch order; `compute_grads` returns the same means.
      mode: The mode the model runs in: ``"train"`` (a Flax NNX model's
        ``model.train()``: batch statistics from the batch, and updated;
        dropout on), ``"eval"`` (``model.eval()``, e.g. fine-tuning with frozen
        batch statistics), or ``None`` (the modes it was built with, for a
        model that manages its modes itself). Each step also reseeds an NNX
        model's rng streams from its key (`pztrain.partition.reseed_streams`).
        Other families have no modes.
      grad_norms: ``None`` (off: nothing computed), ``"global"`` or
        ``"per_param"``: the L2 norm of the grads added to each step's aux (a
        dict, or ``None``) as the metric ``"grad_norm"``, and with
        ``"per_param"`` one per parameter, ``"grad_norm/<name>"``; computed on
        device in the step (in float32, after micro-batches are averaged), so
        `pztrain.fit` sums and logs them like any metric.

    Example:
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def loss_fn(*, model, state, rng, x):
      ...     loss = jnp.mean((x @ model["w"] - 1.0) ** 2)
      ...     return loss, state, {"loss": loss}
      ...
      >>> s = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(0))
      >>> train_step = pztrain.build_train_step(loss_fn)
      >>> s, aux = train_step(s, x=jnp.ones((4, 2)))
      >>> int(s.step), round(float(aux["loss"]), 3)
      (1, 1.0)
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
        mesh: Mesh | None = None,
        data_axis: str | tuple[str, ...] = "data",
        microbatches: int = 1,
        explicit_loss: bool = False,
        mode: str | None = "train",
        grad_norms: str | None = None,
        member_batches: bool = False,
    ):
        self.loss_fn = loss_fn
        self.member_batches = member_batches
        self.mode = mode
        self.grad_norms = grad_norms
        self.jit = jit
        self.donate = donate
        self.steps_per_call = steps_per_call
        self.microbatches = microbatches
        self.mesh = mesh
        self.data_axis, self.explicit_loss = data_axis, explicit_loss
        self.batch_sharding = (
            None if mesh is None else data_sharding(mesh, data_axis, steps_per_call)
        )
        self._state_shardings = state_shardings
        self._batch_shardings = batch_shardings
        self._layout = (
            NO_MESH
            if mesh is None
            else MeshLayout(mesh, mesh_axes(data_axis), explicit_loss)
        )
        self._programs = Programs(self._build)
        self._fused_step: TrainStep | None = None  # see accumulate

    def _build(self, static: Static, optimizer_def: Any) -> TrainPrograms:
        """The programs for one model structure and optimizer."""
        return train_programs(
            self.loss_fn,
            static,
            optimizer_def,
            steps_per_call=self.steps_per_call,
            microbatches=self.microbatches,
            mode=self.mode,
            layout=self._layout,
            grad_norms=self.grad_norms,
            jit=self.jit,
            options=jit_options(
                self.donate, self._state_shardings, self._batch_shardings
            ),
            member_batches=self.member_batches,
        )

    def __call__(
        self, state: TrainState, batch: Any = None, /, **arrays: Any
    ) -> tuple[TrainState, Any]:
        """Runs ``steps_per_call`` optimizer steps on a batch.

        Args:
          state: The current state. With donation on, its arrays are consumed:
            keep using the returned state.
          batch: Instead of keyword arrays: one batch dict, or batches on device
            (`OnDeviceBatches`, e.g. `pztrain.data.IndexedBatches`) from which
            the step takes the batch of its own step.
          **arrays: The batch arrays; with ``steps_per_call=k`` each has a
            leading axis ``k``.

        Returns:
          ``(new_state, aux)``; with ``steps_per_call=k`` the aux leaves are
          stacked along a leading axis ``k``.
        """
        if batch is None:
            batch = arrays
        elif arrays:
            two_batches(batch, arrays)
        state, _, aux = self._run(state, None, batch, 1)
        return state, aux

    def accumulate(
        self,
        state: TrainState,
        sums: MetricSums,
        batch: Any = None,
        /,
        *,
        calls: int = 1,
        stop_flag: Any = None,
        **arrays: Any,
    ) -> tuple[TrainState, MetricSums]:
        """Like calling the step, but adds the metrics to on-device ``sums``.

        The loss and every scalar leaf of aux are summed inside the same jitted
        call; nothing is read back to the host (read the sums with
        ``sums.read()`` when you log). Start from `metric_sums`; ``sums`` is
        donated along with the state.

        Args:
          state: The current state.
          sums: The sums so far.
          batch: A batch dict or `OnDeviceBatches`, or keyword ``arrays``.
          calls: Calls in a row (0: none); the arrays pass from one to the next
            and the state is built once. Each call takes its own step's batch
            from `OnDeviceBatches` (and runs fused with others, up to 32 steps
            per call); a dict batch is trained on ``calls`` times.
          stop_flag: An object whose ``requested`` attribute is read once
            before each call after the first (each fused call): once true, the
            remaining calls are skipped (the new state's ``step`` says how many
            ran).
          **arrays: The batch arrays.

        Returns:
          ``(new_state, new_sums)``.
        """
        if calls < 1:  # nothing to run (a stretch of no whole call)
            return state, sums
        flag, batch = (
            _GO_ON if stop_flag is None else stop_flag,
            one_batch(batch, arrays),
        )
        chunk = fused_calls(batch, calls, self.steps_per_call, self.jit)
        if chunk:  # batches on the device: most calls as one program (_fusion)
            runs, calls = divmod(calls, chunk)
            state, sums, _ = self._fused(chunk)._run(state, sums, batch, runs, flag)
            if not calls or flag.requested:
                return state, sums
        state, sums, _ = self._run(state, sums, batch, calls, flag)
        return state, sums

    def _fused(self, chunk: int) -> TrainStep:
        """This step, ``chunk`` calls' steps per call (made once)."""
        if self._fused_step is None:
            k = self.steps_per_call * chunk
            self._fused_step = self._variant(steps_per_call=k, batch_shardings=None)
        return self._fused_step

    def _run(
        self, state: TrainState, sums: Any, batch: Any, calls: int, flag: Any = _GO_ON
    ):
        """``calls`` calls of the jitted step: ``(new_state, sums, aux)``.

        The one hot path of every call, `accumulate` and `pztrain.fit`. On a
        small model a step is dispatch bound, and every Python operation here
        costs about as much as several in a micro-benchmark (the device's
        threads share the cores): the fields are read from the state's
        ``__dict__``, the program takes four arguments (`pztrain.step._fns.flat`),
        the carry and the new state are filled directly, and the state is
        checked only when the lookup misses (a new rest, optimizer or key).
        """
        try:
            fields = state.__dict__
            rest = fields["model_without_params"]
        except (AttributeError, KeyError):  # not a TrainState
            check_state(state, "train_step(state, ...)", "optax.adam(1e-3)")
            raise
        optimizer_def, root_rng = fields["optimizer_def"], fields["root_rng"]
        last = self._programs.last  # the lookup, inline: the common case
        if last[0] is rest and last[1] is optimizer_def and last[2] is root_rng:
            found = last[3]
        else:
            check_state(state, "train_step(state, ...)", "optax.adam(1e-3)")
            if last[1] is not optimizer_def:  # a new optimizer: is this its state?
                opt_state, params = fields["opt_state"], fields["params"]
                members = member_count(root_rng)
                check_opt_state(optimizer_def, opt_state, params, members)
            found = self._programs.lookup(rest, optimizer_def, root_rng)
            check_counter(found.static.members, fields["step"])
        if self.batch_sharding is not None and isinstance(batch, Mapping):
            batch = on_mesh(batch, self.batch_sharding)
        step, _, rest_arrays, key_data, _ = found
        counter = fields["step"]  # a tracer (the user's jit, scan, vmap): no donation
        if not isinstance(counter, Tracer) and getattr(counter, "is_deleted", _alive)():
            state.check_not_donated("train_step(state, ...)")  # before XLA logs it
        params, opt_state = fields["params"], fields["opt_state"]
        try:
            carry = carry_of(counter, params, opt_state, fields["loss_fn_state"], sums)
            out = step(carry, key_data, rest_arrays, batch)
        except Exception as err:
            raise_if_donated(state, err, "train_step(state, ...)")
            note_inputs(err, params, batch, "train_step(state, ...)")
            raise
        if calls > 1:
            out = self._more_calls(step, out, found, batch, calls, flag)
        carry = out[0]
        new = after_step(
            state, carry.step, carry.params, carry.opt_state, carry.loss_fn_state
        )
        if out[1] is not None:  # the model's state variables changed
            rest = self._programs.rebuild(found, out[1], optimizer_def, root_rng)
            new = replaced(new, {"model_without_params": rest})
        return new, carry.sums, out[2]

    @staticmethod
    def _more_calls(step, out, found, batch, calls, flag):
        """Calls 2 to ``calls`` of `_run`: the arrays go from one to the next;
        each only if ``flag.requested`` is false."""
        for _ in range(calls - 1):
            if flag.requested:
                break
            rest = found.rest if out[1] is None else out[1]
            out = step(out[0], found.key_data, rest, batch)
        return out

    def single(self) -> TrainStep:
        """This step, one optimizer step per call and donating nothing (e.g. to
        replay steps one at a time and keep the state before each)."""
        one = self._batch_shardings if self.steps_per_call == 1 else None
        return self._variant(donate=False, steps_per_call=1, batch_shardings=one)

    def _variant(self, **changes: Any) -> TrainStep:
        """This step with some of its build options changed."""
        options = {name: getattr(self, name) for name in _OPTIONS}
        options["state_shardings"] = self._state_shardings
        options["batch_shardings"] = self._batch_shardings
        return TrainStep(**{**options, **changes})

    def metric_sums(
        self, state: TrainState, batch: Any = None, /, **arrays: Any
    ) -> MetricSums:
        """Zero sums for the metrics this step produces on a batch like ``batch``.

        The metric names come from tracing the loss function once, forward only
        (``jax.eval_shape``); nothing runs on the device. An error of the loss
        carries a call's note, so `pztrain.fit`'s first batch fails as a call does.
        """
        given = batch = one_batch(batch, arrays)
        if not isinstance(batch, Mapping):
            batch = batch.batch_shapes()
        elif self.steps_per_call > 1:  # one step's slice (steps after the members)
            a, sds = int(self.member_batches), jax.ShapeDtypeStruct
            cut = lambda x: sds(x.shape[:a] + x.shape[a + 1 :], x.dtype)  # noqa: E731
            batch = jax.tree.map(cut, batch)
        found = self._lookup(state)
        carry, inputs = args_of(state, found, batch, opt_state=False)
        names = found.program.metric_names
        key = shapes_key((carry, inputs))
        members = found.static.members
        if key not in names:
            try:
                aux = found.program.aux_shape(carry, inputs)
            except Exception as err:
                note_inputs(err, state.params, given, "train_step(state, ...)")
                raise
            scalars = tuple(metric_names(one_member(aux, members)))
            names[key] = (scalars, metric_state_shapes(aux))
        scalars, states = names[key]
        sums = MetricSums.zeros(scalars, members, states)
        replicated = self.mesh and NamedSharding(self.mesh, PartitionSpec())
        if members is None and replicated and replicated.is_fully_addressable:
            return jax.device_put(sums, replicated)  # across processes: the step's
        return placed_as_members(sums, state.root_rng)

    def compute_grads(self, state: TrainState, **batch: Any) -> StepOutputs:
        """Loss, new loss-function state, aux and grads for one batch; no update.

        Uses the same key as the step would (``fold_in(root_rng, step)``) and
        donates nothing. Apply the grads with ``state.apply_gradients(grads)``.
        """
        found = self._lookup(state)
        try:
            return found.program.grads(*args_of(state, found, batch, opt_state=False))
        except Exception as err:
            note_inputs(err, state.params, batch, "compute_grads(state, ...)")
            raise

    def lower(
        self, state: TrainState, batch: Any = None, /, *, sums=None, **arrays: Any
    ) -> jax.stages.Lowered:
        """Lowers the jitted step for ``state`` and a batch (nothing runs).

        The batch is given as in a call: keyword arrays, a dict or
        `OnDeviceBatches`. With ``sums`` (from `metric_sums`): the program
        `accumulate` calls (`pztrain.fit`'s), which adds the metrics to them.
        """
        if not self.jit:
            raise ValueError("lower() needs a jitted step: build it with jit=True.")
        found = self._lookup(state)
        batch = one_batch(batch, arrays)
        if self.batch_sharding is not None and isinstance(batch, Mapping):
            batch = on_mesh(batch, self.batch_sharding)
        carry, *inputs = flat_args(state, found, batch)
        carry = carry_of(
            carry.step, carry.params, carry.opt_state, carry.loss_fn_state, sums
        )
        return found.program.step.lower(carry, *inputs)

    def cost(
        self, state: TrainState, batch: Any = None, /, *, sums=None, **arrays: Any
    ) -> StepCost:
        """What one call costs, from the compiled step; nothing runs.

        FLOPs and memory per device, from XLA's ``cost_analysis`` and
        ``memory_analysis`` of the step compiled for this state and a batch
        like ``batch`` (given as in a call; ``sums``: as `lower`'s). Compiled
        once per batch shape, the compilation the first such call then uses.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from pztrain import TrainState, build_train_step
          >>> def loss_fn(*, model, state, rng, x):
          ...     loss = jnp.mean(x @ model["w"])
          ...     return loss, state, {}
          ...
          >>> state = TrainState.initial_state({"w": jnp.ones((4, 2))},
          ...                                  optax.sgd(0.1), jax.random.key(0))
          >>> cost = build_train_step(loss_fn).cost(state, x=jnp.ones((8, 4)))
          >>> cost.flops > 0, cost.memory.total > 0
          (True, True)
        """
        found = self._lookup(state)
        batch = one_batch(batch, arrays)
        key = shapes_key((flat_args(state, found, batch), sums, self.steps_per_call))
        costs = found.program.costs
        if key not in costs:
            compiled = self.lower(state, batch, sums=sums).compile()
            costs[key] = cost_of(compiled, 1 if self.mesh is None else self.mesh.size)
        return costs[key]

    def memory(
        self, state: TrainState, batch: Any = None, /, **arrays: Any
    ) -> StepMemory:
        """The memory one call needs per device (see `cost`), before it runs."""
        return self.cost(state, batch, **arrays).memory

    def _lookup(self, state: TrainState) -> Found:
        return self._programs.lookup(
            state.model_without_params, state.optimizer_def, state.root_rng
        )


_make = tuple.__new__
# The build options a TrainStep keeps as attributes of the same name.
_OPTIONS = (
    "loss_fn jit donate steps_per_call mesh data_axis microbatches explicit_loss mode "
    "grad_norms member_batches"
).split()


def _alive() -> bool:
    return False
