"""Merged weights out: a model's params written under the source checkpoint's
names and layout, the `WeightMapping` run backwards."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain.finetune._hf import write_checkpoint
from pztrain.finetune._load import model_params
from pztrain.finetune._mapping import MappingError, WeightMapping, export_names
from pztrain.finetune._transforms import Slice, to_source

__all__ = ["export_pretrained", "source_tensors"]


def source_tensors(
    params: Mapping[str, Any], mapping: WeightMapping, *, dtype: Any = None
) -> dict[str, np.ndarray]:
    """``params`` (name → array) as the source checkpoint's tensors.

    Raises:
      MappingError: a param no rule maps back; parts of a fused tensor that
        do not cover it.
    """
    names = export_names(mapping, list(params))
    with jax.transfer_guard_device_to_host("allow"):
        host = {n: np.asarray(jax.device_get(x)) for n, x in params.items()}
    whole: dict[str, np.ndarray] = {}
    parts: dict[str, list[tuple[Slice, np.ndarray, str]]] = {}
    for n, (source, rule) in names.items():
        x = to_source(rule.transforms, host[n])
        if rule.transforms and isinstance(rule.transforms[0], Slice):
            parts.setdefault(source, []).append((rule.transforms[0], x, n))
        elif source in whole:
            raise MappingError(
                f"{mapping.name} mapping: two params map back to {source!r}; "
                "a stored tensor takes one param."
            )
        else:
            whole[source] = x
    for source, pieces in parts.items():
        whole[source] = _fused(source, pieces)
    if dtype is not None:
        whole = {n: x.astype(dtype) for n, x in whole.items()}
    return {n: np.ascontiguousarray(x) for n, x in whole.items()}


def _fused(source: str, pieces: list[tuple[Slice, np.ndarray, str]]) -> np.ndarray:
    pieces = sorted(pieces, key=lambda p: p[0].start)
    at, axis = 0, pieces[0][0].axis
    for s, x, n in pieces:
        if s.start != at or x.shape[axis] != s.stop - s.start:
            raise MappingError(
                f"The parts {[p[2] for p in pieces]} of {source!r} do not cover it "
                f"side by side: {n!r} is rows {s.start}:{s.stop}, the parts "
                f"before end at {at}."
            )
        at = s.stop
    return np.concatenate([x for _, x, _ in pieces], axis=axis)


def export_pretrained(
    path: str | os.PathLike,
    model: Any,
    mapping: WeightMapping,
    *,
    dtype: Any = None,
    config: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Writes a model's weights in Hugging Face's layout under the source names.

    The same `WeightMapping` that `load_pretrained` reads with, run backwards:
    importing and exporting gives back the source tensors bit for bit (at the
    dtype loaded: a float32 checkpoint loaded as bfloat16 comes back rounded).
    For adapters merged into the base first, see `merge_lora`.

    Args:
      path: The directory to write (``model.safetensors``, or shards and
        ``model.safetensors.index.json``; ``config.json`` if ``config``).
      model: A model of any family, or a dict of params.
      mapping: The architecture's `WeightMapping`.
      dtype: The dtype to write (``None``: each array's own).
      config: The ``config.json`` to write beside (`hf_llama_config`).
      max_shard_bytes: Split into shards of at most this many bytes.

    Returns:
      ``path``.

    Raises:
      MappingError: a param no rule maps back (nothing is written).

    Example:
      >>> import tempfile, jax.numpy as jnp, safetensors.numpy
      >>> from pztrain.finetune import Rule, Transpose, WeightMapping
      >>> from pztrain.finetune import export_pretrained
      >>> mapping = WeightMapping([Rule("fc.weight", "w", (Transpose((1, 0)),))])
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = export_pretrained(d, {"w": jnp.ones((2, 3))}, mapping)
      ...     print(safetensors.numpy.load_file(f"{path}/model.safetensors"))
      {'fc.weight': array([[1., 1.],
             [1., 1.],
             [1., 1.]], dtype=float32)}
    """
    params = model_params(model)[0]
    tensors = source_tensors(params, mapping, dtype=dtype)
    if jax.process_index() == 0:
        write_checkpoint(
            Path(path), tensors, config=config, max_shard_bytes=max_shard_bytes
        )
    return Path(path)
