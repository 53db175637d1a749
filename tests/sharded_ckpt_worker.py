"""Sharded checkpoint checks, run in a subprocess with 8 simulated CPU devices.

``python sharded_ckpt_worker.py WORK_DIR``: trains a small MLP with FSDP
shardings over 8 devices, saves the state after 5 steps and restores it into a
1-device state, a 4-device state sharded otherwise, and an abstract sharded
target; each restored state must have its target's shardings, the saved values,
and continue to the same params as the uninterrupted run. Then resumes a `fit`
from `Checkpoints` on the sharded state. Prints ``OK`` at the end; any failed
check raises.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pztrain.checkpoint import Checkpoints, load_params, load_state, save_state
from pztrain.data import ArrayLoader
from pztrain.loop import fit
from pztrain.state import TrainState
from pztrain.step import build_train_step

TX = optax.adam(0.01)


def loss_fn(*, model, state, rng, x, y):
    h = jnp.tanh(x @ model["w1"] + model["b1"])
    loss = jnp.mean((h @ model["w2"] + model["b2"] - y) ** 2)
    return loss, state, {"loss": loss}


def make_state() -> TrainState:
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": 0.3 * jax.random.normal(k1, (8, 16)),
        "b1": jnp.zeros(16),
        "w2": 0.3 * jax.random.normal(k2, (16, 4)),
        "b2": jnp.zeros(4),
    }
    return TrainState.initial_state(params, TX, jax.random.key(1))


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.normal(size=(32, 8)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x[:, :4]).astype(np.float32)})
    return out


def shardings(mesh, spec_of) -> TrainState:
    """A `TrainState` of shardings: params by ``spec_of``, optimizer state
    following them, everything else (scalars too) replicated."""
    abstract = jax.eval_shape(make_state)
    replicated = NamedSharding(mesh, P())
    out = jax.tree.map(lambda _: replicated, abstract)
    params = {k: NamedSharding(mesh, spec_of(x)) for k, x in abstract.params.items()}
    opt = optax.tree_map_params(
        TX,
        lambda _, s: s,
        abstract.opt_state,
        params,
        transform_non_params=lambda _: replicated,
    )
    return out.replace(params=params, opt_state=opt)


def fsdp(x) -> P:  # the first dim along "data" if it divides
    return P("data") if x.ndim and x.shape[0] % 8 == 0 else P()


def last_dim(x) -> P:  # the last dim along "model" if it divides
    if not x.ndim or x.shape[-1] % 4:
        return P()
    return P(*([None] * (x.ndim - 1)), "model")


def sharded_state(s: TrainState) -> TrainState:
    return jax.jit(make_state, out_shardings=s)()


def step_for(s: TrainState | None, axis: str | None):
    if s is None:
        return build_train_step(loss_fn)
    mesh = jax.tree.leaves(s.params)[0].mesh
    data = NamedSharding(mesh, P(axis))
    return build_train_step(
        loss_fn, state_shardings=s, batch_shardings={"x": data, "y": data}
    )


def run(state: TrainState, step, data) -> TrainState:
    for batch in data:
        state, _ = step(state, **batch)
    return state


def arrays(tree) -> list[tuple[str, jax.Array]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat if hasattr(x, "shape")]


def host(tree) -> dict[str, np.ndarray]:
    return {
        p: np.asarray(jax.random.key_data(x) if _is_key(x) else x)
        for p, x in arrays(tree)
    }


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def check_like(restored: TrainState, target, saved: dict[str, np.ndarray], what):
    got, want = arrays(restored), dict(arrays(target))
    assert [p for p, _ in got] == list(want), what
    for p, x in got:
        assert isinstance(x, jax.Array), f"{what}: {p} is {type(x).__name__}"
        t = want[p].sharding
        assert x.sharding == t, f"{what}: {p} has {x.sharding}, target {t}"
    for p, x in host(restored).items():
        np.testing.assert_array_equal(x, saved[p], err_msg=f"{what}: {p}")


def check_continues(state, step, data, want: dict[str, np.ndarray], what):
    final = host(run(state, step, data).params)
    for p, x in final.items():
        np.testing.assert_allclose(x, want[p], atol=1e-5, err_msg=f"{what}: {p}")


def restores(work: Path) -> None:
    data = batches(10)
    mesh8 = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    s8 = shardings(mesh8, fsdp)
    step8 = step_for(s8, "data")
    state5 = run(sharded_state(s8), step8, data[:5])
    assert state5.params["w1"].sharding == s8.params["w1"], "FSDP step"
    save_state(work / "five", state5)
    saved = host(state5)
    want = host(run(state5, step8, data[5:]).params)

    # (a) one device
    one = make_state()
    restored = load_state(work / "five", one)
    check_like(restored, one, saved, "1 device")
    check_continues(restored, step_for(None, None), data[5:], want, "1 device")

    # (b) four devices, sharded along the last dim
    mesh4 = jax.make_mesh(
        (4,),
        ("model",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[4:],
    )
    s4 = shardings(mesh4, last_dim)
    four = sharded_state(s4)
    restored = load_state(work / "five", four)
    check_like(restored, four, saved, "4 devices")
    check_continues(restored, step_for(s4, None), data[5:], want, "4 devices")

    # (c) an abstract target with shardings: nothing materialized first
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(make_state),
        s8,
    )
    restored = load_state(work / "five", abstract)
    check_like(restored, abstract, saved, "abstract")
    check_continues(restored, step8, data[5:], want, "abstract")

    # load_params into abstract params with shardings (and a TrainState's)
    params = load_params(work / "five", abstract.params)
    saved_params = {p[7:]: x for p, x in saved.items() if p.startswith(".params")}
    check_like(params, abstract.params, saved_params, "abstract params")

    # fit resumes on the sharded state, keeping every leaf's sharding
    loader = ArrayLoader(
        {k: np.concatenate([b[k] for b in data]) for k in ("x", "y")}, 32
    )
    with Checkpoints(work / "run", every_steps=3) as ckpts:
        fit(
            sharded_state(s8),
            step8,
            loader,
            num_steps=6,
            log_every=3,
            checkpoints=ckpts,
            progress=False,
        )
    like = sharded_state(s8)
    targets = {p: x.sharding for p, x in arrays(like)}
    with Checkpoints(work / "run") as ckpts:
        latest = ckpts.restore_latest(like)
    assert int(latest.step) == 6
    for p, x in arrays(latest):
        assert x.sharding == targets[p], f"resume: {p} has {x.sharding}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, history = fit(
            like,
            step8,
            loader,
            num_steps=9,
            log_every=3,
            checkpoints=Checkpoints(work / "run", every_steps=3),
            resume=True,
            progress=False,
        )
    assert [r["step"] for r in history.records] == [9], history.records
    assert int(state.step) == 9
    for p, x in arrays(state):
        assert x.sharding == targets[p], f"fit: {p} has {x.sharding}, not {targets[p]}"
    full, _ = fit(sharded_state(s8), step8, loader, num_steps=9, progress=False)
    want = host(full.params)
    for p, x in host(state.params).items():
        np.testing.assert_allclose(x, want[p], atol=1e-5, err_msg=f"fit: {p}")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    restores(Path(sys.argv[1]))
    print("OK")
