"""Reading a checkpoint onto 8 simulated devices, run by ``test_finetune_mesh.py``
in a subprocess (the device count is set before jax is imported)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from finetune_checkpoints import HF_CONFIG, abstract_llama, write_llama
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pztrain import partition
from pztrain.finetune import llama_config, llama_mapping, load_pretrained

MAPPING = llama_mapping(llama_config(HF_CONFIG))


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


SPECS = {  # heads over "a", the rest over "b": boxes that are ranges of the
    # source (heads, embedding) and one that is not (projection, split inside)
    "transformer/embedder.embeddings": P(None, "b"),
    "transformer/block_0/attention/query.weights": P("b", "a"),
    "transformer/block_1/attention/query.weights": P(None, "a", None, "b"),
    "transformer/block_0/attention/output.weights": P("a", None, None, "b"),
    "transformer/block_0/mlp/out_linear.weights": P("b", None),
}


def test_each_tensor_is_read_once_and_lands_sharded(tmp_path):
    tensors = write_llama(tmp_path, shard_bytes=3000)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    shardings = {n: NamedSharding(mesh, s) for n, s in SPECS.items()}
    model, report = load_pretrained(
        tmp_path, abstract_llama(), MAPPING, shardings=shardings
    )
    assert report.bytes_read == sum(x.nbytes for x in tensors.values())
    params, _ = partition.split(model, frozen=True)
    for name in SPECS:
        x = params[name]
        assert x.sharding == shardings[name], name
        assert len({s.device for s in x.addressable_shards}) == 8
    reference, _ = load_pretrained(tmp_path, abstract_llama(), MAPPING)
    want, _ = partition.split(reference, frozen=True)
    for name, x in params.items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[name]), name)


def test_devices_holding_one_piece_share_one_host_buffer(tmp_path):
    """A replicated param, or a piece several devices hold, is made once and
    adopted by each of them (XLA:CPU): its bytes are in memory once, not once
    per device."""
    write_llama(tmp_path)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    specs = {
        "transformer/block_0/mlp/out_linear.weights": P(),  # transposed
        "transformer/embedder.embeddings": P(None, "a"),  # two halves, four each
        "transformer/block_1/attention/query.weights": P(None, "a"),
    }
    shardings = {n: NamedSharding(mesh, s) for n, s in specs.items()}
    model, _ = load_pretrained(tmp_path, abstract_llama(), MAPPING, shardings=shardings)
    params, _ = partition.split(model, frozen=True)
    reference, _ = load_pretrained(tmp_path, abstract_llama(), MAPPING)
    want, _ = partition.split(reference, frozen=True)
    for name, pieces in zip(specs, (1, 2, 2), strict=True):
        x = params[name]
        buffers = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        assert len(buffers) == pieces, (name, len(buffers))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want[name]), name)
