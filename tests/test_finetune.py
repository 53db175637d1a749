"""Weights in and merged weights out: Hugging Face checkpoints the tests write,
read into penzai's Llama-style transformer, dict params, equinox and Flax NNX
models through declared mappings, and written back bit for bit."""

from __future__ import annotations

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from finetune_checkpoints import (
    HF_CONFIG,
    abstract_llama,
    llama_logits,
    penzai_logits,
    write_llama,
)

from pztrain.finetune import (
    MappingError,
    MergeAxes,
    Rule,
    Slice,
    SplitAxis,
    Transpose,
    WeightMapping,
    export_pretrained,
    hf_llama_config,
    llama_config,
    llama_mapping,
    load_pretrained,
    read_config,
)

MAPPING = llama_mapping(llama_config(HF_CONFIG))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_llama(folder)


@pytest.mark.slow  # runs the penzai transformer un-jitted (seconds)
def test_llama_import_matches_a_numpy_llama(llama):
    folder, tensors = llama
    model, report = load_pretrained(folder, abstract_llama(), MAPPING)
    tokens = np.array([1, 5, 2, 9, 3, 3, 0])
    got = penzai_logits(model, tokens)
    np.testing.assert_allclose(got, llama_logits(tensors, tokens), atol=2e-5)
    assert len(report.loaded) == len(tensors) and not report.missing
    assert report.bytes_read == sum(x.nbytes for x in tensors.values())


@pytest.mark.parametrize("shard_bytes", [None, 3000])
def test_round_trip_reproduces_the_source_bit_for_bit(tmp_path, shard_bytes):
    tensors = write_llama(tmp_path / "src", shard_bytes=shard_bytes)
    if shard_bytes:
        assert (tmp_path / "src/model.safetensors.index.json").exists()
    model, _ = load_pretrained(tmp_path / "src", abstract_llama(), MAPPING)
    config = hf_llama_config(llama_config(read_config(tmp_path / "src")))
    export_pretrained(tmp_path / "out", model, MAPPING, config=config)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert list(out) == sorted(tensors)
    for name, x in tensors.items():
        assert out[name].dtype == x.dtype and out[name].tobytes() == x.tobytes()
    assert llama_config(read_config(tmp_path / "out")) == llama_config(HF_CONFIG)


def test_the_rotary_base_is_read_as_each_transformers_version_writes_it():
    v5 = {**HF_CONFIG, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    del v5["rope_theta"]  # transformers 5 writes it in rope_parameters alone
    assert llama_config(v5).rope_wavelength == 5e5
    assert llama_config({**HF_CONFIG, "rope_theta": 5e5}).rope_wavelength == 5e5
    assert llama_config(HF_CONFIG).rope_wavelength == 1e4
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    for scaled in (
        {**HF_CONFIG, "rope_parameters": llama3},  # transformers 5
        {**HF_CONFIG, "rope_scaling": llama3},  # transformers 4
    ):
        with pytest.raises(ValueError, match=re.escape("{'rope_type': 'llama3'}")):
            llama_config(scaled)


def test_bfloat16_on_load_rounds_once(llama):
    folder, tensors = llama
    model, _ = load_pretrained(folder, abstract_llama(), MAPPING, dtype=jnp.bfloat16)
    back = {}
    export_pretrained(folder.parent / "bf16", model, MAPPING)
    back = safetensors.numpy.load_file(str(folder.parent / "bf16/model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    assert back[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back[name], tensors[name].astype(ml_dtypes.bfloat16))


def test_the_report_lists_loaded_missing_and_unexpected(tmp_path):
    tensors = {"a.weight": np.ones((3, 2), np.float32), "extra": np.ones(1, np.float32)}
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    like = {"a": jnp.zeros((2, 3)), "b": jnp.zeros(4)}
    mapping = WeightMapping([Rule("a.weight", "a", (Transpose((1, 0)),))])
    with pytest.raises(MappingError, match=re.escape("params no tensor fills ['b']")):
        load_pretrained(tmp_path, like, mapping)
    params, report = load_pretrained(tmp_path, like, mapping, partial=True)
    assert (report.loaded, report.missing, report.unexpected) == (
        {"a": "a.weight"},
        ("b",),
        ("extra",),
    )
    np.testing.assert_array_equal(params["a"], np.ones((2, 3)))
    np.testing.assert_array_equal(params["b"], np.zeros(4))
    assert "1 loaded, 1 missing, 1 unexpected" in str(report)


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, 3, key=k2)]


def _torch_mlp_tensors():
    rng = np.random.default_rng(1)
    return {
        "net.0.weight": rng.normal(size=(8, 4)).astype(np.float32),
        "net.0.bias": rng.normal(size=(8,)).astype(np.float32),
        "net.2.weight": rng.normal(size=(3, 8)).astype(np.float32),
        "net.2.bias": rng.normal(size=(3,)).astype(np.float32),
    }


def test_an_equinox_model_from_a_torch_mlp(tmp_path):
    """equinox's Linear stores (out, in) as PyTorch does: names only."""
    tensors = _torch_mlp_tensors()
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    mapping = WeightMapping(
        [
            Rule("net.0.{p}", "layers/0/{p}"),
            Rule("net.2.{p}", "layers/1/{p}"),
        ]
    )
    like = eqx.filter_eval_shape(EqxMLP, jax.random.key(0))
    model, _ = load_pretrained(tmp_path, like, mapping)
    x = np.ones(4, np.float32)
    h = np.maximum(tensors["net.0.weight"] @ x + tensors["net.0.bias"], 0)
    want = tensors["net.2.weight"] @ h + tensors["net.2.bias"]
    got = model.layers[1](jax.nn.relu(model.layers[0](x)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    export_pretrained(tmp_path / "out", model, mapping)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert all(out[n].tobytes() == x.tobytes() for n, x in tensors.items())


def test_an_nnx_model_from_a_torch_mlp(tmp_path):
    """Flax's Linear holds (in, out) kernels: a transpose per weight."""
    from flax import nnx

    tensors = _torch_mlp_tensors()
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    t = (Transpose((1, 0)),)
    mapping = WeightMapping(
        [
            Rule("net.0.weight", "l1/kernel", t),
            Rule("net.0.bias", "l1/bias"),
            Rule("net.2.weight", "l2/kernel", t),
            Rule("net.2.bias", "l2/bias"),
        ]
    )
    model, report = load_pretrained(tmp_path, MLP(nnx.Rngs(0)), mapping)
    assert set(report.loaded) == {"l1/kernel", "l1/bias", "l2/kernel", "l2/bias"}
    x = np.ones(4, np.float32)
    h = np.maximum(tensors["net.0.weight"] @ x + tensors["net.0.bias"], 0)
    want = tensors["net.2.weight"] @ h + tensors["net.2.bias"]
    np.testing.assert_allclose(model.l2(jax.nn.relu(model.l1(x))), want, rtol=1e-5)


def test_a_fused_projection_split_and_merged_back(tmp_path):
    rng = np.random.default_rng(2)
    fused = rng.normal(size=(2 * 3 + 4, 5)).astype(np.float32)  # (q | k) rows
    safetensors.numpy.save_file(
        {"qk.weight": fused}, str(tmp_path / "model.safetensors")
    )
    mapping = WeightMapping(
        [
            Rule("qk.weight", "q", (Slice(0, 0, 6), SplitAxis(0, (2, 3)))),
            Rule("qk.weight", "k", (Slice(0, 6, 10), Transpose((1, 0)))),
        ]
    )
    like = {"q": jnp.zeros((2, 3, 5)), "k": jnp.zeros((5, 4))}
    params, _ = load_pretrained(tmp_path, like, mapping)
    np.testing.assert_array_equal(params["q"], fused[:6].reshape(2, 3, 5))
    np.testing.assert_array_equal(params["k"], fused[6:].T)
    export_pretrained(tmp_path / "out", params, mapping)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert out["qk.weight"].tobytes() == fused.tobytes()


def test_merge_axes_reads_heads_into_one_axis(tmp_path):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    safetensors.numpy.save_file({"w": x}, str(tmp_path / "model.safetensors"))
    mapping = WeightMapping([Rule("w", "w", (MergeAxes(0, (2, 3)),))])
    params, _ = load_pretrained(tmp_path, {"w": jnp.zeros((6, 4))}, mapping)
    np.testing.assert_array_equal(params["w"], x.reshape(6, 4))
    export_pretrained(tmp_path / "out", params, mapping)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    np.testing.assert_array_equal(out["w"], x)


# ---------------------------------------------------------------- bad input


def _one(tmp_path, tensors):
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_rule_that_matches_nothing_is_named(tmp_path):
    path = _one(tmp_path, {"a.weight": np.ones(2, np.float32)})
    mapping = WeightMapping([Rule("a.weight", "a"), Rule("b.{i}.weight", "b/{i}")])
    with pytest.raises(
        MappingError,
        match=re.escape("the rule 'b.{i}.weight' -> 'b/{i}' matches no tensor"),
    ):
        load_pretrained(path, {"a": jnp.zeros(2)}, mapping)


def test_two_names_mapped_onto_one_are_named(tmp_path):
    ones = np.ones(2, np.float32)
    path = _one(tmp_path, {"x.0.w": ones, "x.1.w": ones})
    with pytest.raises(MappingError, match="same fields"):
        Rule("x.{i}.w", "w")  # a template losing a field would join names
    rules = [Rule("x.0.w", "w"), Rule("x.{i}.w", "v/{i}"), Rule("x.1.w", "w")]
    mapping = WeightMapping(rules)
    like = {"w": jnp.zeros(2), "v": {"0": jnp.zeros(2), "1": jnp.zeros(2)}}
    with pytest.raises(MappingError, match=re.escape("'x.0.w' and 'x.1.w' of")):
        load_pretrained(path, like, mapping)


def test_a_shape_no_transform_fits_names_the_tensor_and_both_shapes(tmp_path):
    path = _one(tmp_path, {"a.weight": np.ones((3, 2), np.float32)})
    mapping = WeightMapping([Rule("a.weight", "a")])
    msg = "Tensor 'a.weight' of {} is float32[3, 2], but the param 'a' is float32[2, 3]"
    with pytest.raises(MappingError, match=re.escape(msg.format(path))):
        load_pretrained(path, {"a": jnp.zeros((2, 3))}, mapping)
    mapping = WeightMapping([Rule("a.weight", "a", (SplitAxis(0, (2, -1)),))])
    with pytest.raises(MappingError, match=r"SplitAxis.*does not fit an axis of 3"):
        load_pretrained(path, {"a": jnp.zeros((2, 3))}, mapping)


def test_a_float_tensor_into_an_integer_param_is_refused(tmp_path):
    path = _one(tmp_path, {"a": np.ones(2, np.float32), "n": np.ones(2, np.float32)})
    mapping = WeightMapping([Rule("a", "a"), Rule("n", "n")])
    with pytest.raises(MappingError, match="a float cannot be loaded into an integer"):
        load_pretrained(
            path, {"a": jnp.zeros(2), "n": jnp.zeros(2, jnp.int32)}, mapping
        )


def test_an_index_naming_a_missing_shard_is_named(tmp_path):
    write_llama(tmp_path, shard_bytes=3000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"to the shard {shard}, which is missing")
    ):
        load_pretrained(tmp_path, abstract_llama(), MAPPING)


def test_export_refuses_a_param_no_rule_maps_back_before_writing(tmp_path):
    mapping = WeightMapping([Rule("a.weight", "a")])
    with pytest.raises(MappingError, match=re.escape("no rule maps the param 'b'")):
        export_pretrained(
            tmp_path / "out", {"a": jnp.ones(2), "b": jnp.ones(2)}, mapping
        )
    assert not (tmp_path / "out").exists()


def test_a_box_of_the_target_reads_only_its_rows_of_the_source():
    """What a process reads for the devices it holds (one process here holds
    all eight, so the mesh case reads every tensor whole, once)."""
    from pztrain.finetune._transforms import read_plan, shapes_along, to_target

    rule = MAPPING.rules[-4]  # q_proj (16, 16) -> query (16, 2, 2, 4)
    shapes = shapes_along(rule.transforms, (16, 16))
    source = np.arange(256, dtype=np.float32).reshape(16, 16)
    everything = tuple((0, n) for n in shapes[-1])
    whole = to_target(
        rule.transforms, source, read_plan(rule.transforms, shapes, everything)[0]
    )
    box = ((0, 16), (1, 2), (0, 2), (0, 4))  # the second head group
    boxes, got = read_plan(rule.transforms, shapes, box)
    assert boxes[0] == ((8, 16), (0, 16)) and got == box
    part = to_target(rule.transforms, source[8:16], boxes)
    np.testing.assert_array_equal(part, whole[:, 1:2])
    box = ((0, 16), (0, 2), (0, 2), (0, 2))  # half of each head: rows apart
    boxes, got = read_plan(rule.transforms, shapes, box)
    assert boxes[0] == ((0, 16), (0, 16)) and got == everything


def test_a_penzai_v1_model_round_trips(tmp_path):
    from models import penzai_v1_mlp

    rng = np.random.default_rng(4)
    tensors = {
        "fc0.weight": rng.normal(size=(16, 2)).astype(np.float32),
        "fc0.bias": rng.normal(size=(16,)).astype(np.float32),
        "fc1.weight": rng.normal(size=(2, 16)).astype(np.float32),
        "fc1.bias": rng.normal(size=(2,)).astype(np.float32),
    }
    path = _one(tmp_path, tensors)
    mapping = WeightMapping(
        [
            Rule("fc{i}.weight", "Affine_{i}.Linear.weights", (Transpose((1, 0)),)),
            Rule("fc{i}.bias", "Affine_{i}.AddBias.bias"),
        ]
    )
    model, report = load_pretrained(path, penzai_v1_mlp(seed=3), mapping)
    assert len(report.loaded) == 4
    export_pretrained(tmp_path / "out", model, mapping)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert all(out[n].tobytes() == x.tobytes() for n, x in tensors.items())


def test_a_frozen_penzai_models_params_are_named_and_put_back_as_split_does(llama):
    from penzai import pz

    from pztrain import partition
    from pztrain.finetune._load import model_params

    skeleton = abstract_llama()
    named, rebuild = model_params(skeleton)  # one pass over a frozen model
    assert named.keys() == partition.split(skeleton, frozen=True)[0].keys()
    model, _ = load_pretrained(llama[0], skeleton, MAPPING)
    frozen = pz.freeze_params(model)
    named, rebuild = model_params(frozen)
    params, rest = partition.split(frozen, frozen=True)
    assert named.keys() == params.keys()
    new = {k: x + 1 for k, x in named.items()}
    fast = rebuild(new)
    slow = partition.to_user_model(partition.merge(new, rest))
    a, b = pz.unbind_params(fast, freeze=True), pz.unbind_params(slow, freeze=True)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert isinstance(fast.body.sublayers[0], type(slow.body.sublayers[0]))
