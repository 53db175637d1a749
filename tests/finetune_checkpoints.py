"""Small checkpoints in Hugging Face's Llama layout, written by the tests (no
downloads), and a NumPy forward pass of Llama written from its published
semantics (rotate-half rotary, grouped-query heads, RMSNorm, SwiGLU, PyTorch's
``(out, in)`` weights): the independent check of the import mapping."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from penzai import pz

from pztrain.finetune import llama_config, llama_skeleton
from pztrain.finetune._hf import write_checkpoint

HF_CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 11,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def llama_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    e, n, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    p = e // h
    shapes = {
        "model.embed_tokens.weight": (v, e),
        "model.norm.weight": (e,),
        "lm_head.weight": (v, e),
    }
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (e,),
            layer + "post_attention_layernorm.weight": (e,),
            layer + "self_attn.q_proj.weight": (h * p, e),
            layer + "self_attn.k_proj.weight": (kv * p, e),
            layer + "self_attn.v_proj.weight": (kv * p, e),
            layer + "self_attn.o_proj.weight": (e, h * p),
            layer + "mlp.gate_proj.weight": (n, e),
            layer + "mlp.up_proj.weight": (n, e),
            layer + "mlp.down_proj.weight": (e, n),
        }
    return shapes


def llama_tensors(c: dict = HF_CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in llama_shapes(c).items():
        scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5
        base = 1.0 if len(shape) == 1 else 0.0
        out[name] = (base + scale * rng.normal(size=shape)).astype(np.float32)
    return out


def write_llama(
    folder: Path, c: dict = HF_CONFIG, *, shard_bytes: int | None = None, seed=0
) -> dict[str, np.ndarray]:
    tensors = llama_tensors(c, seed)
    write_checkpoint(folder, tensors, config=c, max_shard_bytes=shard_bytes)
    return tensors


def abstract_llama(c: dict = HF_CONFIG, **overrides):
    """The penzai model for ``c``, frozen and abstract (no weights computed)."""
    return llama_skeleton(llama_config(c, **overrides))


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):  # x: (heads, seq, dim), rotate-half
    d, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = (
        np.cos(np.concatenate([ang, ang], -1)),
        np.sin(np.concatenate([ang, ang], -1)),
    )
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def llama_logits(w: dict, tokens: np.ndarray, c: dict = HF_CONFIG) -> np.ndarray:
    """Llama's logits for one sequence of token ids, in float64 NumPy."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    e, eps, theta = c["hidden_size"], c["rms_norm_eps"], c["rope_theta"]
    p, t = e // h, len(tokens)
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(c["num_hidden_layers"]):
        lw = {
            k.split(f"layers.{i}.")[1]: v for k, v in w.items() if f"layers.{i}." in k
        }
        y = _rms(x, lw["input_layernorm.weight"], eps)
        q = (y @ lw["self_attn.q_proj.weight"].T).reshape(t, h, p).transpose(1, 0, 2)
        k = (y @ lw["self_attn.k_proj.weight"].T).reshape(t, kv, p).transpose(1, 0, 2)
        v = (y @ lw["self_attn.v_proj.weight"].T).reshape(t, kv, p).transpose(1, 0, 2)
        q, k = _rope(q, theta), _rope(k, theta)
        k, v = np.repeat(k, h // kv, axis=0), np.repeat(v, h // kv, axis=0)
        a = q @ k.transpose(0, 2, 1) / np.sqrt(p) + mask
        a = np.exp(a - a.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(t, h * p)
        x = x + o @ lw["self_attn.o_proj.weight"].T
        y = _rms(x, lw["post_attention_layernorm.weight"], eps)
        g = y @ lw["mlp.gate_proj.weight"].T
        u = y @ lw["mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ lw["mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


def penzai_logits(model, tokens: np.ndarray) -> np.ndarray:
    out = model(pz.nx.wrap(jax.numpy.asarray(tokens)).tag("seq"))
    return np.asarray(out.untag("seq", "vocabulary").unwrap())
