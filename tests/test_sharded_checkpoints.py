"""Checkpoints restore into the target's shardings, and into abstract targets."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import equinox_mlp, penzai_v2_mlp
from penzai import pz

from pztrain.checkpoint import (
    CheckpointMismatchError,
    load_params,
    load_state,
    save_params,
    save_state,
)
from pztrain.state import TrainState

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

HERE = Path(__file__).resolve().parent


def test_sharded_save_restores_into_other_meshes_abstract_targets_and_resume(
    tmp_path,
):
    """8-device FSDP save → 1 device, a 4-device mesh sharded otherwise, an
    abstract sharded target, `Checkpoints` resume and `fit(resume=True)`: each
    restored leaf has its target's sharding, the saved values, and training
    continues as the uninterrupted run (see sharded_ckpt_worker.py)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, str(HERE / "sharded_ckpt_worker.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK"), done.stdout


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert isinstance(x, jax.Array), type(x)
        np.testing.assert_array_equal(x, y)


def _on_first_device(tree):
    first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for x in jax.tree.leaves(tree):
        assert x.sharding == first, x.sharding


def test_load_params_into_abstract_penzai_v2_model(tmp_path):
    model = penzai_v2_mlp(seed=3)
    save_params(
        tmp_path / "p",
        TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0)),
    )
    # pz.Parameter cannot hold a ShapeDtypeStruct: the abstract model is frozen
    abstract = jax.eval_shape(lambda: pz.freeze_params(penzai_v2_mlp(seed=0)))
    assert isinstance(jax.tree.leaves(abstract)[0], jax.ShapeDtypeStruct)
    loaded = load_params(tmp_path / "p", abstract)
    got, want = pz.unbind_params(loaded)[1], pz.unbind_params(model)[1]
    assert [p.label for p in got] == [p.label for p in want]
    _leaves_equal([p.value for p in got], [p.value for p in want])
    _on_first_device([p.value for p in got])
    x = pz.nx.wrap(jnp.ones((3, 2))).tag("batch", "features")
    np.testing.assert_array_equal(
        loaded(x).unwrap("batch", "features"), model(x).unwrap("batch", "features")
    )


def test_load_params_into_abstract_equinox_model(tmp_path):
    model = equinox_mlp(seed=3)
    save_params(
        tmp_path / "p",
        TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0)),
    )
    abstract = eqx.filter_eval_shape(equinox_mlp, seed=0)
    loaded = load_params(tmp_path / "p", abstract)
    _leaves_equal(eqx.filter(loaded, eqx.is_array), eqx.filter(model, eqx.is_array))
    x = jnp.ones(2)
    np.testing.assert_array_equal(loaded(x), model(x))


def test_load_params_into_dict_of_shape_dtype_structs(tmp_path):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    save_params(tmp_path / "p", params)
    loaded = load_params(tmp_path / "p", jax.eval_shape(lambda: params))
    _leaves_equal(loaded, params)
    assert loaded["b"].dtype == jnp.bfloat16
    _on_first_device(loaded)


@pytest.mark.parametrize("family", ["dict", "equinox"])
def test_load_state_into_eval_shape_of_initial_state(tmp_path, family):
    def make(seed):
        model = equinox_mlp(seed) if family == "equinox" else {"w": jnp.ones(3) * seed}
        return TrainState.initial_state(model, optax.adam(0.1), jax.random.key(seed))

    state = make(3)
    save_state(tmp_path / "s", state)
    if family == "equinox":  # its activation function is no JAX type
        abstract = eqx.filter_eval_shape(make, 0)
    else:
        abstract = jax.eval_shape(lambda: make(0))
    loaded = load_state(tmp_path / "s", abstract)
    _leaves_equal(loaded.params, state.params)
    _leaves_equal(loaded.opt_state, state.opt_state)
    assert jax.random.key_impl(loaded.root_rng) == jax.random.key_impl(state.root_rng)
    np.testing.assert_array_equal(
        jax.random.key_data(loaded.root_rng), jax.random.key_data(state.root_rng)
    )
    _on_first_device((loaded.params, loaded.opt_state, loaded.step))


def test_abstract_leaves_a_params_checkpoint_cannot_fill_are_named(tmp_path):
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    save_params(tmp_path / "p", {"w": params["w"]})
    abstract = jax.eval_shape(lambda: params)
    with pytest.raises(CheckpointMismatchError, match=re.escape("fill: ['b']")):
        load_params(tmp_path / "p", abstract, partial=True)
    state = jax.eval_shape(
        lambda: TrainState.initial_state(params, optax.adam(0.1), jax.random.key(0))
    )
    save_params(tmp_path / "q", params)
    with pytest.raises(CheckpointMismatchError, match=r"\.opt_state.*load_state"):
        load_params(tmp_path / "q", state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_save_and_restore_a_sharded_state(tmp_path):
    """Two processes on 127.0.0.1 (2 CPU devices each, gloo): a sharded state
    saved by both restores into a sharded and an abstract target in both (see
    multiprocess_ckpt_worker.py)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]
    )
    port = str(_free_port())
    worker = str(HERE / "multiprocess_ckpt_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, port, str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert out.strip().endswith("OK"), out
