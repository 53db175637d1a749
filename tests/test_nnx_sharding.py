"""NNX sharding annotations (nnx.with_partitioning) in ShardingRules and on a mesh."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pztrain
from pztrain.partition import annotated_specs
from pztrain.sharding import ShardingError, ShardingRules, param_specs

# An NNX model made on a mesh per test: seconds. The fast subset keeps the
# doctest of annotated_specs.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


class Annotated(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(
            16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, (None, "model"))
        )
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(
            32, 4, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", None))
        )

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


def _mesh(names=("data", "model")):
    return jax.make_mesh((1,) * len(names), names, axis_types=(AxisType.Auto,) * 2)


def _state(mesh):
    with jax.set_mesh(mesh):  # flax shards annotated variables as it makes them
        model = Annotated(nnx.Rngs(0))
    return pztrain.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))


def test_annotations_place_params_after_patterns_and_before_fsdp():
    mesh = _mesh()
    state = _state(mesh)
    assert annotated_specs(state.model_without_params) == {
        "l1/kernel": P(None, "model"),
        "l2/kernel": P("model", None),
    }
    specs = param_specs(state, mesh)
    assert specs["l1/kernel"] == P(None, "model")
    assert specs["l2/kernel"] == P("model")
    assert specs["l1/bias"] == P()
    rules = ShardingRules(patterns=[("l1/kernel", P("data"))], fsdp="data")
    specs = param_specs(state, mesh, rules)
    assert specs["l1/kernel"] == P("data")  # a pattern wins
    assert specs["l2/kernel"] == P("model")  # the annotation beats fsdp
    assert specs["l1/bias"] == P("data")  # fsdp for the rest


def test_an_annotation_naming_an_axis_the_mesh_lacks_is_named():
    state = _state(_mesh())
    with pytest.raises(
        ShardingError,
        match=re.escape(
            "Parameter 'l1/kernel' is annotated with sharding (None, 'model') "
            "(nnx.with_partitioning / out_sharding), which names mesh axis "
            "'model'; the mesh has ['data', 'tensor']."
        ),
    ):
        param_specs(state, _mesh(("data", "tensor")))


@pytest.mark.slow
def test_nnx_on_eight_devices_matches_one_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "nnx_mesh_worker.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "nnx on 8 devices: ok" in result.stdout
