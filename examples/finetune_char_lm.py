"""Fine-tuning a pretrained model with LoRA: its weights in, adapters out.

Run: ``python examples/finetune_char_lm.py`` (after ``pip install -e
".[examples,safetensors]"``). Nothing is downloaded, so the example makes its own
"pretrained" model first: the character LM of ``examples/char_lm.py`` trained on
one text (the Python Language Reference topics ``help()`` shows) and exported in
Hugging Face's Llama layout (``model.safetensors`` + ``config.json``), as a
checkpoint from the Hub would be. Then, as for a downloaded checkpoint:

1. **weights in**: `pztrain.finetune.load_pretrained` reads it through the Llama
   mapping into penzai's llama-like transformer, the frozen base in bfloat16;
2. **adapters**: `pztrain.finetune.add_lora` puts rank-8 adapters on the
   attention's query and value projections; the state trains them alone
   (``trainable=is_adapter``), its ``params`` are the adapters and
   `pztrain.save_params` writes them alone;
3. **fine-tuning** on another text (the source code of the standard library's
   ``argparse``, which the model has never read): bits per character on the new
   text before and after, and on the old text (what it forgot);
4. **out**: the adapters in PEFT's layout (``adapter_model.safetensors`` +
   ``adapter_config.json``, named as the checkpoint names its weights), and the
   merged weights under the checkpoint's own names, read back to check they
   give the same bits per character.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz

import pztrain
from pztrain import finetune

_SPEC = importlib.util.spec_from_file_location(
    "char_lm", Path(__file__).with_name("char_lm.py")
)
lm = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lm)


def texts() -> tuple[str, str]:
    """The old text (prose: Python's help topics) and the new one (code)."""
    import argparse as new_text

    return lm.load_text(), inspect.getsource(new_text)


def split(ids: np.ndarray, seq: int, held_out: int = 8192):
    """Train windows (all but the last ``held_out`` characters) and eval ones."""
    return lm.windows(ids[:-held_out], seq, seq // 4), lm.windows(
        ids[-held_out:], seq, seq
    )


LOGITS = jax.jit(lm.logits_of)


def bits_per_char(model, data: dict[str, np.ndarray]) -> float:
    """Cross-entropy on ``data`` in bits per character."""
    logits = LOGITS(pz.freeze_params(model), jnp.asarray(data["tokens"]))
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.asarray(data["targets"])
    )
    return float(loss.mean()) / math.log(2)


def pretrain(vocab, old_ids, steps, seq, batch_size, out: Path) -> Path:
    """The "pretrained" model: char_lm trained on the old text, exported in
    Hugging Face's Llama layout. Returns the checkpoint's directory."""
    train_data, _ = split(old_ids, seq)
    config = lm.model_config(len(vocab))
    state = pztrain.TrainState.initial_state(
        lm.build_model(len(vocab)), optax.adamw(3e-3), jax.random.key(0)
    )
    loader = pztrain.ArrayLoader(train_data, batch_size, seed=0)
    state, _ = pztrain.fit(
        state, lm.TRAIN_STEP, loader, num_steps=steps, progress=False, loggers=[]
    )
    mapping = finetune.llama_mapping(config, name="lm")
    hf_config = finetune.hf_llama_config(config)
    return finetune.export_pretrained(
        out / "pretrained", pz.freeze_params(state.model), mapping, config=hf_config
    )


def finetune_lora(base, new_train, steps, batch_size, rank=8):
    """LoRA on the attention's query and value projections; returns the state."""
    lora = finetune.LoraConfig(
        rank=rank, alpha=2.0 * rank, targets="attention/(query|value)"
    )
    model = finetune.add_lora(base, lora, jax.random.key(1))
    state = pztrain.TrainState.initial_state(
        model, optax.adamw(3e-3), jax.random.key(2), trainable=finetune.is_adapter
    )
    loader = pztrain.ArrayLoader(new_train, batch_size, seed=1)
    state, _ = pztrain.fit(
        state, lm.TRAIN_STEP, loader, num_steps=steps, progress=False, loggers=[]
    )
    return state


def main(
    pretrain_steps: int = 400,
    finetune_steps: int = 200,
    seq: int = 64,
    batch_size: int = 16,
    out: str = "runs/finetune_char_lm",
) -> dict[str, float]:
    """Pretrains, exports, imports, fine-tunes, exports; returns the figures."""
    out_dir = Path(out)
    old_text, new_text = texts()
    vocab = lm.Vocab(old_text + new_text)  # one "tokenizer" for both texts
    old_ids, new_ids = vocab.encode(old_text), vocab.encode(new_text)
    source = pretrain(vocab, old_ids, pretrain_steps, seq, batch_size, out_dir)

    # 1. Weights in, as for a checkpoint from the Hub.
    config = finetune.llama_config(finetune.read_config(source))
    mapping = finetune.llama_mapping(config, name="lm")
    skeleton = finetune.llama_skeleton(config, name="lm")
    base, report = finetune.load_pretrained(
        source, skeleton, mapping, dtype=jnp.bfloat16
    )
    print(f"{report}\n")

    # 2-3. Adapters, trained on the new text.
    new_train, new_eval = split(new_ids, seq)
    _, old_eval = split(old_ids, seq)
    figures = {
        "new_before": bits_per_char(base, new_eval),
        "old_before": bits_per_char(base, old_eval),
    }
    state = finetune_lora(base, new_train, finetune_steps, batch_size)
    figures["new_after"] = bits_per_char(state.model, new_eval)
    figures["old_after"] = bits_per_char(state.model, old_eval)
    adapters = pztrain.save_params(out_dir / "adapters", state, overwrite=True)
    n_params = sum(x.size for x in state.params.values())
    print(f"{len(state.params)} adapter arrays, {n_params:,} numbers: {adapters}")

    # 4. Out: PEFT's layout, and the merged weights under the source's names.
    peft = finetune.export_peft(out_dir / "peft", state.model, mapping)
    print(json.loads((peft / "adapter_config.json").read_text()))
    merged_dir = finetune.export_pretrained(
        out_dir / "merged",
        finetune.merge_lora(state.model),
        mapping,
        config=finetune.hf_llama_config(config),
    )
    merged, _ = finetune.load_pretrained(
        merged_dir, skeleton, mapping, dtype=jnp.bfloat16
    )
    figures["new_merged"] = bits_per_char(merged, new_eval)
    print("bits per character      before  after LoRA  merged, re-read")
    print(
        f"new text (argparse.py)  {figures['new_before']:6.3f}  "
        f"{figures['new_after']:10.3f}  {figures['new_merged']:15.3f}"
    )
    old = f"{figures['old_before']:6.3f}  {figures['old_after']:10.3f}"
    print(f"old text (help topics)  {old}")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="runs/finetune_char_lm")
    args = parser.parse_args()
    main(args.pretrain_steps, args.finetune_steps, args.seq, args.batch_size, args.out)
