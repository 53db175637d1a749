"""Adapters in PEFT's layout: ``adapter_model.safetensors`` (for each adapted
weight ``<module>.weight`` of the source checkpoint,
``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``…lora_B.weight``
``(out, r)``) beside ``adapter_config.json`` (``peft_type: "LORA"``, ``r``,
``lora_alpha``, ``target_modules``).

A model's factors are laid out as its base weight is: in the source's layout
(equinox: ``A (r, in)``, ``B (out, r)``) or transposed with the heads split in
order (penzai: ``A (in axes…, r)``, ``B (r, out axes…)``; NNX: ``A (in, r)``,
``B (r, out)``); the base weight's rule in the `WeightMapping` tells which.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain.finetune._hf import safetensors_module
from pztrain.finetune._load import model_params
from pztrain.finetune._lora import Adapter, adapters_of
from pztrain.finetune._mapping import MappingError, Rule, WeightMapping, export_names
from pztrain.finetune._transforms import Slice

__all__ = ["export_peft", "load_peft"]

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PREFIX = "base_model.model."


def _source_shape(rule: Rule, shape: tuple[int, ...]) -> tuple[int, ...]:
    for t in reversed(rule.transforms):
        shape = t.inverse_shape(shape)
    return shape


def _in_first(rule: Rule, base: str, target_shape: tuple[int, ...]) -> bool:
    """Whether ``rule`` lays a weight out transposed (in-axes first, each side
    in order) rather than as the source does.

    Raises:
      MappingError: a weight laid out otherwise, or read from a fused tensor.
    """
    if any(isinstance(t, Slice) for t in rule.transforms):
        raise MappingError(
            f"The adapter of {base!r} sits on a part of a fused tensor "
            f"({rule.source!r}): PEFT names whole modules; adapt another layer."
        )
    out, n_in = _source_shape(rule, target_shape)
    x = np.arange(out * n_in, dtype=np.int64).reshape(out, n_in)
    for t in rule.transforms:
        x = t.forward(x, t.shape(x.shape))
    if np.array_equal(x.ravel(), np.arange(out * n_in)):
        return False
    if np.array_equal(x.ravel(), np.arange(out * n_in).reshape(out, n_in).T.ravel()):
        return True
    raise MappingError(
        f"The weight {base!r} is laid out neither as {rule.source!r} nor as its "
        "transpose (heads split in order): its adapter has no PEFT layout."
    )


def _modules(model: Any, mapping: WeightMapping) -> list[tuple[Adapter, str, bool]]:
    """Each adapter, its module's source name, and whether it is in-first."""
    adapters = adapters_of(model)
    if not adapters:
        raise ValueError(
            "The model holds no adapters (pztrain.finetune.add_lora adds them)."
        )
    params = model_params(model)[0]
    try:
        names = export_names(mapping, [a.base for a in adapters])
    except MappingError as e:
        raise MappingError(
            f"The adapters were added to a base whose names the {mapping.name} "
            f"mapping does not match: {e}"
        ) from None
    out = []
    for a in adapters:
        source, rule = names[a.base]
        module = source.removesuffix(".weight")
        in_first = _in_first(rule, a.base, tuple(np.shape(params[a.base])))
        out.append((a, module, in_first))
    return out


def _rank(a: Adapter, params: dict[str, Any], in_first: bool) -> int:
    shape = np.shape(params[a.a])
    return shape[-1] if in_first else shape[0]


def _one(values: set, what: str, hint: str) -> Any:
    if len(values) != 1:
        raise ValueError(f"The adapters differ in {what} ({sorted(values)}); {hint}")
    return values.pop()


def export_peft(
    path: str | os.PathLike,
    model: Any,
    mapping: WeightMapping,
    *,
    base_model_name_or_path: str = "",
) -> Path:
    """Writes a model's adapters in PEFT's layout, named as the source
    checkpoint names the weights they adapt.

    Args:
      path: The directory for ``adapter_model.safetensors`` and
        ``adapter_config.json``.
      model: A model with adapters (`add_lora`), e.g. ``state.model``.
      mapping: The `WeightMapping` the base was loaded with.
      base_model_name_or_path: Written to the config (the Hub id of the base).

    Returns:
      ``path``.

    Raises:
      MappingError: an adapted weight the mapping does not map back (adapters
        of another base), or one without a PEFT layout; nothing is written.

    Example:
      >>> import tempfile, json, equinox as eqx, jax
      >>> from pztrain.finetune import (LoraConfig, Rule, WeightMapping, add_lora,
      ...                               export_peft)
      ...
      >>> base = {"q_proj": eqx.nn.Linear(4, 4, key=jax.random.key(0))}
      >>> model = add_lora(base, LoraConfig(2, 4.0, "q_proj"), jax.random.key(1))
      >>> mapping = WeightMapping([Rule("layers.0.q_proj.{p}", "q_proj/{p}")])
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = export_peft(d, model, mapping)
      ...     config = json.loads((path / "adapter_config.json").read_text())
      ...
      >>> config["r"], config["lora_alpha"], config["target_modules"]
      (2, 4.0, ['q_proj'])
    """
    modules = _modules(model, mapping)
    tensors, r = _peft_tensors(modules, model_params(model)[0])
    config = _peft_config(modules, r, base_model_name_or_path)
    if jax.process_index() == 0:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_file = safetensors_module().numpy.save_file
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
        (folder / CONFIG).write_text(json.dumps(config, indent=2))
    return Path(path)


def _peft_tensors(modules: list, params: dict) -> tuple[dict[str, np.ndarray], int]:
    """The factors in PEFT's names and layout, and their one rank."""
    with jax.transfer_guard_device_to_host("allow"):
        host = {n: np.asarray(jax.device_get(x)) for n, x in params.items()}
    tensors, ranks = {}, set()
    for a, module, in_first in modules:
        r = _rank(a, params, in_first)
        ranks.add(r)
        fa, fb = host[a.a], host[a.b]
        if in_first:
            fa, fb = fa.reshape(-1, r).T, fb.reshape(r, -1).T
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(fa)
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(fb)
    return tensors, _one(ranks, "rank", "PEFT's config holds one rank.")


def _peft_config(modules: list, r: int, base: str) -> dict[str, Any]:
    alpha = _one({round(a.scale * r, 6) for a, _, _ in modules}, "alpha", "")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": max(a.dropout for a, _, _ in modules),
        "target_modules": sorted({m.rsplit(".", 1)[-1] for _, m, _ in modules}),
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def load_peft(path: str | os.PathLike, model: Any, mapping: WeightMapping) -> Any:
    """Reads PEFT adapters into a model with adapters of the same rank on the
    same modules (`add_lora` with a `LoraConfig` of that rank and targets).

    Raises:
      ValueError: a config that is not LoRA, or whose rank, alpha or adapted
        modules differ from the model's (both named); checked before any
        tensor is read.

    Example:
      >>> import tempfile, equinox as eqx, jax, jax.numpy as jnp
      >>> from pztrain.finetune import (LoraConfig, Rule, WeightMapping, add_lora,
      ...                               export_peft, load_peft)
      ...
      >>> base = {"q_proj": eqx.nn.Linear(4, 4, key=jax.random.key(0))}
      >>> lora = LoraConfig(2, 4.0, "q_proj")
      >>> mapping = WeightMapping([Rule("layers.0.q_proj.{p}", "q_proj/{p}")])
      >>> trained = add_lora(base, lora, jax.random.key(1))
      >>> fresh = add_lora(base, lora, jax.random.key(2))
      >>> with tempfile.TemporaryDirectory() as d:
      ...     loaded = load_peft(export_peft(d, trained, mapping), fresh, mapping)
      ...
      >>> bool(jnp.all(loaded["q_proj"].lora_a == trained["q_proj"].lora_a))
      True
    """
    folder = Path(path)
    config = json.loads((folder / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder / CONFIG} is not a LoRA adapter config.")
    modules = _modules(model, mapping)
    params, rebuild = model_params(model)
    _check_peft(folder, config, modules, params)
    loaded = {}
    with safetensors_module().safe_open(str(folder / WEIGHTS), "numpy") as f:
        for a, module, in_first in modules:
            for name, part in ((a.a, "lora_A"), (a.b, "lora_B")):
                x = f.get_tensor(f"{_PREFIX}{module}.{part}.weight")
                like = params[name]
                x = x.T if in_first else x
                loaded[name] = jax.numpy.asarray(
                    x.reshape(np.shape(like)), dtype=like.dtype
                )
    return rebuild({**params, **loaded})


def _check_peft(folder: Path, config: dict, modules: list, params: dict) -> None:
    with safetensors_module().safe_open(str(folder / WEIGHTS), "numpy") as f:
        names = list(f.keys())
    stored = {n.removeprefix(_PREFIX).rsplit(".lora_", 1)[0] for n in names}
    wanted = {m for _, m, _ in modules}
    if stored != wanted:
        raise ValueError(
            f"The adapters in {folder} are on modules {sorted(stored - wanted)} the "
            f"model has none on, and lack {sorted(wanted - stored)}: add_lora with "
            "targets matching the config's target_modules "
            f"{config.get('target_modules')}."
        )
    a, _, in_first = modules[0]
    r = _rank(a, params, in_first)
    if config["r"] != r:
        raise ValueError(
            f"The adapters in {folder} have rank r={config['r']}; the model's have "
            f"rank {r}. Build them with LoraConfig(rank={config['r']}, ...)."
        )
    alpha = round(a.scale * r, 6)
    if float(config["lora_alpha"]) != alpha:
        raise ValueError(
            f"The adapters in {folder} have lora_alpha={config['lora_alpha']}; the "
            f"model's have alpha {alpha}. Build them with "
            f"LoraConfig(alpha={config['lora_alpha']}, ...)."
        )
