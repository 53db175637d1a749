"""The loop's APIs on Auto, Explicit and mixed meshes of 8 simulated CPU
devices: `fit` with the `ArrayLoader`s, `evaluate` and eval steps, save and
restore into target shardings, and the summary; run by ``test_mesh.py`` in a
subprocess (the device count must be set before jax is imported)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mesh_cases import LAYOUTS, batches, loss_fn, make_state, mesh, shardings_of

import pztrain
from pztrain.checkpoint import load_params, load_state, save_params, save_state
from pztrain.sharding import data_sharding, sharded_initial_state, state_shardings

# (layout, axis types): FSDP on 8 devices, and a 4 x 2 data x model mesh whose
# "mixed" kind has an Explicit data axis and an Auto model axis.
MESHES = [("fsdp", "auto"), ("fsdp", "explicit"), ("2d", "explicit"), ("2d", "mixed")]


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


def _on(layout, types):
    """A mesh of ``layout`` with axes of ``types``, and a state on it."""
    shape, names, rules = LAYOUTS[layout]
    m = mesh(shape, names, types)
    return m, rules, sharded_initial_state(make_state, m, rules)


def _data():
    x, y = batches(4, 64)
    return {"x": x.reshape(-1, 16), "y": y.reshape(-1, 4)}  # 256 rows, 8 batches


def _loader(m=None, **kw):
    sharding = None if m is None else data_sharding(m)
    return pztrain.ArrayLoader(_data(), 32, seed=1, sharding=sharding, **kw)


def _close(got, want, atol=1e-5):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)


@functools.cache
def _fit_on_one_device():
    step = pztrain.build_train_step(loss_fn)
    state, _ = pztrain.fit(make_state(), step, _loader(), num_steps=12, progress=False)
    return jax.device_get(state.params)


@pytest.mark.parametrize(
    ("on_device", "steps_per_call"), [(False, 1), (True, 1), (True, 2)]
)
@pytest.mark.parametrize(("layout", "types"), MESHES)
def test_fit_with_an_array_loader_equals_one_device(
    layout, types, on_device, steps_per_call
):
    """12 steps (an epoch and a half) from a loader that puts each batch on
    the mesh, or keeps the epoch there (``on_device=True``), equal one
    device's within 1e-5; every array keeps its sharding."""
    m, _, state = _on(layout, types)
    before = shardings_of(state)
    loader = _loader(m, on_device=on_device)
    if on_device:  # each device holds its rows of every batch of the epoch
        epoch = loader.device_epoch(0).arrays["x"]
        assert epoch.sharding.mesh == m and epoch.sharding.spec == P(None, "data")
    step = pztrain.build_train_step(loss_fn, mesh=m, steps_per_call=steps_per_call)
    state, history = pztrain.fit(
        state, step, loader, num_steps=12, log_every=4, progress=False
    )
    assert int(state.step) == 12 and np.isfinite(history.last()["metrics"]["loss"])
    assert shardings_of(state) == before
    _close(jax.device_get(state.params), _fit_on_one_device())


def eval_fn(*, model, state, rng, x, y):
    loss, _, _ = loss_fn(model=model, state=state, rng=rng, x=x, y=y)
    return {"loss": loss, "mean_x": x.mean()}


@pytest.mark.parametrize(("layout", "types"), MESHES)
def test_eval_steps_and_evaluate_equal_one_device(layout, types):
    """An eval step given a host batch or one split over the mesh, and
    `pztrain.evaluate` over a loader (host or on-device), a list of host
    batches, each give one device's metrics within 1e-5; nothing is donated."""
    m, _, state = _on(layout, types)
    before = shardings_of(state)
    one, eval_step = make_state(), pztrain.build_eval_step(eval_fn)
    x, y = batches(1, 32)
    want = jax.device_get(eval_step(one, x=x[0], y=y[0]))
    on_mesh = pztrain.build_eval_step(eval_fn)
    placed = pztrain.put_batch({"x": x[0], "y": y[0]}, data_sharding(m))
    for batch in (placed, {"x": x[0], "y": y[0]}):
        got = on_mesh(state, **batch)
        assert got["loss"].sharding.device_set == set(m.devices.flat)
        _close(jax.device_get(got), want)
    data = _data()
    listed = [{k: v[i : i + 32] for k, v in data.items()} for i in range(0, 256, 32)]
    want = pztrain.evaluate(one, eval_step, listed)
    for source in (
        pztrain.ArrayLoader(data, 32, shuffle=False, sharding=data_sharding(m)),
        pztrain.ArrayLoader(
            data, 32, shuffle=False, sharding=data_sharding(m), on_device=True
        ),
        listed,
    ):
        _close(pztrain.evaluate(state, on_mesh, source), want)
    assert shardings_of(state) == before
    assert not state.params["w1"].is_deleted()


def _host(tree):
    """Every array of ``tree`` on the host (PRNG keys as their data)."""

    def get(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(get, tree)


def _assert_same(got, want):
    flat, tree = jax.tree.flatten_with_path(_host(got))
    assert tree == jax.tree.structure(_host(want))
    for (path, x), y in zip(flat, jax.tree.leaves(_host(want)), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state trained 3 steps with FSDP on an Explicit mesh, saved (state
    and params), with its values and its params after 2 more steps."""
    work = tmp_path_factory.mktemp("explicit_ckpt")
    m, _, state = _on("fsdp", "explicit")
    step = pztrain.build_train_step(loss_fn, mesh=m)
    x, y = batches(5, 32)
    for i in range(3):
        state, _ = step(state, x=x[i], y=y[i])
    save_state(work / "state", state)
    save_params(work / "params", state)
    values = _host(state)
    for i in (3, 4):
        state, _ = step(state, x=x[i], y=y[i])
    return work, values, jax.device_get(state.params)


# The same layout, the same layout on Auto axes, a 4 x 2 tensor-parallel layout
# (Explicit and mixed), and data parallel on Auto axes.
TARGETS = [*MESHES, ("dp", "auto")]


@pytest.mark.parametrize(("layout", "types"), TARGETS)
def test_a_state_saved_on_an_explicit_mesh_restores_into_target_shardings(
    saved, layout, types
):
    """`load_state` and `load_params` into a concrete target and an abstract
    one (shape, dtype and sharding): the saved values in the target's
    shardings, shown in the summary; the restored state trains on as the
    saved one did (within 1e-5)."""
    work, values, want = saved
    m, rules, like = _on(layout, types)
    targets = shardings_of(like)
    abstract = jax.eval_shape(make_state)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        state_shardings(abstract, m, rules),
    )
    for target in (like, abstract):
        state = load_state(work / "state", target)
        assert shardings_of(state) == targets
        _assert_same(state, values)
        params = load_params(work / "params", target.params)
        assert shardings_of(params) == targets.params
        _assert_same(params, values.params)
    rows = {r.name: r.sharding for r in state.summary().rows}
    assert rows == {k: str(x.sharding.spec) for k, x in state.params.items()}
    if layout == "2d":
        assert rows["w1"] == "P(None, 'model')" and rows["w2"] == "P('model',)"
    step = pztrain.build_train_step(loss_fn, mesh=m)
    x, y = batches(5, 32)
    for i in (3, 4):
        state, _ = step(state, x=x[i], y=y[i])
    assert shardings_of(state) == targets
    _close(jax.device_get(state.params), want)
