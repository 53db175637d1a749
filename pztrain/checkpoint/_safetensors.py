"""Params as one ``.safetensors`` file, for use outside JAX (an optional extra).

Keyed by parameter name (`pztrain.partition.param_names`), checked on the way in
like a params checkpoint (`pztrain.checkpoint._metadata.check_params`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain._tree import named_leaves
from pztrain.checkpoint import _orbax
from pztrain.checkpoint._ema import weights_to_save
from pztrain.checkpoint._metadata import check_params
from pztrain.checkpoint._targets import filled, params_of, params_target

__all__ = ["export_safetensors", "import_safetensors"]


def export_safetensors(
    path: str | os.PathLike, state_or_params: Any, *, ema: bool = False
) -> Path:
    """Writes the params to one ``.safetensors`` file, keyed by parameter name.

    For use outside JAX (PyTorch, NumPy, Rust …). Needs ``pztrain[safetensors]``. With
    several processes every process calls it: arrays split across them are gathered
    (each process needs the host memory for the whole params) and process 0 writes the
    file. ``ema=True``: a state's EMA params (`pztrain.with_ema`) instead of its params.

    Example:
      >>> from pztrain import export_safetensors
      >>> import tempfile, jax.numpy as jnp, safetensors.numpy
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = export_safetensors(d + "/w.safetensors", {"w": jnp.ones(2)})
      ...     print(safetensors.numpy.load_file(path))
      {'w': array([1., 1.], dtype=float32)}
    """
    save_file = _safetensors().save_file
    named = named_leaves(
        params_of(weights_to_save(state_or_params, ema, "export_safetensors"))
    )
    with jax.transfer_guard_device_to_host("allow"):
        tensors = {n: _whole_on_host(x) for n, x in named}
    if jax.process_index() == 0:
        save_file(tensors, str(path), metadata={"format": "pztrain.params"})
    _orbax.barrier(f"pztrain.export_safetensors {path}")
    return Path(path)


def _whole_on_host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    host = np.asarray(jax.device_get(x))
    return np.ascontiguousarray(host).reshape(host.shape)  # a scalar stays 0-d


def import_safetensors(
    path: str | os.PathLike, like: Any, *, partial: bool = False
) -> Any:
    """Reads params from a ``.safetensors`` file into ``like`` (see `load_params`).

    Example:
      >>> from pztrain import export_safetensors, import_safetensors
      >>> import tempfile, jax.numpy as jnp
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = export_safetensors(d + "/w.safetensors", {"w": jnp.ones(2)})
      ...     print(import_safetensors(path, {"w": jnp.zeros(2)})["w"])
      [1. 1.]
    """
    tensors = _safetensors().load_file(str(path))
    params, rebuild = params_target(like)
    stored = {n: (tuple(t.shape), str(t.dtype)) for n, t in tensors.items()}
    wanted = check_params(Path(path), stored, dict(named_leaves(params)), partial)
    loaded = {n: jax.numpy.asarray(tensors[n]) for n in wanted}
    return rebuild(filled(params, loaded))


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "safetensors export/import needs the extra: pip install "
            "'pztrain[safetensors]'."
        ) from None
    return safetensors.numpy
