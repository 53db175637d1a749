"""The first NaN, named: one step re-run with a finiteness check per array.

Nothing here runs on the normal path. When a step's loss (or an update) is not
finite, `find_nonfinite` re-runs that one step from a state and its batch:

* the loss's forward pass, one operation at a time (only when the loss is not
  finite): the first operation whose result is not finite while its inputs are,
  and the params that feed it most directly;
* the grads (`TrainStep.compute_grads`, the step's own program) and the params
  after the optimizer update, each array checked.

`NonFinite.line` says it in one line, e.g. ``non-finite grads first in
['layers/3/weight'] at step 1234; params finite; loss finite``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._optax import optimizer_update
from pztrain._tree import is_float_array, named_leaves
from pztrain.partition import split_rest

__all__ = ["NonFinite", "explain_in_run", "find_nonfinite", "replay_to_first"]

_MANY = object()  # a value that depends on more than one param


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """What was not finite when a step was re-run.

    Attributes:
      step: The step re-run.
      loss_finite: Whether the loss was finite.
      forward: The params nearest to the first non-finite value of the loss's
        forward pass (empty when the loss is finite).
      operation: That value's operation (``"exp"``, ``"dot_general"`` …).
      grads: The names of the non-finite grads, in the params' order.
      params: The names of the params not finite after the update.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pztrain.step import find_nonfinite
      >>> import optax, pztrain
      >>> def loss_fn(*, model, state, rng):  # finite at 0, its gradient is not
      ...     return jnp.sum(jnp.sqrt(model["w"])), state, {}
      ...
      >>> state = pztrain.TrainState.initial_state(
      ...     {"w": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(0))
      >>> found = find_nonfinite(pztrain.build_train_step(loss_fn), state)
      >>> found.loss_finite, found.grads, found.params
      (True, ('w',), ('w',))
      >>> print(found.line())
      non-finite grads first in ['w'] at step 0; params non-finite in ['w']; loss finite
    """

    step: int
    loss_finite: bool
    forward: tuple[str, ...]
    operation: str | None
    grads: tuple[str, ...]
    params: tuple[str, ...]

    def line(self) -> str:
        """The finding in one line."""
        params = _in("params", self.params)
        loss = "loss finite" if self.loss_finite else "loss non-finite"
        if self.forward:
            return (
                f"non-finite values first in {list(self.forward)} "
                f"({self.operation}) at step {self.step}; {loss}; "
                f"{_in('grads', self.grads)}; {params}"
            )
        if self.grads:
            return (
                f"non-finite grads first in {_few(self.grads)} at step "
                f"{self.step}; {params}; {loss}"
            )
        if self.params:
            return (
                f"non-finite params first in {_few(self.params)} after the update "
                f"at step {self.step}; grads finite; {loss}"
            )
        return f"step {self.step} re-run: {loss}; grads finite; params finite"


def _few(names: tuple[str, ...], most: int = 4) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{list(names[:most])}{more}"


def _in(what: str, names: tuple[str, ...]) -> str:
    return f"{what} non-finite in {_few(names)}" if names else f"{what} finite"


@jax.jit
def _finite_flags(leaves: list[Any]) -> list[jax.Array]:
    return [jnp.isfinite(x).all() for x in leaves]


def _nonfinite_names(tree: Any) -> tuple[str, ...]:
    named = [(n, x) for n, x in named_leaves(tree) if is_float_array(x)]
    flags = jax.device_get(_finite_flags([x for _, x in named]))
    return tuple(n for (n, _), ok in zip(named, flags, strict=True) if not ok)


def find_nonfinite(
    train_step: Any, state: Any, batch: Any = None, /, *, step: int | None = None
) -> NonFinite:
    """Re-runs one step from ``state`` on ``batch`` and names what is not finite.

    Args:
      train_step: The `TrainStep` whose step went wrong.
      state: The state before that step (not donated: nothing here donates).
      batch: That step's batch (a dict of arrays, one step's worth).
      step: The step's number, for its key ``fold_in(root_rng, step)``;
        default ``state.step``.

    Returns:
      A `NonFinite`; ``.line()`` says it in one line.

    Example:
      >>> from pztrain.step import find_nonfinite
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def loss_fn(*, model, state, rng, x):
      ...     loss = jnp.sum(jnp.exp(x * model["scale"])) + jnp.sum(model["w"] ** 2)
      ...     return loss, state, {}
      ...
      >>> state = pztrain.TrainState.initial_state(
      ...     {"scale": jnp.ones(2), "w": jnp.ones(2)}, optax.sgd(0.1),
      ...     jax.random.key(0))
      >>> step = pztrain.build_train_step(loss_fn)
      >>> found = find_nonfinite(step, state, {"x": jnp.array([1.0, 500.0])})
      >>> found.forward, found.operation, found.grads, found.loss_finite
      (('scale',), 'exp', ('scale',), False)
      >>> found.line()[:54]
      "non-finite values first in ['scale'] (exp) at step 0; "
    """
    batch = dict(batch or {})
    at = int(state.step) if step is None else int(step)
    state = state.replace(step=jnp.asarray(at, jnp.int32))
    out = train_step.compute_grads(state, **batch)
    new_params, _ = jax.jit(optimizer_update, static_argnums=0)(
        state.optimizer_def, out.grads, state.opt_state, state.params
    )
    loss_finite = bool(np.isfinite(np.asarray(out.loss, np.float32)).all())
    forward, operation = ((), None)
    if not loss_finite:
        forward, operation = _first_in_forward(train_step, state, batch, at)
    return NonFinite(
        step=at,
        loss_finite=loss_finite,
        forward=forward,
        operation=operation,
        grads=_nonfinite_names(out.grads),
        params=_nonfinite_names(new_params),
    )


def _first_in_forward(train_step, state, batch, at) -> tuple[tuple[str, ...], Any]:
    """The loss's forward pass one operation at a time: the params nearest the
    first operation whose result is not finite while its inputs are."""
    spec, rest = split_rest(state.model_without_params)
    rng = jax.random.fold_in(state.root_rng, at)
    mode = getattr(train_step, "mode", "train")

    def loss_of(params: Any) -> Any:
        model, _ = spec.bind(params, rest, rng, mode)
        out = train_step.loss_fn(
            model=model, state=state.loss_fn_state, rng=rng, **batch
        )
        return out[0]

    closed = jax.make_jaxpr(loss_of)(state.params)
    named = named_leaves(state.params)
    return _walk(closed, [n for n, _ in named], [x for _, x in named])


def _walk(closed: Any, names: list[str], values: list[Any]) -> tuple[tuple, Any]:
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    deps: dict[Any, Any] = {v: None for v in jaxpr.constvars}
    for var, name, value in zip(jaxpr.invars, names, values, strict=True):
        env[var], deps[var] = value, name
    producer: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if _is_literal(v) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with eqn.ctx.manager:
            outs = _bind(eqn, invals)
        outs = outs if eqn.primitive.multiple_results else [outs]
        source = _merge(deps.get(v) for v in eqn.invars if not _is_literal(v))
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var], deps[var], producer[var] = value, source, eqn
        if not all(map(_finite, outs)) and all(map(_finite, invals)):
            return _nearest(eqn, deps, producer), eqn.primitive.name
    return (), None


def _bind(eqn: Any, invals: list[Any]) -> Any:
    """Runs one equation. ``get_bind_params`` gives the params, or (jax < 0.10)
    ``(subfuns, params)``."""
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple | list) else ((), got)
    return eqn.primitive.bind(*subfuns, *invals, **params)


def _is_literal(v: Any) -> bool:
    return hasattr(v, "val") and not hasattr(v, "count")


def _finite(x: Any) -> bool:
    if not is_float_array(x) and not isinstance(x, float):
        return True
    return bool(
        np.isfinite(np.asarray(x, np.float64 if np.iscomplexobj(x) else None)).all()
    )


def _merge(sources: Any) -> Any:
    found = None
    for s in sources:
        if s is None:
            continue
        if s is _MANY or (found is not None and found != s):
            return _MANY
        found = s
    return found


def _nearest(eqn: Any, deps: dict, producer: dict) -> tuple[str, ...]:
    """The params read by ``eqn`` itself, or else by the nearest operations
    before it (breadth first through values that mix several params)."""
    level, seen = [eqn], set()
    while level:
        names = {
            deps[v]
            for e in level
            for v in e.invars
            if not _is_literal(v) and isinstance(deps.get(v), str)
        }
        if names:
            return tuple(sorted(names))
        seen.update(map(id, level))
        level = [
            producer[v]
            for e in level
            for v in e.invars
            if not _is_literal(v) and v in producer and id(producer[v]) not in seen
        ]
    return ()


def explain_in_run(info: Any, state: Any, first: int) -> str:
    """``"non-finite loss at step <first>: "`` and what `find_nonfinite` finds
    re-running step ``first`` of a `pztrain.fit` run from ``state``, on the batch
    the run's data gives that step (``batch_at``).

    Re-running needs finite params: with ``optax.apply_if_finite`` the state
    at hand never took the bad update. Otherwise (``NanPolicy("stop")``) the
    run's newest checkpoint at or before step ``first`` is restored and the
    steps from it replayed one at a time (`replay_to_first`), so that the step
    re-run is the first whose update was not finite, from the state before it.
    Without such a checkpoint the line names the params that are not finite
    now. Never raises: a failure to re-run is said in the line.

    Example:
      What `pztrain.NanPolicy` says when step 2's batch overflows ``exp``:

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from pztrain.step import explain_in_run
      >>> import optax, pztrain
      >>> def loss_fn(*, model, state, rng, x):
      ...     return jnp.mean(jnp.exp(x * model["w"])), state, {}
      ...
      >>> data = pztrain.ArrayLoader({"x": np.array([1, 1, 1e3, 1], np.float32)},
      ...                            batch_size=1, shuffle=False)
      >>> state = pztrain.TrainState.initial_state(
      ...     {"w": jnp.ones(())}, optax.sgd(0.01), jax.random.key(0))
      >>> info = pztrain.LoopInfo(  # as fit gives it to its callbacks
      ...     start_step=0, end_step=4, steps_per_epoch=4, steps_per_call=1,
      ...     log_every=1, evaluates=False, run_dir=None, train_data=data,
      ...     train_step=pztrain.build_train_step(loss_fn))
      >>> print(explain_in_run(info, state, 2))  # doctest: +NORMALIZE_WHITESPACE
      non-finite loss at step 2: non-finite values first in ['w'] (exp) at step 2;
      loss non-finite; grads non-finite in ['w']; params non-finite in ['w']
    """
    return f"non-finite loss at step {first}: {_explained(info, state, first)}"


def _explained(info: Any, state: Any, first: int) -> str:
    data = getattr(info, "train_data", None)
    train_step = getattr(info, "train_step", None)
    try:
        rerun = train_step is not None and hasattr(data, "batch_at")
        bad = _nonfinite_names(state.params)
        if bad:
            found = _restored(info, state, first) if rerun else None
            if found is None:
                why = (
                    f"no checkpoint at or before step {first} to replay from "
                    "(fit(checkpoints=Checkpoints(dir, every_steps=N)))"
                    if rerun
                    else "the data gives no batch by step (batch_at) to replay"
                )
                return (
                    f"params non-finite in {_few(bad)} at step {int(state.step)}; "
                    f"{why}; or re-run a state from before the step with "
                    "pztrain.step.find_nonfinite"
                )
            state, first = replay_to_first(train_step, found, data, first)
        if not rerun:
            return "not re-run: the data gives no batch by step (batch_at)"
        return find_nonfinite(
            train_step, state, data.batch_at(first), step=first
        ).line()
    except Exception as err:  # naming must never hide the stop itself
        return f"could not re-run step {first}: {type(err).__name__}: {err}"


def _restored(info: Any, like: Any, first: int) -> Any:
    """The newest checkpoint of the run's at or before step ``first``, restored
    into ``like`` (``None`` if there is none)."""
    checkpoints = getattr(info, "checkpoints", None)
    if checkpoints is None:
        return None
    checkpoints.wait()
    saved = [s for s in checkpoints.steps() if s <= first]
    return checkpoints.restore(max(saved), like) if saved else None


def replay_to_first(train_step: Any, state: Any, data: Any, last: int) -> tuple:
    """Steps from ``state`` (at its own step) to ``last``, one at a time on the
    batches ``data.batch_at`` gives, until one leaves params that are not
    finite.

    Args:
      train_step: The run's `TrainStep` (replayed one step per call, without
        donation: `TrainStep.single`).
      state: A state from before the step that went wrong, e.g. a checkpoint.
      data: The run's data (anything with ``batch_at(step)``).
      last: The step known to go wrong (its loss is not finite).

    Returns:
      ``(state_before, step)``: the first step whose update left params that are
      not finite, or ``last``, and the state just before it.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from pztrain.step import replay_to_first
      >>> import optax, pztrain
      >>> def loss_fn(*, model, state, rng, x):
      ...     return jnp.mean(jnp.exp(x * model["w"])), state, {}
      ...
      >>> data = pztrain.ArrayLoader({"x": np.array([1, 1, 1e3, 1], np.float32)},
      ...                            batch_size=1, shuffle=False)
      >>> state = pztrain.TrainState.initial_state(
      ...     {"w": jnp.ones(())}, optax.sgd(0.01), jax.random.key(0))
      >>> step = pztrain.build_train_step(loss_fn)
      >>> before, at = replay_to_first(step, state, data, last=3)
      >>> at, int(before.step), float(before.params["w"]) < 1.0
      (2, 2, True)
    """
    one = train_step.single()
    for at in range(int(state.step), last):
        new, _ = one(state, data.batch_at(at))
        if _nonfinite_names(new.params):
            return state, at
        state = new
    return state, last
