"""`pztrain.evaluate_checkpoints` beside a run whose retention deletes
checkpoints (``keep_last``): a reader's mark keeps the checkpoint being read,
deletes are renames first, and what the job could not read is named."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax.numpy as jnp
import pytest

import pztrain
from pztrain.checkpoint import _readers, _writer
from pztrain.checkpoint._metadata import checkpoint_steps
from pztrain.loop import _eval_job

sys.path.insert(0, str(Path(__file__).parent))
import eval_job_trainer as trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _at(step: int) -> pztrain.TrainState:
    state = trainer.initial_state()
    return state.replace(step=jnp.asarray(step, state.step.dtype))


def _evaluations():
    return [pztrain.Evaluation("p", lambda s: {"step": s.step, "w0": s.params["w"][0]})]


def _job(directory, run_dir, evaluations=None, **kwargs):
    return pztrain.evaluate_checkpoints(
        directory, trainer.initial_state(), evaluations or _evaluations(),
        run_dir=run_dir, priority=None, **kwargs,
    )  # fmt: skip


def test_retention_keeps_a_checkpoint_a_reader_marks_until_the_read_ends(tmp_path):
    ckpts = pztrain.Checkpoints(tmp_path, keep_last=1)
    ckpts.save(_at(2), 2)
    with _readers.reading(tmp_path, 2):
        ckpts.save(_at(4), 4)
        ckpts.save(_at(6), 6)
        assert ckpts.steps() == [2, 6]  # 4 deleted; 2 kept: it is being read
    assert not list(tmp_path.glob(".pztrain-reader-*"))  # the mark is gone
    ckpts.save(_at(8), 8)
    assert ckpts.steps() == [8]  # once read, retention deletes it


def test_a_dead_readers_mark_holds_nothing_and_is_removed(tmp_path):
    def mark(name, **record):
        path = tmp_path / f"{_readers.MARK_PREFIX}{name}.json"
        path.write_text(json.dumps(record))
        return path

    now = 1000.0
    here = {"host": socket.gethostname(), "pid": os.getpid()}
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    live = mark("live", step=2, expires=now + 60, **here)
    far = mark("far", step=4, expires=now + 60, host="another-host", pid=1)
    expired = mark("expired", step=6, expires=now - 1, **here)
    killed = mark("killed", step=8, expires=now + 60, host=here["host"],
                  pid=int(ended.stdout))  # fmt: skip
    assert _readers.held_steps(tmp_path, now=now) == {2, 4}
    assert live.exists() and far.exists()
    assert not expired.exists() and not killed.exists()
    assert _readers.held_steps(tmp_path, now=now + 61) == set()  # all expired


def test_the_marks_heartbeat_pushes_its_expiry_on(tmp_path):
    with _readers.reading(tmp_path, 2, ttl=0.3):
        time.sleep(0.5)  # past the first expiry: the heartbeat renewed it
        assert _readers.held_steps(tmp_path) == {2}


def test_a_deleted_checkpoint_is_renamed_away_whole_before_it_is_removed(
    tmp_path, monkeypatch
):
    seen = []
    rmtree = shutil.rmtree

    def spy(path, *args, **kwargs):
        if Path(path).name == _writer.TRASH and Path(path).exists():
            trash = sorted(p.name for p in Path(path).iterdir())
            seen.append(((tmp_path / "2").exists(), trash))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", spy)
    ckpts = pztrain.Checkpoints(tmp_path, keep_last=1)
    ckpts.save(_at(2), 2)
    ckpts.save(_at(4), 4)
    assert seen == [(False, ["2"])]  # gone from its place, whole in the trash
    assert sorted(os.listdir(tmp_path)) == ["4"]  # and the trash removed


def test_the_job_holds_a_mark_that_retention_honours_while_it_reads(
    tmp_path, monkeypatch
):
    ckpts = pztrain.Checkpoints(tmp_path / "ckpt", keep_last=1)
    ckpts.save(_at(2), 2)
    during = []
    load = _eval_job.load_params

    def read_while_training_saves(path, like):
        if Path(path).name == "2":  # training saves 4 while the job reads 2
            ckpts.save(_at(4), 4)
            during.append(sorted(ckpts.steps()))
        return load(path, like)

    monkeypatch.setattr(_eval_job, "load_params", read_while_training_saves)
    history = _job(tmp_path / "ckpt", tmp_path / "job", follow=False)
    assert during == [[2, 4]]  # retention kept 2 while it was read
    assert [r["step"] for r in history.records] == [2, 4]
    ckpts.save(_at(6), 6)
    assert ckpts.steps() == [6]


def test_a_checkpoint_the_run_deleted_before_the_read_is_skipped_and_named(
    tmp_path, monkeypatch
):
    for step in (2, 4, 6):
        pztrain.save_state(tmp_path / "ckpt" / str(step), _at(step))
    load = _eval_job.load_params

    def deleted_meanwhile(path, like):
        if Path(path).name == "2":  # while 2 is read, the run deletes 2 and 4
            for step in (2, 4):
                shutil.rmtree(tmp_path / "ckpt" / str(step))
        return load(path, like)

    monkeypatch.setattr(_eval_job, "load_params", deleted_meanwhile)
    with pytest.warns(UserWarning) as caught:
        history = _job(tmp_path / "ckpt", tmp_path / "job", follow=False)
    assert [r["step"] for r in history.records] == [6]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2  # each checkpoint it listed and could not read
    for step, message in zip((2, 4), messages, strict=True):
        assert f"skipped checkpoint {step} (" in message
        assert "the training run deleted it" in message and "keep_last" in message


def test_a_directory_the_job_cannot_mark_is_read_unmarked_warned_once(
    tmp_path, monkeypatch
):
    for step in (2, 4):
        pztrain.save_state(tmp_path / "ckpt" / str(step), _at(step))

    def read_only(path, record):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_readers, "_write", read_only)
    with pytest.warns(UserWarning) as caught:
        history = _job(tmp_path / "ckpt", tmp_path / "job", follow=False)
    assert [r["step"] for r in history.records] == [2, 4]
    (message,) = [str(w.message) for w in caught]  # once, not once a checkpoint
    assert "cannot mark checkpoint 2 as being read" in message


def test_a_damaged_checkpoint_that_is_still_there_raises(tmp_path):
    pztrain.save_state(tmp_path / "ckpt" / "2", _at(2))
    for data in (tmp_path / "ckpt" / "2" / "params").rglob("*"):
        if data.is_file() and data.name not in ("_METADATA", "_sharding"):
            data.write_bytes(b"")
    with pytest.raises(pztrain.CheckpointError) as raised:
        _job(tmp_path / "ckpt", tmp_path / "job", follow=False)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "checkpoint 2 is still in" in notes and "it is damaged" in notes
    assert not list((tmp_path / "ckpt").glob(".pztrain-reader-*"))


@pytest.mark.slow
def test_a_slow_job_follows_a_run_that_keeps_two_checkpoints(tmp_path):
    ckpt, num_steps = tmp_path / "ckpt", 40
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/eval_job_trainer.py"), str(ckpt),
         str(num_steps), "0.05", "2"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip

    def slow(state):  # slower than training by construction: it waits for
        step = int(state.step)  # the run to save 4 more checkpoints
        while proc.poll() is None and not any(
            s >= step + 8 for s in checkpoint_steps(ckpt)
        ):
            time.sleep(0.05)
        return {"step": state.step}

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = _job(ckpt, tmp_path / "job", [pztrain.Evaluation("p", slow)],
                           timeout=120, poll=0.1)  # fmt: skip
        assert proc.wait(timeout=120) == 0  # training never waited for the job
    finally:
        proc.kill()
    steps = [r["step"] for r in history.records]
    assert steps == sorted(set(steps)) and steps[-1] == num_steps
    assert all(r["metrics"]["p/step"] == r["step"] for r in history.records)
    skipped = [str(w.message) for w in caught if "skipped checkpoint" in str(w.message)]
    assert skipped, "retention deleted no checkpoint the job had seen"
    for message in skipped:
        assert "the training run deleted it" in message
        assert int(message.split("skipped checkpoint ")[1].split(" ")[0]) not in steps
    assert len(steps) + len(skipped) <= num_steps // 2
    assert not list(ckpt.glob(".pztrain-reader-*"))  # no mark left behind
    assert not (ckpt / _writer.TRASH).exists()
