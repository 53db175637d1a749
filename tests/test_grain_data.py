"""GrainLoader (random-access data: grain MapDatasets, Hugging Face datasets) and
grain IterDatasets given to fit (sequential data, iterator state checkpointed)."""

from __future__ import annotations

import itertools
import json
import pickle
import re
import sys

import datasets
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from grain_examples import N, example, examples

import pztrain
from pztrain.data import ArrayLoader, BatchError, BulkSource, GrainLoader
from pztrain.data._sequential import SequentialData


def arrays() -> dict[str, np.ndarray]:
    rows = [example(i) for i in range(N)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class Counting:
    """A grain data source that records every index it reads."""

    def __init__(self, n: int = N):
        self.n, self.read = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(int(i))
        return example(i)

    def __repr__(self):  # grain's DataLoader checks a saved state's source by it
        return f"Counting({self.n})"


def _ids(batch) -> list[int]:
    return np.asarray(batch["id"]).tolist()


# ----------------------------------------------------------------------------
# global batches: a function of the step and the seed


def test_global_batches_depend_only_on_step_seed_and_length():
    a, b = GrainLoader(examples(), 8, seed=5), GrainLoader(examples(), 8, seed=5)
    steps = range(3 * a.steps_per_epoch)
    assert [a.example_ids(s) for s in steps] == [b.example_ids(s) for s in steps]
    assert [a.example_ids(s) for s in steps] == [_ids(a.batch_at(s)) for s in steps]
    assert a.example_ids(0) != GrainLoader(examples(), 8, seed=6).example_ids(0)
    # Each epoch is a permutation of the examples, and another one each epoch.
    epochs = [sum((a.example_ids(e * 5 + i) for i in range(5)), []) for e in range(3)]
    assert all(sorted(e) == list(range(N)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_order_grain_is_graines_own_shuffle_seeded_per_epoch():
    loader = GrainLoader(examples(), 8, seed=7, order="grain")  # pztrain 0.2's
    order = grain.MapDataset.range(N).shuffle(seed=7)  # grain's, epoch e: seed + e
    for step in (0, 4, 5, 13):
        epoch, index = divmod(step, 5)
        places = range(epoch * N + index * 8, epoch * N + index * 8 + 8)
        assert loader.example_ids(step) == [order[p] for p in places]


def test_without_shuffle_the_order_is_the_datasets():
    loader = GrainLoader(examples(), 8, shuffle=False)
    assert loader.example_ids(1) == list(range(8, 16))
    assert loader.example_ids(6) == list(range(8, 16))  # epoch 1, batch 1


@pytest.mark.slow  # grain shuffles the rows of each process, epoch after epoch
@pytest.mark.parametrize("count", [2, 4])
def test_process_rows_make_the_same_global_batch(count):
    whole = GrainLoader(examples(), 8, seed=1)
    parts = [
        GrainLoader(examples(), 8, seed=1, process_index=p, process_count=count)
        for p in range(count)
    ]
    for step in range(12):
        assert all(p.example_ids(step) == whole.example_ids(step) for p in parts)
        got = np.concatenate([p.batch_at(step)["x"] for p in parts])
        np.testing.assert_array_equal(got, whole.batch_at(step)["x"])


def test_each_process_reads_only_its_rows():
    sources = [Counting() for _ in range(2)]
    loaders = [
        GrainLoader(s, 8, seed=2, process_index=p, process_count=2)
        for p, s in enumerate(sources)
    ]
    for s in sources:
        s.read.clear()  # the rows checked when the loader was made
    for step in range(10):  # two epochs
        for loader in loaders:
            loader.batch_at(step)
    want = [loaders[0].example_ids(s) for s in range(10)]
    assert sources[0].read == [i for ids in want for i in ids[:4]]
    assert sources[1].read == [i for ids in want for i in ids[4:]]
    assert len(sources[0].read) == len(sources[1].read) == 10 * 4


def test_random_map_draws_anew_each_epoch_and_alike_on_any_process_count():
    noisy = examples().random_map(
        lambda e, rng: {**e, "noise": np.float32(rng.random())}, seed=3
    )
    one = GrainLoader(noisy, 8, shuffle=False)
    half = GrainLoader(noisy, 8, shuffle=False, process_index=1, process_count=2)
    np.testing.assert_array_equal(one.batch_at(0)["id"], one.batch_at(5)["id"])
    assert not np.array_equal(one.batch_at(0)["noise"], one.batch_at(5)["noise"])
    np.testing.assert_array_equal(
        half.batch_at(5)["noise"], one.batch_at(5)["noise"][4:]
    )


class Jitter:
    """A batch transform: noise drawn from each row's position, the positions
    kept (picklable, for grain's workers)."""

    def __call__(self, batch, positions):
        noise = np.array([np.random.default_rng(p).random() for p in positions])
        return {**batch, "x": batch["x"] + noise[:, None], "pos": positions}


def test_a_batch_transform_sees_the_rows_and_their_positions_on_any_process_count():
    one = GrainLoader(examples(), 8, seed=2, batch_transform=Jitter())
    half = [
        GrainLoader(
            examples(),
            8,
            seed=2,
            batch_transform=Jitter(),
            process_index=p,
            process_count=2,
        )
        for p in range(2)
    ]
    plain = GrainLoader(examples(), 8, seed=2)
    for step in (0, 7):  # epoch 0 and epoch 1: positions e * N + i
        got = one.batch_at(step)
        epoch = step // one.steps_per_epoch
        assert (got["pos"] % N).tolist() == one.example_ids(step)
        assert (got["pos"] // N == epoch).all()
        noise = [np.random.default_rng(p).random() for p in got["pos"]]
        np.testing.assert_allclose(
            got["x"], plain.batch_at(step)["x"] + np.array(noise)[:, None], rtol=1e-6
        )
        halves = [h.batch_at(step) for h in half]
        for key in got:
            np.testing.assert_array_equal(
                np.concatenate([h[key] for h in halves]), got[key]
            )


@pytest.mark.slow  # a worker process
def test_a_batch_transform_runs_in_grain_workers():
    loader = GrainLoader(examples(), 8, seed=2, workers=1, batch_transform=Jitter())
    stream = loader.iter_from_step(3)
    got = [next(stream) for _ in range(2)]
    for step, batch in zip((3, 4), got, strict=True):
        for key, want in loader.batch_at(step).items():
            np.testing.assert_array_equal(batch[key], want)


def test_bad_batch_transforms_are_named():
    with pytest.raises(BatchError, match="batch_transform must be a function"):
        GrainLoader(examples(), 8, batch_transform="x")
    with pytest.raises(BatchError, match=re.escape("returned a list; it must return")):
        GrainLoader(examples(), 8, batch_transform=lambda b, p: [b])
    with pytest.raises(
        BatchError, match=re.escape("returned 'x' of shape (2, 4) for a batch of 8")
    ):
        GrainLoader(examples(), 8, batch_transform=lambda b, p: {"x": b["x"][:2]})


@pytest.mark.parametrize("k", [1, 3])
def test_iter_from_step_matches_batch_at_and_stacks_steps(k):
    loader = GrainLoader(examples(), 8, seed=4)
    stream = loader.iter_from_step(3, steps_per_call=k)
    for call in range(4):
        got = next(stream)
        first = 3 + call * k
        want = [loader.batch_at(s) for s in range(first, first + k)]
        if k == 1:
            np.testing.assert_array_equal(got["x"], want[0]["x"])
        else:
            assert got["x"].shape == (k, 8, 4)
            np.testing.assert_array_equal(got["x"], np.stack([w["x"] for w in want]))
    stream.close()


def test_eval_order_is_fixed_and_evaluate_matches_an_array_loader():
    loader = GrainLoader(examples(), 8, shuffle=False)
    assert [_ids(b) for b in loader] == [_ids(b) for b in loader.epoch(0)]
    assert [i for b in loader for i in _ids(b)] == list(range(N))
    state = _state()
    step = pztrain.build_eval_step(_eval_fn)
    got = pztrain.evaluate(state, step, loader)
    want = pztrain.evaluate(state, step, ArrayLoader(arrays(), 8, shuffle=False))
    assert got == want


def test_a_hugging_face_dataset_reads_rows_in_one_call_per_batch(monkeypatch):
    hf = datasets.Dataset.from_dict(arrays()).with_format("numpy")
    loader = GrainLoader(hf, 8, seed=3)
    calls = []
    read = BulkSource.read
    monkeypatch.setattr(
        BulkSource, "read", lambda self, idx: calls.append(idx) or read(self, idx)
    )
    batch = loader.batch_at(6)
    assert len(calls) == 1 and len(calls[0]) == 8  # one gather of the columns
    assert _ids(batch) == loader.example_ids(6)
    np.testing.assert_array_equal(batch["x"], arrays()["x"][loader.example_ids(6)])
    assert batch["x"].dtype == np.float32


# ----------------------------------------------------------------------------
# fit


def loss_fn(*, model, state, rng, x, y, id):
    del rng, id
    logits = x @ model["w"] + model["b"][None]
    loss = optax.sigmoid_binary_cross_entropy(logits[:, 0], y).mean()
    return loss, state, {"loss": loss}


def _eval_fn(*, model, state, rng, x, y, id):
    return {"loss": loss_fn(model=model, state=state, rng=rng, x=x, y=y, id=id)[0]}


def _state():
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    return pztrain.TrainState.initial_state(params, optax.adam(0.05), jax.random.key(0))


STEP = pztrain.build_train_step(loss_fn)


def _fit(data, num_steps, **kwargs):
    kwargs = {"log_every": 2, "progress": False, "loggers": [], **kwargs}
    return pztrain.fit(_state(), STEP, data, num_steps=num_steps, **kwargs)


def _same_params(a, b):
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)


@pytest.mark.slow  # three runs
def test_fit_on_grain_matches_fit_on_arrays_in_the_same_order():
    a, _ = _fit(GrainLoader(examples(), 8, shuffle=False), 12)
    b, _ = _fit(ArrayLoader(arrays(), 8, shuffle=False), 12)
    _same_params(a, b)
    c, _ = _fit(examples().batch(8), 12)  # a batched MapDataset: its own order
    _same_params(a, c)


@pytest.mark.slow  # three runs
def test_fit_resumes_a_grain_loader_exactly(tmp_path):
    loader = GrainLoader(examples(), 8, seed=9)
    full, _ = _fit(loader, 14)
    ckpt = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=2)
    _fit(loader, 8, checkpoints=ckpt)
    ckpt = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=2)
    resumed, history = _fit(loader, 14, checkpoints=ckpt, resume=True)
    assert history.records[0]["step"] == 10
    _same_params(resumed, full)


def sequential(seed: int = 1) -> grain.IterDataset:
    """Shuffled examples, repeated, batched in order: a grain IterDataset."""
    ds = examples().shuffle(seed=seed).repeat().to_iter_dataset()
    return ds.batch(8, drop_remainder=True)


@pytest.mark.slow  # three runs
@pytest.mark.parametrize("k", [1, 2])
def test_an_iter_dataset_resumes_exactly_from_its_checkpointed_state(tmp_path, k):
    step = pztrain.build_train_step(loss_fn, steps_per_call=k)
    full, _ = pztrain.fit(
        _state(), step, sequential(), num_steps=12, log_every=2, progress=False
    )
    ckpt = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=2)
    pztrain.fit(
        _state(), step, sequential(), num_steps=6, log_every=2, progress=False,
        checkpoints=ckpt,
    )  # fmt: skip
    saved = pztrain.read_metadata(tmp_path / "ckpt" / "6")["metadata"]["callbacks"]
    assert saved["data"]["process_count"] == 1
    assert "next_index" in json.dumps(saved["data"]["iterators"])
    ckpt = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=2)
    resumed, _ = pztrain.fit(
        _state(), step, sequential(), num_steps=12, log_every=2, progress=False,
        checkpoints=ckpt, resume=True,
    )  # fmt: skip
    _same_params(resumed, full)


@pytest.mark.slow  # three runs
def test_a_data_loader_resumes_exactly(tmp_path):
    def loader():
        return grain.DataLoader(
            data_source=Counting(),
            sampler=grain.samplers.IndexSampler(
                N, shuffle=True, seed=3, num_epochs=None
            ),
            operations=[grain.transforms.Batch(8, drop_remainder=True)],
            worker_count=0,
        )

    full, _ = _fit(loader(), 10)
    _fit(loader(), 4, checkpoints=pztrain.Checkpoints(tmp_path / "c", every_steps=2))
    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=2)
    resumed, _ = _fit(loader(), 10, checkpoints=ckpt, resume=True)
    _same_params(resumed, full)


def test_sequential_data_marks_pass_ends_and_resumes_after_a_pass_end():
    data = SequentialData(examples().to_iter_dataset().batch(8))
    items = list(itertools.islice(data.items(), 7))  # passes repeat
    assert [ends for _, ends, _ in items] == [False] * 4 + [True] + [False] * 2
    assert [_ids(b)[0] for b, _, _ in items] == [0, 8, 16, 24, 32, 0, 8]
    items = items[:5]
    data.load_state_dict({"process_count": 1, "iterators": [items[-1][2]]})
    again = data.items()  # saved at the pass's end: the next pass, from its start
    assert _ids(next(again)[0]) == list(range(8))


# ----------------------------------------------------------------------------
# bad input: the error names the index or key and the fix; nothing is written


def _refused(tmp_path, make, error, message):
    run_dir = tmp_path / "run"
    with pytest.raises(error, match=re.escape(message)):
        _fit(make(), 4, run_dir=run_dir, loggers=None)
    assert not run_dir.exists()


def test_bad_items_that_are_not_dicts_of_arrays(tmp_path):
    records = grain.MapDataset.range(N).map(lambda i: str(i).encode())
    _refused(
        tmp_path,
        lambda: GrainLoader(records, 8, shuffle=False),
        BatchError,
        "Example 0 is a bytes, not a dict of arrays: decode the records a batch at "
        "a time with GrainLoader(..., decode=...)",
    )
    texts = examples().map(lambda e: {**e, "text": "abc"})
    _refused(
        tmp_path,
        lambda: GrainLoader(texts, 8, shuffle=False),
        BatchError,
        "Example 0['text'] is a str, not an array: convert it in a .map",
    )


def test_bad_ragged_example_shapes(tmp_path):
    ragged = examples().map(lambda e: {**e, "x": e["x"][: 3 + e["id"] % 2]})
    _refused(
        tmp_path,
        lambda: GrainLoader(ragged, 8, shuffle=False),
        BatchError,
        "Example 1['x'] is float32[4], example 0's is float32[3]: the examples of "
        "a batch need one shape and dtype. Pad or crop them",
    )
    later = examples().map(lambda e: {**e, "x": e["x"][: 3 if e["id"] == 30 else 4]})
    loader = GrainLoader(later, 8, shuffle=False)  # the first batch is fine
    with pytest.raises(BatchError, match=re.escape("Example 30['x'] is float32[3]")):
        loader.batch_at(3)


def test_bad_dataset_shorter_than_one_global_batch(tmp_path):
    _refused(
        tmp_path,
        lambda: GrainLoader(examples(), 64),
        BatchError,
        "The dataset holds 40 examples, fewer than one global batch of "
        "batch_size=64: pass batch_size <= 40, or more data.",
    )


def test_bad_map_dataset_batched_with_another_batch_size(tmp_path):
    _refused(
        tmp_path,
        lambda: GrainLoader(examples().batch(4), 8),
        BatchError,
        "The dataset is batched with .batch(4) but batch_size=8: drop the "
        "dataset's .batch(4), or pass batch_size=4.",
    )
    _refused(
        tmp_path,
        lambda: examples().batch(4).map(lambda b: b),
        BatchError,
        "train_data (a grain.MapDataset): The dataset is batched",
    )
    _refused(
        tmp_path,
        examples,
        BatchError,
        "train_data (a grain.MapDataset): GrainLoader needs the global batch "
        "size: pass batch_size=..., or end the dataset with .batch(batch_size).",
    )


def test_bad_shuffled_iter_dataset_for_elastic_resume(tmp_path):
    _refused(
        tmp_path,
        lambda: GrainLoader(sequential(), 8),
        BatchError,
        "GrainLoader needs random access; got a grain BatchIterDataset (e.g. from "
        ".to_iter_dataset()), read in order: it cannot start at a step, nor be "
        "split anew over another number of processes. Pass the grain.MapDataset",
    )
    data = SequentialData(sequential())
    with pytest.raises(
        BatchError,
        match=re.escape(
            "its iterator state was saved by 2 process(es) and this run has 1. A "
            "sequential source resumes exactly on the same number of processes "
            "only. To resume on another number, train from random-access data: "
            "pztrain.GrainLoader(map_dataset, batch_size)"
        ),
    ):
        data.load_state_dict({"process_count": 2, "iterators": ["{}", "{}"]})


def test_bad_hugging_face_dataset_without_a_numpy_format(tmp_path):
    hf = datasets.Dataset.from_dict(arrays())
    _refused(
        tmp_path,
        lambda: GrainLoader(hf, 8),
        BatchError,
        "The datasets.Dataset has format None (rows of Python objects); give it a "
        "NumPy format: dataset.with_format('numpy').",
    )
    _refused(
        tmp_path,
        lambda: hf.with_format("numpy"),
        TypeError,
        "train_data is a Dataset of rows; pass pztrain.GrainLoader(dataset, "
        "batch_size)",
    )


def test_bad_options_name_the_argument():
    with pytest.raises(
        BatchError, match=re.escape("seed must be an int in [0, 4294967295]; got -1.")
    ):
        GrainLoader(examples(), 8, seed=-1)
    with pytest.raises(
        BatchError, match=re.escape("workers must be an int >= 0; got 1.5.")
    ):
        GrainLoader(examples(), 8, workers=1.5)
    with pytest.raises(
        BatchError, match=re.escape("The dataset is endless (.repeat()")
    ):
        GrainLoader(examples().repeat(), 8)
    with pytest.raises(
        BatchError, match=re.escape("Example 3 is None: a random-access")
    ):
        GrainLoader(examples().filter(lambda e: e["id"] != 3), 8, shuffle=False)


@pytest.mark.parametrize(("module", "extra"), [("grain", "data"), ("datasets", "hf")])
def test_a_missing_optional_library_names_its_extra(monkeypatch, module, extra):
    from pztrain.data._extras import import_extra

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(
        ImportError,
        match=re.escape(f"pip install 'pztrain[{extra}]'"),
    ):
        import_extra(module)
    if module == "grain":
        with pytest.raises(ImportError, match=re.escape("pztrain[data]")):
            GrainLoader([{"x": np.zeros(2)}] * 4, 2)


def test_bulk_source_reads_a_batch_in_one_call_and_pickles_a_mapped_file_by_name(
    tmp_path,
):
    rows = np.arange(4000 * 16, dtype=np.float32).reshape(4000, 16)
    np.save(tmp_path / "rows.npy", rows)
    source = BulkSource(np.load(tmp_path / "rows.npy", mmap_mode="r"))
    got = source._getitems([7, 3, 3999])
    assert [type(r) for r in got] == [np.ndarray] * 3  # plain rows, not memmaps
    np.testing.assert_array_equal(np.stack(got), rows[[7, 3, 3999]])
    sent = pickle.dumps(source)  # as grain sends it to its workers
    assert len(sent) < 1000 < rows.nbytes
    np.testing.assert_array_equal(pickle.loads(sent)._getitems([5])[0], rows[5])


def test_batches_go_onto_the_steps_sharding(monkeypatch):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    loader = GrainLoader(
        examples(), 8, seed=1, sharding=pztrain.sharding.data_sharding(mesh)
    )
    assert loader.batch_sharding(2).spec == jax.sharding.PartitionSpec(None, "data")
    step = pztrain.build_train_step(loss_fn, mesh=mesh, steps_per_call=2)
    placed = []
    put = pztrain.data._blocks.put_batch

    def spy(batch, sharding):
        placed.append((sharding, batch["x"].shape))
        return put(batch, sharding)

    monkeypatch.setattr(pztrain.data._blocks, "put_batch", spy)
    state, _ = pztrain.fit(
        pztrain.shard_state(_state(), mesh), step, loader, num_steps=8,
        log_every=4, progress=False, loggers=[],
    )  # fmt: skip
    assert int(state.step) == 8
    assert placed and all(s == step.batch_sharding for s, _ in placed)
    assert all(shape == (32, 8, 4) for _, shape in placed)  # a block of 32 steps


def _dies_in_a_worker(batch, positions):  # as a worker that re-ran a script does
    import os

    if os.getpid() != int(os.environ["PZTRAIN_TEST_PARENT"]):
        os._exit(3)
    return batch


@pytest.mark.slow
def test_a_worker_that_dies_gets_a_note_on_the_main_guard(monkeypatch):
    import os

    monkeypatch.setenv("PZTRAIN_TEST_PARENT", str(os.getpid()))
    loader = GrainLoader(
        examples(), 8, seed=0, workers=1, batch_transform=_dies_in_a_worker
    )
    with pytest.raises(RuntimeError) as info:
        list(itertools.islice(iter(loader), 2))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert 'if __name__ == "__main__":' in notes and "workers=0" in notes
