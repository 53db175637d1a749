"""Explicit meshes on 8 simulated CPU devices: storage and compute layouts,
micro-batches, and the errors a step on a mesh gives; run by ``test_mesh.py`` in a
subprocess (the device count must be set before jax is imported)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_cases import (
    COLLECTIVES,
    LAYOUTS,
    batches,
    collectives,
    loss_fn,
    make_state,
    mesh,
    shardings_of,
)

import pztrain
from pztrain.sharding import ShardingError, ShardingRules, sharded_initial_state


@pytest.fixture(autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"


def _compiled(layout, types, **build):
    """The compiled HLO text of a step of ``layout`` on a mesh of ``types``."""
    shape, names, rules = LAYOUTS[layout]
    m = mesh(shape, names, types)
    state = sharded_initial_state(make_state, m, rules)
    step = pztrain.build_train_step(loss_fn, mesh=m, **build)
    x, y = batches(1, batch=64)
    return step.lower(state, x=x[0], y=y[0]).compile().as_text()


def _collectives_of(layout, types, **build):
    return collectives(_compiled(layout, types, **build))


def computations(text):
    """The lines of each computation of HLO text, by name (``"ENTRY"``)."""
    found, name = {}, None
    for line in text.splitlines():
        head = re.match(r"(ENTRY )?%(\S+) ", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            found[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            found[name].append(line)
    return found


def reductions_by_place(text):
    """All-reduces and reduce-scatters in the ENTRY computation and in the
    loops' bodies (with every computation they call), and the loops' count."""
    comps = computations(text)
    refs = {
        n: set(re.findall(r"%([\w.\-]+)", "\n".join(ls))) for n, ls in comps.items()
    }
    bodies = {
        b
        for ls in comps.values()
        for b in re.findall(r"body=%([\w.\-]+)", "\n".join(ls))
    }
    loop, todo = set(), list(bodies)
    while todo:  # a body and what it calls, transitively
        name = todo.pop()
        if name in comps and name not in loop:
            loop.add(name)
            todo.extend(refs[name])

    def count(names):
        pattern = r"\s(?:all-reduce|reduce-scatter)(?:-start)?\("
        return sum(len(re.findall(pattern, "\n".join(comps[n]))) for n in names)

    return {"entry": count(["ENTRY"]), "loop": count(loop), "loops": len(bodies)}


def _steps_equal_one_device(layout, types, microbatches, steps=5):
    """``steps`` steps on a mesh with micro-batches equal one device's on the
    whole batch (params within 1e-5), and keep the state's shardings."""
    shape, names, rules = LAYOUTS[layout]
    m = mesh(shape, names, types)
    state = sharded_initial_state(make_state, m, rules)
    before = shardings_of(state)
    step = pztrain.build_train_step(loss_fn, mesh=m, microbatches=microbatches)
    x, y = batches(steps, batch=64)
    for i in range(steps):
        state, aux = step(state, x=x[i], y=y[i])
    one, whole = make_state(), pztrain.build_train_step(loss_fn)
    for i in range(steps):
        one, want = whole(one, x=x[i], y=y[i])
    for name in one.params:
        np.testing.assert_allclose(state.params[name], one.params[name], atol=1e-5)
    np.testing.assert_allclose(aux["loss"], want["loss"], rtol=1e-5)
    assert shardings_of(state) == before


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_explicit_and_auto_meshes_compile_the_same_collectives(layout):
    assert _collectives_of(layout, "explicit") == _collectives_of(layout, "auto")


@pytest.mark.parametrize("types", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_microbatches_reduce_the_grads_once_per_step(layout, types):
    text = _compiled(layout, types, microbatches=4)
    gathers = {"dp": 0, "fsdp": 3}[layout]  # each FSDP param gathered once
    assert collectives(text) == {
        "all-reduce": 1,  # grads, loss and metrics together, after the scan
        "all-gather": gathers,
        "reduce-scatter": 0,
        "collective-permute": 0,
    }
    # Where: in the step's ENTRY computation, none in the micro-batch loop's
    # body (a reduction there would run once per micro-batch).
    assert reductions_by_place(text) == {"entry": 1, "loop": 0, "loops": 1}
    _steps_equal_one_device(layout, types, microbatches=4)


@pytest.mark.parametrize("types", ["auto", "explicit", "mixed"])
def test_microbatches_on_a_data_by_model_mesh_equal_one_device(types):
    """Tensor-parallel grads accumulate in their own layout (the scan's
    carry keeps the ``model`` axis) on a 4 x 2 mesh."""
    _steps_equal_one_device("2d", types, microbatches=4)


def test_a_default_mesh_trains_the_readme_way():
    m = jax.make_mesh((8,), ("data",))  # JAX's default: Explicit axes
    assert m.axis_types == (AxisType.Explicit,)
    state = sharded_initial_state(make_state, m, ShardingRules(fsdp="data"))
    x, y = batches(4, 64)
    loader = pztrain.ArrayLoader(
        {"x": x.reshape(-1, 16), "y": y.reshape(-1, 4)},
        batch_size=32,
        sharding=pztrain.sharding.data_sharding(m),
    )
    step = pztrain.build_train_step(loss_fn, mesh=m)
    eval_step = pztrain.build_eval_step(
        lambda *, model, state, rng, x, y: {
            "loss": loss_fn(model=model, state=state, rng=rng, x=x, y=y)[0]
        }
    )
    state, history = pztrain.fit(
        state, step, loader, num_steps=8, progress=False,
        eval_step=eval_step, eval_data=loader,
    )  # fmt: skip
    assert int(state.step) == 8 and np.isfinite(history.last("eval")["metrics"]["loss"])
    assert state.params["w1"].sharding.spec == P(None, "data")


def _transformer(key=0):
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=16,
        projection_dim=8,
        mlp_hidden_dim=32,
        num_decoder_blocks=1,
        vocab_size=32,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    return llamalike_common.build_llamalike_transformer(
        config, init_base_rng=jax.random.key(key), name="lm"
    )


def lm_loss(*, model, state, rng, tokens):
    from penzai import pz

    logits = model(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq"))
    logits = logits.untag("batch", "seq", "vocabulary").unwrap()
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return loss.mean(), state, {"loss": loss.mean()}


LM_RULES = ShardingRules(
    axes={"heads": "model", "neurons": "model", "vocabulary": "model"},
    fsdp="data",
)
TOKENS = np.random.default_rng(0).integers(0, 32, (5, 8, 9)).astype(np.int32)


def _lm_state():
    return pztrain.TrainState.initial_state(
        _transformer(), optax.adam(1e-2), jax.random.key(2)
    )


@pytest.mark.parametrize(
    ("types", "microbatches"),
    [("auto", 1), ("explicit", 1), ("mixed", 1), ("explicit", 2)],
)
def test_a_transformer_on_a_data_by_model_mesh_equals_one_device(types, microbatches):
    m = mesh((4, 2), ("data", "model"), types)
    state = sharded_initial_state(_lm_state, m, LM_RULES)
    assert any("model" in str(x.sharding.spec) for x in state.params.values())
    before = _leaf_shardings(state)
    step = pztrain.build_train_step(lm_loss, mesh=m, microbatches=microbatches)
    one, one_step = _lm_state(), pztrain.build_train_step(lm_loss)
    for t in TOKENS:
        state, _ = step(state, tokens=t)
        one, _ = one_step(one, tokens=t)
    for name in one.params:
        np.testing.assert_allclose(state.params[name], one.params[name], atol=1e-5)
    assert _leaf_shardings(state) == before


def _leaf_shardings(state):
    """The shardings of the state's step, params and optimizer state."""
    trees = (state.step, state.params, state.opt_state)
    return [x.sharding for x in jax.tree.leaves(trees)]


@functools.cache
def _transformer_collectives(types):
    """The collectives of the transformer's compiled step on a 4 x 2 mesh."""
    m = mesh((4, 2), ("data", "model"), types)
    state = sharded_initial_state(_lm_state, m, LM_RULES)
    step = pztrain.build_train_step(lm_loss, mesh=m)
    text = step.lower(state, tokens=TOKENS[0]).compile().as_text()
    ops = (*COLLECTIVES, "all-to-all")
    found = re.findall(r"\s(" + "|".join(ops) + r")(?:-start)?\(", text)
    return {op: found.count(op) for op in ops}


@pytest.mark.parametrize("types", ["explicit", "mixed"])
def test_a_transformer_compiles_the_collectives_of_auto_axes(types):
    """The step on Explicit or mixed axes compiles the collectives of the
    step on Auto axes (penzai named-axis rules on model, FSDP on data)."""
    assert _transformer_collectives(types) == _transformer_collectives("auto")
    # Auto's, measured (jax 0.10.2, CPU): 8 all-reduces over "model" (the
    # tensor-parallel partial sums, forward and backward), 1 over "data" (the
    # grads and the loss, fused), and the 3 FSDP-split norm scales gathered.
    assert _transformer_collectives("auto") == {
        "all-reduce": 9,
        "all-gather": 3,
        "reduce-scatter": 0,
        "collective-permute": 0,
        "all-to-all": 0,
    }


def test_a_batch_that_does_not_divide_over_the_data_axes_is_named():
    m = mesh((8,), ("data",), "explicit")
    state = sharded_initial_state(make_state, m)
    step = pztrain.build_train_step(loss_fn, mesh=m)
    x, y = batches(1, batch=12)
    with pytest.raises(pztrain.BatchError, match=r"batch\['x'\].*12.*8"):
        step(state, x=x[0], y=y[0])


def test_an_explicit_loss_that_fights_the_compute_layout_is_named():
    m = mesh((8,), ("data",), "explicit")
    state = sharded_initial_state(make_state, m, ShardingRules(fsdp="data"))

    def constrained(*, model, state, rng, x, y):
        h = jnp.tanh(x @ model["w1"] + model["b1"][None])  # split over "data"
        h = jax.lax.with_sharding_constraint(h, P(None, "data"))  # not so
        loss = jnp.mean((h @ model["w2"] - y) ** 2)
        return loss, state, {"loss": loss}

    step = pztrain.build_train_step(constrained, mesh=m, explicit_loss=True)
    x, y = batches(1)
    with pytest.raises(
        ShardingError, match=r"explicit_loss=True.*compute layout.*jax.sharding.reshard"
    ):
        step(state, x=x[0], y=y[0])
    auto = pztrain.build_train_step(constrained, mesh=m)  # auto mode: a hint
    state, aux = auto(state, x=x[0], y=y[0])
    assert np.isfinite(aux["loss"])


def test_a_state_on_another_mesh_of_the_same_devices_is_refused_by_name():
    """A 4 x 2 mesh, or the same 8 devices in reverse order: the step names
    an array, its mesh and the fix, at the first call or at a later one."""
    m = mesh((8,), ("data",), "explicit")
    step = pztrain.build_train_step(loss_fn, mesh=m)
    x, y = batches(2)
    four_by_two = sharded_initial_state(
        make_state, mesh((4, 2), ("data", "model"), "explicit"), LAYOUTS["2d"][2]
    )
    reversed_order = jax.sharding.Mesh(
        np.array(jax.devices()[::-1]), ("data",), axis_types=(AxisType.Explicit,)
    )
    backwards = sharded_initial_state(
        make_state, reversed_order, ShardingRules(fsdp="data")
    )

    def refused(shape, ids):
        return (
            re.escape(f"state.step is on a mesh {shape} over device ids [{ids}")
            + ".*not on the step's mesh.*"
            + re.escape("shard_state(state, train_step.mesh, rules)")
        )

    with pytest.raises(ShardingError, match=refused({"data": 4, "model": 2}, "0, 1")):
        step(four_by_two, x=x[0], y=y[0])
    with pytest.raises(ShardingError, match=refused({"data": 8}, "7, 6")):
        step(backwards, x=x[0], y=y[0])
    state, _ = step(sharded_initial_state(make_state, m), x=x[0], y=y[0])
    with pytest.raises(ShardingError, match=refused({"data": 8}, "7, 6")):
        step(backwards, x=x[1], y=y[1])  # after the program was compiled
    state, _ = step(state, x=x[1], y=y[1])
    assert int(state.step) == 2


def test_a_batch_on_the_mesh_but_not_split_is_split():
    """A batch already on the mesh's devices, replicated, is split along the
    data axis as a host batch is (with micro-batches, per device)."""
    from pztrain.step._call_batch import on_mesh

    m = mesh((8,), ("data",), "explicit")
    step = pztrain.build_train_step(loss_fn, mesh=m, microbatches=2)
    x, y = batches(1, batch=32)
    whole = NamedSharding(m, P())
    batch = {"x": jax.device_put(x[0], whole), "y": jax.device_put(y[0], whole)}
    placed = on_mesh(batch, step.batch_sharding)
    assert placed["x"].sharding == step.batch_sharding
    assert on_mesh(placed, step.batch_sharding) is placed  # nothing to do
    state, aux = step(sharded_initial_state(make_state, m), batch)
    want_state, want = step(sharded_initial_state(make_state, m), x=x[0], y=y[0])
    np.testing.assert_allclose(aux["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(state.params["w1"], want_state.params["w1"], atol=1e-6)


def test_microbatches_that_do_not_split_a_devices_share_name_the_global_shape():
    m = mesh((8,), ("data",), "explicit")
    step = pztrain.build_train_step(loss_fn, mesh=m, microbatches=4)
    x, y = batches(1, batch=16)
    with pytest.raises(
        pztrain.BatchError,
        match=r"batch\['x'\] has shape \[16, 16\]: 16 examples over 8 data shards "
        r"= 2 per device, not a multiple of 4.*divisible by 32",
    ):
        step(sharded_initial_state(make_state, m), x=x[0], y=y[0])
