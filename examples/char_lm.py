"""A character-level language model: penzai's llamalike transformer, tiny.

Run: ``python examples/char_lm.py`` (after ``pip install -e ".[examples]"``).
Nothing is downloaded: the text is the Python Language Reference topics that
``help()`` shows, from the standard library's ``pydoc_data.topics`` (79
topics, about 465k characters, 103 distinct; every CPython install ships it).
The first 90% trains; 16k characters of the last 10% measure bits per character.

It trains a 2-block llamalike transformer (width 64, 4 heads, context 64) with
`pztrain.fit`, evaluates bits per character (cross-entropy / ln 2) on the held
out text, checkpoints with `pztrain.Checkpoints` and ``resume=True`` (run it
again with a larger ``--steps`` and it continues where it stopped, its learning
rate schedule stretched to the new total), then loads
the trained params into a freshly built model with `pztrain.load_params` and
greedily samples ~100 characters from a prompt.

While it trains, an evaluation in Python (`pztrain.Evaluation` with a function
of the state) samples 100 characters at each evaluation (``--sample-every N``:
every N steps; 0: never): the run's loggers record them as text, in
``RUN_DIR/media.jsonl`` (`pztrain.loggers.read_media` reads it back) and in
TensorBoard's Text tab with a `pztrain.TensorBoardLogger`.

With ``--data-dir DIR`` (needs ``pip install "pztrain[data]"``) the training
text is read from disk instead of memory: the first run writes its paragraphs
once to ``DIR/train.array_record`` (one record each, UTF-8), and training reads
them through grain: shuffled each epoch, encoded, packed into sequences of
``seq + 1`` characters (grain's ``ConcatThenSplitIterDataset``: paragraphs of
any length end to end, cut at fixed lengths) and batched. That pipeline is a
grain ``IterDataset``, read in order: `pztrain.fit` keeps its iterator state
with each checkpoint, so a resumed run goes on with the very next batch.
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

import pztrain

PROMPT = "The "


def load_text() -> str:
    """The text of ``help()`` 's topics, from the standard library: no download."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


class Vocab:
    """Characters ↔ integer ids, from the characters a text uses."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.ids[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def windows(ids: np.ndarray, seq: int, stride: int) -> dict[str, np.ndarray]:
    """Next-character pairs: ``tokens`` and ``targets`` (shifted by one)."""
    starts = np.arange(0, len(ids) - seq - 1, stride)
    rows = ids[starts[:, None] + np.arange(seq + 1)]
    return {"tokens": rows[:, :-1], "targets": rows[:, 1:]}


def model_config(vocab_size: int):
    """A 2-block llamalike transformer, width 64, 4 heads (about 120k params)."""
    return llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=4,
        query_head_multiplier=1,
        embedding_dim=64,
        projection_dim=16,
        mlp_hidden_dim=192,
        num_decoder_blocks=2,
        vocab_size=vocab_size,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )


def build_model(vocab_size: int, seed: int = 0):
    """The transformer of `model_config`, its weights drawn from ``seed``."""
    return llamalike_common.build_llamalike_transformer(
        model_config(vocab_size), init_base_rng=jax.random.key(seed), name="lm"
    )


def logits_of(model, tokens: jax.Array) -> jax.Array:
    """``[batch, seq]`` ids → ``[batch, seq, vocab]`` logits (positions 0, 1, …)."""
    out = model(pz.nx.wrap(tokens).tag("batch", "seq"))
    return out.untag("batch", "seq", "vocabulary").unwrap()


def _metrics(model, tokens, targets):
    logits = logits_of(model, tokens)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, {"loss": loss, "bits_per_char": loss / math.log(2)}


def loss_fn(*, model, state, rng, tokens, targets):
    """Next-character cross-entropy (penzai's loss-function contract)."""
    del rng
    loss, aux = _metrics(model, tokens, targets)
    return loss, state, aux


def eval_fn(*, model, state, rng, tokens, targets):
    del state, rng
    return _metrics(model, tokens, targets)[1]


# Built once: a second run in the same process reuses the compiled steps.
TRAIN_STEP = pztrain.build_train_step(loss_fn)
EVAL_STEP = pztrain.build_eval_step(eval_fn)


@functools.partial(jax.jit, static_argnames=("known", "length", "seq"))
def sample_ids(model, buffer, key, temperature, *, known, length, seq):
    """``buffer[known : known + length]`` filled, one character at a time.

    One jitted loop (compiled once per prompt length, ``length`` and ``seq``):
    the model sees the last ``seq`` characters (the context it was trained
    on; causal attention makes the padding after them harmless). A
    ``temperature`` of 0 takes the most likely character, else one drawn from
    the softmax of the logits divided by it (a traced value: no recompile).
    """

    def body(t, buffer):
        n = known + t  # characters known so far
        lo = jnp.maximum(n - seq, 0)
        window = jax.lax.dynamic_slice(buffer, (lo,), (seq,))
        logits = logits_of(model, window[None])[0, n - lo - 1]
        scaled = logits / jnp.maximum(temperature, 1e-6)
        drawn = jax.random.categorical(jax.random.fold_in(key, t), scaled)
        next_id = jnp.where(temperature > 0, drawn, jnp.argmax(logits))
        return buffer.at[n].set(next_id.astype(jnp.int32))

    return jax.lax.fori_loop(0, length, body, buffer)


def sample(
    model, vocab: Vocab, prompt: str, length: int, seq: int, temperature=0.0, key=None
) -> str:
    """``length`` characters after ``prompt``: the most likely ones
    (``temperature=0``) or drawn at ``temperature`` with ``key``."""
    start = vocab.encode(prompt)
    buffer = np.zeros(max(len(start) + length, seq), np.int32)
    buffer[: len(start)] = start
    key = jax.random.key(0) if key is None else key
    frozen = pz.freeze_params(model)  # values, not mutable Parameters
    out = sample_ids(
        frozen, buffer, key, temperature, known=len(start), length=length, seq=seq
    )
    return vocab.decode(np.asarray(out[len(start) : len(start) + length]))


def greedy_sample(model, vocab: Vocab, prompt: str, length: int, seq: int) -> str:
    """``length`` characters after ``prompt``, each the most likely next one."""
    return sample(model, vocab, prompt, length, seq)


def sample_evaluation(vocab: Vocab, seq: int, every: int, temperature: float = 0.8):
    """An evaluation in Python: every ``every`` steps, 100 characters sampled
    after `PROMPT` from the model being trained, logged as text (``fit``'s
    loggers record it: ``media.jsonl`` in the run directory, TensorBoard's
    Text tab …) under ``eval/samples/text``. The key is a function of the
    step, so a resumed run samples what the uninterrupted one did."""

    def samples(state: pztrain.TrainState) -> dict[str, str]:
        key = jax.random.fold_in(jax.random.key(1), state.step)
        text = sample(state.model, vocab, PROMPT, 100, seq, temperature, key)
        return {"text": PROMPT + text}

    return pztrain.Evaluation("samples", samples, every=every)


def prepare(seq: int):
    """The vocabulary, and train / eval windows (first 90% / last 10%).

    Evaluation reads the first 16k held-out characters (evaluating all 46k at
    every eval would cost a tenth of the run, and most of a short one).
    """
    text = load_text()
    vocab = Vocab(text)
    ids = vocab.encode(text)
    cut = int(0.9 * len(ids))
    held_out = ids[cut : cut + 16_384 + 1]
    return vocab, windows(ids[:cut], seq, seq // 4), windows(held_out, seq, seq)


def write_paragraphs(data_dir) -> Path:
    """The first 90% of the text (the training part), written once to
    ``data_dir/train.array_record``: one record per paragraph, UTF-8."""
    from array_record.python.array_record_module import ArrayRecordWriter

    path = Path(data_dir) / "train.array_record"
    if path.exists():
        return path
    text = load_text()
    train_text = text[: int(0.9 * len(text))]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = ArrayRecordWriter(str(partial), "group_size:1")
    for paragraph in train_text.split("\n\n"):  # the separators go back below
        writer.write((paragraph + "\n\n").encode())
    writer.close()
    partial.rename(path)  # a run killed while writing leaves no half file
    return path


def disk_data(path, vocab: Vocab, seq: int, batch_size: int, seed: int = 0):
    """Batches of packed sequences from the paragraphs on disk: a grain
    ``IterDataset`` (shuffled paragraphs, a new order each epoch; encoded;
    concatenated and cut into ``seq + 1`` characters; batched)."""
    import grain

    source = grain.sources.ArrayRecordDataSource([str(path)])
    paragraphs = grain.MapDataset.source(source).shuffle(seed=seed).repeat()
    ids = paragraphs.map(lambda record: {"ids": vocab.encode(record.decode())})
    packed = grain.experimental.ConcatThenSplitIterDataset(
        ids.to_iter_dataset(), length_struct={"ids": seq + 1}
    )
    pairs = packed.map(lambda e: {"tokens": e["ids"][:-1], "targets": e["ids"][1:]})
    return pairs.batch(batch_size, drop_remainder=True)


def eval_loader(eval_data):
    """All held-out windows as one batch: one shape, one compile."""
    size = len(eval_data["tokens"])
    return pztrain.ArrayLoader(eval_data, size, shuffle=False)


def train(
    steps,
    seq,
    run_dir,
    batch_size=16,
    progress=True,
    seed=0,
    data_dir=None,
    sample_every=None,
):
    """Trains (or resumes) the run in ``run_dir``, from memory or from the
    paragraphs in ``data_dir``, sampling text every ``sample_every`` steps
    (default: at each evaluation; 0: never); returns (state, history)."""
    vocab, train_data, eval_data = prepare(seq)
    if data_dir is None:
        train_batches = pztrain.ArrayLoader(train_data, batch_size, seed=seed)
    else:
        path = write_paragraphs(data_dir)
        train_batches = disk_data(path, vocab, seq, batch_size, seed)
    model = build_model(len(vocab), seed)
    warmup = min(50, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, steps)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=schedule),
    )
    state = pztrain.TrainState.initial_state(model, optimizer, jax.random.key(seed))
    eval_every = max(steps // 4, 1)
    sample_every = eval_every if sample_every is None else sample_every
    samples = [sample_evaluation(vocab, seq, sample_every)] if sample_every else []
    state, history = pztrain.fit(
        state,
        TRAIN_STEP,
        train_batches,
        num_steps=steps,
        eval_step=EVAL_STEP,
        eval_data=eval_loader(eval_data),
        eval_every=eval_every,
        evaluations=samples,  # text sampled on the host, logged as text
        log_every=min(50, eval_every),
        checkpoints=pztrain.Checkpoints(
            Path(run_dir) / "ckpt", every_steps=eval_every, keep_last=2
        ),
        resume=True,  # a checkpoint in run_dir: continue from it
        run_dir=run_dir,
        hparams={
            "steps": steps,
            "seq": seq,
            "batch_size": batch_size,
            "from_disk": data_dir is not None,
            "sample_every": sample_every,
        },
        progress=progress,
    )
    return state, history


def main(
    steps: int = 600,
    seq: int = 64,
    run_dir: str = "runs/char_lm",
    batch_size: int = 16,
    progress: bool = True,
    seed: int = 0,
    data_dir: str | None = None,
    sample_every: int | None = None,
) -> tuple[float, str]:
    """Trains, evaluates, reloads and samples; returns (eval bits/char, sample)."""
    state, _ = train(
        steps, seq, run_dir, batch_size, progress, seed, data_dir, sample_every
    )
    vocab, _, eval_data = prepare(seq)
    result = pztrain.evaluate(state, EVAL_STEP, eval_loader(eval_data))
    bits = result["bits_per_char"]
    print(
        f"step {int(state.step)}: eval {bits:.3f} bits/char (uniform: "
        f"{math.log2(len(vocab)):.3f} over {len(vocab)} characters)"
    )

    # Inference: a model built from code, with the newest checkpoint's params.
    model = pztrain.load_params(Path(run_dir) / "ckpt", build_model(len(vocab)))
    sample = greedy_sample(model, vocab, PROMPT, 100, seq)
    print(f"greedy sample:\n{PROMPT}{sample}")
    return bits, sample


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="total steps")
    parser.add_argument("--seq", type=int, default=64, help="context length")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-dir", default="runs/char_lm")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--data-dir", help="train from the text's paragraphs on disk (written once)"
    )
    parser.add_argument(
        "--sample-every",
        type=int,
        help="steps between text samples (default: at each evaluation; 0: none)",
    )
    args = parser.parse_args()
    main(
        args.steps,
        args.seq,
        args.run_dir,
        args.batch_size,
        not args.no_progress,
        data_dir=args.data_dir,
        sample_every=args.sample_every,
    )
