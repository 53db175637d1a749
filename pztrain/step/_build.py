"""`build_train_step`: a `TrainStep` from a loss function, its options checked."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from pztrain.partition import MODES
from pztrain.state import TrainState  # noqa: F401 - the docstring's example
from pztrain.step._norms import checked_grad_norms
from pztrain.step._train import TrainStep
from pztrain.step._types import LossFunction

__all__ = ["LossFunction", "build_train_step", "checked_mode"]


def build_train_step(
    loss_fn: LossFunction,
    *,
    jit: bool = True,
    donate: bool | None = None,
    steps_per_call: int = 1,
    state_shardings: Any = None,
    batch_shardings: Any = None,
    mesh: Mesh | None = None,
    data_axis: str | tuple[str, ...] = "data",
    microbatches: int = 1,
    explicit_loss: bool = False,
    mode: str | None = "train",
    grad_norms: str | None = None,
    member_batches: bool = False,
) -> TrainStep:
    """Builds a `TrainStep` for ``loss_fn`` (penzai's loss-function contract).

    Args:
      loss_fn: ``(*, model, state, rng, **batch) -> (loss, new_state, aux)``.
      jit: Whether to ``jax.jit`` the step (``False``: eagerly, to debug).
      donate: Donate what the step updates (default ``jit``; a donated state
        used again is a `DonatedStateError`).
      steps_per_call: Steps fused in one call; batch leaves get a leading axis.
      state_shardings: A `TrainState` of shardings for the step's in and outs.
      batch_shardings: Shardings for the batch dict.
      mesh: A device mesh (Auto, Explicit or mixed axes): batches split along
        ``data_axis``, shardings kept.
      data_axis: The mesh axis (or axes) the examples of a batch are split over.
      microbatches: Micro-batches per step (accumulated grads: see `TrainStep`).
      explicit_loss: On a mesh, run ``loss_fn`` with Explicit axes (it sees the
        compute layout in its types) instead of in auto mode.
      mode: A Flax NNX model's mode: ``"train"``, ``"eval"`` or ``None`` (as built).
      grad_norms: ``"global"`` or ``"per_param"``: grad norms as metrics in the
        aux (see `TrainStep`); ``None`` (default): none, nothing computed.
      member_batches: For a population (`pztrain.population`): each member
        gets its own batch, every batch leaf having a leading member axis
        (``[K, batch, ...]``; with ``steps_per_call=k``, ``[K, k, batch,
        ...]``); ``False`` (default): one batch shared by every member.

    Raises:
      ValueError: for counts < 1, ``donate=True`` without jit, a bad ``mode``
        or ``grad_norms``.

    Example:
      >>> from pztrain import build_train_step, TrainState
      >>> import jax, jax.numpy as jnp, optax
      >>> def loss_fn(*, model, state, rng, x, y):
      ...     return jnp.mean((x * model["w"] - y) ** 2), state, {}
      ...
      >>> state = TrainState.initial_state({"w": jnp.array(0.0)}, optax.sgd(0.1),
      ...                                  jax.random.key(0))
      >>> train_step, x = build_train_step(loss_fn), jnp.ones(4)
      >>> for _ in range(50):
      ...     state, aux = train_step(state, x=x, y=2 * x)
      ...
      >>> round(float(state.params["w"]), 3)
      2.0
    """
    return TrainStep(**_checked(dict(locals())))


def checked_mode(mode: Any) -> str | None:
    """``mode`` if a step can run a model in it (`pztrain.partition.MODES`)."""
    if mode not in MODES:
        raise ValueError(
            f"mode must be 'train', 'eval' or None (modes left as the model was "
            f"built); got {mode!r}."
        )
    return mode


def _checked_mesh(mesh: Any) -> Mesh | None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"build_train_step(mesh=...) takes a jax.sharding.Mesh (e.g. "
            f"jax.make_mesh((8,), ('data',))); got {type(mesh).__name__}."
        )
    return mesh


def _checked(options: dict[str, Any]) -> dict[str, Any]:
    """`build_train_step`'s arguments, checked, as `TrainStep` takes them."""
    k, m = options["steps_per_call"], options["microbatches"]
    jit, donate = options["jit"], options["donate"]
    options["donate"] = _check_build(options["loss_fn"], jit, donate, k, m)
    options["mesh"] = _checked_mesh(options["mesh"])
    options["mode"] = checked_mode(options["mode"])
    options["grad_norms"] = checked_grad_norms(options["grad_norms"])
    if not isinstance(options["member_batches"], bool):
        raise TypeError(
            f"member_batches must be True or False; got {options['member_batches']!r}."
        )
    return options


def _check_build(loss_fn: Any, jit: bool, donate: bool | None, k: int, m: int) -> bool:
    """Checks `build_train_step`'s arguments; returns whether to donate."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}.")
    for name, value in (("steps_per_call", k), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
    if donate and not jit:
        raise ValueError("donate=True needs jit=True (only jitted calls donate).")
    return jit if donate is None else donate
