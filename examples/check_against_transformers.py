"""Checks `pztrain.finetune` against Hugging Face's own libraries.

Extra requirements, beyond pztrain's (not installed by any of its extras):
``torch``, ``transformers`` (4.46 or newer, 5.x included) and ``peft``. Make an
environment of their own for them, e.g.::

    python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install -e ".[safetensors]" torch transformers peft
    /tmp/hfvenv/bin/python examples/check_against_transformers.py

(PyPI's ``torch`` for Linux brings CUDA libraries; PyTorch's CPU wheels are
smaller.) Nothing is downloaded: the script builds a tiny random
``LlamaForCausalLM`` with ``transformers`` and then, with pztrain:

1. imports its ``save_pretrained`` checkpoint (safetensors, ``config.json``)
   through `pztrain.finetune.llama_mapping` into penzai's llama-like
   transformer and compares the logits of a batch of tokens;
2. adds LoRA adapters to every projection, trains them a few steps, exports
   them with `pztrain.finetune.export_peft`, loads them onto the
   ``transformers`` model with ``peft.PeftModel.from_pretrained`` and compares
   the logits again;
3. exports the merged weights with `pztrain.finetune.export_pretrained`, loads
   them with ``LlamaForCausalLM.from_pretrained`` and compares once more.

It prints the largest absolute difference of the logits at each point and exits
with status 1 if one exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz

import pztrain
from pztrain import finetune

EXTRAS = ("torch", "transformers", "peft")
TARGETS = r"attention/(query|key|value|output)|mlp/(gating|value|out)_linear"


def require_extras() -> None:
    """Exits with a message naming the missing packages, if any."""
    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"check_against_transformers.py needs {', '.join(missing)} (not "
            "pztrain's dependencies). Install them in an environment of their "
            f"own: pip install {' '.join(missing)}"
        )


def hf_llama(folder: Path, seed: int):
    """A tiny random ``LlamaForCausalLM`` saved in ``folder``: the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,  # neither default of pztrain's reading
        rope_theta=500_000.0,
        initializer_range=0.2,  # logits far from uniform
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def pz_logits(model, tokens: np.ndarray) -> np.ndarray:
    out = model(pz.nx.wrap(jnp.asarray(tokens)).tag("batch", "seq"))
    return np.asarray(out.untag("batch", "seq", "vocabulary").unwrap())


def lm_loss(*, model, state, rng, tokens):
    logits = model(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq"))
    logits = logits.untag("batch", "seq", "vocabulary").unwrap()
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return loss.mean(), state, {"loss": loss.mean()}


def fine_tune(base, steps: int, tokens: np.ndarray):
    """LoRA on every projection of ``base``, trained ``steps`` steps."""
    lora = finetune.LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    model = finetune.add_lora(base, lora, jax.random.key(1))
    state = pztrain.TrainState.initial_state(
        model, optax.adam(3e-2), jax.random.key(2), trainable=finetune.is_adapter
    )
    state, history = pztrain.fit(
        state,
        pztrain.build_train_step(lm_loss),
        [{"tokens": jnp.asarray(tokens)}] * steps,
        num_steps=steps,
        log_every=steps,
        progress=False,
        loggers=[],
    )
    return state, history.series("loss")[1][-1]


def main(steps: int = 10, seed: int = 0, out: str | None = None) -> dict[str, float]:
    """The checks; returns the largest absolute differences of the logits."""
    require_extras()
    import peft
    import transformers

    work = Path(out or tempfile.mkdtemp())
    hf = hf_llama(work / "hf", seed)
    tokens = np.random.default_rng(seed).integers(0, 64, (4, 16))
    print(f"transformers {transformers.__version__}, peft {peft.__version__}")

    config = finetune.llama_config(finetune.read_config(work / "hf"))
    mapping = finetune.llama_mapping(config)
    base, report = finetune.load_pretrained(
        work / "hf", finetune.llama_skeleton(config), mapping
    )
    print(str(report).splitlines()[0])
    want = hf_logits(hf, tokens)
    diffs = {"import": float(np.abs(pz_logits(base, tokens) - want).max())}
    print(f"imported model vs transformers: max |logits diff| {diffs['import']:.2e}")

    state, loss = fine_tune(base, steps, tokens)
    ours = pz_logits(state.model, tokens)
    finetune.export_peft(work / "peft", state.model, mapping)
    adapted = peft.PeftModel.from_pretrained(hf, str(work / "peft")).eval()
    diffs["peft"] = float(np.abs(ours - hf_logits(adapted, tokens)).max())
    moved = float(np.abs(ours - want).max())
    print(
        f"after {steps} LoRA steps (loss {loss:.3f}; the logits moved by up to "
        f"{moved:.2f}): pztrain vs PeftModel.from_pretrained: max |logits diff| "
        f"{diffs['peft']:.2e}"
    )

    finetune.export_pretrained(
        work / "merged",
        finetune.merge_lora(state.model),
        mapping,
        config=finetune.hf_llama_config(config),
    )
    merged = transformers.LlamaForCausalLM.from_pretrained(work / "merged").eval()
    diffs["merged"] = float(np.abs(ours - hf_logits(merged, tokens)).max())
    print(
        "merged weights, LlamaForCausalLM.from_pretrained vs pztrain's adapted "
        f"model: max |logits diff| {diffs['merged']:.2e}"
    )
    return diffs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out", default=None, help="keep the files here")
    args = parser.parse_args()
    diffs = main(args.steps, args.seed, args.out)
    bad = {k: v for k, v in diffs.items() if not v <= args.tolerance}
    if bad:
        sys.exit(f"Differences above the tolerance {args.tolerance:g}: {bad}")
    print(f"all within {args.tolerance:g}")
