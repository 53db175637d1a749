"""Low-rank adapters on chosen linear layers, for penzai v2, equinox and Flax
NNX models: `add_lora`, `merge_lora` and `is_adapter` (the ``trainable=`` that
trains the adapters alone).

penzai's adapters are its own ``penzai.toolshed.lora.LowRankAdapter`` (the
base ``Linear`` kept, ``LoRA_A`` and a zero ``LoRA_B`` beside it), with the
``alpha / rank`` scale and dropout added to its update branch; equinox's and
NNX's are the small layers of `pztrain.finetune._lora_layers`. No library does
all three: qwix intercepts Flax modules only, and penzai ships its own.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from pztrain import partition
from pztrain._tree import path_name
from pztrain.finetune._lora_layers import (
    EqxLoraLinear,
    eqx_lora_linear,
    eqx_merged,
    is_nnx_lora,
    nnx_lora_linear,
    nnx_merged,
)

__all__ = [
    "Adapter",
    "LoraConfig",
    "adapters_of",
    "add_lora",
    "is_adapter",
    "merge_lora",
]

_ADAPTER = re.compile(r"(LoRA_[AB]\.weights|lora_[ab])$")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which linear layers get an adapter, and its shape.

    Attributes:
      rank: The adapter's rank ``r``.
      alpha: The update is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
      targets: A regex searched in each linear layer's weight name (its param
        name: ``"attention/(query|value)"`` for penzai's transformer).
      dropout: The rate of dropout on the adapter's input while training.

    Example:
      >>> from pztrain.finetune import LoraConfig
      >>> LoraConfig(rank=8, alpha=16.0, targets="attention/(query|value)")
      LoraConfig(rank=8, alpha=16.0, targets='attention/(query|value)', dropout=0.0)
    """

    rank: int
    alpha: float
    targets: str
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"LoraConfig: rank is a positive int; got {self.rank!r}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig: dropout is in [0, 1); got {self.dropout}.")
        re.compile(self.targets)


def is_adapter(name: str, value: Any = None) -> bool:
    """``trainable=is_adapter`` trains the adapters alone: the base stays in
    ``model_without_params`` with no gradient or optimizer state.

    Example:
      >>> from pztrain.finetune import is_adapter
      >>> is_adapter("transformer/block_0/attention/query/LoRA_A.weights")
      True
      >>> is_adapter("transformer/block_0/attention/query.weights")
      False
    """
    return _ADAPTER.search(name) is not None


def add_lora(model: Any, config: LoraConfig, rng: jax.Array) -> Any:
    """``model`` with an adapter on each linear layer ``config.targets`` names.

    The adapters are float32, whatever the base's dtype; each starts as a zero
    update. Build the state with ``trainable=is_adapter``.

    Args:
      model: A penzai v2 model (its ``pz.nn.Linear`` layers; dropout reads
        penzai's ``random_stream`` side input), an equinox model (its
        ``eqx.nn.Linear`` layers; dropout when called with ``key=``) or a
        Flax NNX model (its ``nnx.Linear`` layers; a copy is adapted).
      config: A `LoraConfig`.
      rng: A key for the adapters' initial ``A``.

    Raises:
      ValueError: no linear layer's weight name matches ``config.targets``
        (the names are listed).

    Example:
      >>> import equinox as eqx, jax, optax, pztrain
      >>> from pztrain.finetune import LoraConfig, add_lora, is_adapter
      >>> base = {"fc": eqx.nn.Linear(4, 3, key=jax.random.key(0))}
      >>> model = add_lora(base, LoraConfig(2, 4.0, "fc"), jax.random.key(1))
      >>> state = pztrain.TrainState.initial_state(
      ...     model, optax.adam(1e-3), jax.random.key(0), trainable=is_adapter)
      >>> {name: x.shape for name, x in state.params.items()}
      {'fc/lora_a': (2, 4), 'fc/lora_b': (3, 2)}
    """
    family = partition.family_of(model)
    if family == "penzai_v2":
        return _penzai_add(model, config, rng)
    if family == "nnx":
        return _nnx_add(model, config, rng)
    return _eqx_add(model, config, rng)


def _no_target(config: LoraConfig, names: list[str]) -> ValueError:
    shown = ", ".join(map(repr, names[:6])) + (" …" if len(names) > 6 else "")
    return ValueError(
        f"LoraConfig(targets={config.targets!r}) matches no linear layer's weight "
        f"(the names: {shown or 'none'}). Fix the pattern (searched in each name)."
    )


def _keys(rng: jax.Array, n: int) -> list[jax.Array]:
    return list(jax.random.split(rng, max(n, 1)))


def _penzai_add(model: Any, config: LoraConfig, rng: jax.Array) -> Any:
    from penzai import pz
    from penzai.toolshed import lora

    label = lambda lin: str(lin.weights.label)  # noqa: E731
    linears = pz.select(model).at_instances_of(pz.nn.Linear)
    names = [label(x) for x in linears.get_sequence()]
    chosen = linears.where(lambda lin: re.search(config.targets, label(lin)))
    if chosen.count() == 0:
        raise _no_target(config, names)

    def adapt(lin: Any) -> Any:
        name = label(lin).removesuffix(".weights")
        ad = lora.LowRankAdapter.from_linear(lin, name, rng, config.rank)
        branch = ad.sublayers[0]
        update = branch.branches[1]
        scale = pz.nn.ConstantRescale(by=jnp.asarray(config.alpha / config.rank))
        drop = [pz.nn.StochasticDropout(config.dropout)] if config.dropout else []
        update = dataclasses.replace(
            update, sublayers=[*drop, *update.sublayers, scale]
        )
        branches = [branch.branches[0], update]
        return dataclasses.replace(
            ad, sublayers=[dataclasses.replace(branch, branches=branches)]
        )

    return chosen.apply(adapt)


def _eqx_add(model: Any, config: LoraConfig, rng: jax.Array) -> Any:
    is_linear = lambda x: isinstance(x, eqx.nn.Linear)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)
    names = [f"{path_name(p)}/weight" for p, x in flat if is_linear(x)]
    keys, out = iter(_keys(rng, len(names))), []
    for path, x in flat:
        name = f"{path_name(path)}/weight"
        if is_linear(x) and re.search(config.targets, name):
            x = eqx_lora_linear(
                x, name, config.rank, config.alpha, config.dropout, next(keys)
            )
        out.append(x)
    if not any(isinstance(x, EqxLoraLinear) for x in out):
        raise _no_target(config, names)
    return treedef.unflatten(out)


def _nnx_nodes(model: Any, kind: Any) -> list[tuple[tuple[Any, ...], Any]]:
    from flax import nnx

    return [(p, x) for p, x in nnx.iter_graph(model) if kind(x) and p]


def _nnx_set(model: Any, path: tuple[Any, ...], value: Any) -> None:
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _nnx_add(model: Any, config: LoraConfig, rng: jax.Array) -> Any:
    from flax import nnx

    model = nnx.clone(model)
    linears = _nnx_nodes(model, lambda x: isinstance(x, nnx.Linear))
    names = ["/".join(map(str, p)) + "/kernel" for p, _ in linears]
    chosen = [(p, x, n) for (p, x), n in zip(linears, names, strict=True)]
    chosen = [c for c in chosen if re.search(config.targets, c[2])]
    if not chosen:
        raise _no_target(config, names)
    for (path, lin, name), key in zip(chosen, _keys(rng, len(chosen)), strict=True):
        layer = nnx_lora_linear(
            lin, name, config.rank, config.alpha, config.dropout, key
        )
        _nnx_set(model, path, layer)
    return model


def merge_lora(model: Any) -> Any:
    """``model`` with each adapter merged into its base weight (in the base's
    dtype) and removed: the structure `add_lora` was given, ready for
    `export_pretrained`. A zero adapter leaves the weight bit for bit.

    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> from pztrain.finetune import LoraConfig, add_lora, merge_lora
      >>> base = {"fc": eqx.nn.Linear(4, 3, key=jax.random.key(0))}
      >>> model = add_lora(base, LoraConfig(2, 4.0, "fc"), jax.random.key(1))
      >>> merged = merge_lora(model)
      >>> type(merged["fc"]).__name__
      'Linear'
      >>> bool(jnp.all(merged["fc"].weight == base["fc"].weight))
      True
    """
    family = partition.family_of(model)
    if family == "penzai_v2":
        return _penzai_merge(model)
    if family == "nnx":
        from flax import nnx

        model = nnx.clone(model)
        for path, layer in _nnx_nodes(model, is_nnx_lora):
            _nnx_set(model, path, nnx_merged(layer))
        return model
    is_lora = lambda x: isinstance(x, EqxLoraLinear)  # noqa: E731
    return jax.tree.map(
        lambda x: eqx_merged(x) if is_lora(x) else x, model, is_leaf=is_lora
    )


def _penzai_merge(model: Any) -> Any:
    from penzai import pz
    from penzai.toolshed import lora

    def merge(ad: Any) -> Any:
        base, update = ad.sublayers[0].branches
        lin = base.sublayers[0]
        parts = [x for x in update.sublayers if isinstance(x, pz.nn.Linear)]
        scale = [x for x in update.sublayers if isinstance(x, pz.nn.ConstantRescale)]
        a, b = parts[0].weights.value, parts[1].weights.value
        w = lin.weights.value
        ins, outs = list(lin.input_axes), list(lin.output_axes)
        low = [n for n in a.named_shape if n not in ins][0]
        a_data = a.order_as(*ins, low).unwrap(*ins, low)
        b_data = b.order_as(low, *outs).unwrap(low, *outs)
        delta = jnp.tensordot(a_data, b_data, axes=1)
        if scale:
            delta = delta * scale[0].by
        names = list(w.named_shape)
        w_data = w.order_as(*ins, *outs).unwrap(*ins, *outs)
        new = pz.nx.wrap((w_data + delta).astype(w_data.dtype)).tag(*ins, *outs)
        return dataclasses.replace(
            lin, weights=_with_value(lin.weights, new.order_as(*names))
        )

    return pz.select(model).at_instances_of(lora.LowRankAdapter).apply(merge)


def _with_value(param: Any, value: Any) -> Any:
    """A penzai parameter (a ``pz.Parameter`` or a frozen value) holding ``value``."""
    from penzai import pz

    if isinstance(param, pz.Parameter):
        return pz.Parameter(value=value, label=param.label, metadata=param.metadata)
    return dataclasses.replace(param, value=value)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter of a model: its base weight's param name, its two factors'
    param names, its scale (``alpha / rank``) and its dropout rate."""

    base: str
    a: str
    b: str
    scale: float
    dropout: float = 0.0


def adapters_of(model: Any) -> list[Adapter]:
    """The adapters `add_lora` put into ``model``, in the model's order."""
    family = partition.family_of(model)
    if family == "penzai_v2":
        return _penzai_adapters(model)
    if family == "nnx":
        nodes = _nnx_nodes(model, is_nnx_lora)
        return [
            Adapter(
                x.base_name,
                f"{_join(p)}/lora_a",
                f"{_join(p)}/lora_b",
                x.scale,
                x.dropout.rate,
            )
            for p, x in nodes
        ]
    is_lora = lambda x: isinstance(x, EqxLoraLinear)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_lora)[0]
    return [
        Adapter(
            x.base_name,
            f"{path_name(p)}/lora_a",
            f"{path_name(p)}/lora_b",
            x.scale,
            x.dropout,
        )
        for p, x in flat
        if is_lora(x)
    ]


def _join(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path))


def _penzai_adapters(model: Any) -> list[Adapter]:
    from penzai import pz
    from penzai.toolshed import lora

    out = []
    for ad in pz.select(model).at_instances_of(lora.LowRankAdapter).get_sequence():
        base, update = ad.sublayers[0].branches
        parts = [x for x in update.sublayers if isinstance(x, pz.nn.Linear)]
        scale = [x for x in update.sublayers if isinstance(x, pz.nn.ConstantRescale)]
        drop = [x for x in update.sublayers if isinstance(x, pz.nn.StochasticDropout)]
        out.append(
            Adapter(
                str(base.sublayers[0].weights.label),
                str(parts[0].weights.label),
                str(parts[1].weights.label),
                float(scale[0].by) if scale else 1.0,
                drop[0].drop_rate if drop else 0.0,
            )
        )
    return out
