"""Adapters out in PEFT's layout and back in: names in the source
checkpoint's naming, factors whose product is the merged weights' change, and
the checks on the way in."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from finetune_checkpoints import HF_CONFIG, abstract_llama, write_llama

from pztrain.finetune import (
    LoraConfig,
    MappingError,
    Rule,
    WeightMapping,
    add_lora,
    export_peft,
    export_pretrained,
    llama_config,
    llama_mapping,
    load_peft,
    load_pretrained,
    merge_lora,
)
from pztrain.finetune._load import model_params

MAPPING = llama_mapping(llama_config(HF_CONFIG))
LORA = LoraConfig(rank=2, alpha=4.0, targets=r"attention/(query|output)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_llama(folder)


def _with_random_adapters(model, seed=3):
    """The adapters set to random values (as training would leave them)."""
    params, rebuild = model_params(model)
    rng = np.random.default_rng(seed)
    new = {
        n: jnp.asarray(rng.normal(size=np.shape(x)), x.dtype) * 0.1
        for n, x in params.items()
        if "LoRA_" in n or "lora_" in n
    }
    return rebuild({**params, **new})


def _lora_llama(folder, config=LORA, seed=1):
    base, _ = load_pretrained(folder, abstract_llama(), MAPPING)
    return add_lora(base, config, jax.random.key(seed))


def test_peft_factors_multiply_to_the_merged_change(llama, tmp_path):
    folder, tensors = llama
    model = _with_random_adapters(_lora_llama(folder))
    export_peft(tmp_path / "peft", model, MAPPING, base_model_name_or_path="me/tiny")
    config = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert config["r"] == 2 and config["lora_alpha"] == 4.0
    assert config["target_modules"] == ["o_proj", "q_proj"]
    assert config["base_model_name_or_path"] == "me/tiny"
    peft = safetensors.numpy.load_file(str(tmp_path / "peft/adapter_model.safetensors"))
    assert len(peft) == 8
    export_pretrained(tmp_path / "merged", merge_lora(model), MAPPING)
    merged = safetensors.numpy.load_file(str(tmp_path / "merged/model.safetensors"))
    for i in range(2):
        for proj in ("q_proj", "o_proj"):
            module = f"model.layers.{i}.self_attn.{proj}"
            a = peft[f"base_model.model.{module}.lora_A.weight"]
            b = peft[f"base_model.model.{module}.lora_B.weight"]
            assert a.shape == (2, 16) and b.shape == (16, 2)
            want = tensors[f"{module}.weight"] + 2.0 * b @ a  # alpha / r = 2
            np.testing.assert_allclose(merged[f"{module}.weight"], want, atol=1e-5)
    unadapted = "model.layers.0.self_attn.k_proj.weight"
    assert merged[unadapted].tobytes() == tensors[unadapted].tobytes()


def test_peft_adapters_load_back_into_a_fresh_lora_model(llama, tmp_path):
    model = _with_random_adapters(_lora_llama(llama[0]))
    export_peft(tmp_path, model, MAPPING)
    fresh = _lora_llama(llama[0], seed=9)
    loaded = load_peft(tmp_path, fresh, MAPPING)
    want, got = model_params(model)[0], model_params(loaded)[0]
    for name, x in want.items():
        np.testing.assert_array_equal(got[name], x, name)


def test_peft_in_refuses_another_rank_or_other_targets(llama, tmp_path):
    export_peft(tmp_path, _with_random_adapters(_lora_llama(llama[0])), MAPPING)
    rank4 = _lora_llama(llama[0], LoraConfig(4, 8.0, LORA.targets))
    with pytest.raises(
        ValueError, match=re.escape("have rank r=2; the model's have rank 4")
    ):
        load_peft(tmp_path, rank4, MAPPING)
    other = _lora_llama(llama[0], LoraConfig(2, 4.0, "attention/query"))
    msg = (
        "are on modules ['model.layers.0.self_attn.o_proj', "
        "'model.layers.1.self_attn.o_proj'] the model has none on"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        load_peft(tmp_path, other, MAPPING)
    alpha = _lora_llama(llama[0], LoraConfig(2, 8.0, LORA.targets))
    with pytest.raises(
        ValueError, match=re.escape("have lora_alpha=4.0; the model's have alpha 8.0")
    ):
        load_peft(tmp_path, alpha, MAPPING)


def test_adapters_of_another_base_are_refused_before_writing(llama, tmp_path):
    model = _lora_llama(llama[0])
    other = WeightMapping(
        [Rule("model.embed_tokens.weight", "transformer/embedder.embeddings")]
    )
    with pytest.raises(
        MappingError,
        match=re.escape(
            "added to a base whose names the custom mapping does not match"
        ),
    ):
        export_peft(tmp_path / "peft", model, other)
    assert not (tmp_path / "peft").exists()


def test_equinox_and_nnx_adapters_round_trip_through_peft(tmp_path):
    import equinox as eqx
    from flax import nnx

    eqx_model = {"proj": eqx.nn.Linear(4, 6, key=jax.random.key(0))}
    mapping = WeightMapping([Rule("proj.{p}", "proj/{p}")])
    lora = LoraConfig(2, 2.0, "proj/weight")
    model = _with_random_adapters(add_lora(eqx_model, lora, jax.random.key(1)))
    export_peft(tmp_path / "eqx", model, mapping)
    peft = safetensors.numpy.load_file(str(tmp_path / "eqx/adapter_model.safetensors"))
    np.testing.assert_array_equal(
        peft["base_model.model.proj.lora_A.weight"], model["proj"].lora_a
    )
    back = load_peft(
        tmp_path / "eqx", add_lora(eqx_model, lora, jax.random.key(5)), mapping
    )
    np.testing.assert_array_equal(back["proj"].lora_b, model["proj"].lora_b)

    class One(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(4, 6, rngs=nnx.Rngs(0))

    t = (pztrain_transpose(),)
    mapping = WeightMapping(
        [Rule("proj.weight", "proj/kernel", t), Rule("proj.bias", "proj/bias")]
    )
    lora = LoraConfig(2, 2.0, "proj/kernel")
    model = _with_random_adapters(add_lora(One(), lora, jax.random.key(1)))
    export_peft(tmp_path / "nnx", model, mapping)
    peft = safetensors.numpy.load_file(str(tmp_path / "nnx/adapter_model.safetensors"))
    np.testing.assert_array_equal(
        peft["base_model.model.proj.lora_A.weight"], model.proj.lora_a[...].T
    )
    back = load_peft(
        tmp_path / "nnx", add_lora(One(), lora, jax.random.key(5)), mapping
    )
    np.testing.assert_array_equal(back.proj.lora_b[...], model.proj.lora_b[...])


def pztrain_transpose():
    from pztrain.finetune import Transpose

    return Transpose((1, 0))


def test_dropout_acts_while_training_and_is_written_to_the_config(tmp_path):
    import equinox as eqx

    base = {"proj": eqx.nn.Linear(4, 6, key=jax.random.key(0))}
    lora = LoraConfig(2, 2.0, "proj/weight", dropout=0.5)
    model = _with_random_adapters(add_lora(base, lora, jax.random.key(1)))
    x = jnp.ones(4)
    plain, dropped = model["proj"](x), model["proj"](x, key=jax.random.key(2))
    assert not np.allclose(plain, dropped)
    np.testing.assert_array_equal(model["proj"](x), plain)  # no key: no dropout
    mapping = WeightMapping([Rule("proj.{p}", "proj/{p}")])
    export_peft(tmp_path, model, mapping)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.5


@pytest.mark.slow  # runs the penzai transformer un-jitted (seconds)
def test_penzai_dropout_reads_the_random_stream(llama):
    from penzai import pz

    lora = LoraConfig(2, 4.0, "attention/query", dropout=0.5)
    model = pz.freeze_params(_with_random_adapters(_lora_llama(llama[0], lora)))
    tokens = pz.nx.wrap(jnp.array([1, 5, 2, 9])).tag("seq")

    def run(seed):
        stream = pz.RandomStream.from_base_key(jax.random.key(seed))
        return model(tokens, random_stream=stream).unwrap("seq", "vocabulary")

    np.testing.assert_array_equal(run(0), run(0))
    assert not np.allclose(run(0), run(1))  # a mask drawn from the stream
