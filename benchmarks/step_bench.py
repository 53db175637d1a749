"""Train-step speed of pztrain against a hand-written ``jax.jit`` step and its peers.

Run from the repository root::

    python benchmarks/step_bench.py --quick            # < 2 minutes on 2 CPU cores
    python benchmarks/step_bench.py --full --json out.json
    python benchmarks/step_bench.py --full --workloads W0,W3 --impls raw,pztrain
    python benchmarks/step_bench.py --full --workloads W0 --gc off --objects 300000

Every implementation trains the same model, from the same initial params, on the
same batch, with ``optax.adam`` and softmax cross-entropy. All of them run in this
one process. Trials are interleaved: each round runs every implementation once,
in a shuffled order, with a baseline trial before and after each (B X B Y B …).
A trial runs a fixed number of calls with no host sync between steps and blocks
on the last output at its end. The speed of an implementation is the median over
rounds of its steps/s divided by the mean steps/s of the two baseline trials
around it (paired ratios). Each round runs with Python's garbage collector off
(as ``timeit`` does) and then on (as users run), ``--gc`` choosing; ``--objects
N`` holds N small objects for a collection to scan.

Besides speed it records the time of each implementation's first call (trace +
compile + one step, with JAX's caches cleared before each sample) and, for the
hand-written baselines and pztrain, the compiled step's ``memory_analysis()``:
argument, output, aliased (donated) and temporary bytes, and whether the aliased
bytes cover all params and optimizer-state bytes.

The ``pztrain fit`` column runs ``pztrain.fit`` (on-device metrics, a progress
bar, a log record every 100 steps) on an on-device ``ArrayLoader``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.metadata
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz

# Adam's learning rate (--learning-rate changes it). The benchmark trains on one
# fixed batch, so the loss reaches 0 within ~10k steps on W0; a side-by-side
# check found the same step time before and after that (26.7 µs trained-out
# against 26.4 µs at rate 0), so the figures do not depend on how far each
# implementation has trained.
LEARNING_RATE = 1e-3
FUSED = 32  # steps per call of the fused (lax.scan) implementations
FIT_MIN_STEPS = 300  # steps a fit trial runs at least: 3 of its log windows
SEED = 0


# ----------------------------------------------------------------------------
# workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model + batch size.

    Attributes:
      name: ``W0`` … ``W3``.
      title: A one-line description for the tables.
      batch: Examples (MLP) or sequences (transformer) per step.
      sizes: MLP layer widths, input first; empty for the transformer.
      blocks: Transformer blocks.
      seq: Transformer sequence length.
      vocab: Transformer vocabulary size.
      embed: Transformer embedding width.
    """

    name: str
    title: str
    batch: int
    sizes: tuple[int, ...] = ()
    blocks: int = 0
    seq: int = 0
    vocab: int = 0
    embed: int = 0

    @property
    def is_mlp(self) -> bool:
        return bool(self.sizes)


WORKLOADS = {
    "W0": Workload("W0", "MLP 8-8-8-2, batch 8", batch=8, sizes=(8, 8, 8, 2)),
    "W1": Workload(
        "W1", "MLP 64-256-256-10, batch 128", batch=128, sizes=(64, 256, 256, 10)
    ),
    "W2": Workload(
        "W2",
        "MLP 784-2048-2048-10, batch 512",
        batch=512,
        sizes=(784, 2048, 2048, 10),
    ),
    "W3": Workload(
        "W3",
        "penzai v2 transformer, 4 blocks, seq 32, batch 8",
        batch=8,
        blocks=4,
        seq=32,
        vocab=128,
        embed=32,
    ),
    "W3s": Workload(
        "W3s",
        "penzai v2 transformer, 1 block (quick stand-in for W3)",
        batch=8,
        blocks=1,
        seq=32,
        vocab=128,
        embed=32,
    ),
}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _copy(x: jax.Array) -> jax.Array:
    """A fresh device buffer, so that donating it cannot delete anyone else's."""
    return jnp.copy(x)


class Problem:
    """The shared data and initial params of one workload, in every model family.

    Each ``*_model`` method returns a new model holding its own copies of the
    same initial arrays, so an implementation that donates them harms no other.
    """

    def __init__(self, workload: Workload):
        self.workload = workload
        key_params, key_x, key_y = jax.random.split(jax.random.key(SEED), 3)
        w = workload
        if w.is_mlp:
            self._mlp = []
            keys = jax.random.split(key_params, len(w.sizes) - 1)
            for k, n_in, n_out in zip(keys, w.sizes[:-1], w.sizes[1:], strict=True):
                kw, kb = jax.random.split(k)
                weight = jax.random.normal(kw, (n_in, n_out)) * np.sqrt(2.0 / n_in)
                bias = 0.01 * jax.random.normal(kb, (n_out,))
                self._mlp.append((weight, bias))
            x = jax.random.normal(key_x, (w.batch, w.sizes[0]))
            y = jax.random.randint(key_y, (w.batch,), 0, w.sizes[-1])
        else:
            tokens = jax.random.randint(key_x, (w.batch, w.seq + 1), 0, w.vocab)
            x, y = tokens[:, :-1], tokens[:, 1:]
        self.batch = {"x": x, "y": y}
        self.stacked = {
            k: jnp.broadcast_to(v, (FUSED, *v.shape)).copy()
            for k, v in self.batch.items()
        }

    # --- the hand-written model: a flat dict of arrays + an apply function

    def raw_model(self) -> tuple[dict[str, jax.Array], Callable[..., jax.Array]]:
        """``(params, apply)`` with ``apply(params, x) -> logits``."""
        if self.workload.is_mlp:
            params = {}
            for i, (weight, bias) in enumerate(self._mlp):
                params[f"w{i}"], params[f"b{i}"] = _copy(weight), _copy(bias)
            return params, _mlp_apply
        # The transformer: params by penzai label; the structure closed over.
        unbound, values = pz.unbind_params(self.penzai_v2_model(), freeze=True)
        leaves, treedef = jax.tree.flatten(values)
        if len(leaves) != len(values):
            raise AssertionError("expected one array per penzai parameter")
        labels = [v.label for v in values]

        def apply(params, x):
            bound = treedef.unflatten([params[label] for label in labels])
            return penzai_v2_logits(pz.bind_variables(unbound, bound), x)

        return dict(zip(labels, leaves, strict=True)), apply

    # --- penzai v2

    def penzai_v2_model(self) -> Any:
        w = self.workload
        if not w.is_mlp:
            return _build_transformer(w)
        from penzai.models import simple_mlp

        model = simple_mlp.MLP.from_config(
            name="mlp", init_base_rng=jax.random.key(SEED), feature_sizes=list(w.sizes)
        )
        for param in pz.unbind_params(model)[1]:
            param.value = self._named_value(str(param.label), param.value)
        return model

    # --- penzai v1

    def penzai_v1_model(self) -> Any:
        from penzai.deprecated.v1 import pz as pz1
        from penzai.deprecated.v1.example_models import simple_mlp as simple_mlp_v1

        model = simple_mlp_v1.MLP.from_config(feature_sizes=list(self.workload.sizes))
        model = pz1.nn.initialize_parameters(model, jax.random.key(SEED))
        return (
            pz1.select(model)
            .at_instances_of(pz1.nn.Parameter)
            .apply(
                lambda p: dataclasses.replace(
                    p, value=self._named_value(p.name, p.value)
                )
            )
        )

    def _named_value(self, name: str, named: Any) -> Any:
        """``named`` (a penzai NamedArray) holding the shared array for ``name``."""
        layer = int(re.search(r"Affine_(\d+)", name).group(1))
        array = self._mlp[layer][0 if name.endswith("weights") else 1]
        if named.data_array.shape != array.shape:
            raise AssertionError(f"{name}: {named.data_array.shape} != {array.shape}")
        return dataclasses.replace(named, data_array=_copy(array))

    # --- Flax linen

    def flax_model(self) -> tuple[Any, dict[str, Any]]:
        """``(module, params)`` for a linen MLP."""
        import flax.linen as nn

        sizes = self.workload.sizes

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                for i, width in enumerate(sizes[1:]):
                    if i:
                        x = nn.relu(x)
                    x = nn.Dense(width)(x)
                return x

        module = MLP()
        params = {
            f"Dense_{i}": {"kernel": _copy(weight), "bias": _copy(bias)}
            for i, (weight, bias) in enumerate(self._mlp)
        }
        x = self.batch["x"]
        expected = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
        if jax.tree.structure(expected) != jax.tree.structure(params):
            raise AssertionError("Flax param names changed")
        return module, params

    # --- equinox

    def equinox_model(self) -> Any:
        import equinox as eqx

        sizes = self.workload.sizes
        if len(set(sizes[1:-1])) != 1:
            raise ValueError("eqx.nn.MLP needs equal hidden widths")
        model = eqx.nn.MLP(
            sizes[0], sizes[-1], sizes[1], len(sizes) - 2, key=jax.random.key(SEED)
        )
        weights = [_copy(w.T) for w, _ in self._mlp]
        biases = [_copy(b) for _, b in self._mlp]
        return eqx.tree_at(
            lambda m: (
                [layer.weight for layer in m.layers]
                + [layer.bias for layer in m.layers]
            ),
            model,
            weights + biases,
        )


def _mlp_apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    n_layers = len(params) // 2
    for i in range(n_layers):
        if i:
            x = jax.nn.relu(x)
        x = x @ params[f"w{i}"] + params[f"b{i}"]
    return x


def _build_transformer(w: Workload) -> Any:
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=w.embed,
        projection_dim=w.embed // 2,
        mlp_hidden_dim=4 * w.embed,
        num_decoder_blocks=w.blocks,
        vocab_size=w.vocab,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )
    return llamalike_common.build_llamalike_transformer(
        config, init_base_rng=jax.random.key(SEED), name="transformer"
    )


def penzai_v2_logits(model: Any, x: jax.Array) -> jax.Array:
    """Runs a penzai v2 MLP (``[batch, features]``) or transformer (tokens)."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        out = model(pz.nx.wrap(x).tag("batch", "seq"))
        return out.unwrap("batch", "seq", "vocabulary")
    out = model(pz.nx.wrap(x).tag("batch", "features"))
    return out.unwrap("batch", "features")


def _tree_nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


# ----------------------------------------------------------------------------
# implementations


@dataclasses.dataclass
class Runner:
    """A ready-to-run training loop of one implementation on one workload.

    Attributes:
      run: ``run(n)`` makes ``n`` calls (``n * steps_per_call`` optimizer steps)
        without syncing the host, keeps the new state for the next ``run`` and
        returns the last call's loss; the caller blocks on it.
      steps_per_call: Optimizer steps per call.
      lower: Lowers the jitted step for the current state (for memory stats).
      state_bytes: Bytes of params + optimizer state (+ loss state), all of which
        donation should alias.
      min_calls: Calls a trial makes at least, whatever its length (a ``fit``
        trial is one ``fit`` call: shorter than a few log windows, it would
        measure starting a run, not running one).
    """

    run: Callable[[int], Any]
    steps_per_call: int = 1
    lower: Callable[[], jax.stages.Lowered] | None = None
    state_bytes: int | None = None
    min_calls: int = 1


def _loop(step: Callable[..., Any], carry: list[Any], batch: dict[str, Any]):
    """``run(n)`` for a step ``(*carry, **batch) -> (*new_carry, loss)``."""

    def run(n: int) -> Any:
        c, loss = tuple(carry), None
        for _ in range(n):
            *c, loss = step(*c, **batch)
        carry[:] = c
        return loss

    return run


def build_raw(problem: Problem, fused: int = 1) -> Runner:
    """The baseline: a hand-written jitted step with donation."""
    params, apply = problem.raw_model()
    tx = optax.adam(LEARNING_RATE)

    def one(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(apply(p, x), y))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def many(params, opt_state, x, y):
        def body(carry, xy):
            params, opt_state, loss = one(*carry, *xy)
            return (params, opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (x, y))
        return params, opt_state, losses

    step = jax.jit(one if fused == 1 else many, donate_argnums=(0, 1))
    carry = [params, tx.init(params)]
    batch = problem.batch if fused == 1 else problem.stacked
    return Runner(
        _loop(step, carry, batch),
        steps_per_call=fused,
        lower=lambda: step.lower(*carry, **batch),
        state_bytes=_tree_nbytes(carry),
    )


def build_raw_counter(problem: Problem) -> Runner:
    """The baseline plus what a train state adds: an on-device step counter.

    The counter is taken and returned (and donated) like pztrain's and Flax's
    ``step``; the difference to the baseline is what keeping the step on the
    device costs, whatever the library.
    """
    params, apply = problem.raw_model()
    tx = optax.adam(LEARNING_RATE)

    def one(step, params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(apply(p, x), y))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return step + 1, optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(one, donate_argnums=(0, 1, 2))
    carry = [jnp.zeros((), jnp.int32), params, tx.init(params)]
    return Runner(
        _loop(step, carry, problem.batch),
        lower=lambda: step.lower(*carry, **problem.batch),
        state_bytes=_tree_nbytes(carry[1:]),
    )


def build_tight_scan(problem: Problem) -> Runner:
    """A hand-written ``lax.scan`` of ``FUSED`` steps on the pztrain column's
    model, as tight as a scan gets: the carry is the flat list of the model's
    parameter arrays and the optimizer state over them, the model is bound
    inside the body, the batch slices are the scanned inputs; it returns the
    losses."""
    unbound, values = pz.unbind_params(problem.penzai_v2_model(), freeze=True)
    leaves, treedef = jax.tree.flatten(values)
    if len(leaves) != len(values):
        raise AssertionError("expected one array per penzai parameter")
    tx = optax.adam(LEARNING_RATE)

    def loss_of(leaves, x, y):
        model = pz.bind_variables(unbound, treedef.unflatten(leaves))
        return cross_entropy(penzai_v2_logits(model, x), y)

    def body(carry, xy):
        leaves, opt_state = carry
        loss, grads = jax.value_and_grad(loss_of)(leaves, *xy)
        updates, opt_state = tx.update(grads, opt_state, leaves)
        return (optax.apply_updates(leaves, updates), opt_state), loss

    def many(leaves, opt_state, x, y):
        carry, losses = jax.lax.scan(body, (leaves, opt_state), (x, y))
        return *carry, losses

    step = jax.jit(many, donate_argnums=(0, 1))
    carry = [leaves, tx.init(leaves)]
    return Runner(
        _loop(step, carry, problem.stacked),
        steps_per_call=FUSED,
        lower=lambda: step.lower(*carry, **problem.stacked),
        state_bytes=_tree_nbytes(carry),
    )


def build_flax(problem: Problem) -> Runner:
    """Flax ``TrainState`` and a jitted step that donates it (the Flax docs' way)."""
    from flax.training import train_state

    module, params = problem.flax_model()
    state = train_state.TrainState.create(
        apply_fn=module.apply, params=params, tx=optax.adam(LEARNING_RATE)
    )

    def step(state, x, y):
        def loss_of(params):
            return cross_entropy(state.apply_fn({"params": params}, x), y)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), loss

    return Runner(_loop(jax.jit(step, donate_argnums=0), [state], problem.batch))


def build_flax_same(problem: Problem) -> Runner:
    """Flax's ``TrainState`` on the ``pztrain_dict`` column's model: the same
    dict of arrays, apply function, loss and aux, in a jitted step donating the
    state, called as Flax users write the loop: ``state, aux = step(state, x, y)``.
    """
    from flax.training import train_state

    params, apply = problem.raw_model()
    state = train_state.TrainState.create(
        apply_fn=apply, params=params, tx=optax.adam(LEARNING_RATE)
    )

    def train_step(state, x, y):
        def loss_of(params):
            loss = cross_entropy(state.apply_fn(params, x), y)
            return loss, {"loss": loss}

        grads, aux = jax.grad(loss_of, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), aux

    step = jax.jit(train_step, donate_argnums=0)
    holder = [state]
    x, y = problem.batch["x"], problem.batch["y"]

    def run(n: int) -> Any:
        state, aux = holder[0], None
        for _ in range(n):
            state, aux = step(state, x, y)
        holder[0] = state
        return aux["loss"]

    return Runner(
        run,
        lower=lambda: step.lower(holder[0], x, y),
        state_bytes=_tree_nbytes((state.params, state.opt_state)),
    )


def _penzai_loss(logits_fn: Callable[[Any, jax.Array], jax.Array]):
    """A loss function with penzai's contract (shared by v1, v2 and pztrain)."""

    def loss_fn(*, model, state, rng, x, y):
        del rng
        loss = cross_entropy(logits_fn(model, x), y)
        return loss, state, {"loss": loss}

    return loss_fn


def _penzai_v1_logits(model: Any, x: jax.Array) -> jax.Array:
    from penzai.deprecated.v1 import pz as pz1

    return model(pz1.nx.wrap(x).tag("batch", "features")).unwrap("batch", "features")


def build_penzai_v1(problem: Problem) -> Runner:
    """penzai v1 ``TrainState`` + ``build_train_step_fn`` with donation."""
    from penzai.deprecated.v1.toolshed import basic_training

    state = basic_training.TrainState.initial_state(
        problem.penzai_v1_model(), optax.adam(LEARNING_RATE), jax.random.key(SEED)
    )
    step = basic_training.build_train_step_fn(
        _penzai_loss(_penzai_v1_logits), donate_params_and_state=True
    )
    return Runner(_aux_loop(step, [state], problem.batch))


def _aux_loop(step: Callable[..., Any], holder: list[Any], batch: dict[str, Any]):
    """``run(n)`` for a step ``(state, **batch) -> (state, aux)``, called as its
    users write the loop: ``state, aux = step(state, x=x, y=y)``."""
    x, y = batch["x"], batch["y"]

    def run(n: int) -> Any:
        state, aux = holder[0], None
        for _ in range(n):
            state, aux = step(state, x=x, y=y)
        holder[0] = state
        return aux["loss"]

    return run


def build_penzai_v2(problem: Problem) -> Runner:
    """penzai v2 ``StatefulTrainer`` with donation."""
    from penzai.toolshed import basic_training

    trainer = basic_training.StatefulTrainer.build(
        root_rng=jax.random.key(SEED),
        model=problem.penzai_v2_model(),
        optimizer_def=optax.adam(LEARNING_RATE),
        loss_fn=_penzai_loss(penzai_v2_logits),
        donate_states=True,
    )
    batch = problem.batch

    def run(n: int) -> Any:
        aux = None
        for _ in range(n):
            aux = trainer.step(**batch)
        return aux["loss"]

    return Runner(run)


def build_equinox(problem: Problem) -> Runner:
    """An ``eqx.filter_jit`` step donating model and optimizer state."""
    import equinox as eqx

    model = problem.equinox_model()
    tx = optax.adam(LEARNING_RATE)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    # The batch comes first so that "all-except-first" donates all but it.
    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        x, y = batch

        def loss_of(model):
            return cross_entropy(jax.vmap(model)(x), y)

        loss, grads = eqx.filter_value_and_grad(loss_of)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    batch = (problem.batch["x"], problem.batch["y"])
    return Runner(_loop(lambda *c: step(batch, *c), [model, opt_state], {}))


def build_pztrain(problem: Problem, family: str = "penzai_v2", fused: int = 1):
    """pztrain ``TrainState.initial_state`` + ``build_train_step``."""
    import pztrain

    if family == "penzai_v2":
        model, logits_fn = problem.penzai_v2_model(), penzai_v2_logits
    else:
        model, logits_fn = problem.raw_model()
    state = pztrain.TrainState.initial_state(
        model, optax.adam(LEARNING_RATE), jax.random.key(SEED)
    )
    step = pztrain.build_train_step(_penzai_loss(logits_fn), steps_per_call=fused)
    batch = problem.batch if fused == 1 else problem.stacked
    holder = [state]
    return Runner(
        _aux_loop(step, holder, batch),
        steps_per_call=fused,
        lower=lambda: step.lower(holder[0], **batch),
        state_bytes=_tree_nbytes((state.params, state.opt_state, state.loss_fn_state)),
    )


def build_pztrain_program(problem: Problem) -> Runner:
    """pztrain's jitted program for the pztrain column, called with no Python
    around it: the flat arguments a call passes, and its outputs fed back.

    What any call path in Python can at best reach: the ceiling of the
    ``pztrain`` column (which builds a new `TrainState` around each call). It
    reads the step's private table of programs (a measurement, not an API).
    """
    import pztrain
    from pztrain.step._types import Carry

    state = pztrain.TrainState.initial_state(
        problem.penzai_v2_model(), optax.adam(LEARNING_RATE), jax.random.key(SEED)
    )
    step = pztrain.build_train_step(_penzai_loss(penzai_v2_logits))
    found = step._programs.lookup(
        state.model_without_params, state.optimizer_def, state.root_rng
    )
    carry = [Carry(state.step, state.params, state.opt_state, state.loss_fn_state)]
    batch = problem.batch

    def run(n: int) -> Any:
        c, out = carry[0], None
        for _ in range(n):
            out = found.step(c, found.key_data, found.rest, batch)
            c = out[0]
        carry[0] = c
        return out[2]["loss"]

    return Runner(run)


def build_pztrain_fit(problem: Problem, evaluations=()) -> Callable[[int], Any]:
    """``pztrain.fit`` on the pztrain column's model, loss and optimizer
    (``evaluations``: passed to ``fit``, for ``eval_bench.py``).

    The data is the workload's batch repeated (up to 256 times, 64 MiB), in an on-device
    ``ArrayLoader`` (shuffled per epoch, sliced inside the step). Each ``run(n)``
    is one ``fit`` call of ``n`` more steps with on-device metrics, a tqdm
    progress bar (written to /dev/null) and a log record every 100 steps (and at
    its end). Returns the new params to block on.
    """
    import tqdm

    import pztrain

    model = problem.penzai_v2_model()
    logits_fn = penzai_v2_logits
    state = pztrain.TrainState.initial_state(
        model, optax.adam(LEARNING_RATE), jax.random.key(SEED)
    )
    step = pztrain.build_train_step(_penzai_loss(logits_fn))
    batch_bytes = sum(np.asarray(v).nbytes for v in problem.batch.values())
    copies = int(np.clip(64 * 2**20 // batch_bytes, 1, 256))  # <= 64 MiB of data
    arrays = {
        k: np.concatenate([np.asarray(v)] * copies) for k, v in problem.batch.items()
    }
    loader = pztrain.ArrayLoader(
        arrays, problem.workload.batch, seed=SEED, on_device=True
    )
    devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the runner)
    bar = functools.partial(tqdm.tqdm, file=devnull, mininterval=0.5)
    holder = [state, 0]

    def run(n: int) -> Any:
        state, done = holder
        state, _ = pztrain.fit(
            state,
            step,
            loader,
            num_steps=done + n,
            log_every=100,
            evaluations=evaluations,
            progress=pztrain.ProgressBar(make_bar=bar),
        )
        holder[:] = [state, done + n]
        return state.params

    return run


def _build_fit_runner(problem: Problem) -> Runner:
    # At least 3 log windows of 100 steps a trial, as a run has thousands.
    return Runner(build_pztrain_fit(problem), min_calls=FIT_MIN_STEPS)


# ----------------------------------------------------------------------------
# the table of implementations


@dataclasses.dataclass(frozen=True)
class Impl:
    """An implementation: a column of the tables.

    Attributes:
      key: Its name on the command line and in JSON.
      label: Its column header.
      build: Makes a `Runner` for a problem.
      mlp_only: Why it cannot run the transformer, if it cannot.
    """

    key: str
    label: str
    build: Callable[[Problem], Runner]
    mlp_only: str = ""


IMPLS = [
    Impl("raw", "raw jit (baseline)", build_raw),
    Impl("raw_counter", "raw jit + step counter", build_raw_counter),
    Impl("flax", "flax TrainState", build_flax, "no Flax version of the model"),
    Impl("flax_same", "flax TrainState, dict model", build_flax_same),
    Impl(
        "pz_v1",
        "penzai v1 build_train_step_fn",
        build_penzai_v1,
        "no penzai v1 version of the model",
    ),
    Impl("pz_v2", "penzai v2 StatefulTrainer", build_penzai_v2),
    Impl("equinox", "equinox filter_jit", build_equinox, "no equinox version"),
    Impl("pztrain", "pztrain", build_pztrain),
    Impl(
        "pztrain_dict",
        "pztrain, dict model",
        lambda p: build_pztrain(p, family="dict"),
    ),
    Impl("pztrain_program", "pztrain's program alone", build_pztrain_program),
    Impl("pztrain_fit", "pztrain fit", _build_fit_runner),
    Impl("raw_scan32", f"raw lax.scan ×{FUSED}", lambda p: build_raw(p, fused=FUSED)),
    Impl("tight_scan32", f"tight lax.scan ×{FUSED}", build_tight_scan),
    Impl(
        "pztrain_32",
        f"pztrain steps_per_call={FUSED}",
        lambda p: build_pztrain(p, fused=FUSED),
    ),
]
BASELINE = "raw"
# Whose trace + compile time each implementation is compared with (default:
# BASELINE): the fused step with the fused baseline.
COMPILE_REFERENCE = {"pztrain_32": "tight_scan32"}
MEMORY_IMPLS = (
    "raw",
    "flax_same",
    "pztrain",
    "pztrain_dict",
    "raw_scan32",
    "tight_scan32",
    "pztrain_32",
)


# ----------------------------------------------------------------------------
# measuring


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to measure.

    Attributes:
      trials: Timing rounds (>= 5).
      trial_seconds: Target length of one trial of one implementation (a
        trial makes at least one call).
      compile_samples: First-call samples per implementation, each taken after
        ``jax.clear_caches()``; 0 takes the one sample from the timing build
        (caches cleared only before the first implementation).
      memory: Whether to record ``memory_analysis()`` of the compiled steps.
      gc_modes: Python's garbage collector during trials: ``"off"`` (as
        ``timeit`` runs; ``gc.collect()`` between rounds) and/or ``"on"`` (as
        users run: collections happen where the allocations make them). Each
        round runs every mode in turn.
    """

    trials: int
    trial_seconds: float
    compile_samples: int
    memory: bool = True
    gc_modes: tuple[str, ...] = ("off", "on")


QUICK = Settings(trials=5, trial_seconds=0.06, compile_samples=0)
FULL = Settings(trials=21, trial_seconds=0.1, compile_samples=7)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first[:160]}"


def _first_loss(out: Any) -> float | None:
    try:
        return float(np.ravel(np.asarray(out))[0])
    except (TypeError, ValueError, IndexError):
        return None


def timed_rounds(
    runs: dict[str, Callable[[int], Any]], rounds: int, calls: int
) -> list[dict[str, float]]:
    """Per round, each run's seconds for ``run(calls)`` (blocked on).

    Every run is called once first (compile, warm up). Each round calls every
    run once in a shuffled order with the collector off; a collection runs
    between rounds. For benchmarks that compare a few runs by their ratios.
    """
    for run in runs.values():
        jax.block_until_ready(run(calls))
    order, rng, out = list(runs), random.Random(SEED), []
    gc.disable()
    try:
        for _ in range(rounds):
            rng.shuffle(order)
            times = {}
            for name in order:
                t0 = time.perf_counter()
                jax.block_until_ready(runs[name](calls))
                times[name] = time.perf_counter() - t0
            out.append(times)
            gc.collect()
    finally:
        gc.enable()
    return out


def _timed(runner: Runner, n: int) -> tuple[float, Any]:
    start = time.perf_counter()
    out = jax.block_until_ready(runner.run(n))
    return time.perf_counter() - start, out


def _memory(runner: Runner) -> dict[str, Any]:
    stats = runner.lower().compile().memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
        "peak_memory_in_bytes",
    )
    out = {f: getattr(stats, f, None) for f in fields}
    out["state_bytes"] = runner.state_bytes
    alias = out["alias_size_in_bytes"]
    out["all_state_donated"] = alias is not None and alias >= runner.state_bytes
    return out


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class FirstCall:
    """One timed first call.

    Attributes:
      runner: The runner, ready for more calls.
      seconds: Trace + lower + XLA compile + one call.
      out: What the call returned (its loss).
      lower_s: Trace + lower alone, for runners with ``lower``.
      xla_s: XLA compile alone, for runners with ``lower``.
    """

    runner: Runner
    seconds: float
    out: Any
    lower_s: float | None = None
    xla_s: float | None = None


def _first_call(
    impl: Impl, problem: Problem, skipped: dict[str, str]
) -> FirstCall | None:
    """Builds ``impl``'s runner and times its first call; ``None`` if it fails.

    Where the runner can lower its step, the first call is taken in stages
    (``lower()``, ``compile()``, then the call, which finds the executable in
    JAX's caches), so trace + lower and XLA compile are timed apart.
    """
    try:
        runner = impl.build(problem)
        start = time.perf_counter()
        lower_s = xla_s = None
        if runner.lower is not None:
            lowered = runner.lower()
            lower_s = time.perf_counter() - start
            lowered.compile()
            xla_s = time.perf_counter() - start - lower_s
        out = jax.block_until_ready(runner.run(1))
        elapsed = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - report it, don't crash
        skipped[impl.key] = _short(err)
        _log(f"  {problem.workload.name} {impl.key}: not run ({skipped[impl.key]})")
        return None
    return FirstCall(runner, elapsed, out, lower_s, xla_s)


def _first_call_samples(
    problem: Problem, active: list[Impl], settings: Settings, skipped: dict[str, str]
) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]]]:
    """First-call samples, each after ``jax.clear_caches()``, in an order that
    rotates between samples: the seconds, and (lower, compile) stages."""
    first_s: dict[str, list[float]] = {i.key: [] for i in active}
    stages: dict[str, list[tuple[float, float]]] = {i.key: [] for i in active}
    for sample in range(settings.compile_samples):
        shift = sample % len(active)
        for impl in active[shift:] + active[:shift]:
            if impl.key in skipped:
                continue
            jax.clear_caches()
            gc.collect()
            got = _first_call(impl, problem, skipped)
            if got:
                first_s[impl.key].append(got.seconds)
                if got.lower_s is not None:
                    stages[impl.key].append((got.lower_s, got.xla_s))
        _log(f"  {problem.workload.name}: first-call sample {sample + 1} done")
    return first_s, stages


@dataclasses.dataclass
class Built:
    """The runners of one workload, ready for the rounds.

    Attributes:
      runners: By implementation key.
      calls: Calls per trial, by key.
      first_loss: The first call's loss, by key.
      memory: ``memory_analysis()`` fields, by key.
    """

    runners: dict[str, Runner] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    first_loss: dict[str, float | None] = dataclasses.field(default_factory=dict)
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)


def _build_runners(
    problem: Problem,
    active: list[Impl],
    settings: Settings,
    skipped: dict[str, str],
    first_s: dict[str, list[float]],
    stages: dict[str, list[tuple[float, float]]],
) -> Built:
    """Builds every runner once more (caches cleared once, before the first),
    reads its memory stats and sizes its trials to ~``trial_seconds``."""
    jax.clear_caches()
    built = Built()
    for impl in active:
        gc.collect()
        got = _first_call(impl, problem, skipped)
        if not got:
            continue
        runner = got.runner
        if not settings.compile_samples:
            first_s[impl.key].append(got.seconds)
            if got.lower_s is not None:
                stages[impl.key].append((got.lower_s, got.xla_s))
        built.first_loss[impl.key] = _first_loss(got.out)
        if settings.memory and impl.key in MEMORY_IMPLS and runner.lower:
            try:
                built.memory[impl.key] = _memory(runner)  # hits the compile cache
            except Exception as err:  # noqa: BLE001
                built.memory[impl.key] = {"error": _short(err)}
        n = 1
        elapsed, _ = _timed(runner, n)
        while elapsed < settings.trial_seconds / 3 and n < 1 << 16:
            n *= 2
            elapsed, _ = _timed(runner, n)
        # The fastest of three: a call that compiles (fit's first fused call
        # comes with its first 32-step stretch) must not shorten the trials.
        elapsed = min(elapsed, _timed(runner, n)[0], _timed(runner, n)[0])
        calls = round(settings.trial_seconds * n / elapsed)
        built.calls[impl.key] = max(runner.min_calls, calls)
        built.runners[impl.key] = runner
    _log(f"  {problem.workload.name}: runners built and sized")
    return built


def _interleave(
    built: Built, settings: Settings, label: str
) -> dict[str, tuple[dict[str, list[float]], dict[str, list[float]]]]:
    """Interleaved trials: per garbage-collector mode, ``(rates, ratios)``.

    Each round runs, for each mode, every implementation once in a shuffled
    order with a baseline trial before and after each one: B X1 B X2 B … Xn B.
    An implementation's ratio for the round is its steps/s over the mean of the
    two baseline trials around it.
    """
    runners, calls = built.runners, built.calls
    out = {
        m: ({k: [] for k in runners}, {k: [] for k in runners})
        for m in settings.gc_modes
    }
    order = random.Random(SEED)
    others = [k for k in runners if k != BASELINE]

    def trial(key: str, mode: str) -> float:
        # With the collector off (like timeit) no collection runs inside a
        # trial, where a pass would scan every implementation's objects;
        # gc.collect() runs between rounds in both modes.
        if mode == "off":
            gc.disable()
        try:
            elapsed, _ = _timed(runners[key], calls[key])
        finally:
            gc.enable()
        rate = calls[key] * runners[key].steps_per_call / elapsed
        out[mode][0][key].append(rate)
        return rate

    for rnd in range(settings.trials):
        for mode in settings.gc_modes:
            gc.collect()
            order.shuffle(others)
            if BASELINE not in runners:
                for key in others:
                    trial(key, mode)
                continue
            before = trial(BASELINE, mode)
            for key in others:
                rate = trial(key, mode)
                after = trial(BASELINE, mode)
                out[mode][1][key].append(rate / ((before + after) / 2))
                before = after
        _log(f"  {label}: round {rnd + 1}/{settings.trials} done")
    return out


def _entry(
    key: str,
    runner: Runner,
    rates: list[float],
    ratios: list[float],
    first_s: list[float],
    stages: list[tuple[float, float]],
) -> dict[str, Any]:
    """One implementation's figures in one garbage-collector mode."""
    steady = runner.steps_per_call / statistics.median(rates)
    entry: dict[str, Any] = {
        "steps_per_s": rates,
        "median_steps_per_s": statistics.median(rates),
        "steps_per_call": runner.steps_per_call,
        "first_call_s": first_s,
        "median_first_call_s": statistics.median(first_s),
        # trace + compile: the first call less one steady-state call
        "compile_s": statistics.median(first_s) - steady,
        "compile_samples_s": [f - steady for f in first_s],
    }
    if stages:
        entry["lower_s"] = statistics.median(x[0] for x in stages)
        entry["xla_compile_s"] = statistics.median(x[1] for x in stages)
    if key == BASELINE:
        entry["median_ratio"] = 1.0
    elif ratios:
        entry["ratios"] = ratios
        entry["median_ratio"] = statistics.median(ratios)
    return entry


def measure_workload(
    workload: Workload, impls: list[Impl], settings: Settings
) -> list[dict[str, Any]]:
    """First-call times, memory stats and interleaved timing for one workload:
    one report entry per garbage-collector mode."""
    problem = Problem(workload)
    skipped = {i.key: i.mlp_only for i in impls if i.mlp_only and not workload.is_mlp}
    active = [i for i in impls if i.key not in skipped]
    first_s, stages = _first_call_samples(problem, active, settings, skipped)
    active = [i for i in active if i.key not in skipped]
    built = _build_runners(problem, active, settings, skipped, first_s, stages)
    measured = _interleave(built, settings, workload.name)
    report = []
    for mode, (rates, ratios) in measured.items():
        results: dict[str, Any] = {}
        for impl in impls:
            key = impl.key
            if key in skipped:
                results[key] = {"skipped": skipped[key]}
                continue
            entry = _entry(
                key,
                built.runners[key],
                rates[key],
                ratios[key],
                first_s[key],
                stages[key],
            )
            entry["calls_per_trial"] = built.calls[key]
            entry["first_loss"] = built.first_loss.get(key)
            if key in built.memory:
                entry["memory"] = built.memory[key]
            results[key] = entry
        _compile_ratios(results)
        report.append(
            {"workload": dataclasses.asdict(workload), "gc": mode, "results": results}
        )
    return report


def _compile_ratios(results: dict[str, Any]) -> None:
    """Trace + compile relative to the reference, paired by sample: sample i of
    every implementation was taken in the same rotation, so the ratio of two of
    them cancels a slow stretch of the machine that a ratio of medians keeps."""
    for key, entry in results.items():
        ref = results.get(COMPILE_REFERENCE.get(key, BASELINE), {})
        mine, theirs = entry.get("compile_samples_s"), ref.get("compile_samples_s")
        if mine and theirs and len(mine) == len(theirs) and ref is not entry:
            entry["compile_ratio"] = statistics.median(
                a / b for a, b in zip(mine, theirs, strict=True)
            )


def paired(results: dict[str, Any], key: str, ref: str) -> float | None:
    """``key``'s speed over ``ref``'s: the median over rounds of the quotient of
    their paired ratios to the baseline (both measured in the same round)."""
    got, against = results.get(key, {}), results.get(ref, {})
    if "median_ratio" not in got or "median_ratio" not in against:
        return None
    if ref == BASELINE:
        return got["median_ratio"]
    mine, theirs = got.get("ratios", []), against.get("ratios", [])
    if mine and len(mine) == len(theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    return got["median_ratio"] / against["median_ratio"]


# ----------------------------------------------------------------------------
# reporting


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_rate(r: float) -> str:
    return f"{r:,.0f}" if r >= 100 else f"{r:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _columns(report: dict[str, Any], impls: list[Impl]) -> list[Impl]:
    """Drops columns where no workload ran (their reasons go in the notes)."""
    return [
        i
        for i in impls
        if any("skipped" not in w["results"][i.key] for w in report["workloads"])
    ]


def _title(w: dict[str, Any], modes: int) -> str:
    """A table row's title: the workload (and the collector's mode if the
    report holds more than one)."""
    name = w["workload"]["name"]
    title = f"{name} {WORKLOADS[name].title}" if name in WORKLOADS else name
    return f"{title}, gc {w['gc']}" if modes > 1 and "gc" in w else title


def _once(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per workload (the first collector mode's): compile times,
    memory and losses are measured once, not per mode."""
    seen, out = set(), []
    for w in report["workloads"]:
        if w["workload"]["name"] not in seen:
            seen.add(w["workload"]["name"])
            out.append(w)
    return out


def render(report: dict[str, Any], impls: list[Impl]) -> str:
    """The markdown tables of a report."""
    cols = _columns(report, impls)
    modes = len({w.get("gc") for w in report["workloads"]})
    notes: dict[str, set[str]] = {}
    for w in report["workloads"]:
        for impl in impls:
            reason = w["results"][impl.key].get("skipped")
            if reason:
                where = f"{w['workload']['name']} {impl.label}"
                notes.setdefault(reason, set()).add(where)
    out = []

    speed_rows, abs_rows, compile_rows = [], [], []
    once = _once(report)
    for w in report["workloads"]:
        res = w["results"]
        title = _title(w, modes)
        speed, absolute, comp = [title], [title], [_title(w, 1)]
        base_c = res.get(BASELINE, {}).get("compile_s")
        for impl in cols:
            r = res[impl.key]
            if "skipped" in r:
                speed.append("–")
                absolute.append("–")
                comp.append("–")
                continue
            rate = r["median_steps_per_s"]
            if impl.key == BASELINE:
                speed.append(f"1.00 ({_fmt_rate(rate)} steps/s)")
            else:
                speed.append(f"{r['median_ratio']:.2f}" if "median_ratio" in r else "?")
            spread = r.get("ratios", [])
            if len(spread) >= 4:
                lo, _, hi = statistics.quantiles(spread, n=4)
                absolute.append(f"{_fmt_rate(rate)} [{lo:.2f}–{hi:.2f}]")
            else:
                absolute.append(_fmt_rate(rate))
            c = r["compile_s"]
            ratio = r.get("compile_ratio")
            if ratio is None and base_c and impl.key != BASELINE:
                ratio = c / base_c
            comp.append(f"{c:.2f}" + (f" ({ratio:.2f}×)" if ratio else ""))
        speed_rows.append(speed)
        abs_rows.append(absolute)
        if w in once:
            compile_rows.append(comp)

    header = ["workload"] + [i.label for i in cols]
    out.append(
        "### Steps/s relative to the raw jit baseline (median of paired ratios)\n"
    )
    out.append(_table(header, speed_rows))
    out.append("\n### Absolute steps/s (median) [quartiles of the paired ratios]\n")
    out.append(_table(header, abs_rows))
    out.append(
        "\n### Trace + compile, seconds: median first call less one steady call "
        "(× the baseline, or × the tight scan for pztrain ×32: median of ratios "
        "paired by sample)\n"
    )
    out.append(_table(header, compile_rows))

    staged = [
        i
        for i in impls
        if any("lower_s" in w["results"][i.key] for w in report["workloads"])
    ]
    if staged:
        rows = []
        for w in once:
            row = [w["workload"]["name"]]
            for impl in staged:
                r = w["results"][impl.key]
                row.append(
                    f"{r['lower_s']:.3f} + {r['xla_compile_s']:.3f}"
                    if "lower_s" in r
                    else "–"
                )
            rows.append(row)
        out.append(
            "\n### The same, in stages: trace + lower, then XLA compile (seconds, "
            "median)\n"
        )
        out.append(_table(["workload"] + [i.label for i in staged], rows))

    mem_rows = []
    for w in once:
        name = w["workload"]["name"]
        for impl in impls:
            mem = w["results"][impl.key].get("memory")
            if not mem:
                continue
            if "error" in mem:
                mem_rows.append([name, impl.label] + ["?"] * 6 + [mem["error"]])
                continue
            mem_rows.append(
                [
                    name,
                    impl.label,
                    _fmt_bytes(mem["argument_size_in_bytes"]),
                    _fmt_bytes(mem["output_size_in_bytes"]),
                    _fmt_bytes(mem["alias_size_in_bytes"]),
                    _fmt_bytes(mem["temp_size_in_bytes"]),
                    _fmt_bytes(mem["state_bytes"]),
                    "yes" if mem["all_state_donated"] else "**no**",
                    "",
                ]
            )
    if mem_rows:
        out.append("\n### Compiled step memory (`memory_analysis()`)\n")
        out.append(
            _table(
                [
                    "workload",
                    "implementation",
                    "arguments",
                    "outputs",
                    "aliased (donated)",
                    "temp",
                    "params + opt state",
                    "all donated",
                    "note",
                ],
                mem_rows,
            )
        )

    losses = []
    for w in once:
        res = w["workload"]["name"], w["results"]
        vals = {
            k: v["first_loss"]
            for k, v in res[1].items()
            if v.get("first_loss") is not None
        }
        if vals:
            spread = max(vals.values()) - min(vals.values())
            losses.append(f"{res[0]}: {spread:.1e} over {len(vals)} implementations")
    if losses:
        out.append(
            "\nSame start, same data: spread of the step-0 loss — " + "; ".join(losses)
        )
    if notes:
        out.append("\n– means not run:")
        for reason, where in sorted(notes.items()):
            out.append(f"- {', '.join(sorted(where))}: {reason}")
    return "\n".join(out)


TARGETS = [
    # (implementation, workload, minimum, reference, strict): the speed of the
    # implementation over the reference's in the same run, the median over
    # rounds of the quotient of their paired ratios to the baseline (`paired`);
    # strict: it must be above the minimum ("ahead of"), not just reach it.
    ("pztrain", "W0", 0.90, BASELINE, False),
    ("pztrain", "W0", 1.00, "flax", False),
    ("pztrain_dict", "W0", 1.00, "flax_same", True),
    ("pztrain", "W1", 0.97, BASELINE, False),
    ("pztrain", "W2", 0.97, BASELINE, False),
    ("pztrain", "W3", 0.97, BASELINE, False),
    ("pztrain_32", "W0", 0.95, "tight_scan32", False),
    ("pztrain_32", "W3", 0.95, "tight_scan32", False),
    # fit with its data on the device (fused between host points, issue 31):
    ("pztrain_fit", "W0", 3.00, BASELINE, False),
    ("pztrain_fit", "W0", 1.00, "pztrain", False),  # a hand loop of its step
    ("pztrain_fit", "W1", 0.97, BASELINE, False),
    ("pztrain_fit", "W3", 0.97, BASELINE, False),
]


def check_targets(report: dict[str, Any]) -> list[str]:
    """One line per pztrain target that this run measured (per collector mode)."""
    modes = len({w.get("gc") for w in report["workloads"]})
    lines = []
    for key, wname, minimum, ref, strict in TARGETS:
        for w in report["workloads"]:
            if w["workload"]["name"] != wname:
                continue
            ratio = paired(w["results"], key, ref)
            if ratio is None:
                continue
            ok = ratio > minimum if strict else ratio >= minimum
            where = f"{wname}, gc {w['gc']}" if modes > 1 else wname
            res = w["results"]
            medians = res[key]["median_ratio"] / res[ref]["median_ratio"]
            lines.append(
                f"- {key} on {where}: {ratio:.3f}× {ref} (target "
                f"{'>' if strict else '≥'} {minimum}) "
                + ("met" if ok else "**missed**")
                + ("" if ref == BASELINE else f"; ratio of the medians {medians:.3f}")
            )
    for w in _once(report):
        wname, res = w["workload"]["name"], w["results"]
        for key in ("pztrain", "pztrain_dict", "pztrain_32"):
            ref = COMPILE_REFERENCE.get(key, BASELINE)
            base = res.get(ref, {}).get("compile_s")
            c = res.get(key, {}).get("compile_s")
            if base and c:
                ratio = res[key].get("compile_ratio", c / base)
                lines.append(
                    f"- {key} trace + compile on {wname}: {ratio:.2f}× {ref} "
                    "(target ≤ 1.1) " + ("met" if ratio <= 1.1 else "**missed**")
                )
    return lines


def environment() -> dict[str, Any]:
    versions = {}
    for dist in ("jax", "jaxlib", "penzai", "optax", "flax", "equinox", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "devices": [str(d) for d in jax.devices()],
        "load_average_at_start": os.getloadavg(),
        "versions": versions,
    }


def _warm_up() -> None:
    """Pays JAX's and penzai's one-off start-up costs before anything is timed."""
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    jax.block_until_ready(f(jnp.ones((4, 4))))
    jax.block_until_ready(pz.nx.wrap(jnp.ones(3)).tag("a").unwrap("a"))


def _set_learning_rate(rate: float) -> None:
    global LEARNING_RATE
    LEARNING_RATE = rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="W0, W1, W3s (default)")
    mode.add_argument("--full", action="store_true", help="W0–W3, longer trials")
    parser.add_argument("--workloads", help="comma-separated, e.g. W0,W3")
    parser.add_argument(
        "--impls",
        help="comma-separated implementation keys (the baseline is always added): "
        + ",".join(i.key for i in IMPLS),
    )
    parser.add_argument("--trials", type=int, help="override the number of trials")
    parser.add_argument(
        "--gc",
        choices=("on", "off", "both"),
        default="both",
        help="Python's garbage collector during trials (default: both, in turn)",
    )
    parser.add_argument(
        "--objects",
        type=int,
        default=0,
        help="small objects the process holds while it measures (e.g. 300000: "
        "what a collection with the collector on has to scan)",
    )
    parser.add_argument("--json", help="write all samples to this file")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=LEARNING_RATE,
        help="Adam's learning rate (default %(default)g)",
    )
    args = parser.parse_args(argv)
    _set_learning_rate(args.learning_rate)

    settings = FULL if args.full else QUICK
    if args.trials:
        settings = dataclasses.replace(settings, trials=max(5, args.trials))
    gc_modes = ("off", "on") if args.gc == "both" else (args.gc,)
    settings = dataclasses.replace(settings, gc_modes=gc_modes)
    names = (
        args.workloads.split(",")
        if args.workloads
        else (["W0", "W1", "W2", "W3"] if args.full else ["W0", "W1", "W3s"])
    )
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    impls = IMPLS
    if args.impls:
        wanted = set(args.impls.split(",")) | {BASELINE}
        bad = wanted - {i.key for i in IMPLS}
        if bad:
            parser.error(f"unknown implementations {sorted(bad)}")
        impls = [i for i in IMPLS if i.key in wanted]

    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    _warm_up()
    # Lists, which the collector always tracks (tuples of numbers it drops).
    held = [[i] for i in range(args.objects)]  # noqa: F841 (only held)
    report: dict[str, Any] = {
        "mode": "full" if args.full else "quick",
        "settings": dataclasses.asdict(settings),
        "learning_rate": LEARNING_RATE,
        "environment": environment(),
        "objects_held": args.objects,
        "workloads": [],
    }
    for name in names:
        _log(f"{name}: {WORKLOADS[name].title}")
        report["workloads"].extend(measure_workload(WORKLOADS[name], impls, settings))
    report["seconds"] = time.perf_counter() - start
    report["environment"]["load_average_at_end"] = os.getloadavg()

    env = report["environment"]
    load = env["load_average_at_start"][0], env["load_average_at_end"][0]
    print(
        f"\n## step_bench ({report['mode']}): {env['cpu_count']} CPU cores, "
        f"jax {env['versions']['jax']}, {settings.trials} interleaved rounds, "
        f"{report['seconds']:.0f} s, 1-min load average {load[0]:.1f} → "
        f"{load[1]:.1f}, Adam learning rate {report['learning_rate']:g}, garbage "
        f"collector {' then '.join(settings.gc_modes)} in each round, "
        f"{args.objects:,} extra objects held\n"
    )
    print(render(report, impls))
    targets = check_targets(report)
    if targets:
        print("\n### pztrain targets\n")
        print("\n".join(targets))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
