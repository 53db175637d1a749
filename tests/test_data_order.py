"""GrainLoader's epoch order: a Feistel permutation computed a batch at a time
(a bijection, a pure function of seed, epoch and length, a fair shuffle), the
same global batches on any process count and read a block at a time, and old
checkpoints (pztrain 0.2's grain order, no record of it) resumed exactly or
refused with the fix."""

from __future__ import annotations

import json
import re

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from grain_examples import N, examples

import pztrain
from pztrain.data import BatchError, GrainLoader
from pztrain.data._order import epoch_keys, permute, shuffled
from pztrain.data._reading import ReadBlocks

# ----------------------------------------------------------------------------
# the permutation


SIZES = [1, 2, 3, 5, 7, 8, 16, 31, 32, 97, 127, 128, 1000, 1024, 4099, 65536, 65537]


@pytest.mark.parametrize("n", SIZES)
def test_each_epoch_is_a_permutation_of_the_examples(n):
    for seed, epoch in [(0, 0), (1, 0), (1, 1), (2**32 - 1, 12345)]:
        got = shuffled(np.arange(n), np.full(n, epoch), n, seed)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(np.sort(got), np.arange(n))


def test_the_order_is_a_pure_function_of_seed_epoch_and_length():
    places = np.array([5, 0, 999, 17])
    keys = epoch_keys(3, np.array([2]))[0]
    assert permute(places, 1000, keys).tolist() == [155, 58, 553, 925]  # pinned
    one = shuffled(np.arange(1000), np.full(1000, 2), 1000, 3)
    np.testing.assert_array_equal(one[places], permute(places, 1000, keys))
    # Places of several epochs in one call: each keyed by its own epoch.
    mixed = shuffled(np.array([5, 5, 5]), np.array([0, 1, 2]), 1000, 3)
    assert mixed[2] == one[5] and len(set(mixed.tolist())) == 3
    assert not np.array_equal(one, shuffled(np.arange(1000), 2, 1000, 4))
    assert not np.array_equal(one, shuffled(np.arange(1000), 2, 1001, 3)[:1000])


def test_it_shuffles_like_a_random_permutation():
    n, epochs = 1000, 400
    orders = np.stack([shuffled(np.arange(n), e, n, 7) for e in range(epochs)])
    # Where a place's example falls: even over tenths of the range.
    tenths = np.stack([np.bincount(o // 100, minlength=10) for o in orders.T[:50]])
    chi2 = ((tenths - epochs / 10) ** 2 / (epochs / 10)).sum(1)
    assert chi2.mean() < 13  # 9 for a uniform draw
    # No trace of the place in the example, nor of one place in the next.
    spread = 1 / np.sqrt(n)
    rank = [np.corrcoef(np.arange(n), o)[0, 1] for o in orders]
    nextdoor = [np.corrcoef(o[:-1], o[1:])[0, 1] for o in orders]
    assert abs(np.mean(rank)) < spread and np.std(rank) < 1.5 * spread
    assert abs(np.mean(nextdoor)) < spread and np.std(nextdoor) < 1.5 * spread
    fixed = (orders == np.arange(n)).sum(1).mean()
    assert 0.7 < fixed < 1.3  # 1 for a uniform draw


# ----------------------------------------------------------------------------
# batches


def test_global_batches_are_the_permutation_cut_into_batches():
    loader = GrainLoader(examples(), 8, seed=7)
    for epoch in range(3):
        order = shuffled(np.arange(N), epoch, N, 7).tolist()
        got = [i for s in range(5) for i in loader.example_ids(epoch * 5 + s)]
        assert got == order


@pytest.mark.parametrize("count", [2, 4])
def test_every_process_count_reads_the_same_global_batches(count):
    whole = GrainLoader(examples(), 8, seed=1)
    parts = [
        GrainLoader(examples(), 8, seed=1, process_index=p, process_count=count)
        for p in range(count)
    ]
    for step in range(12):
        assert all(p.example_ids(step) == whole.example_ids(step) for p in parts)
        got = np.concatenate([p.batch_at(step)["id"] for p in parts])
        assert got.tolist() == whole.example_ids(step)


def test_a_block_holds_the_batches_of_its_steps():
    loader = GrainLoader(examples(), 8, seed=5)
    rows = loader._rows
    block = ReadBlocks(rows, start=0, size=8)(1)  # steps 8 to 15, two epochs
    assert block["id"].shape == (8, 8)
    for i, step in enumerate(range(8, 16)):
        assert block["id"][i].tolist() == loader.example_ids(step)
    late = ReadBlocks(rows, start=11, size=8)(0)  # steps 8-10 are not read
    assert late["id"][3:].tolist() == block["id"][3:].tolist()
    assert all(late["id"][i].tolist() == late["id"][3].tolist() for i in range(3))


def test_order_grain_keeps_pztrain_0_2_batches():
    loader = GrainLoader(examples(), 8, seed=7, order="grain")
    order = grain.MapDataset.range(N).shuffle(seed=7)  # grain's, epoch e: seed + e
    for step in (0, 4, 5, 13):
        epoch, index = divmod(step, 5)
        places = range(epoch * N + index * 8, epoch * N + index * 8 + 8)
        assert loader.example_ids(step) == [order[p] for p in places]
    with pytest.raises(BatchError, match=re.escape("order must be one of")):
        GrainLoader(examples(), 8, order="random")


# ----------------------------------------------------------------------------
# resume: the order is kept with each checkpoint and checked


def loss_fn(*, model, state, rng, x, y, id):
    del rng, id
    logits = x @ model["w"] + model["b"][None]
    loss = optax.sigmoid_binary_cross_entropy(logits[:, 0], y).mean()
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)


def _fit(data, num_steps, **kwargs):
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    state = pztrain.TrainState.initial_state(
        params, optax.adam(0.05), jax.random.key(0)
    )
    kwargs = {"log_every": 2, "progress": False, "loggers": [], **kwargs}
    return pztrain.fit(state, STEP, data, num_steps=num_steps, **kwargs)


def _checkpointed(tmp_path, loader, steps):
    ckpts = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=2)
    _fit(loader, steps, checkpoints=ckpts)
    return tmp_path / "ckpt" / str(steps)


def _resume(tmp_path, loader, steps):
    ckpts = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=2)
    return _fit(loader, steps, checkpoints=ckpts, resume=True)


def _same_params(a, b):
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)


def _forget_order(checkpoint):
    """Makes ``checkpoint`` look as pztrain 0.2 wrote it: no data order."""
    meta = checkpoint / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    assert saved["metadata"]["callbacks"].pop("data_order") == {"order": "grain"}
    meta.write_text(json.dumps(saved))


@pytest.mark.slow  # three runs
def test_a_checkpoint_without_an_order_resumes_only_in_grain_order(tmp_path):
    full, _ = _fit(GrainLoader(examples(), 8, seed=9, order="grain"), 14)
    saved = _checkpointed(
        tmp_path, GrainLoader(examples(), 8, seed=9, order="grain"), 8
    )
    _forget_order(saved)
    with pytest.raises(
        BatchError,
        match=re.escape(
            f"Checkpoint 8 in {tmp_path / 'ckpt'} does not record its data order: "
            "pztrain 0.2 saved it, whose GrainLoader shuffled with grain's "
            "index_shuffle; this one shuffles with order='feistel', so the resumed "
            "run would train on other batches. Pass GrainLoader(..., order='grain')"
        ),
    ):
        _resume(tmp_path, GrainLoader(examples(), 8, seed=9), 14)
    loader = GrainLoader(examples(), 8, seed=9, order="grain")
    resumed, history = _resume(tmp_path, loader, 14)
    assert history.records[0]["step"] == 10
    _same_params(resumed, full)  # the batches of the uninterrupted run


@pytest.mark.slow  # two runs
def test_a_checkpoint_of_another_order_is_refused_unless_asked_for(tmp_path):
    _checkpointed(tmp_path, GrainLoader(examples(), 8, seed=9, order="grain"), 4)
    with pytest.raises(
        BatchError,
        match=re.escape(
            "The checkpoint's run shuffled its data with order='grain'; this "
            "GrainLoader shuffles with order='feistel', so the resumed run would "
            "train on other batches. Pass order='grain' to resume"
        ),
    ):
        _resume(tmp_path, GrainLoader(examples(), 8, seed=9), 8)
    state, _ = _resume(tmp_path, GrainLoader(examples(), 8, seed=9, order="feistel"), 8)
    assert int(state.step) == 8  # asked for: goes on in the new order


@pytest.mark.slow  # three runs
def test_the_default_order_resumes_exactly(tmp_path):
    full, _ = _fit(GrainLoader(examples(), 8, seed=3), 14)
    _checkpointed(tmp_path, GrainLoader(examples(), 8, seed=3), 8)
    resumed, history = _resume(tmp_path, GrainLoader(examples(), 8, seed=3), 14)
    assert history.records[0]["step"] == 10
    _same_params(resumed, full)
