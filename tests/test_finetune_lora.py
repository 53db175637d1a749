"""Low-rank adapters over an imported base: the base frozen in
``model_without_params`` (bf16, no optimizer state), the adapters float32
params; training, params-alone checkpoints, resume, merging, for penzai,
equinox and Flax NNX."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from finetune_checkpoints import HF_CONFIG, abstract_llama, penzai_logits, write_llama
from penzai import pz

import pztrain
from pztrain.finetune import (
    LoraConfig,
    Rule,
    WeightMapping,
    add_lora,
    export_pretrained,
    is_adapter,
    llama_config,
    llama_mapping,
    load_pretrained,
    merge_lora,
)

MAPPING = llama_mapping(llama_config(HF_CONFIG))
LORA = LoraConfig(rank=2, alpha=4.0, targets=r"attention/(query|value)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_llama(folder)


def lm_loss(*, model, state, rng, tokens):
    logits = model(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq"))
    logits = logits.untag("batch", "seq", "vocabulary").unwrap()
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    target = tokens[:, 1:]
    loss = -jnp.mean(jnp.take_along_axis(logp, target[..., None], -1))
    return loss, state, {"loss": loss}


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 11, (4, 9)), jnp.int32)


def lora_state(folder, dtype=jnp.bfloat16, seed=1):
    base, _ = load_pretrained(folder, abstract_llama(), MAPPING, dtype=dtype)
    model = add_lora(base, LORA, jax.random.key(seed))
    return pztrain.TrainState.initial_state(
        model, optax.adam(3e-2), jax.random.key(0), trainable=is_adapter
    )


def test_the_adapters_are_the_params_and_the_base_stays_frozen(llama):
    state = lora_state(llama[0])
    assert set(state.params) == {
        f"transformer/block_{i}/attention/{w}/LoRA_{ab}.weights"
        for i in range(2)
        for w in ("query", "value")
        for ab in "AB"
    }
    assert all(x.dtype == jnp.float32 for x in state.params.values())
    rest = [x for x in jax.tree.leaves(state.model_without_params) if x.ndim >= 1]
    assert {x.dtype for x in rest if x.size > 1} == {jnp.dtype(jnp.bfloat16)}
    n_params = sum(x.size for x in state.params.values())
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    assert n_opt == 2 * n_params + 1  # two moments of the adapters, a count


@pytest.mark.slow  # compiles a step
def test_a_lora_run_on_one_device_compiles_its_step_once(llama):
    """A base read onto the default device is uncommitted, as the adapters are:
    a state mixing committed and uncommitted arrays compiled its step again at
    the second call (the first call's outputs are committed)."""
    state = lora_state(llama[0])
    assert not any(x.committed for x in jax.tree.leaves(state))
    compiles = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        step = pztrain.build_train_step(lm_loss)
        for _ in range(3):
            state, _ = step(state, tokens=TOKENS)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == 1, compiles


@pytest.mark.slow  # compiles and trains for seconds
def test_a_fresh_adapter_leaves_the_outputs_and_trains_the_loss_down(llama):
    state = lora_state(llama[0], dtype=jnp.float32)
    base, _ = load_pretrained(llama[0], abstract_llama(), MAPPING)
    tokens = np.array([1, 5, 2, 9, 3])
    np.testing.assert_array_equal(
        penzai_logits(state.model, tokens), penzai_logits(base, tokens)
    )
    step = pztrain.build_train_step(lm_loss)
    losses = []
    for _ in range(30):
        state, aux = step(state, tokens=TOKENS)
        losses.append(float(aux["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.slow  # compiles and trains for seconds
def test_merged_adapters_give_the_adapted_outputs_and_export(llama, tmp_path):
    state = lora_state(llama[0], dtype=jnp.float32)
    step = pztrain.build_train_step(lm_loss)
    for _ in range(5):
        state, _ = step(state, tokens=TOKENS)
    merged = merge_lora(state.model)
    tokens = np.array([1, 5, 2, 9, 3])
    np.testing.assert_allclose(
        penzai_logits(merged, tokens), penzai_logits(state.model, tokens), atol=1e-4
    )
    export_pretrained(tmp_path / "merged", merged, MAPPING)
    again, _ = load_pretrained(tmp_path / "merged", abstract_llama(), MAPPING)
    np.testing.assert_allclose(
        penzai_logits(again, tokens), penzai_logits(merged, tokens), atol=1e-6
    )


def test_zero_adapters_merge_to_the_source_bit_for_bit(llama, tmp_path):
    folder, tensors = llama
    state = lora_state(folder, dtype=jnp.float32)
    export_pretrained(tmp_path / "out", merge_lora(state.model), MAPPING)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert all(out[n].tobytes() == x.tobytes() for n, x in tensors.items())


@pytest.mark.slow  # compiles and trains for seconds
def test_params_alone_are_the_adapters_and_load_into_a_fresh_lora_model(
    llama, tmp_path
):
    state = lora_state(llama[0])
    step = pztrain.build_train_step(lm_loss)
    for _ in range(3):
        state, _ = step(state, tokens=TOKENS)
    path = pztrain.save_params(tmp_path / "adapters", state)
    assert set(pztrain.read_metadata(path)["params"]["names"]) == set(state.params)
    fresh = lora_state(llama[0], seed=7)
    loaded = pztrain.load_params(path, fresh)
    for name, x in state.params.items():
        np.testing.assert_array_equal(loaded.params[name], x)


@pytest.mark.slow  # two fits with checkpoints
def test_a_lora_run_resumes_where_it_stopped(llama, tmp_path):
    step = pztrain.build_train_step(lm_loss)
    data = [{"tokens": TOKENS}] * 12

    def run(num_steps, resume, folder):
        ckpts = pztrain.Checkpoints(folder, every_steps=2, async_save=False)
        return pztrain.fit(
            lora_state(llama[0]),
            step,
            data,
            num_steps=num_steps,
            log_every=2,
            checkpoints=ckpts,
            resume=resume,
            progress=False,
            loggers=[],
        )[0]

    straight = run(8, False, tmp_path / "a")
    run(4, False, tmp_path / "b")
    resumed = run(8, True, tmp_path / "b")
    assert int(resumed.step) == 8
    for name, x in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], x)


def test_shard_state_keeps_a_base_read_onto_the_mesh_where_it_is(llama):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",))
    name = "transformer/block_0/mlp/out_linear.weights"
    split = NamedSharding(mesh, P("data", None))
    base, _ = load_pretrained(
        llama[0], abstract_llama(), MAPPING, shardings={name: split}
    )
    state = pztrain.TrainState.initial_state(
        add_lora(base, LORA, jax.random.key(1)),
        optax.adam(3e-2),
        jax.random.key(0),
        trainable=is_adapter,
    )
    placed = pztrain.shard_state(state, mesh)
    weights, _ = pztrain.partition.split(placed.model, frozen=True)
    assert weights[name].sharding == split  # not gathered: P() would
    other = weights["transformer/block_0/mlp/value_linear.weights"]
    assert other.sharding.spec == P()  # on one device, now on the mesh
    assert all(x.sharding.spec == P() for x in placed.params.values())


def test_targets_that_match_no_linear_are_named(llama):
    base, _ = load_pretrained(llama[0], abstract_llama(), MAPPING)
    with pytest.raises(ValueError, match=re.escape("matches no linear layer's weight")):
        add_lora(base, LoraConfig(2, 4.0, "attention/qkv"), jax.random.key(0))


# ---------------------------------------------------------------- equinox, NNX


def _mlp_checkpoint(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "net.0.weight": rng.normal(size=(16, 4)).astype(np.float32),
        "net.0.bias": rng.normal(size=(16,)).astype(np.float32) * 0.1,
        "net.2.weight": rng.normal(size=(1, 16)).astype(np.float32) * 0.25,
        "net.2.bias": np.zeros(1, np.float32),
    }
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Linear(4, 16, key=k1), eqx.nn.Linear(16, 1, key=k2)]

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


X = jnp.asarray(np.random.default_rng(2).normal(size=(32, 4)), jnp.float32)
Y = jnp.sin(X[:, :1] * 2)


def _mse(*, model, state, rng, x, y):
    loss = jnp.mean((jax.vmap(model)(x) - y) ** 2)
    return loss, state, {"loss": loss}


def _train(model, steps=40):
    state = pztrain.TrainState.initial_state(
        model, optax.adam(3e-2), jax.random.key(0), trainable=is_adapter
    )
    step = pztrain.build_train_step(_mse)
    losses = []
    for _ in range(steps):
        state, aux = step(state, x=X, y=Y)
        losses.append(float(aux["loss"]))
    return state, losses


@pytest.mark.slow  # compiles and trains for seconds
def test_equinox_lora_trains_and_merges_back(tmp_path):
    tensors = _mlp_checkpoint(tmp_path)
    mapping = WeightMapping(
        [Rule("net.0.{p}", "layers/0/{p}"), Rule("net.2.{p}", "layers/1/{p}")]
    )
    base, _ = load_pretrained(
        tmp_path, eqx.filter_eval_shape(EqxMLP, jax.random.key(0)), mapping
    )
    model = add_lora(base, LoraConfig(2, 2.0, r"layers/\d/weight"), jax.random.key(1))
    state, losses = _train(model)
    assert set(state.params) == {f"layers/{i}/lora_{ab}" for i in (0, 1) for ab in "ab"}
    assert losses[-1] < 0.7 * losses[0], losses
    merged = merge_lora(state.model)
    np.testing.assert_allclose(jax.vmap(merged)(X), jax.vmap(state.model)(X), atol=1e-5)
    fresh = merge_lora(model)
    export_pretrained(tmp_path / "out", fresh, mapping)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert all(out[n].tobytes() == x.tobytes() for n, x in tensors.items())


@pytest.mark.slow  # compiles and trains for seconds
def test_nnx_lora_trains_and_merges_back(tmp_path):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = (
                nnx.Linear(4, 16, rngs=rngs),
                nnx.Linear(16, 1, rngs=rngs),
            )

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    tensors = _mlp_checkpoint(tmp_path)
    t = (pztrain.finetune.Transpose((1, 0)),)
    mapping = WeightMapping(
        [
            Rule("net.0.weight", "l1/kernel", t),
            Rule("net.0.bias", "l1/bias"),
            Rule("net.2.weight", "l2/kernel", t),
            Rule("net.2.bias", "l2/bias"),
        ]
    )
    base, _ = load_pretrained(tmp_path, MLP(nnx.Rngs(0)), mapping)
    model = add_lora(base, LoraConfig(2, 2.0, r"l\d/kernel"), jax.random.key(1))
    state, losses = _train(model)
    assert set(state.params) == {f"l{i}/lora_{ab}" for i in (1, 2) for ab in "ab"}
    assert losses[-1] < 0.7 * losses[0], losses
    merged = merge_lora(state.model)
    np.testing.assert_allclose(merged(X), state.model(X), atol=1e-5)
    export_pretrained(tmp_path / "out", merge_lora(model), mapping)
    out = safetensors.numpy.load_file(str(tmp_path / "out/model.safetensors"))
    assert all(out[n].tobytes() == x.tobytes() for n, x in tensors.items())


@pytest.mark.slow  # compiles and trains for seconds
def test_an_ema_of_the_adapters_alone(llama, tmp_path):
    base, _ = load_pretrained(llama[0], abstract_llama(), MAPPING, dtype=jnp.bfloat16)
    model = add_lora(base, LORA, jax.random.key(1))
    tx = pztrain.with_ema(optax.adam(3e-2), 0.9)
    state = pztrain.TrainState.initial_state(
        model, tx, jax.random.key(0), trainable=is_adapter
    )
    step = pztrain.build_train_step(lm_loss)
    for _ in range(3):
        state, _ = step(state, tokens=TOKENS)
    ema = pztrain.ema.ema_params_of(state.opt_state)
    assert set(ema) == set(state.params)
    assert all(x.dtype == jnp.float32 for x in ema.values())
    path = pztrain.save_params(tmp_path / "ema", state, ema=True)
    assert set(pztrain.read_metadata(path)["params"]["names"]) == set(state.params)


# ------------------------------------------------- the evaluation job, the EMA


def lm_eval(*, model, state, rng, tokens):
    return {"loss": lm_loss(model=model, state=state, rng=rng, tokens=tokens)[0]}


def ema_lora_state(folder, seed=1):
    base, _ = load_pretrained(folder, abstract_llama(), MAPPING, dtype=jnp.bfloat16)
    model = add_lora(base, LORA, jax.random.key(seed))
    tx = pztrain.with_ema(optax.adam(3e-2), 0.5)
    return pztrain.TrainState.initial_state(
        model, tx, jax.random.key(0), trainable=is_adapter
    )


@pytest.mark.slow  # a fit with evaluations and checkpoints, then the job
def test_the_evaluation_job_on_a_lora_run_gives_the_runs_own_evaluations(
    llama, tmp_path
):
    valid = [{"tokens": TOKENS[:2]}, {"tokens": TOKENS[2:]}]
    evaluations = [
        pztrain.Evaluation("plain", pztrain.build_eval_step(lm_eval), valid, every=2),
        pztrain.Evaluation(
            "avg", pztrain.build_eval_step(lm_eval), valid, every=2, ema="both"
        ),
    ]
    state, history = pztrain.fit(
        ema_lora_state(llama[0]),
        pztrain.build_train_step(lm_loss),
        [{"tokens": TOKENS[::-1]}, {"tokens": TOKENS}] * 3,
        num_steps=6,
        log_every=2,
        evaluations=evaluations,
        checkpoints=pztrain.Checkpoints(
            tmp_path / "ckpt", every_steps=2, keep_last=3, async_save=False
        ),
        progress=False,
        loggers=[],
    )
    run = {r["step"]: r["metrics"] for r in history.records if r["split"] == "eval"}
    assert sorted(run) == [2, 4, 6] and {"plain/loss", "avg/ema/loss"} <= set(run[2])
    like = ema_lora_state(llama[0], seed=7)  # other adapters: all from the files
    job = pztrain.evaluate_checkpoints(
        tmp_path / "ckpt", like, evaluations, run_dir=tmp_path / "job",
        follow=False, priority=None,
    )  # fmt: skip
    got = {r["step"]: r["metrics"] for r in job.records}
    assert sorted(got) == [2, 4, 6]
    for step, metrics in got.items():
        assert metrics == {k: run[step][k] for k in metrics}, step
    assert got[6]["avg/ema/loss"] != got[6]["avg/loss"]

    # The EMA of a full-state checkpoint: adapters alone, into a LoRA state
    # built the same way (a bare model counts its frozen base as params too).
    meta = pztrain.read_metadata(tmp_path / "ckpt" / "6")
    assert set(meta["params"]["names"]) == set(state.params) == set(state.ema_params)
    fresh = ema_lora_state(llama[0], seed=7)
    loaded = pztrain.load_params(tmp_path / "ckpt" / "6", fresh, ema=True)
    ema_state = state.using_ema()
    assert set(loaded.params) == set(ema_state.params)
    for name, x in ema_state.params.items():
        assert x.dtype == jnp.float32
        np.testing.assert_array_equal(loaded.params[name], x, name)
    tokens = np.array([1, 5, 2, 9, 3])
    np.testing.assert_array_equal(
        penzai_logits(loaded.model, tokens), penzai_logits(ema_state.model, tokens)
    )
