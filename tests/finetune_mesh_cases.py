"""Reading a checkpoint onto 8 simulated devices and training LoRA adapters
over it there, run by ``test_finetune_mesh.py`` in a subprocess (the device
count is set before jax is imported)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from finetune_checkpoints import HF_CONFIG, abstract_llama, write_llama
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz

import pztrain
from pztrain import partition
from pztrain.finetune import (
    LoraConfig,
    add_lora,
    export_peft,
    is_adapter,
    llama_config,
    llama_mapping,
    load_pretrained,
)

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


# ------------------------------------------------------------ LoRA on the mesh

LORA = LoraConfig(rank=2, alpha=4.0, targets=r"attention/(query|value)")
TOKENS = np.random.default_rng(0).integers(0, 11, (8, 9)).astype(np.int32)
TX = optax.adam(3e-2)  # one optimizer object: the runs on the mesh share a program


def _lm_loss(*, model, state, rng, tokens):
    logits = model(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq"))
    logits = logits.untag("batch", "seq", "vocabulary").unwrap()
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return loss.mean(), state, {"loss": loss.mean()}


def _fsdp(mesh):
    """Each base weight split over "data" (FSDP), as `ShardingRules` say."""
    rules = pztrain.ShardingRules(fsdp="data")
    names, _ = partition.split(abstract_llama(), frozen=True)
    return {
        n: NamedSharding(mesh, rules.spec(n, tuple(x.shape), None, mesh))
        for n, x in names.items()
    }


def _lora_fit(folder, ckpt, num_steps, step, mesh=None, resume=False):
    """A LoRA run over the base in ``folder``: on ``mesh``, the base read
    straight onto it (FSDP), the state then put there as the many-devices
    guide does (`pztrain.shard_state`: the adapters replicated)."""
    shardings = None if mesh is None else _fsdp(mesh)
    base, _ = load_pretrained(folder, abstract_llama(), MAPPING, shardings=shardings)
    model = add_lora(base, LORA, jax.random.key(1))
    state = pztrain.TrainState.initial_state(
        model, TX, jax.random.key(0), trainable=is_adapter
    )
    if mesh is not None:
        state = pztrain.shard_state(state, mesh)
    batches = [{"tokens": TOKENS}, {"tokens": TOKENS[::-1]}] * 2
    return pztrain.fit(
        state,
        step,
        batches,
        num_steps=num_steps,
        log_every=2,
        checkpoints=pztrain.Checkpoints(ckpt, every_steps=2, async_save=False),
        resume=resume,
        progress=False,
        loggers=[],
    )[0]


def test_lora_over_a_base_read_onto_the_mesh_resumes_and_exports(tmp_path):
    folder = tmp_path / "llama"
    write_llama(folder)
    mesh = jax.make_mesh((8,), ("data",))
    on_mesh = pztrain.build_train_step(_lm_loss, mesh=mesh)
    straight = _lora_fit(folder, tmp_path / "a", 4, on_mesh, mesh)
    weights, _ = partition.split(straight.model, frozen=True)
    for name, sharding in _fsdp(mesh).items():  # the base stayed split
        assert weights[name].sharding == sharding, name
    split = weights["transformer/block_0/mlp/out_linear.weights"].sharding
    assert not split.is_fully_replicated

    _lora_fit(folder, tmp_path / "b", 2, on_mesh, mesh)
    resumed = _lora_fit(folder, tmp_path / "b", 4, on_mesh, mesh, resume=True)
    assert int(resumed.step) == 4
    for name, x in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], x, name)

    one = _lora_fit(folder, tmp_path / "c", 4, pztrain.build_train_step(_lm_loss))
    for run, state in (("mesh", straight), ("one", one)):
        export_peft(tmp_path / run, state.model, MAPPING)
    read = lambda run: safetensors.numpy.load_file(  # noqa: E731
        str(tmp_path / run / "adapter_model.safetensors")
    )
    mesh_peft, one_peft = read("mesh"), read("one")
    assert set(mesh_peft) == set(one_peft) and len(one_peft) == 8
    for name, x in one_peft.items():
        assert np.abs(x).max() > 0, name  # trained, not B's zeros
        np.testing.assert_allclose(mesh_peft[name], x, atol=2e-5, err_msg=name)
