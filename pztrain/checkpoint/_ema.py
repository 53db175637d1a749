"""The EMA params a full-state checkpoint holds (`pztrain.with_ema`), found by
their stored paths: ``<optimizer state>.ema_params<the param's key path>``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain._tree import path_name, path_repr
from pztrain.checkpoint._integrity import StoredArray
from pztrain.checkpoint._metadata import (
    CHECKSUM,
    CheckpointMismatchError,
    describe_shape,
)
from pztrain.checkpoint._targets import param_target
from pztrain.state import TrainState

__all__ = ["stored_ema", "weights_to_save"]

_FIELD = ".ema_params"


def stored_ema(
    path: Path, meta: dict[str, Any], params: Any, wanted: set[str]
) -> dict[str, StoredArray]:
    """The state item's EMA arrays for the params ``wanted``, by name.

    Names with no EMA (a model's own state: batch statistics) are left out:
    they load from the params item.

    Raises:
      CheckpointMismatchError: if the checkpoint holds no EMA (params only, or
        an optimizer without `pztrain.with_ema`), or an EMA whose shape or
        dtype differs from the target's, naming the parameter.
    """
    state = meta.get("state") or {"paths": []}
    prefix = _prefix(path, state["paths"])
    index = {p: i for i, p in enumerate(state["paths"])}
    sums = state.get(CHECKSUM) or [None] * len(index)
    found = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_name(key_path)
        i = index.get(prefix + path_repr(key_path))
        if name not in wanted or i is None:
            continue
        stored = (tuple(state["shapes"][i]), state["dtypes"][i])
        want = (tuple(np.shape(leaf)), str(leaf.dtype))
        if stored != want:
            raise CheckpointMismatchError(
                f"The EMA of parameter {name!r} in {path} is "
                f"{describe_shape(*stored)}, but the target expects "
                f"{describe_shape(*want)}."
            )
        target = param_target(stored[1], leaf)
        found[name] = StoredArray(f"EMA of parameter {name!r}", str(i), target, sums[i])
    return found


def _prefix(path: Path, paths: list[str]) -> str:
    """The stored path of the EMA params (``.opt_state.ema_params``)."""
    prefixes = {p.split(_FIELD, 1)[0] + _FIELD for p in paths if _FIELD in p}
    if len(prefixes) != 1:
        what = "params only (save_params)" if not paths else "a state without one"
        raise CheckpointMismatchError(
            f"{path} holds no EMA weights ({what}): load them from a checkpoint "
            "of a state whose optimizer was built with pztrain.with_ema, or load "
            "the params with ema=False."
        )
    return prefixes.pop()


def weights_to_save(state_or_params: Any, ema: bool, where: str) -> Any:
    """The state (or params) to save: with ``ema``, the state's EMA params
    (``where`` names the caller in the error for a non-state)."""
    if not ema:
        return state_or_params
    if not isinstance(state_or_params, TrainState):
        raise TypeError(
            f"{where}(..., ema=True) takes a TrainState (whose optimizer keeps "
            f"an EMA: pztrain.with_ema); got {type(state_or_params).__name__}."
        )
    return state_or_params.using_ema()
