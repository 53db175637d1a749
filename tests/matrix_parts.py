"""One small builder per axis value of the combination matrix
(`tests/combination_matrix.py`): the model family, members, data, evaluations,
stops, checkpoints, step options and devices of a row, as `fit` arguments."""

from __future__ import annotations

import functools
import os
import signal

import equinox as eqx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from models import (
    dict_mlp_apply,
    dict_mlp_params,
    equinox_mlp,
    logits_of,
    penzai_v1_mlp,
    penzai_v2_mlp,
)
from nnx_models import mlp as nnx_mlp

import pztrain
from pztrain.data import StepLoader

N, EVAL_N, BATCH = 64, 20, 16  # 4 steps an epoch
NUM_STEPS, LOG_EVERY, STOP_AT, HIDDEN = 16, 4, 8, 8
POISONED = 45  # the example whose loss is NaN in the ``nan`` rows


def example(i: int, poison: bool = False, bad: bool = False) -> dict:
    """Example ``i``; ``bad``: x of 5 features, which the models refuse."""
    x = np.random.default_rng(i).standard_normal(5 if bad else 4).astype(np.float32)
    out = {"x": x, "y": np.int32(x[:4].sum() > 0)}
    if poison:
        out["poison"] = np.float32(np.nan if i == POISONED else 0.0)
    return out


def arrays(first: int, n: int, poison=False, bad=False) -> dict[str, np.ndarray]:
    rows = [example(i, poison, bad) for i in range(first, first + n)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


# -- families: init(seed) -> TrainState, and the logits of a model ------------


class EqxBatchNorm(eqx.Module):
    """Linear -> eqx.nn.BatchNorm -> relu -> Linear; state in eqx.nn.State."""

    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(4, HIDDEN, key=k1)
        self.bn = eqx.nn.BatchNorm(HIDDEN, axis_name="batch", mode="batch")
        self.l2 = eqx.nn.Linear(HIDDEN, 2, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.l1(x), state)
        return self.l2(jax.nn.relu(h)), state


def family_model(family: str, seed: int):
    """``(model, loss_fn_state)`` of a family (``flax``: its params)."""
    if family == "pzv2":
        return penzai_v2_mlp(seed, HIDDEN, inputs=4), None
    if family == "pzv1":
        return penzai_v1_mlp(seed, HIDDEN, inputs=4), None
    if family == "eqx":
        return equinox_mlp(seed, HIDDEN, inputs=4), None
    if family == "eqxstate":
        return eqx.nn.make_with_state(EqxBatchNorm)(jax.random.key(seed))
    if family == "nnx":
        return nnx_mlp(seed, hidden=HIDDEN), None
    return dict_mlp_params(seed, HIDDEN, inputs=4), None


def optimizer(row) -> optax.GradientTransformation:
    # eps=1e-3: a bias before BatchNorm has a zero gradient but for rounding,
    # which Adam with eps=1e-8 would turn into steps of the full learning rate
    tx = optax.adam(0.05, eps=1e-3)
    return pztrain.with_ema(tx, decay=0.9) if row["ckpt"] == "ema" else tx


def init_fn(row):
    def init(seed: int) -> pztrain.TrainState:
        model, extra = family_model(row["family"], seed)
        key = jax.random.key(seed + 1000)
        if row["family"] == "flax":
            return pztrain.TrainState.create(
                apply_fn=dict_mlp_apply, params=model, tx=optimizer(row), root_rng=key
            )
        return pztrain.TrainState.initial_state(model, optimizer(row), key, extra)

    return init


def logits_and_state(model, state, x, inference: bool):
    if isinstance(state, eqx.nn.State):
        if inference:
            model = eqx.nn.inference_mode(model)
        run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return run(x, state)
    return logits_of(model, x), state


def loss_fn(*, model, state, rng, x, y, poison=None):
    del rng
    logits, state = logits_and_state(model, state, x, inference=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    if poison is not None:
        loss = loss * (1.0 + jnp.sum(poison))  # NaN grads too
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y, poison=None):
    del rng, poison
    logits, _ = logits_and_state(model, state, x, inference=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


# -- devices and members --------------------------------------------------------


def members(row) -> int | None:
    """The population's size (``None``: one run)."""
    if row["members"] == "solo":
        return None
    return 8 if row["devices"] == "8dev" else 4


def mesh_of(row):
    """The 8-device mesh: ``data`` for one run, ``members`` for a population."""
    if row["devices"] == "1dev":
        return None
    name = "data" if members(row) is None else "members"
    return jax.make_mesh((8,), (name,), axis_types=(AxisType.Auto,))


def new_state(row, seed: int | None = None) -> pztrain.TrainState:
    """The row's fresh state (``seed``: that member alone, one run)."""
    init, mesh, k = init_fn(row), mesh_of(row), members(row)
    if seed is not None:
        return init(seed)
    if k is None:
        return init(0) if mesh is None else pztrain.sharding.shard_state(init(0), mesh)
    pop = pztrain.make_population(init, seeds=range(k))
    return pop if mesh is None else pztrain.population.shard_members(pop, mesh)


def train_step(row, solo: bool = False) -> pztrain.TrainStep:
    """The row's train step (``solo``: for a member's run alone), shared by
    the rows that build the same one (its programs compile once)."""
    on_mesh = row["devices"] == "8dev" and members(row) is None and not solo
    per_member = row["data"] == "permember" and not solo
    return _train_step(row["step"], on_mesh, per_member)


@functools.cache
def _train_step(kind: str, on_mesh: bool, per_member: bool) -> pztrain.TrainStep:
    options = {
        "plain": {},
        "spc2": {"steps_per_call": 2},
        "micro2": {"microbatches": 2},
        "norms": {"grad_norms": "global"},
    }[kind]
    if on_mesh:
        options["mesh"] = mesh_of({"devices": "8dev", "members": "solo"})
    return pztrain.build_train_step(loss_fn, member_batches=per_member, **options)


@functools.cache
def eval_step() -> pztrain.EvalStep:
    return pztrain.build_eval_step(eval_fn)


# -- data -----------------------------------------------------------------------


class MemberLoader(StepLoader):
    """One `ArrayLoader` per member (seeds 0, 1, ...), their batches stacked on
    a leading member axis (then the steps, with ``steps_per_call``)."""

    def __init__(self, loaders):
        self.loaders = loaders

    @property
    def steps_per_epoch(self) -> int:
        return self.loaders[0].steps_per_epoch

    def batch_at(self, step):
        return _stack([loader.batch_at(step) for loader in self.loaders])

    def epoch(self, epoch=0):
        for batches in zip(
            *(loader.epoch(epoch) for loader in self.loaders), strict=True
        ):
            yield _stack(batches)

    def iter_from_step(self, step, steps_per_call=1):
        its = [loader.iter_from_step(step, steps_per_call) for loader in self.loaders]
        for batches in zip(*its, strict=True):
            yield _stack(batches)


def _stack(batches):
    return {k: np.stack([np.asarray(b[k]) for b in batches]) for k in batches[0]}


def train_data(row, member: int | None = None):
    """The row's train loader (``member``: that member's own, for its solo run)."""
    poison, bad = row["stop"] == "nan", row["stop"] == "badbatch"
    data = arrays(0, N, poison, bad)
    if row["data"] == "permember":
        if member is not None:
            return pztrain.ArrayLoader(data, BATCH, seed=member)
        loaders = [
            pztrain.ArrayLoader(data, BATCH, seed=i) for i in range(members(row))
        ]
        return MemberLoader(loaders)
    sharding = one_batch_sharding(row) if member is None else None
    if row["data"] == "grain":
        source = grain.MapDataset.range(N).map(lambda i: example(i, poison, bad))
        return pztrain.GrainLoader(source, BATCH, seed=0, sharding=sharding)
    on_device = row["data"] == "device"
    return pztrain.ArrayLoader(
        data, BATCH, seed=0, on_device=on_device, sharding=sharding
    )


def one_batch_sharding(row):
    """The sharding of one batch: examples over ``data`` for one run on the
    mesh (a population's members are split instead: its batches are not)."""
    mesh = mesh_of(row)
    if mesh is None or members(row) is not None:
        return None
    return pztrain.sharding.data_sharding(mesh)


def eval_loader(row, first: int = N) -> pztrain.ArrayLoader:
    return pztrain.ArrayLoader(
        arrays(first, EVAL_N),
        BATCH,
        shuffle=False,  # the last partial batch: evaluated after the epoch
        sharding=one_batch_sharding(row),
    )


# -- evaluations: fit arguments, and each one's cadence by record prefix ----------


def param_norm(state) -> dict[str, float]:
    return {"norm": float(optax.tree.norm(state.params))}


def evaluations(row, step) -> tuple[dict, dict[str, int | None]]:
    """``fit``'s evaluation arguments and ``{metric prefix: every}``."""
    ev = eval_step()
    kind = row["evals"]
    if kind == "unnamed":
        return {"eval_step": ev, "eval_data": eval_loader(row), "eval_every": 4}, {
            "": 4
        }
    if kind == "named2":
        named = [
            pztrain.Evaluation("val", ev, eval_loader(row), every=4),
            pztrain.Evaluation("test", ev, eval_loader(row, N + EVAL_N), every=8),
        ]
        return {"evaluations": named}, {"val/": 4, "test/": 8}
    if kind == "hostfn":
        return {"evaluations": [pztrain.Evaluation("probe", param_norm, every=8)]}, {
            "probe/": 8
        }
    final = pztrain.Evaluation("final", ev, eval_loader(row), every=1000, at_end=True)
    return {"evaluations": [final]}, {"final/": None}


def monitor(row) -> str:
    """The metric that EarlyStopping and keep_best watch in the row."""
    return {
        "unnamed": "eval/loss",
        "named2": "eval/val/loss",
        "hostfn": "eval/probe/norm",
        "atend": "loss",  # its only evaluation runs at the end
    }[row["evals"]]


# -- stops and checkpoints ----------------------------------------------------------


class SignalAt(pztrain.Callback):
    """Sends ``sig`` to this process at the log point of ``step``."""

    def __init__(self, sig, step=STOP_AT):
        self.sig, self.step = sig, step

    def on_log(self, state, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), self.sig)


class Boom(Exception):
    pass


class RaiseAt(pztrain.Callback):
    """Raises `Boom` at the log point of ``step``."""

    def __init__(self, step=STOP_AT):
        self.step = step

    def on_log(self, state, record):
        if record["step"] == self.step:
            raise Boom(f"boom at step {self.step}")


def stoppers(row) -> list[pztrain.Callback]:
    """The callbacks that end the row's run early (none for an uninterrupted one)."""
    stop = row["stop"]
    if stop == "early":
        return [pztrain.EarlyStopping(monitor(row), patience=1, min_delta=1e6)]
    if stop == "nan":
        return [pztrain.NanPolicy("stop")]
    if stop in ("sigint", "sigterm"):
        return [SignalAt(signal.SIGINT if stop == "sigint" else signal.SIGTERM)]
    if stop == "raise":
        return [RaiseAt()]
    if stop == "refuse":  # a typo of the row's monitor
        return [pztrain.EarlyStopping(monitor(row) + "_typo")]
    return []


def checkpoints(row, directory) -> pztrain.Checkpoints | None:
    kind = row["ckpt"]
    if kind == "none":
        return None
    if kind == "keepbest":
        return pztrain.Checkpoints(
            directory, every_steps=4, keep_last=1, keep_best=1, monitor=monitor(row)
        )
    return pztrain.Checkpoints(directory, every_steps=4, keep_last=1)
