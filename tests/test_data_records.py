"""Reading at speed: records decoded a batch at a time (`RecordLayout`), ArrayRecord
files read a batch per reader call, Hugging Face columns gathered from NumPy views
(the batches `dataset[indices]` gives), `fit` fed a block of steps at a time, and
the whole first batch checked when the loader is made."""

from __future__ import annotations

import pickle
import re

import datasets
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

import pztrain
from pztrain.data import BatchError, BulkSource, GrainLoader, RecordLayout
from pztrain.data._array_record import ArrayRecordFiles
from pztrain.data._arrow import ArrowColumns

N = 300


def arrays(n: int = N) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((n, 3)).astype(np.float32),
        "y": np.arange(n, dtype=np.int32),
    }


def write(path, data, options: str = "group_size:1") -> str:
    writer = ArrayRecordWriter(str(path), options)
    for record in RecordLayout.like(data).encode(data):
        writer.write(record)
    writer.close()
    return str(path)


# ----------------------------------------------------------------------------
# RecordLayout


def test_a_layout_turns_records_into_arrays_and_back():
    data = {
        "image": np.arange(4 * 2 * 3, dtype=np.uint8).reshape(4, 2, 3),
        "label": np.array([1, 0, 1, 1], np.int64),
        "weight": np.linspace(0, 1, 4).astype(np.float16),
        "mask": np.array([True, False, True, False]),
    }
    layout = RecordLayout.like(data)
    assert layout.record_size == 6 + 8 + 2 + 1
    records = layout.encode(data)
    assert [len(r) for r in records] == [17] * 4
    back = layout.decode(records[::-1])
    for name, value in data.items():
        assert back[name].dtype == value.dtype and back[name].flags.writeable
        np.testing.assert_array_equal(back[name], value[::-1])
    rows = np.frombuffer(b"".join(records), np.uint8).reshape(4, 17)
    np.testing.assert_array_equal(layout.decode(rows)["label"], data["label"])
    assert RecordLayout(layout.dtype) == layout
    assert pickle.loads(pickle.dumps(layout)) == layout


def test_bad_layouts_and_records_are_named():
    layout = RecordLayout({"x": ("float32", (2,))})
    with pytest.raises(
        BatchError,
        match=re.escape(
            "RecordLayout.decode: 2 records of [4] bytes, but this layout's records "
            "are 8 bytes"
        ),
    ):
        layout.decode([b"abcd", b"efgh"])
    with pytest.raises(BatchError, match=re.escape("has dtype <U3, not numbers")):
        RecordLayout({"name": ("U3", ())})
    with pytest.raises(BatchError, match=re.escape("got fields ['y']; the layout has")):
        layout.encode({"y": np.zeros((2, 2))})
    with pytest.raises(BatchError, match=re.escape("'x' has shape (2, 3); the layout")):
        layout.encode({"x": np.zeros((2, 3))})


# ----------------------------------------------------------------------------
# ArrayRecord


def test_an_array_record_file_is_read_a_block_per_call_and_decoded(
    tmp_path, monkeypatch
):
    data = arrays()
    source = grain.sources.ArrayRecordDataSource([write(tmp_path / "a", data)])
    layout = RecordLayout.like(data)
    loader = GrainLoader(source, 8, seed=1, decode=layout)
    for step in (0, 37, 80):
        batch = loader.batch_at(step)
        ids = loader.example_ids(step)
        assert batch["y"].tolist() == ids
        np.testing.assert_array_equal(batch["x"], data["x"][ids])
    calls = []
    read = ArrayRecordFiles.read
    monkeypatch.setattr(
        ArrayRecordFiles, "read", lambda self, k: calls.append(len(k)) or read(self, k)
    )
    blocks = loader.fit_source(0, 1, 0, None)
    block, count = next(blocks.stretch(0, 100))
    assert count == 32 and calls == [32 * 8]  # 32 steps' records, one call
    assert block.arrays["y"].shape == (32, 8)
    assert np.asarray(block.arrays["y"][5]).tolist() == loader.example_ids(5)
    blocks.close()


def test_records_across_files_come_back_in_order(tmp_path):
    data = arrays()
    parts = [
        write(tmp_path / f"p{i}", {k: v[i::3] for k, v in data.items()})
        for i in range(3)
    ]
    source = grain.sources.ArrayRecordDataSource(parts)
    files = ArrayRecordFiles.of(source)
    assert files is not None and files.counts == [100, 100, 100]
    keys = np.array([299, 0, 150, 100, 99, 200, 5])
    assert files.read(keys) == source.__getitems__(keys.tolist())
    again = pickle.loads(pickle.dumps(files))  # as its file names
    assert again.read(keys) == source.__getitems__(keys.tolist())
    assert ArrayRecordFiles.of([b"a"]) is None  # another source: read as it is


def test_decode_takes_a_dtype_or_a_function_and_is_checked(tmp_path):
    data = arrays()
    source = grain.sources.ArrayRecordDataSource([write(tmp_path / "a", data)])
    layout = RecordLayout.like(data)
    by_dtype = GrainLoader(source, 8, seed=1, decode=layout.dtype)
    np.testing.assert_array_equal(
        by_dtype.batch_at(3)["x"], data["x"][by_dtype.example_ids(3)]
    )

    def first_byte(records):
        return {"b": np.array([r[0] for r in records], np.uint8)}

    assert GrainLoader(source, 8, decode=first_byte).batch_at(0)["b"].shape == (8,)
    with pytest.raises(BatchError, match=re.escape("decode must be a function")):
        GrainLoader(source, 8, decode="utf-8")
    with pytest.raises(
        BatchError,
        match=re.escape("decode <lambda> returned 'x' of shape (1,) for a batch of 8"),
    ):
        GrainLoader(source, 8, decode=lambda records: {"x": np.zeros(1)})
    with pytest.raises(
        BatchError,
        match=re.escape("decode <lambda> returned 'raw' of dtype |S16, not numbers"),
    ):
        GrainLoader(source, 8, decode=lambda records: {"raw": np.array(records)})
    with pytest.raises(
        BatchError,
        match=re.escape(
            "Example 0 is a bytes, not a dict of arrays: decode the records a batch "
            "at a time with GrainLoader(..., decode=...)"
        ),
    ):
        GrainLoader(source, 8, shuffle=False)  # records need decoding


@pytest.mark.slow  # a worker process
def test_grain_workers_decode_blocks(tmp_path):
    data = arrays()
    source = grain.sources.ArrayRecordDataSource([write(tmp_path / "a", data)])
    loader = GrainLoader(source, 8, seed=2, workers=1, decode=RecordLayout.like(data))
    blocks = loader.fit_source(40, 1, 1, None)
    block, count = next(blocks.stretch(40, 64))
    assert count == 24  # steps 40 to 63 of the block of steps 32 to 63
    for step in (40, 63):
        row = np.asarray(block.arrays["y"][step % 32])
        assert row.tolist() == loader.example_ids(step)
    blocks.close()


# ----------------------------------------------------------------------------
# Hugging Face


def features(n: int = 2500) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "x": rng.random((n, 3)).astype(np.float32),
        "y": np.arange(n, dtype=np.int32),
        "mask": np.arange(n) % 3 == 0,
        "grid": rng.random((n, 2, 3)).astype(np.float32),
        "half": rng.random(n).astype(np.float16),
        "byte": (np.arange(n) % 200).astype(np.uint8),
        "wide": rng.random(n),  # float64
    }


def test_hugging_face_columns_read_as_views_give_the_datasets_own_batches(tmp_path):
    data = features()
    datasets.Dataset.from_dict(data).save_to_disk(str(tmp_path / "hf"))
    on_disk = datasets.load_from_disk(str(tmp_path / "hf")).with_format("numpy")
    grid = datasets.Features(
        {"grid": datasets.Array2D((2, 3), "float32"), "y": datasets.Value("int32")}
    )
    typed = datasets.Dataset.from_dict(
        {"grid": data["grid"], "y": data["y"]}, features=grid
    ).with_format("numpy")
    assert on_disk.data.table.column("x").num_chunks > 1  # gathered chunk by chunk
    keys = np.random.default_rng(0).integers(0, 2000, 300)
    for ds in (
        on_disk,
        on_disk.shuffle(seed=1),  # an indices mapping
        on_disk.select(range(100, 2100)),
        on_disk.train_test_split(0.2, seed=0)["train"],
        on_disk.with_format("numpy", columns=["x", "byte"]),
        typed,
    ):
        columns = ArrowColumns.of(ds)
        assert columns is not None
        got, want = columns.read(keys), ds[keys.tolist()]
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype, name  # int64, float32
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    again = pickle.loads(pickle.dumps(ArrowColumns.of(on_disk)))
    np.testing.assert_array_equal(again.read(keys)["x"], on_disk[keys.tolist()]["x"])


def test_other_hugging_face_columns_are_read_through_the_dataset(monkeypatch):
    texts = datasets.Dataset.from_dict(
        {"t": [str(i) for i in range(N)], "ragged": [[0] * (i % 3) for i in range(N)]}
    ).with_format("numpy")
    assert ArrowColumns.of(texts) is None
    assert ArrowColumns.of(texts.with_format("numpy", columns=["t"])) is None
    numbers = datasets.Dataset.from_dict(arrays()).with_format("numpy")
    mixed = numbers.add_column("t", [str(i) for i in range(N)])
    only = mixed.with_format("numpy", columns=["x", "y"])
    assert ArrowColumns.of(only) is not None  # the text column is not read
    loader = GrainLoader(only, 8, seed=3)
    calls = []
    read = BulkSource.read
    monkeypatch.setattr(
        BulkSource, "read", lambda self, k: calls.append(len(k)) or read(self, k)
    )
    batch = loader.batch_at(6)
    assert calls == [8] and batch["y"].tolist() == loader.example_ids(6)
    assert batch["y"].dtype == np.int64  # as the numpy format gives it


# ----------------------------------------------------------------------------
# fit: blocks of steps; the first batch checked before anything is written


def loss_fn(*, model, state, rng, x, y):
    del rng, y
    loss = jnp.mean((x @ model["w"]) ** 2)
    return loss, state, {"loss": loss}


def _state():
    params = {"w": jnp.ones((3, 1))}
    return pztrain.TrainState.initial_state(params, optax.sgd(0.01), jax.random.key(0))


def test_fit_on_blocks_trains_on_the_batches_of_each_step(tmp_path):
    data = arrays()
    seen = []

    def spy_loss(*, model, state, rng, x, y):
        jax.debug.callback(lambda v: seen.append(np.asarray(v).tolist()), y)
        return loss_fn(model=model, state=state, rng=rng, x=x, y=y)

    source = grain.sources.ArrayRecordDataSource([write(tmp_path / "a", data)])
    loader = GrainLoader(source, 8, seed=1, decode=RecordLayout.like(data))
    state, _ = pztrain.fit(
        _state(), pztrain.build_train_step(spy_loss), loader, num_steps=70,
        log_every=10, progress=False, loggers=[],
    )  # fmt: skip
    assert int(state.step) == 70
    assert seen == [loader.example_ids(s) for s in range(70)]


def test_the_blocks_in_flight_stay_within_16_mib_else_a_step_at_a_time():
    big = {"x": np.zeros((16, 32000), np.float32), "y": np.zeros(16, np.int32)}
    layout = RecordLayout.like(big)
    records = layout.encode(big)
    # 125 KiB a batch, 4 MiB a block: held, 2 prefetched, 1 being read: 16 MiB
    one = GrainLoader(records, 1, decode=layout)
    assert one.fit_source(0, 1, 2, None) is not None
    assert one.fit_source(0, 1, 3, None) is None  # a fifth block: 20 MiB
    two = GrainLoader(records, 2, decode=layout)  # 8 MiB a block
    assert two.fit_source(0, 1, 2, None) is None
    assert two.fit_source(0, 1, 0, None) is not None  # held and being read
    workers = GrainLoader(records, 1, decode=layout, workers=1, worker_buffer=2)
    assert workers.fit_source(0, 1, 2, None) is None  # 2 more kept by the worker


def _heads(records: list) -> dict[str, np.ndarray]:
    """A large record decoded to a small row (its first 4 floats)."""
    return {"x": np.stack([np.frombuffer(r, np.float32)[:4] for r in records])}


def test_large_records_are_read_8_mib_at_a_time_however_small_the_batch(
    monkeypatch,
):
    mib = np.zeros(2**18, np.float32)  # 1 MiB records, decoded to 16 bytes
    records = [(mib + i).tobytes() for i in range(64)]
    loader = GrainLoader(records, 4, shuffle=False, decode=_heads)
    assert loader.fit_source(0, 1, 2, None) is not None  # small decoded blocks
    calls = []
    read = BulkSource.read
    monkeypatch.setattr(
        BulkSource, "read", lambda self, idx: calls.append(len(idx)) or read(self, idx)
    )
    got = next(loader.iter_from_step(0, steps_per_call=32))  # 128 records
    assert calls == [8] * 16  # 8 MiB of records per call, not 128 MiB at once
    assert got["x"].shape == (32, 4, 4)
    np.testing.assert_array_equal(got["x"][:, :, 0].ravel(), np.arange(128) % 64)


def test_the_whole_first_batch_is_checked_before_the_run_directory_is_made(tmp_path):
    bad = grain.MapDataset.range(N).map(
        lambda i: {"x": np.zeros(3 if i != 20 else 2, np.float32), "y": np.int32(i)}
    )
    run_dir = tmp_path / "run"
    with pytest.raises(BatchError, match=re.escape("Example 20['x'] is float32[2]")):
        pztrain.fit(
            _state(), pztrain.build_train_step(loss_fn),
            GrainLoader(bad, 32, shuffle=False), num_steps=4, run_dir=run_dir,
            progress=False,
        )  # fmt: skip
    assert not run_dir.exists()
