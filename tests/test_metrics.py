"""MetricSums: on-device sums of step metrics, one array, read as means."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pztrain.metrics import MetricSums, Summary, metric_names

ADD = jax.jit(MetricSums.add)


def test_metric_sums_are_one_array_with_static_names():
    sums = MetricSums.zeros(["loss", "acc"])
    leaves, treedef = jax.tree.flatten(sums)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.float32
    summed = ADD(sums, jnp.float32(jnp.nan), {"acc": jnp.float32(0.5)}, jnp.int32(7))
    summed = ADD(summed, jnp.float32(2.0), {"acc": jnp.float32(1.0)}, jnp.int32(8))
    assert jax.tree.structure(summed) == treedef
    summary = summed.read()
    assert summary.count == 2 and summary.nonfinite == 1
    assert summary.first_nonfinite_step == 7
    assert summary.means["acc"] == 0.75 and np.isnan(summary.means["loss"])


@pytest.mark.parametrize("first", [0, 7, 65535, 65536, 2**24 + 3, 2**31 - 2])
def test_metric_sums_keep_the_first_nonfinite_step_exactly(first):
    sums = MetricSums.zeros(["loss"])
    sums = ADD(sums, jnp.float32(1.0), {}, jnp.int32(first - 1 if first else 0))
    sums = ADD(sums, jnp.float32(jnp.inf), {}, jnp.int32(first))
    sums = ADD(sums, jnp.float32(jnp.nan), {}, jnp.int32(first + 1))
    summary = sums.read()
    assert summary.first_nonfinite_step == first
    assert (summary.count, summary.nonfinite) == (3, 2)


def test_reset_gives_zeros_with_the_same_names_and_keeps_the_old_sums():
    sums = ADD(MetricSums.zeros(["loss", "a/b"]), 3.0, {"a": {"b": 1.0}}, 0)
    fresh = sums.reset()
    assert fresh.names == ("loss", "a/b")
    assert fresh.read() == Summary({"loss": 0.0, "a/b": 0.0}, 0, 0, -1)
    assert sums.read().means == {"loss": 3.0, "a/b": 1.0}  # not donated by reset
    assert fresh.is_ready() in (True, False)
    fresh.packed.block_until_ready()
    assert fresh.is_ready()


def test_an_aux_loss_takes_the_place_of_the_loss_and_vectors_are_no_metrics():
    aux = {"loss": jnp.float32(5.0), "logits": jnp.zeros(3), "n": jnp.int32(2)}
    assert metric_names(aux) == ["loss", "n"]
    sums = ADD(MetricSums.zeros(metric_names(aux)), jnp.float32(1.0), aux, 0)
    assert sums.read().means == {"loss": 5.0, "n": 2.0}
    shapes = jax.eval_shape(lambda: aux)
    assert metric_names(shapes) == ["loss", "n"]  # shapes alone are enough
