"""examples/char_lm.py, reduced: trains, resumes, reloads and samples."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from penzai import pz

import pztrain
from pztrain.loggers import read_media
from pztrain.records import History

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "char_lm.py"


def _load():
    spec = importlib.util.spec_from_file_location("char_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_char_lm_trains_resumes_reloads_and_samples(tmp_path):
    lm = _load()
    run_dir = tmp_path / "run"
    seq = 32

    # First half: 30 steps, checkpointed; the checkpoint holds the state's params.
    state, _ = lm.train(30, seq, run_dir, batch_size=16, progress=False)
    assert int(state.step) == 30
    vocab, _, eval_data = lm.prepare(seq)
    fresh = lm.build_model(len(vocab), seed=1)  # other initial weights
    loaded = pztrain.load_params(run_dir / "ckpt", fresh)
    tokens = eval_data["tokens"][:8]
    logits = jax.jit(lm.logits_of)  # one compile for the three models

    def logits_of(model):
        return np.asarray(logits(pz.freeze_params(model), tokens))

    expected = logits_of(state.model)
    assert not np.array_equal(logits_of(fresh), expected)
    np.testing.assert_array_equal(logits_of(loaded), expected)

    # Second half: the same run directory, 60 steps in all: resumes at 30.
    bits, sample = lm.main(steps=60, seq=seq, run_dir=str(run_dir), progress=False)
    steps, _ = History.from_jsonl(run_dir).series("loss")
    assert steps == sorted(set(steps)) and steps[-1] == 60 and 30 in steps
    assert sorted(int(p.name) for p in (run_dir / "ckpt").iterdir())[-1] == 60

    assert bits < math.log2(len(vocab)) - 1.5  # uniform guessing: log2(vocab)
    assert isinstance(sample, str) and len(sample) == 100
    assert set(sample) <= set(vocab.chars)

    # Text sampled at each evaluation, through the loggers: 7, 14, 21, 28 and
    # the end (30) by the first run, 45 and 60 by the resumed one.
    media = read_media(run_dir)
    eval_steps, _ = History.from_jsonl(run_dir).series("bits_per_char", "eval")
    assert [m["step"] for m in media] == eval_steps == [7, 14, 21, 28, 30, 45, 60]
    assert {m["key"] for m in media} == {"eval/samples/text"}
    for m in media:
        assert m["text"].startswith(lm.PROMPT) and len(m["text"]) == 104
        assert set(m["text"]) <= set(vocab.chars)


def test_char_lm_sampler_compiles_once_and_draws_from_its_key():
    lm = _load()
    vocab, _, _ = lm.prepare(32)
    models = [lm.build_model(len(vocab), seed) for seed in (0, 1)]
    key = jax.random.key(3)
    drawn = [lm.sample(m, vocab, "The ", 40, 32, 0.8, key) for m in models]
    assert drawn[0] == lm.sample(models[0], vocab, "The ", 40, 32, 0.8, key)
    assert drawn[0] != lm.sample(models[0], vocab, "The ", 40, 32, 0.8, key=None)
    greedy = lm.greedy_sample(models[0], vocab, "The ", 40, 32)
    assert greedy == lm.sample(models[0], vocab, "The ", 40, 32, 0.0, key)
    assert len(set(drawn[0])) > len(set(greedy))  # drawn: more varied
    assert lm.sample_ids._cache_size() == 1  # two models, two temperatures


def test_char_lm_from_disk_packs_resumes_at_the_next_batch(tmp_path):
    lm = _load()
    data_dir, run_dir, seq = tmp_path / "data", tmp_path / "run", 32

    # 12 steps from the paragraphs on disk (written now), checkpointed at 12.
    state, _ = lm.train(12, seq, run_dir, 8, progress=False, data_dir=data_dir)
    record_file = data_dir / "train.array_record"
    written = record_file.stat().st_mtime_ns
    meta = pztrain.read_metadata(run_dir / "ckpt" / "12")["metadata"]
    saved = json.loads(meta["callbacks"]["data"]["iterators"][0])

    # The saved iterator state gives the batch an uninterrupted pipeline gives
    # at step 12 (packed sequences of seq + 1 characters, one shape).
    vocab, _, _ = lm.prepare(seq)
    uninterrupted = iter(lm.disk_data(record_file, vocab, seq, 8))
    want = [next(uninterrupted) for _ in range(13)][-1]
    resumed = iter(lm.disk_data(record_file, vocab, seq, 8))
    resumed.set_state(saved)
    got = next(resumed)
    assert got["tokens"].shape == (8, seq) and got["targets"].shape == (8, seq)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["targets"][:, :-1], got["tokens"][:, 1:])

    # Run again with more steps: it resumes at 12, reading the same file.
    state, history = lm.train(24, seq, run_dir, 8, progress=False, data_dir=data_dir)
    assert int(state.step) == 24
    assert min(r["step"] for r in history.records) > 12
    assert record_file.stat().st_mtime_ns == written
