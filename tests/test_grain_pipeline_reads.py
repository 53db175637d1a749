"""A grain pipeline as grain teaches it, ``MapDataset.source(source).map(...)``,
read by GrainLoader a batch of records per call: the same examples at the same
step as grain's own read of one record per call, and a warning when it cannot."""

from __future__ import annotations

import re
import warnings

import grain
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from grain_examples import N, example

from pztrain.data import BatchError, GrainLoader, RecordLayout
from pztrain.data._array_record import ArrayRecordFiles

LAYOUT = RecordLayout(
    {"x": ("float32", (4,)), "y": ("float32", ()), "id": ("int32", ())}
)


def decode(record: bytes) -> dict[str, np.ndarray]:
    """One record to one example (module level: grain's workers unpickle it)."""
    row = np.frombuffer(record, LAYOUT.dtype)[0]
    return {k: np.asarray(row[k]) for k in ("x", "y", "id")}


def noise(e: dict, rng: np.random.Generator) -> dict:
    return {**e, "noise": np.float32(rng.random())}


def not_37(e: dict) -> bool:
    return int(e["id"]) != 37


def shaped(e: dict) -> bool:
    return e["x"].shape == (4,)


@pytest.fixture
def path(tmp_path) -> str:
    rows = [example(i) for i in range(N)]
    data = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    path = str(tmp_path / "examples.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for record in LAYOUT.encode(data):
        writer.write(record)
    writer.close()
    return path


def pipeline(path: str, keep=not_37) -> grain.MapDataset:
    source = grain.sources.ArrayRecordDataSource([path])
    examples = grain.MapDataset.source(source).map(decode)
    return examples.random_map(noise, seed=5).filter(keep)


def per_record(ds: grain.MapDataset, loader: GrainLoader, step: int) -> list:
    """Global batch ``step`` as grain reads it a record per call: example ``i``
    of epoch ``e`` at index ``e * len + i`` (None where the filter drops it)."""
    epoch = step // loader.steps_per_epoch
    return [ds[epoch * N + i] for i in loader.example_ids(step)]


def assert_same(batch: dict, examples: list) -> None:
    assert batch.keys() == examples[0].keys()
    for key in batch:
        np.testing.assert_array_equal(batch[key], np.stack([e[key] for e in examples]))


class Reads:
    """Counts the source's reads: one record per call, or a batch per call."""

    def __init__(self, monkeypatch):
        self.records, self.batches = 0, []
        one = grain.sources.ArrayRecordDataSource.__getitem__
        many = ArrayRecordFiles.read

        def count_one(source, key):
            self.records += 1
            return one(source, key)

        def count_many(files, keys):
            self.batches.append(len(keys))
            return many(files, keys)

        monkeypatch.setattr(
            grain.sources.ArrayRecordDataSource, "__getitem__", count_one
        )
        monkeypatch.setattr(ArrayRecordFiles, "read", count_many)


def test_a_pipeline_on_array_record_reads_a_batch_per_call_the_same_examples(
    path, monkeypatch
):
    ds = pipeline(path)
    loader = GrainLoader(ds, 8, seed=4)
    steps = range(3 * loader.steps_per_epoch)  # across two epoch ends
    wants = [per_record(ds, loader, step) for step in steps]
    reads = Reads(monkeypatch)
    dropped = 0
    for step, want in zip(steps, wants, strict=True):
        if any(e is None for e in want):  # the filter dropped example 37
            dropped += 1
            with pytest.raises(BatchError, match="Example 37 is None"):
                loader.batch_at(step)
        else:
            assert_same(loader.batch_at(step), want)
    assert dropped == 3  # once an epoch
    assert reads.records == 0  # never a record per call
    assert reads.batches == [8] * 3 * loader.steps_per_epoch
    assert loader.dataset is ds  # the user's pipeline, untouched
    assert type(ds.parents[0].parents[0].parents[0]._source).__name__ == (
        "ArrayRecordDataSource"
    )


@pytest.mark.parametrize("k", [1, 3])
def test_a_resumed_pipeline_reads_the_same_examples_from_its_step(path, k):
    ds = pipeline(path, keep=shaped)
    loader = GrainLoader(ds, 8, seed=4)
    start = 3  # epoch 0's fourth batch: the stream crosses into epoch 1, 2
    stream = loader.iter_from_step(start, steps_per_call=k)
    for call in range(9 // k):
        got = next(stream)
        for j in range(k):
            step = start + call * k + j
            batch = {key: v[j] for key, v in got.items()} if k > 1 else got
            assert_same(batch, per_record(ds, loader, step))
    stream.close()


@pytest.mark.slow  # a worker process
def test_a_pipeline_read_in_batches_in_a_grain_worker(path):
    ds = pipeline(path, keep=shaped)
    loader = GrainLoader(ds, 8, seed=4, workers=1)
    stream = loader.iter_from_step(4)
    for step in range(4, 12):
        assert_same(next(stream), per_record(ds, loader, step))
    stream.close()


class Passing(grain.MapDataset):
    """A user's own transformation: reads its parent a record at a time."""

    def __init__(self, parent):
        super().__init__(parent)

    def __len__(self):
        return len(self._parent)

    def __getitem__(self, index):
        return self._parent[index]


class OneByOne:
    """A data source with no batched read."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return example(i)


def _warnings(make) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = make()
        for step in range(12):
            loader.batch_at(step)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_pipeline_that_cannot_be_read_in_batches_is_said_once_with_the_fix(path):
    source = grain.sources.ArrayRecordDataSource([path])
    mine = Passing(grain.MapDataset.source(source)).map(decode)
    said = _warnings(lambda: GrainLoader(mine, 8, seed=4))
    assert len(said) == 1
    assert "one record per call" in said[0] and "Passing" in said[0]
    assert "grain.MapDataset.source(pztrain.data.BulkSource(source))" in said[0]
    alone = _warnings(lambda: GrainLoader(grain.MapDataset.source(OneByOne()), 8))
    assert len(alone) == 1
    assert re.search(
        "a OneByOne, reads one record per call: give it a __getitems__", alone[0]
    )
    halves = [
        grain.MapDataset.source(source)[:20],
        grain.MapDataset.source(source)[20:],
    ]
    both = grain.MapDataset.concatenate(halves).map(decode)
    said = _warnings(lambda: GrainLoader(both, 8, seed=4))
    assert len(said) == 1 and "combines several datasets" in said[0]


def test_pipelines_with_nothing_to_gain_read_as_they_are_without_a_word():
    in_memory = [example(i) for i in range(N)]
    for ds in (
        grain.MapDataset.range(N).map(example),
        grain.MapDataset.source(in_memory),
    ):
        assert _warnings(lambda ds=ds: GrainLoader(ds, 8, seed=4)) == []
