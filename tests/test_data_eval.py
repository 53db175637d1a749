"""Every example of an evaluation counts: a loader's last partial batch too
(`pztrain.data.eval_batches`), on one device and on a mesh of 8 simulated
devices (in a subprocess: ``XLA_FLAGS`` must be set before jax is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain.data import ArrayLoader, GrainLoader, RecordLayout, eval_batches

ROOT = Path(__file__).resolve().parents[1]


def data(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {
        "x": rng.standard_normal((n, 3)).astype(np.float32),
        "y": rng.integers(0, 2, n).astype(np.int32),
    }


def eval_fn(*, model, state, rng, x, y):
    z = x @ model["w"]
    return {"sq": jnp.mean(z**2), "hit": jnp.mean((z > 0) == (y == 1))}


def state() -> pztrain.TrainState:
    w = jnp.array([0.5, -1.0, 2.0], jnp.float32)
    return pztrain.TrainState.initial_state({"w": w}, optax.sgd(0.1), jax.random.key(0))


def whole(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """The metrics over the whole set at once, in float64."""
    z = arrays["x"].astype(np.float64) @ np.array([0.5, -1.0, 2.0])
    return {"sq": np.mean(z**2), "hit": np.mean((z > 0) == (arrays["y"] == 1))}


def loaders(arrays: dict[str, np.ndarray], batch: int) -> dict[str, object]:
    layout = RecordLayout.like(arrays)
    hf = datasets.Dataset.from_dict(arrays).with_format("numpy")
    examples = grain.MapDataset.source(layout.encode(arrays)).map(
        lambda r: {k: v[0] for k, v in layout([r]).items()}
    )
    return {
        "array": ArrayLoader(arrays, batch, shuffle=True, seed=1),
        "array, partial kept": ArrayLoader(arrays, batch, drop_remainder=False),
        "grain records": GrainLoader(layout.encode(arrays), batch, decode=layout),
        "grain .map": GrainLoader(examples, batch, shuffle=False),
        "hugging face": GrainLoader(hf, batch, seed=3),
    }


@pytest.mark.parametrize(
    "kind",
    ["array", "array, partial kept", "grain records", "grain .map", "hugging face"],
)
def test_4000_examples_in_batches_of_3000_evaluate_as_the_whole_set(kind):
    arrays = data(4000)
    loader = loaders(arrays, 3000)[kind]
    got = pztrain.evaluate(state(), pztrain.build_eval_step(eval_fn), loader)
    want = whole(arrays)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-6, err_msg=name)
    rows = [len(b["y"]) for b in eval_batches(loader)]
    assert rows == [3000, 1000]


def test_fit_evaluates_every_example_of_a_grain_loader():
    arrays = data(4000)
    layout = RecordLayout.like(arrays)
    valid = GrainLoader(layout.encode(arrays), 3000, decode=layout)

    def loss_fn(*, model, state, rng, x, y):  # a zero loss: the params stay
        loss = 0.0 * jnp.mean(x @ model["w"])
        return loss, state, {"loss": loss}

    _, history = pztrain.fit(
        state(), pztrain.build_train_step(loss_fn), ArrayLoader(arrays, 100),
        num_steps=2, eval_step=pztrain.build_eval_step(eval_fn), eval_data=valid,
        eval_every=2, progress=False, loggers=[],
    )  # fmt: skip
    (record,) = [r for r in history.records if r["split"] == "eval"]
    want = whole(arrays)
    for name in want:
        np.testing.assert_allclose(record["metrics"][name], want[name], rtol=2e-6)


def test_eval_batches_hold_every_example_once_whatever_the_shuffle():
    arrays = {"i": np.arange(103, dtype=np.int64)}
    for loader in (
        ArrayLoader(arrays, 10, seed=4),
        GrainLoader(RecordLayout.like(arrays).encode(arrays), 10, seed=4,
                    decode=RecordLayout.like(arrays)),
    ):  # fmt: skip
        assert loader.steps_per_epoch == 10  # training: full batches only
        got = [b["i"] for b in eval_batches(loader)]
        assert [len(b) for b in got] == [10] * 10 + [3]
        assert sorted(np.concatenate(got).tolist()) == list(range(103))
    assert loader.rest(0).keys() == {"i"}  # the rest of epoch 0, as a batch


def test_a_loader_without_a_rest_and_plain_iterables_are_read_as_they_are():
    arrays = data(40)
    assert ArrayLoader(arrays, 8).rest(0) is None  # 40 = 5 batches of 8
    assert (
        GrainLoader(grain.MapDataset.source([{"x": np.ones(2)}] * 8), 4).rest() is None
    )
    plain = [{"x": np.ones((2, 3))}, {"x": np.ones((1, 3))}]
    assert [len(b["x"]) for b in eval_batches(plain)] == [2, 1]
    with pytest.raises(pztrain.BatchError):
        list(eval_batches([{"x": np.ones((2, 3)), "y": np.ones(3)}]))


MESH_CASES = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import test_data_eval as t
import pztrain
from pztrain.data import ArrayLoader, GrainLoader, RecordLayout, eval_batches

assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("data",))
sharding = pztrain.sharding.data_sharding(mesh)
state = pztrain.sharding.sharded_initial_state(t.state, mesh)
step = pztrain.build_eval_step(t.eval_fn)
for n, pieces in ((4000, [3000, 1000]), (4003, [3000, 1000, 3])):
    arrays = t.data(n)
    layout = RecordLayout.like(arrays)
    for loader in (
        ArrayLoader(arrays, 3000, seed=2, sharding=sharding),
        GrainLoader(layout.encode(arrays), 3000, decode=layout, sharding=sharding),
    ):
        got = list(eval_batches(loader))
        assert [len(b["y"]) for b in got] == pieces, [len(b["y"]) for b in got]
        specs = [b["x"].sharding.spec for b in got]
        assert specs[:2] == [P("data"), P("data")], specs  # split over the mesh
        assert specs[2:] in ([], [P()]), specs  # the 3 left over: replicated
        values = pztrain.evaluate(state, step, loader)
        want = t.whole(arrays)
        for name in want:
            np.testing.assert_allclose(values[name], want[name], rtol=2e-6)
print("ok 4000 4003")
"""


def test_on_a_mesh_of_8_devices_the_rest_is_split_and_counted_exactly(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", MESH_CASES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "ok 4000 4003", result.stdout[-3000:]
