"""`load_from_checkpoint`: a model rebuilt from the hyperparameters a
checkpoint stored, with its params (Lightning's ``Model.load_from_checkpoint``).

The checkpoint holds arrays and JSON only; the model's structure comes from
code, ``build_fn(**hparams)``, and the params are then read into it by name.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from pztrain.checkpoint._format import load_params, read_metadata

__all__ = ["load_from_checkpoint"]


def load_from_checkpoint(
    directory: str | os.PathLike,
    build_fn: Callable[..., Any],
    *,
    partial: bool = False,
    **overrides: Any,
) -> Any:
    """Rebuilds a model with ``build_fn(**hparams)`` and loads its params.

    The hyperparameters are those the checkpoint stored: ``fit(hparams=...)``
    with a `pztrain.Checkpoints`, or ``save_params(..., metadata={"hparams":
    ...})``; ``overrides`` replace or add some.

    Args:
      directory: A checkpoint, or a `pztrain.Checkpoints` directory (its newest
        checkpoint).
      build_fn: Builds the model, or a `pztrain.TrainState`, from the
        hyperparameters as keyword arguments.
      partial: Load only the params both sides have (see `load_params`).
      **overrides: Hyperparameters to use instead of (or besides) the stored ones.

    Returns:
      What ``build_fn`` built, with the stored params.

    Raises:
      TypeError: if ``build_fn`` does not take the hyperparameters, naming the
        missing or unexpected ones and those stored.
      pztrain.CheckpointMismatchError: if the built model's params differ from
        the stored ones (names, shapes, dtypes).

    Example:
      >>> import tempfile, jax.numpy as jnp; from pztrain import load_from_checkpoint
      >>> from pztrain.checkpoint import save_params
      >>> def build(width):
      ...     return {"w": jnp.zeros(width)}
      ...
      >>> d = tempfile.mkdtemp() + "/ckpt"
      >>> _ = save_params(d, {"w": jnp.ones(3)}, metadata={"hparams": {"width": 3}})
      >>> load_from_checkpoint(d, build)["w"]
      Array([1., 1., 1.], dtype=float32)
    """
    metadata = read_metadata(directory).get("metadata", {})
    stored = metadata.get("hparams") or {}
    hparams = {**stored, **overrides}
    _check_signature(build_fn, hparams, stored)
    return load_params(directory, build_fn(**hparams), partial=partial)


def _check_signature(build_fn: Callable[..., Any], hparams: dict, stored: dict):
    if not callable(build_fn):
        raise TypeError(
            f"build_fn must be a function hparams -> model; got "
            f"{type(build_fn).__name__}."
        )
    try:
        signature = inspect.signature(build_fn)
    except (TypeError, ValueError):  # a builtin: let the call say
        return
    try:
        signature.bind(**hparams)
    except TypeError as e:
        raise TypeError(
            f"build_fn{signature} cannot take the checkpoint's hyperparameters: "
            f"{e}. Stored: {sorted(stored)}; pass missing ones as keyword "
            "arguments to load_from_checkpoint, or change build_fn."
        ) from None
