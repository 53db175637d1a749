"""LoRA layers for equinox and Flax NNX: a linear layer's own arrays (under
their own names) plus ``lora_a`` and ``lora_b``, in PEFT's layout for equinox
(``(rank, in)``, ``(out, rank)``, as ``eqx.nn.Linear`` stores ``(out, in)``)
and in NNX's for NNX (``(in, rank)``, ``(rank, out)``, as its kernel is
``(in, out)``). ``lora_b`` starts at zero, so a fresh adapter leaves the model's
outputs as they were. The output is ``base(x) + alpha / rank * b(a(dropout(x)))``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

__all__ = [
    "EqxLoraLinear",
    "eqx_lora_linear",
    "eqx_merged",
    "is_nnx_lora",
    "nnx_lora_linear",
    "nnx_merged",
]


def _a_init(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """PEFT's default for A: Kaiming-uniform with a = sqrt(5)."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


class EqxLoraLinear(eqx.Module):
    """An ``eqx.nn.Linear`` with a low-rank adapter.

    Attributes:
      weight: The base weight ``(out, in)`` (frozen: train with
        ``trainable=is_adapter``).
      bias: The base bias, or ``None``.
      lora_a: ``(rank, in)``, float32.
      lora_b: ``(out, rank)``, float32, zero at first.
      scale: ``alpha / rank``.
      dropout: The rate applied to the adapter's input when called with a key.
      base_name: The base weight's param name in the model the adapter was
        added to (what PEFT names the adapter after).
    """

    weight: jax.Array
    bias: jax.Array | None
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    base_name: str = eqx.field(static=True)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        y = self.weight @ x
        if self.bias is not None:
            y = y + self.bias
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0)
        return y + self.scale * (self.lora_b @ (self.lora_a @ x)).astype(y.dtype)


def eqx_lora_linear(
    linear: Any, name: str, rank: int, alpha: float, dropout: float, key: jax.Array
) -> EqxLoraLinear:
    out, n_in = linear.weight.shape
    return EqxLoraLinear(
        weight=linear.weight,
        bias=linear.bias,
        lora_a=_a_init(key, (rank, n_in), n_in),
        lora_b=jnp.zeros((out, rank), jnp.float32),
        scale=alpha / rank,
        dropout=dropout,
        base_name=name,
    )


def eqx_merged(layer: EqxLoraLinear) -> Any:
    """The ``eqx.nn.Linear`` with the adapter merged into its weight."""
    delta = layer.scale * (layer.lora_b @ layer.lora_a)
    weight = (layer.weight + delta).astype(layer.weight.dtype)
    n_out, n_in = weight.shape
    linear = eqx.nn.Linear(
        n_in, n_out, use_bias=layer.bias is not None, key=jax.random.key(0)
    )
    linear = eqx.tree_at(lambda m: m.weight, linear, weight)
    if layer.bias is not None:
        linear = eqx.tree_at(lambda m: m.bias, linear, layer.bias)
    return linear


@functools.cache
def _nnx_class() -> type:
    from flax import nnx

    class NnxLoraLinear(nnx.Module):
        """An ``nnx.Linear``'s kernel and bias (same names) with an adapter."""

        def __init__(self, linear, name, rank, alpha, dropout, key) -> None:
            n_in, n_out = linear.kernel.shape
            self.kernel, self.bias = linear.kernel, linear.bias
            self.lora_a = nnx.Param(_a_init(key, (rank, n_in), n_in).T)
            self.lora_b = nnx.Param(jnp.zeros((rank, n_out), jnp.float32))
            self.dropout = nnx.Dropout(dropout, rngs=nnx.Rngs(dropout=key))
            self.scale, self.base_name = alpha / rank, name

        def __call__(self, x: jax.Array) -> jax.Array:
            y = x @ self.kernel[...]
            if self.bias is not None:
                y = y + self.bias[...].reshape((1,) * (y.ndim - 1) + (-1,))
            lora = self.dropout(x) @ self.lora_a[...] @ self.lora_b[...]
            return y + (self.scale * lora).astype(y.dtype)

    return NnxLoraLinear


def nnx_lora_linear(
    linear: Any, name: str, rank: int, alpha: float, dropout: float, key: jax.Array
) -> Any:
    """An NNX module holding ``linear``'s kernel and bias (same names) and an
    adapter (``lora_a`` ``(in, rank)``, ``lora_b`` ``(rank, out)``)."""
    return _nnx_class()(linear, name, rank, alpha, dropout, key)


def is_nnx_lora(x: Any) -> bool:
    """An NNX LoRA layer (flax already imported when one exists)."""
    return type(x).__name__ == "NnxLoraLinear" and isinstance(x, _nnx_class())


def nnx_merged(layer: Any) -> Any:
    """An ``nnx.Linear`` with the adapter merged into its kernel."""
    from flax import nnx

    kernel = layer.kernel[...]
    delta = layer.scale * (layer.lora_a[...] @ layer.lora_b[...])
    n_in, n_out = kernel.shape
    has_bias = layer.bias is not None
    linear = nnx.Linear(
        n_in, n_out, use_bias=has_bias, param_dtype=kernel.dtype, rngs=nnx.Rngs(0)
    )
    linear.kernel = nnx.Param((kernel + delta).astype(kernel.dtype))
    if has_bias:
        linear.bias = nnx.Param(layer.bias[...])
    return linear
