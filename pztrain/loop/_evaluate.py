"""`evaluate`: an eval step's metrics averaged over a dataset, read once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pztrain._members import member_count
from pztrain._tree import named_leaves
from pztrain.data import eval_batches
from pztrain.data._batch import BatchError, check_batch
from pztrain.data._kinds import as_fit_data
from pztrain.loop._hooks import eval_inputs, host_reads
from pztrain.loop._signals import StopFlag, stop_signals
from pztrain.metric_states import is_metric_state
from pztrain.metrics import EvalSums
from pztrain.state import TrainState
from pztrain.state._state import check_state
from pztrain.step import EvalStep

__all__ = ["evaluate", "evaluate_until"]


def evaluate(
    state: TrainState,
    eval_step: EvalStep,
    data: Iterable[Any],
    *,
    ema: bool | str = False,
) -> dict:
    """Averages ``eval_step``'s metrics over all batches of ``data``.

    Each batch's metrics are taken as means over that batch and weighted by its
    size, so a last partial batch counts exactly as much as its examples. The sums
    stay on device; the host reads them once, at the end.

    Args:
      state: The state to evaluate, a `pztrain.TrainState`. To evaluate a
        model alone, make one (its optimizer is not used):
        ``pztrain.TrainState.initial_state(model, optax.identity(),
        jax.random.key(0))``.
      eval_step: From `pztrain.build_eval_step`; its metrics are scalars.
      data: A `pztrain.ArrayLoader` or `pztrain.GrainLoader` (one pass, in
        order: its epoch 0; with a ``sharding``, each batch is split over the
        mesh and, with several processes, assembled from every process's
        rows), a grain ``MapDataset`` ending in ``.batch(n)`` (read in its
        order, as a `pztrain.GrainLoader`) or any iterable of batch dicts.
      ema: Evaluate the EMA params (`pztrain.with_ema`) instead of the params
        (``True``), or both in one pass over ``data`` (``"both"``: the EMA's
        metrics named ``"ema/<name>"``).

    Returns:
      Metric name → float mean over all examples.

    Raises:
      TypeError: if ``state`` is not a `pztrain.TrainState` (a model, say).
      BatchError: for an empty ``data`` or a bad batch.
      pztrain.ema.NoEmaError: ``ema`` asked of a state without an EMA.
      KeyboardInterrupt: at the batch after a SIGINT (in the main thread; see
        `pztrain.fit` for signals).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, pztrain
      >>> from pztrain import evaluate, TrainState
      >>> def eval_fn(*, model, state, rng, x):
      ...     return {"mean": jnp.mean(x * model["w"])}
      ...
      >>> state = TrainState.initial_state({"w": jnp.array(2.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> data = pztrain.ArrayLoader({"x": np.arange(10.0)}, batch_size=4,
      ...                            shuffle=False, drop_remainder=False)  # 4, 4, 2
      >>> evaluate(state, pztrain.build_eval_step(eval_fn), data)  # 2 * mean(0..9)
      {'mean': 9.0}
    """
    with stop_signals() as flag:
        values = evaluate_until(state, eval_step, data, flag, ema)
        flag.acted = values is None  # stopped on it: said below
    if values is None:
        raise KeyboardInterrupt(
            "evaluate was interrupted between two batches; nothing changed (the "
            "state is not consumed by an evaluation)."
        )
    return values


def evaluate_until(
    state: TrainState,
    eval_step: EvalStep,
    data: Iterable[Any],
    flag: StopFlag,
    ema: bool | str = False,
) -> dict | None:
    """`evaluate`, or ``None`` if ``flag`` asks to stop before a batch."""
    check_state(state, "evaluate(state, ...)")
    run = _on_weights(state, eval_step, ema)
    data = as_fit_data(data, "data", train=False)
    sums = EvalSums(member_count(state.root_rng))
    per_member = sums.members if getattr(eval_step, "member_batches", 0) else None
    with eval_inputs():  # host batches and weights, moved by jit and jnp
        for batch in eval_batches(data):  # every example once; on a mesh, placed
            if flag.requested:
                return None
            n = check_batch(batch, members=per_member)  # a member's (global) batch
            values = run(batch)
            sums = sums.add(values, n)  # metric states merged, the rest weighted
    if sums.total == 0:
        raise BatchError("evaluate got no batches: the eval data is empty.")
    with host_reads():  # a population's: per member, and more
        return sums.read()


def _on_weights(state: TrainState, eval_step: EvalStep, ema: Any):
    """``batch -> metrics`` on the params, the EMA params, or both."""
    if ema is False:
        return lambda batch: eval_step(state, **batch)
    if not (ema is True or ema == "both"):
        raise ValueError(f"ema must be False, True or 'both'; got {ema!r}.")
    averaged = state.using_ema()
    if ema is True:
        return lambda batch: eval_step(averaged, **batch)

    def both(batch: dict[str, Any]) -> dict[str, Any]:
        values = dict(named_leaves(eval_step(state, **batch), is_metric_state))
        return {**values, **_prefixed(eval_step(averaged, **batch))}

    return both


def _prefixed(values: Any) -> dict[str, Any]:
    """An eval step's metrics named ``"ema/<name>"``."""
    return {f"ema/{name}": v for name, v in named_leaves(values, is_metric_state)}
