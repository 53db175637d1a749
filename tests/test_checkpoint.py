"""Checkpoints: params alone, full state, retention, exact resume, no pickle."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import (
    XOR_X,
    XOR_Y,
    family_state,
    penzai_v2_mlp,
    xor_loss,
)
from penzai import pz

import pztrain
from pztrain import CheckpointError, TrainState

HERE = Path(__file__).resolve().parent


def _state(family: str, seed: int = 0):
    return family_state(family, seed=seed, lr=0.01)


def _trained(family: str):
    state = _state(family)
    step = pztrain.build_train_step(xor_loss)
    for _ in range(3):
        state, _ = step(state, x=XOR_X, y=XOR_Y)
    return state


def _assert_params_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # trains each family to save it
@pytest.mark.parametrize("family", ["penzai_v2", "penzai_v1", "equinox", "flax"])
def test_params_round_trip_into_state_model_and_dict(tmp_path, family):
    trained = _trained(family)
    pztrain.save_params(tmp_path / "p", trained)
    fresh = _state(family, seed=7)
    loaded = pztrain.load_params(tmp_path / "p", fresh)
    assert isinstance(loaded, TrainState)
    _assert_params_equal(loaded.params, trained.params)
    as_dict = pztrain.load_params(tmp_path / "p", fresh.params)
    _assert_params_equal(as_dict, trained.params)
    if family != "flax":
        model = pztrain.load_params(tmp_path / "p", fresh.model)
        assert type(model) is type(trained.model)
        state_of_model = TrainState.initial_state(
            model, optax.sgd(0.1), jax.random.key(0)
        )
        _assert_params_equal(state_of_model.params, trained.params)


@pytest.mark.slow  # trains, saves, loads and runs the model again
def test_loaded_penzai_model_runs_like_the_trained_one(tmp_path):
    trained = _trained("penzai_v2")
    pztrain.save_params(tmp_path / "p", trained)
    model = pztrain.load_params(tmp_path / "p", penzai_v2_mlp(seed=3))
    assert all(isinstance(p, pz.Parameter) for p in pz.unbind_params(model)[1])
    x = pz.nx.wrap(XOR_X).tag("batch", "features")
    np.testing.assert_array_equal(
        model(x).unwrap("batch", "features"),
        trained.model(x).unwrap("batch", "features"),
    )


def test_param_mismatch_errors_name_the_parameter(tmp_path):
    pztrain.save_params(tmp_path / "p", {"w": jnp.ones(3), "b": jnp.ones(())})
    with pytest.raises(
        CheckpointError, match=re.escape("missing names ['c'], unexpected names ['b']")
    ):
        pztrain.load_params(tmp_path / "p", {"w": jnp.ones(3), "c": jnp.ones(())})
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "Parameter 'w' in "
            + str(tmp_path / "p")
            + " is float32[3], but the target expects float32[4]"
        ),
    ):
        pztrain.load_params(tmp_path / "p", {"w": jnp.ones(4), "b": jnp.ones(())})
    with pytest.raises(
        CheckpointError,
        match=re.escape("is float32[3], but the target expects bfloat16[3]"),
    ):
        pztrain.load_params(
            tmp_path / "p", {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(())}
        )


def test_partial_loading_is_explicit(tmp_path):
    pztrain.save_params(tmp_path / "p", {"body": jnp.full(3, 2.0), "head": jnp.ones(2)})
    target = {"body": jnp.zeros(3), "new_head": jnp.zeros(5)}
    loaded = pztrain.load_params(tmp_path / "p", target, partial=True)
    np.testing.assert_array_equal(loaded["body"], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(loaded["new_head"], np.zeros(5))


def test_directory_errors(tmp_path):
    with pytest.raises(CheckpointError, match="the directory does not exist"):
        pztrain.load_params(tmp_path / "nope", {"w": jnp.ones(1)})
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a pztrain checkpoint"):
        pztrain.load_params(tmp_path / "empty", {"w": jnp.ones(1)})
    pztrain.save_params(tmp_path / "p", {"w": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=re.escape("pass overwrite=True")):
        pztrain.save_params(tmp_path / "p", {"w": jnp.ones(1)})
    pztrain.save_params(tmp_path / "p", {"w": jnp.full(1, 5.0)}, overwrite=True)
    assert float(pztrain.load_params(tmp_path / "p", {"w": jnp.ones(1)})["w"][0]) == 5.0


def test_corrupt_checkpoint_is_named(tmp_path):
    pztrain.save_params(tmp_path / "p", {"w": jnp.arange(1000.0)})
    chunks = [
        f
        for f in (tmp_path / "p" / "params" / "0").rglob("*")
        if f.is_file() and not f.name.startswith(".")
    ]
    for f in chunks:
        f.write_bytes(f.read_bytes()[:7])  # truncate every file of the array
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"Checkpoint {tmp_path / 'p'} is incomplete or corrupt"),
    ):
        pztrain.load_params(tmp_path / "p", {"w": jnp.zeros(1000)})
    (tmp_path / "p" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(CheckpointError, match="incomplete or corrupt: cannot read"):
        pztrain.load_params(tmp_path / "p", {"w": jnp.zeros(1000)})


class MyState(TrainState):
    epoch: jax.Array
    note: int


@pytest.mark.slow  # a second or more (compiles, imports)
def test_full_state_round_trip_keeps_exact_types(tmp_path):
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.01),
    )
    model = penzai_v2_mlp()
    state = MyState.initial_state(
        model,
        tx,
        jax.random.key(4),
        loss_fn_state={"n": jnp.array(3)},
        epoch=jnp.array(2),
        note=11,
    )
    step = pztrain.build_train_step(
        lambda **kw: (xor_loss(**kw)[0], {"n": kw["state"]["n"] + 1}, {})
    )
    for _ in range(2):
        state, _ = step(state, x=XOR_X, y=XOR_Y)
    pztrain.save_state(tmp_path / "s", state)
    like = MyState.initial_state(
        penzai_v2_mlp(seed=9),
        tx,
        jax.random.key(0),
        loss_fn_state={"n": jnp.array(0)},
        epoch=jnp.array(0),
        note=0,
    )
    back = pztrain.load_state(tmp_path / "s", like)
    assert type(back.opt_state[1]) is type(state.opt_state[1])
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        if not hasattr(a, "dtype"):  # the Python int field
            assert a == b
            continue
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    assert back.note == 11 and int(back.step) == 2 and int(back.loss_fn_state["n"]) == 5
    meta = pztrain.read_metadata(tmp_path / "s")
    assert meta["metadata"]["hyperparams"]["learning_rate"] == pytest.approx(0.01)
    assert meta["params"]["names"] == sorted(state.params)
    with pytest.raises(CheckpointError, match="holds params only"):
        pztrain.save_params(tmp_path / "p", state)
        pztrain.load_state(tmp_path / "p", like)
    other = MyState.initial_state(
        model, optax.sgd(0.1), jax.random.key(0), epoch=jnp.array(0), note=0
    )
    with pytest.raises(CheckpointError, match="does not match the target state"):
        pztrain.load_state(tmp_path / "s", other)


@pytest.mark.slow  # trains an equinox model to save it
def test_no_pickle_is_written_or_loaded(tmp_path, monkeypatch):
    state = _trained("equinox")
    pztrain.save_state(tmp_path / "s", state)
    for f in (tmp_path / "s").rglob("*"):
        if f.is_file():
            head = f.read_bytes()[:2]
            assert not (
                head[:1] == b"\x80"
                and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
            ), f
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for where in ("s", "s/params", "s/state", "s/meta"):
        (tmp_path / where / "evil.pkl").write_bytes(pickle.dumps(Payload()))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("the load path unpickled something")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    back = pztrain.load_state(tmp_path / "s", _state("equinox", seed=3))
    _assert_params_equal(back.params, state.params)
    assert not marker.exists()


def test_safetensors_export_and_import(tmp_path):
    trained = _trained("penzai_v2")
    pztrain.export_safetensors(tmp_path / "w.safetensors", trained)
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(tensors) == sorted(trained.params)
    model = pztrain.import_safetensors(
        tmp_path / "w.safetensors", penzai_v2_mlp(seed=5)
    )
    state = TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
    _assert_params_equal(state.params, trained.params)


# ------------------------------------------------------------------ during fit


def _fit_setup():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 2)).astype(np.float32)
    data = pztrain.ArrayLoader({"x": x, "y": (x[:, 0] > 0).astype(np.int32)}, 8)
    eval_data = pztrain.ArrayLoader({"x": x, "y": (x[:, 0] > 0).astype(np.int32)}, 32)
    return (
        data,
        eval_data,
        pztrain.build_train_step(xor_loss),
        pztrain.build_eval_step(lambda **kw: {"loss": xor_loss(**kw)[0]}),
    )


@pytest.mark.slow  # a run with keep_last and keep_best: many saves
def test_keep_last_and_best_never_delete_the_newest(tmp_path):
    data, eval_data, step, eval_step = _fit_setup()
    ckpt = pztrain.Checkpoints(
        tmp_path / "c", keep_last=1, keep_best=1, monitor="eval/loss"
    )
    losses = {}

    class Record(pztrain.Callback):
        def on_eval_end(self, state, record):
            losses[record["step"]] = record["metrics"]["loss"]

    pztrain.fit(
        _state("equinox"),
        step,
        data,
        num_steps=40,
        eval_step=eval_step,
        eval_data=eval_data,
        eval_every=8,
        log_every=8,
        callbacks=[Record()],
        checkpoints=ckpt,
        progress=False,
    )
    kept = sorted(int(p.name) for p in (tmp_path / "c").iterdir() if p.name.isdigit())
    best = min(losses, key=losses.get)
    assert 40 in kept and best in kept and len(kept) <= 2
    assert not list((tmp_path / "c").glob("*tmp*"))


@pytest.mark.slow  # a run saving every 4 steps, interrupted
def test_saves_finish_when_the_run_is_interrupted(tmp_path):
    data, _, step, _ = _fit_setup()

    class Interrupt(pztrain.Callback):
        def on_log(self, state, record):
            if record["step"] == 12:
                raise KeyboardInterrupt

    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=4, keep_last=10)
    with pytest.raises(KeyboardInterrupt):
        pztrain.fit(
            _state("equinox"),
            step,
            data,
            num_steps=40,
            log_every=4,
            callbacks=[Interrupt()],
            checkpoints=ckpt,
            progress=False,
        )
    # Interrupted inside the log point of step 12 (before its record was
    # logged): a checkpoint at 12 would lose that record on resume, so the
    # newest is 8.
    assert sorted(int(p.name) for p in (tmp_path / "c").iterdir()) == [4, 8]
    assert not list((tmp_path / "c").glob("*tmp*"))


@pytest.mark.slow  # three runs
def test_resume_in_process_is_exact_and_logs_continue(tmp_path):
    data, eval_data, step, eval_step = _fit_setup()

    def run(run_dir, num_steps, resume):
        stopper = pztrain.EarlyStopping("eval/loss", patience=100)
        ckpt = pztrain.Checkpoints(run_dir / "c", every_steps=8)
        state, _ = pztrain.fit(
            _state("equinox"),
            step,
            data,
            num_steps=num_steps,
            eval_step=eval_step,
            eval_data=eval_data,
            eval_every=8,
            log_every=4,
            callbacks=[stopper],
            checkpoints=ckpt,
            resume=resume,
            run_dir=run_dir,
            progress=False,
        )
        return state, stopper

    full, full_stopper = run(tmp_path / "a", 32, False)
    run(tmp_path / "b", 16, False)
    resumed, stopper = run(tmp_path / "b", 32, True)
    _assert_params_equal(resumed.params, full.params)
    _assert_params_equal(resumed.opt_state, full.opt_state)
    assert (stopper.best, stopper.best_step, stopper.wait) == (
        full_stopper.best,
        full_stopper.best_step,
        full_stopper.wait,
    )
    records = pztrain.loggers.read_jsonl(tmp_path / "b")
    expected = pztrain.loggers.read_jsonl(tmp_path / "a")
    key = lambda r: (r["step"], r["split"])  # noqa: E731
    assert [key(r) for r in records] == [key(r) for r in expected]
    assert [r["metrics"] for r in records] == [r["metrics"] for r in expected]


@pytest.mark.slow  # a run, a damaged save and a resume
def test_unreadable_newest_checkpoint_is_skipped_with_a_warning(tmp_path):
    data, _, step, _ = _fit_setup()
    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=4, keep_last=5)
    pztrain.fit(
        _state("equinox"),
        step,
        data,
        num_steps=8,
        log_every=4,
        checkpoints=ckpt,
        progress=False,
    )
    (tmp_path / "c" / "8" / "meta" / "metadata").write_text("garbage")
    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=4, keep_last=5)
    with pytest.warns(
        UserWarning,
        match=re.escape(f"Skipping unreadable checkpoint {tmp_path / 'c' / '8'}"),
    ):
        state = ckpt.restore_latest(_state("equinox"))
    assert int(state.step) == 4
    ckpt.close()


def _worker(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    return subprocess.run(
        [sys.executable, str(HERE / "ckpt_worker.py"), str(run_dir), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "kill_saving"])
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, mode):
    full = _worker(tmp_path / "full", "full")
    assert full.returncode == 0, full.stderr
    killed = _worker(tmp_path / "run", mode, "10" if mode == "kill" else "14")
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "run" / "final.npz").exists()
    kept = sorted(
        int(p.name) for p in (tmp_path / "run" / "ckpt").iterdir() if p.name.isdigit()
    )
    if mode == "kill":
        assert kept[-1] == 8
    else:  # the save of step 14 was killed midway: only its temporary dir is left
        assert kept[-1] == 12
        assert list((tmp_path / "run" / "ckpt").glob("14.orbax-checkpoint-tmp*"))
    resumed = _worker(tmp_path / "run", "full")
    assert resumed.returncode == 0, resumed.stderr
    if mode == "kill_saving":
        assert "Removing incomplete checkpoint" in resumed.stderr
        assert not list((tmp_path / "run" / "ckpt").glob("*.orbax-checkpoint-tmp*"))
    a = np.load(tmp_path / "full" / "final.npz")
    b = np.load(tmp_path / "run" / "final.npz")
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(2, 25, 2))


@pytest.mark.slow
def test_async_save_outside_fit_is_finished_at_exit(tmp_path):
    code = (
        "import jax, jax.numpy as jnp, optax, pztrain\n"
        "state = pztrain.TrainState.initial_state({'w': jnp.ones((1000, 1000))},"
        " optax.adam(0.1), jax.random.key(0))\n"
        f"ckpt = pztrain.Checkpoints({str(tmp_path / 'c')!r})\n"
        "ckpt.save(state, 3)\n"  # async; the script exits without wait() or close()
    )
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "c" / "3" / "commit_success.txt").exists() or (
        tmp_path / "c" / "3" / "_CHECKPOINT_METADATA"
    ).exists()
    assert not list((tmp_path / "c").glob("*tmp*"))
    back = pztrain.load_params(tmp_path / "c", {"w": jnp.zeros((1000, 1000))})
    np.testing.assert_array_equal(back["w"], np.ones((1000, 1000)))
