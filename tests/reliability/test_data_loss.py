"""Mistakes that must not lose data or crash with a raw error (issue 11, part)."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import CheckpointError, DonatedStateError, TrainState
from pztrain.loggers import JsonlLogger, read_jsonl


def loss_fn(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"]) ** 2)
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)
X = jnp.ones((4, 3))


def new_state() -> TrainState:
    return TrainState.initial_state(
        {"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0)
    )


# ------------------------------------------------------ a consumed state


@pytest.mark.parametrize(
    "use, where",
    [
        (
            lambda s, d: pztrain.fit(s, STEP, [{"x": X}], num_steps=2, progress=False),
            "fit(state, ...)",
        ),
        (lambda s, d: s.summary(), "state.summary()"),
        (lambda s, d: pztrain.save_params(d / "p", s), "save_params"),
        (lambda s, d: pztrain.save_state(d / "s", s), "save_state"),
        (lambda s, d: STEP(s, x=X), "train_step(state, ...)"),
    ],
    ids=["fit", "summary", "save_params", "save_state", "step"],
)
def test_a_consumed_state_is_refused_by_name(tmp_path, use, where):
    """Re-running a notebook cell with a state a step already consumed."""
    state0 = new_state()
    STEP(state0, x=X)  # consumes state0's arrays
    with pytest.raises(
        DonatedStateError,
        match=re.escape(f"{where}: ") + ".*donated to a train step.*re-run the cell",
    ):
        use(state0, tmp_path)
    assert not (tmp_path / "p").exists() and not (tmp_path / "s").exists()


# ------------------------------------------------- unreadable metadata


def _two_checkpoints(directory: pathlib.Path) -> None:
    state, _ = STEP(new_state(), x=X)
    pztrain.Checkpoints(directory).save(state, 1)
    state, _ = STEP(state, x=X)
    pztrain.Checkpoints(directory).save(state, 2)


@pytest.mark.parametrize(
    "bad",
    [
        b"[1, 2]",
        b'{"format": "pztrain.checkpoint", "state": {}}',
        b'{"format": "pztrain.checkpoint", "params": {"names": ["w"], '
        b'"shapes": [], "dtypes": []}}',
        b'{"format": "pztrain.checkpoint", "format_version": "x"}',
        b"\xff\xfe\x00not utf-8",
    ],
    ids=["json-list", "no-params", "uneven-lists", "bad-version", "not-utf8"],
)
def test_resume_skips_a_checkpoint_whose_metadata_is_not_pztrains(tmp_path, bad):
    _two_checkpoints(tmp_path / "c")
    meta = tmp_path / "c" / "2" / "meta" / "metadata"
    meta.write_bytes(bad)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "c" / "2"))):
        pztrain.read_metadata(tmp_path / "c" / "2")
    with pytest.warns(
        UserWarning,
        match=re.escape(f"Skipping unreadable checkpoint {tmp_path / 'c' / '2'}"),
    ):
        state = pztrain.Checkpoints(tmp_path / "c").restore_latest(new_state())
    assert int(state.step) == 1


# ------------------------------------------------------- the JSONL log


def test_a_resumed_log_is_rewritten_atomically(tmp_path, monkeypatch):
    """A run killed while the log is cut back to the resume step keeps its log."""
    log = JsonlLogger(tmp_path)
    for step in (2, 4, 6):
        log.log_record({"step": step, "split": "train", "metrics": {"loss": 1.0}})
    log.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    real_open = pathlib.Path.open

    class Killed(BaseException):
        pass

    def open_then_die(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        if "w" in mode:
            f.close()
            raise Killed  # the process dies right after opening for writing
        return f

    monkeypatch.setattr(pathlib.Path, "open", open_then_die)
    with pytest.raises(Killed):
        JsonlLogger(tmp_path, resume_step=4)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    JsonlLogger(tmp_path, resume_step=4).close()
    assert [r["step"] for r in read_jsonl(tmp_path)] == [2, 4]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_log_line_cut_short_by_a_kill_is_not_a_record(tmp_path):
    log = JsonlLogger(tmp_path)
    for step in (2, 4):
        log.log_record({"step": step, "split": "train", "metrics": {"loss": 1.0}})
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "split": "tr')  # the kill came mid-write
    assert [r["step"] for r in read_jsonl(tmp_path)] == [2, 4]
    JsonlLogger(tmp_path, resume_step=4).close()  # a resume rewrites it whole
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\nnot json\n{"step": 4}\n')
    with pytest.raises(ValueError):  # a bad line inside the file is an error
        read_jsonl(tmp_path)


# ------------------------------------------------------- overwrite=True


@pytest.mark.parametrize("save", [pztrain.save_params, pztrain.save_state])
def test_a_failed_overwrite_keeps_the_old_checkpoint(tmp_path, save):
    state, _ = STEP(new_state(), x=X)
    save(tmp_path / "ck", state)
    with pytest.raises(
        CheckpointError,
        match=re.escape("metadata['run'][1] is a object, which JSON cannot hold"),
    ):
        save(tmp_path / "ck", state, metadata={"run": [1, object()]}, overwrite=True)
    back = pztrain.load_params(tmp_path / "ck", new_state())
    assert float(back.params["w"][0]) == float(state.params["w"][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no leftovers
    later, _ = STEP(state, x=X)
    save(tmp_path / "ck", later, overwrite=True)  # a good overwrite replaces it
    back = pztrain.load_params(tmp_path / "ck", new_state())
    assert float(back.params["w"][0]) == float(later.params["w"][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_save_that_fails_midway_leaves_the_old_checkpoint_and_no_temporaries(
    tmp_path, monkeypatch
):
    state, _ = STEP(new_state(), x=X)
    pztrain.save_params(tmp_path / "ck", state)
    import pztrain.checkpoint._orbax as orbax_settings

    class DiskFull:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def save(self, directory, args):
            directory.mkdir()  # some of it was written ...
            (directory / "part").write_text("x")
            raise OSError(28, "No space left on device")  # ... then the disk filled

    monkeypatch.setattr(orbax_settings, "checkpointer", DiskFull)
    with pytest.raises(OSError, match="No space left"):
        pztrain.save_params(tmp_path / "ck", new_state(), overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    back = pztrain.load_params(tmp_path / "ck", new_state())
    assert float(back.params["w"][0]) == float(state.params["w"][0])


def test_checkpoints_store_numpy_hyperparameters_as_json(tmp_path):
    _, _ = pztrain.fit(
        new_state(),
        STEP,
        [{"x": X}],
        num_steps=2,
        hparams={"lr": np.float32(0.1), "sizes": (3, 1)},
        checkpoints=pztrain.Checkpoints(tmp_path / "c"),
        progress=False,
    )
    meta = pztrain.read_metadata(tmp_path / "c")
    assert meta["metadata"]["hparams"] == {"lr": pytest.approx(0.1), "sizes": [3, 1]}
