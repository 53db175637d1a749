"""The declared mapping of Hugging Face's Llama checkpoints onto penzai's
Llama-style transformer (`penzai.models.transformer.variants.llamalike_common`),
and its configuration read from (or written as) ``config.json``.

Hugging Face stores each ``Linear`` weight ``(out, in)`` and the attention heads
flattened (``q_proj``: ``(heads * head_dim, embedding)``); penzai's arrays hold
the input axes first and the heads apart (``query.weights``: ``(embedding,
head_groups, query_heads, projection)``). Both use the rotate-half rotary
embedding, so no row permutation is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from pztrain.finetune._load import penzai_skeleton
from pztrain.finetune._mapping import Rule, WeightMapping
from pztrain.finetune._transforms import SplitAxis, Transpose

__all__ = ["hf_llama_config", "llama_config", "llama_mapping", "llama_skeleton"]

_T = (Transpose((1, 0)),)


def _heads(config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The head axes of the query and of the key/value weights."""
    kv, mult = config.num_kv_heads, config.query_head_multiplier
    if mult == 1:
        return (kv,), (kv,)
    if kv == 1:
        return (mult,), ()
    return (kv, mult), (kv,)


def llama_mapping(config: Any, name: str = "transformer") -> WeightMapping:
    """Hugging Face Llama names and layouts ↔ penzai's llama-like transformer.

    Args:
      config: The model's ``LlamalikeTransformerConfig`` (`llama_config`), built
        without a layer stack and with untied embeddings.
      name: The model's name (``build_llamalike_transformer(name=...)``).

    Returns:
      A `WeightMapping` for `load_pretrained`, `export_pretrained` and the PEFT
      adapters.

    Example:
      >>> from pztrain.finetune import llama_config, llama_mapping
      >>> config = llama_config({"hidden_size": 16, "intermediate_size": 32,
      ...     "num_attention_heads": 4, "num_key_value_heads": 2,
      ...     "num_hidden_layers": 2, "vocab_size": 11})
      >>> rule = llama_mapping(config).rules[-4]  # q_proj
      >>> rule.to_target("model.layers.1.self_attn.q_proj.weight")
      'transformer/block_1/attention/query.weights'
    """
    if config.use_layer_stack or config.tie_embedder_and_logits:
        raise ValueError(
            "llama_mapping maps a transformer without a layer stack and with its "
            "own lm_head (use_layer_stack=False, tie_embedder_and_logits=False)."
        )
    q, kv = _heads(config)
    p, nq, nkv = config.projection_dim, len(q) + 1, len(kv) + 1
    head_in = lambda heads, n: (SplitAxis(0, (*heads, p)), Transpose((n, *range(n))))  # noqa: E731
    layer = [  # (Hugging Face name, penzai name, transforms) in a block
        ("input_layernorm", "pre_attention_norm/scale", ()),
        ("post_attention_layernorm", "pre_ffw_norm/scale", ()),
        ("mlp.gate_proj", "mlp/gating_linear", _T),
        ("mlp.up_proj", "mlp/value_linear", _T),
        ("mlp.down_proj", "mlp/out_linear", _T),
        ("self_attn.q_proj", "attention/query", head_in(q, nq)),
        ("self_attn.k_proj", "attention/key", head_in(kv, nkv)),
        ("self_attn.v_proj", "attention/value", head_in(kv, nkv)),
        (
            "self_attn.o_proj",
            "attention/output",
            (SplitAxis(1, (*q, p)), Transpose((*range(1, nq + 1), 0))),
        ),
    ]
    rules = [
        Rule("model.embed_tokens.weight", f"{name}/embedder.embeddings"),
        Rule("model.norm.weight", f"{name}/final_norm/scale.weights"),
        Rule("lm_head.weight", f"{name}/lm_head.weights", _T),
    ]
    for hf, pz_name, transforms in layer:
        rules.append(
            Rule(
                f"model.layers.{{i}}.{hf}.weight",
                f"{name}/block_{{i}}/{pz_name}.weights",
                transforms,
            )
        )
    return WeightMapping(rules, name="llama")


_UNSUPPORTED = ("attention_bias", "mlp_bias")


def _rope(c: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """The rotary base of a configuration, and the rotary settings penzai's
    transformer lacks (by name). transformers 5 writes them in
    ``rope_parameters`` (``rope_type``, ``rope_theta``); earlier versions as
    ``rope_theta`` and ``rope_scaling`` beside the other fields."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10_000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    bad = {} if kind == "default" else {"rope_type": kind}
    if partial not in (None, 1, 1.0):
        bad["partial_rotary_factor"] = partial
    return float(theta), bad


def llama_config(hf_config: Mapping[str, Any], **overrides: Any) -> Any:
    """penzai's ``LlamalikeTransformerConfig`` for a Hugging Face Llama
    ``config.json`` (as a dict; `read_config` reads one).

    The rotary base is read where the saving version of ``transformers`` put
    it: ``rope_parameters["rope_theta"]`` (5.x) or ``rope_theta`` (4.x).

    Args:
      hf_config: The checkpoint's configuration.
      **overrides: Fields to set (``parameter_dtype=jnp.bfloat16``,
        ``activation_dtype=...``).

    Raises:
      ValueError: a feature penzai's llama-like transformer lacks (tied
        embeddings, a RoPE type other than ``"default"`` such as Llama 3's
        scaling, partial rotary embeddings, biases), named.

    Example:
      >>> from pztrain.finetune import llama_config
      >>> config = llama_config({"hidden_size": 16, "intermediate_size": 32,
      ...     "num_attention_heads": 4, "num_key_value_heads": 2,
      ...     "num_hidden_layers": 2, "vocab_size": 11})
      >>> config.num_kv_heads, config.query_head_multiplier, config.projection_dim
      (2, 2, 4)
    """
    from penzai.models.transformer.variants import llamalike_common

    c = dict(hf_config)
    theta, bad = _rope(c)
    bad |= {k: c[k] for k in _UNSUPPORTED if c.get(k)}
    if c.get("tie_word_embeddings"):
        bad["tie_word_embeddings"] = True
    if bad:
        raise ValueError(
            f"This Llama configuration uses {bad}, which penzai's llama-like "
            "transformer does not implement; llama_config cannot build it."
        )
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    fields = dict(
        num_kv_heads=kv,
        query_head_multiplier=heads // kv,
        embedding_dim=c["hidden_size"],
        projection_dim=c.get("head_dim") or c["hidden_size"] // heads,
        mlp_hidden_dim=c["intermediate_size"],
        num_decoder_blocks=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
        rope_wavelength=theta,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        parameter_dtype=jnp.float32,
        activation_dtype=jnp.float32,
    )
    return llamalike_common.LlamalikeTransformerConfig(**{**fields, **overrides})


def hf_llama_config(config: Any) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a penzai llama-like configuration.

    Example:
      >>> from pztrain.finetune import hf_llama_config, llama_config
      >>> hf = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
      ...       "num_hidden_layers": 2, "vocab_size": 11}
      >>> hf_llama_config(llama_config(hf))["num_key_value_heads"]
      4
    """
    heads = config.num_kv_heads * config.query_head_multiplier
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.embedding_dim,
        "intermediate_size": config.mlp_hidden_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.projection_dim,
        "num_hidden_layers": config.num_decoder_blocks,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_wavelength,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def llama_skeleton(config: Any, name: str = "transformer") -> Any:
    """penzai's llama-like transformer for ``config``, its parameters frozen
    and abstract: the target `load_pretrained` fills (no weight computed).

    Example:
      >>> from pztrain.finetune import llama_config, llama_skeleton
      >>> config = llama_config({"hidden_size": 16, "intermediate_size": 32,
      ...     "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 11})
      >>> skeleton = llama_skeleton(config)
      >>> type(skeleton).__name__
      'TransformerLM'
    """
    from penzai.models.transformer.variants import llamalike_common

    build = llamalike_common.build_llamalike_transformer
    return penzai_skeleton(lambda rng: build(config, init_base_rng=rng, name=name))
