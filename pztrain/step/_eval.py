"""Eval steps: metrics of a `TrainState` on a batch, nothing donated or changed."""

from __future__ import annotations

from typing import Any, Protocol

import jax

from pztrain.state import TrainState
from pztrain.state._donation import raise_if_donated
from pztrain.state._state import check_state
from pztrain.step import _fns
from pztrain.step._build import checked_mode
from pztrain.step._members import over_members
from pztrain.step._mesh import MeshLayout, mesh_of
from pztrain.step._notes import note_inputs
from pztrain.step._on_mesh import OnMesh
from pztrain.step._programs import Programs, args_of
from pztrain.step._types import Static

__all__ = ["EvalFunction", "EvalStep", "build_eval_step"]


class EvalFunction(Protocol):
    """The eval-function contract: like `LossFunction`, returning metrics only.

    Example:
      >>> import jax
      >>> from pztrain import build_eval_step, TrainState
      >>> import jax.numpy as jnp, optax
      >>> def eval_fn(*, model, state, rng, x, y):  # an EvalFunction
      ...     err = x * model["w"] - y
      ...     return {"mse": jnp.mean(err**2), "max_err": jnp.max(jnp.abs(err))}
      ...
      >>> state = TrainState.initial_state({"w": jnp.array(2.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> m = build_eval_step(eval_fn)(state, x=jnp.ones(2), y=jnp.array([1.0, 4.0]))
      >>> {k: float(v) for k, v in m.items()}
      {'max_err': 2.0, 'mse': 2.5}
    """

    def __call__(self, *, model: Any, state: Any, rng: jax.Array, **batch: Any) -> Any:
        """Returns a pytree of metrics for ``model`` on one batch."""


class EvalStep:
    """A built eval step: ``eval_step(state, **batch) -> metrics``.

    The key is ``fold_in(fold_in(root_rng, step), 1)``: fixed for a given state,
    and distinct from the train key of the same step. Nothing is donated and the
    state is not changed (penzai v2 state-variable updates and a Flax NNX
    model's batch-statistic and rng updates are dropped).

    Attributes:
      eval_fn: The eval function.
      jit: Whether the step is jitted.
      mode: The mode the model runs in (``"eval"``: a Flax NNX model's
        ``model.eval()``, running averages and no dropout).
      ema: Whether it evaluates the state's EMA params (`pztrain.with_ema`).

    Example:
      The same key for the same state, and the state left as it was:

      >>> import jax
      >>> from pztrain import build_eval_step, TrainState
      >>> import jax.numpy as jnp, optax
      >>> def eval_fn(*, model, state, rng, x):
      ...     return {"mean": jnp.mean(x * model["w"]), "draw": jax.random.uniform(rng)}
      ...
      >>> state = TrainState.initial_state({"w": jnp.array(2.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> eval_step = build_eval_step(eval_fn)
      >>> a, b = eval_step(state, x=jnp.ones(3)), eval_step(state, x=jnp.ones(3))
      >>> float(a["mean"]), bool(a["draw"] == b["draw"]), int(state.step)
      (2.0, True, 0)
    """

    def __init__(
        self,
        eval_fn: EvalFunction,
        *,
        jit: bool,
        mode: str | None = "eval",
        ema: bool = False,
        member_batches: bool = False,
    ):
        self.eval_fn = eval_fn
        self.member_batches = member_batches
        self.jit = jit
        self.mode = mode
        self.ema = ema
        self._programs = Programs(self._build)

    def _build(self, static: Static, mesh: Any) -> Any:
        """The program for a model structure, on ``mesh`` (``None``: no mesh):
        in explicit mode with the eval function in auto mode, as a train step
        (`pztrain.step._mesh`); evaluation needs no compute layout."""
        if mesh is None:
            fn = self._members(static, _fns.eval_fn(self.eval_fn, static, self.mode))
            return jax.jit(fn) if self.jit else fn
        layout = MeshLayout(mesh, data_axes=())
        fn = _fns.eval_fn(self.eval_fn, static, self.mode, layout)
        fn = self._members(static, fn)
        return OnMesh(fn, layout, {}, ("state", "inputs")) if self.jit else fn

    def _members(self, static: Static, fn: Any) -> Any:
        """``fn`` mapped over a population's members (one metric per member)."""
        if static.members is None:
            return fn
        return over_members(fn, static.members, self.member_batches)

    def __call__(self, state: TrainState, **batch: Any) -> Any:
        """Returns ``eval_fn``'s metrics for ``state`` on ``batch``."""
        check_state(state, "eval_step(state, ...)")
        if self.ema:
            state = state.using_ema()
        mesh = mesh_of(state.params)  # the program's mesh: the state's
        found = self._programs.lookup(state.model_without_params, mesh, state.root_rng)
        try:
            return found.program(*args_of(state, found, batch, opt_state=False))
        except Exception as err:
            raise_if_donated(state, err, "eval_step(state, ...)")
            note_inputs(err, state.params, batch, "eval_step(state, ...)")
            raise

    def output_shapes(self, state: TrainState, batch: dict[str, Any]) -> Any:
        """The shapes and dtypes of the metrics on a batch like ``batch``
        (``jax.ShapeDtypeStruct`` s), traced (``jax.eval_shape``): nothing runs.

        An error of the eval function carries the note a call's does.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from pztrain import build_eval_step, TrainState
          >>> def eval_fn(*, model, state, rng, x):
          ...     return {"mean": jnp.mean(x * model["w"])}
          ...
          >>> state = TrainState.initial_state(
          ...     {"w": jnp.array(2.0)}, optax.sgd(0.1), jax.random.key(0))
          >>> build_eval_step(eval_fn).output_shapes(state, {"x": jnp.ones(3)})
          {'mean': ShapeDtypeStruct(shape=(), dtype=float32)}
        """
        check_state(state, "eval_step(state, ...)")
        if self.ema:
            state = state.using_ema()
        mesh = mesh_of(state.params)
        found = self._programs.lookup(state.model_without_params, mesh, state.root_rng)
        program = found.program  # on a mesh, an OnMesh: its own eval_shape
        shapes = getattr(program, "eval_shape", None) or (
            lambda *args: jax.eval_shape(program, *args)
        )
        try:
            return shapes(*args_of(state, found, batch, opt_state=False))
        except Exception as err:
            note_inputs(err, state.params, batch, "eval_step(state, ...)")
            raise


def build_eval_step(
    eval_fn: EvalFunction,
    *,
    jit: bool = True,
    mode: str | None = "eval",
    ema: bool = False,
    member_batches: bool = False,
) -> EvalStep:
    """Builds an eval step: ``eval_fn(*, model, state, rng, **batch) -> metrics``.

    Args:
      eval_fn: Returns a pytree of metrics (usually a dict of scalars).
      jit: Whether to ``jax.jit`` it.
      mode: The mode a Flax NNX model runs in: ``"eval"`` (``model.eval()``:
        running averages, no dropout), ``"train"`` (e.g. Monte Carlo dropout;
        the batch statistics it computes are not kept), or ``None`` for a model
        that manages its modes itself. Ignored by other families.
      ema: Evaluate the state's EMA params (`pztrain.with_ema`), not its
        params (as ``eval_step(state.using_ema(), ...)``).
      member_batches: For a population (`pztrain.population`): one batch per
        member (a leading member axis on every leaf); ``False``: one batch
        shared by every member. A population's metrics have a member axis.

    Returns:
      An `EvalStep`.

    Example:
      >>> from pztrain import build_eval_step, TrainState
      >>> import jax, jax.numpy as jnp, optax
      >>> def eval_fn(*, model, state, rng, x):
      ...     return {"mean": jnp.mean(x * model["w"])}
      ...
      >>> state = TrainState.initial_state({"w": jnp.array(2.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> float(build_eval_step(eval_fn)(state, x=jnp.ones(3))["mean"])
      2.0
    """
    if not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable; got {type(eval_fn).__name__}.")
    if not isinstance(ema, bool):
        raise TypeError(f"ema must be True or False; got {ema!r}.")
    if not isinstance(member_batches, bool):
        raise TypeError(
            f"member_batches must be True or False; got {member_batches!r}."
        )
    mode = checked_mode(mode)
    return EvalStep(eval_fn, jit=jit, mode=mode, ema=ema, member_batches=member_batches)
