"""Checkpoints never drop a save, a record or another run silently (issue 11).

Each test fails on the code before the issue: a fresh run into a used
directory, a step saved twice, a resume into another structure, a crash during
an evaluation at a checkpointed step, a NaN state, a directory that cannot be
written, a save that fails in the background.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import CheckpointError, CheckpointMismatchError, TrainState
from pztrain.loggers import read_jsonl
from pztrain.records import TIMING_KEYS


def loss_fn(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"]) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x):
    return {"loss": jnp.mean((x @ model["w"]) ** 2)}


STEP = pztrain.build_train_step(loss_fn)
EVAL = pztrain.build_eval_step(eval_fn)
X = jnp.ones((4, 3)) * 0.1
REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = [{"x": X}]


def new_state(tx=None) -> TrainState:
    return TrainState.initial_state(
        {"w": jnp.ones(3)}, tx or optax.sgd(0.1), jax.random.key(0)
    )


def train(state, ckpt, **kw):
    return pztrain.fit(state, STEP, DATA, progress=False, checkpoints=ckpt, **kw)


def _without_time(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def _files(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# ------------------------------------------- a directory another run used


def test_a_fresh_run_refuses_a_directory_that_holds_checkpoints(tmp_path):
    train(new_state(), pztrain.Checkpoints(tmp_path / "c"), num_steps=4)
    before = _files(tmp_path)
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{tmp_path / 'c'} already holds checkpoints [4] of another")
        + ".*resume=True.*new directory.*overwrite=True",
    ):
        train(new_state(), pztrain.Checkpoints(tmp_path / "c"), num_steps=2)
    assert _files(tmp_path) == before  # nothing touched


@pytest.mark.slow  # two runs
def test_overwrite_deletes_the_other_runs_checkpoints_when_training_starts(tmp_path):
    train(new_state(), pztrain.Checkpoints(tmp_path / "c"), num_steps=4)
    ckpt = pztrain.Checkpoints(tmp_path / "c", overwrite=True)
    with pytest.warns(UserWarning, match=re.escape("Deleting checkpoints [4] in")):
        train(new_state(), ckpt, num_steps=2)
    assert ckpt.steps() == [2]


def test_a_fresh_run_refuses_a_run_dir_with_another_runs_log(tmp_path):
    train(new_state(), None, num_steps=2, log_every=1, run_dir=tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="holds another run's log"):
        train(new_state(), None, num_steps=2, log_every=1, run_dir=tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_saving_a_step_twice_is_an_error_or_an_explicit_overwrite(tmp_path):
    first, _ = STEP(new_state(), x=X)
    second, _ = STEP(new_state(), x=2 * X)
    pztrain.Checkpoints(tmp_path).save(first, 1)
    with pytest.raises(CheckpointError, match="Checkpoint 1 already exists in"):
        pztrain.Checkpoints(tmp_path).save(second, 1)
    back = pztrain.load_params(tmp_path / "1", new_state())
    np.testing.assert_array_equal(back.params["w"], first.params["w"])
    pztrain.Checkpoints(tmp_path, overwrite=True).save(second, 1)
    back = pztrain.load_params(tmp_path / "1", new_state())
    np.testing.assert_array_equal(back.params["w"], second.params["w"])


def test_saving_a_consumed_state_names_the_call(tmp_path):
    state = new_state()
    STEP(state, x=X)
    with pytest.raises(pztrain.DonatedStateError, match="Checkpoints.save"):
        pztrain.Checkpoints(tmp_path).save(state, 0)


# --------------------------------------------- resume into another structure


def test_resume_into_another_structure_is_an_error_and_touches_nothing(tmp_path):
    opts = dict(num_steps=4, log_every=2, run_dir=tmp_path / "run")
    train(new_state(), pztrain.Checkpoints(tmp_path / "c", every_steps=2), **opts)
    before = _files(tmp_path)
    other = new_state(optax.adam(0.1))  # another optimizer chain
    with pytest.raises(CheckpointMismatchError, match=r"\.opt_state"):
        train(
            other,
            pztrain.Checkpoints(tmp_path / "c", keep_last=1),
            resume=True,
            **{**opts, "num_steps": 8},
        )
    assert _files(tmp_path) == before


@pytest.mark.slow  # a run, damaged saves and a resume
def test_resume_sets_unreadable_newer_checkpoints_aside_and_saves_again(tmp_path):
    ckpt = pztrain.Checkpoints(tmp_path, every_steps=2, keep_last=5)
    train(new_state(), ckpt, num_steps=4, log_every=2)
    (tmp_path / "4" / "meta" / "metadata").write_text("[]")
    with pytest.warns(UserWarning, match="Skipping unreadable checkpoint .*4"):
        state, _ = train(new_state(), ckpt, num_steps=6, log_every=2, resume=True)
    assert int(state.step) == 6
    assert ckpt.steps() == [2, 4, 6]  # 4 saved again, from the resumed run
    assert (tmp_path / "4.unreadable").is_dir()
    (tmp_path / "4" / "meta" / "metadata").write_text("[]")  # again: a new name
    (tmp_path / "6" / "meta" / "metadata").write_text("[]")
    with pytest.warns(UserWarning) as warned:
        state, _ = train(new_state(), ckpt, num_steps=6, log_every=2, resume=True)
    assert [str(w.message).split(":")[0][-2:] for w in warned] == ["/6", "/4"]
    assert int(state.step) == 6  # from 2
    assert sorted(p.name for p in tmp_path.glob("*.unreadable*")) == [
        "4.unreadable",
        "4.unreadable-2",
        "6.unreadable",
    ]


# ------------------------------------------ a crash inside a host point


class FailingEvalData:
    """Eval data whose ``fail_at``-th pass (counting from 1) raises."""

    def __init__(self, fail_at: int | None):
        self.fail_at, self.passes = fail_at, 0

    def __iter__(self):
        self.passes += 1
        if self.passes == self.fail_at:
            raise RuntimeError("evaluation crashed")
        return iter(DATA)


@pytest.mark.slow  # three runs
@pytest.mark.parametrize(
    "num_steps, every, fail_at, kept",
    [
        (12, 4, 2, [4]),  # the evaluation at step 8, inside the loop
        (10, 2, 3, [6, 8]),  # the final one, at step 10, after the loop
    ],
    ids=["eval-inside-the-run", "final-eval"],
)
def test_a_crash_during_evaluation_at_a_checkpointed_step_loses_no_record(
    tmp_path, num_steps, every, fail_at, kept
):
    loader = pztrain.ArrayLoader({"x": np.arange(24.0).reshape(8, 3) / 24}, 4)

    def run(run_dir, ckpt_dir, fail_at, resume=False):
        return pztrain.fit(
            new_state(),
            STEP,
            loader,
            progress=False,
            checkpoints=pztrain.Checkpoints(ckpt_dir, every_steps=every),
            num_steps=num_steps,
            log_every=2,
            eval_every=4,
            eval_step=EVAL,
            eval_data=FailingEvalData(fail_at),
            run_dir=run_dir,
            resume=resume,
        )

    whole, _ = run(tmp_path / "whole", tmp_path / "whole_c", None)
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        run(tmp_path / "run", tmp_path / "c", fail_at)
    assert pztrain.Checkpoints(tmp_path / "c").steps() == kept
    resumed, _ = run(tmp_path / "run", tmp_path / "c", None, resume=True)
    assert _without_time(read_jsonl(tmp_path / "run")) == _without_time(
        read_jsonl(tmp_path / "whole")
    )
    np.testing.assert_array_equal(resumed.params["w"], whole.params["w"])


# ----------------------------------------------------------------- NaN


@pytest.mark.slow  # a run stopped by a NaN, then a restore
def test_a_nan_state_is_never_saved_and_resume_restores_the_last_finite(tmp_path):
    nan_data = [{"x": X}] * 5 + [{"x": X * jnp.nan}] + [{"x": X}] * 10
    ckpt = pztrain.Checkpoints(tmp_path, every_steps=2, keep_last=5)
    with pytest.warns(UserWarning, match="Not saving checkpoint 6 .*not finite"):
        state, history = pztrain.fit(
            new_state(),
            STEP,
            nan_data,
            num_steps=10,
            log_every=2,
            callbacks=[pztrain.NanPolicy("stop")],
            checkpoints=ckpt,
            progress=False,
        )
    # counted from 0; the params that went non-finite are named
    assert history.stop_reason.startswith("non-finite loss at step 5: params non")
    assert ckpt.steps() == [2, 4]
    back = ckpt.restore_latest(new_state())
    assert int(back.step) == 4 and bool(jnp.isfinite(back.params["w"]).all())


@pytest.mark.slow  # a run over NaN batches (test_skip_counts_... stays fast)
def test_skip_whose_apply_if_finite_gave_up_stops_the_run(tmp_path):
    tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=2)
    nan_data = [{"x": X}] * 2 + [{"x": X * jnp.nan}] * 6 + [{"x": X}] * 4
    state, history = pztrain.fit(
        new_state(tx),
        STEP,
        nan_data,
        num_steps=12,
        log_every=4,
        callbacks=[pztrain.NanPolicy("skip")],
        progress=False,
    )
    assert re.match(
        r"optax.apply_if_finite gave up .*params are not finite", history.stop_reason
    )
    assert int(state.step) == 8  # the log point where it was seen


def test_skip_counts_the_updates_it_skipped(tmp_path):
    tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5)
    nan_data = [{"x": X}] * 2 + [{"x": X * jnp.nan}] * 3 + [{"x": X}] * 3
    _, history = pztrain.fit(
        new_state(tx),
        STEP,
        nan_data,
        num_steps=8,
        log_every=4,
        callbacks=[pztrain.NanPolicy("skip")],
        progress=False,
    )
    skipped = [r["metrics"]["skipped_updates"] for r in history.records]
    assert skipped == [2.0, 3.0] and history.stop_reason is None


# ------------------------------------------------ directories and disks


def test_a_checkpoint_directory_that_is_a_file_fails_before_the_first_step(tmp_path):
    (tmp_path / "f").write_text("")
    for where in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(CheckpointError, match=re.escape(str(where))):
            train(new_state(), pztrain.Checkpoints(where), num_steps=2)


def test_keep_best_without_evaluation_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"keep_best=2.*'eval/loss'.*no evaluation"):
        train(new_state(), pztrain.Checkpoints(tmp_path, keep_best=2), num_steps=2)


_DISK_FULL = textwrap.dedent(
    """
    import resource, signal, sys, time
    import jax, jax.numpy as jnp, optax, pztrain

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: writes fail

    def loss_fn(*, model, state, rng, x):
        loss = jnp.mean((x @ model["w"]) ** 2)
        return loss, state, {"loss": loss}

    class DiskFull(pztrain.Callback):
        def on_train_start(self, state, info):
            resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))

    state = pztrain.TrainState.initial_state(
        {"w": jnp.zeros(100_000)}, optax.adam(0.1), jax.random.key(0))
    t = time.perf_counter()
    try:
        pztrain.fit(state, pztrain.build_train_step(loss_fn),
                    [{"x": jnp.ones((2, 100_000))}], num_steps=40, log_every=2,
                    callbacks=[DiskFull()], progress=False,
                    checkpoints=pztrain.Checkpoints(sys.argv[1], every_steps=2))
    except pztrain.CheckpointError as e:
        print("ERROR", e)
    print("SECONDS", time.perf_counter() - t)
    """
)


@pytest.mark.slow
def test_a_save_that_fails_in_the_background_stops_the_run_and_cleans_up(tmp_path):
    """A full disk (a file-size limit): the error names the step, the run stops
    at the next host point, no temporaries are left, the process exits."""
    script = tmp_path / "disk_full.py"
    script.write_text(_DISK_FULL)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's pztrain
    )
    assert out.returncode == 0, out.stderr[-3000:]
    error = re.search(r"^ERROR (.*)$", out.stdout, re.M)
    assert error, out.stdout
    assert re.match(r"Saving checkpoint 2 in .* failed: .*resume=True", error[1])
    assert list((tmp_path / "c").iterdir()) == []  # no temporaries left
    seconds = float(re.search(r"SECONDS (\S+)", out.stdout)[1])
    assert seconds < 60  # stopped early: not 40 steps of saves, no 300 s hang


def test_keep_best_by_a_train_metric_ranks_the_saves(tmp_path):
    ckpt = pztrain.Checkpoints(tmp_path, every_steps=2, keep_best=1, monitor="loss")
    train(new_state(), ckpt, num_steps=6, log_every=2)
    assert ckpt.best_step() == 6  # the loss falls: the newest is the best
    assert pztrain.read_metadata(tmp_path / "6")["metadata"]["metrics"]["loss"] > 0


def test_keep_best_whose_metric_never_appears_is_refused_or_warns(tmp_path):
    # Data read ahead: the train metrics are known, the typo is refused at once.
    ckpt = pztrain.Checkpoints(
        tmp_path / "a", every_steps=2, keep_best=1, monitor="acc"
    )
    with pytest.raises(ValueError, match="monitors 'acc', which no train record"):
        train(new_state(), ckpt, num_steps=4, log_every=2)
    assert not (tmp_path / "a").exists()
    # Data read once (a generator): not known before the run, warned at its end.
    ckpt = pztrain.Checkpoints(
        tmp_path / "b", every_steps=2, keep_best=1, monitor="acc"
    )
    batches = ({"x": X} for _ in range(4))
    with pytest.warns(UserWarning, match="ranked no checkpoint: .*'acc'"):
        pztrain.fit(
            new_state(),
            STEP,
            batches,
            progress=False,
            checkpoints=ckpt,
            num_steps=4,
            log_every=2,
        )


class _CtrlCAt(pztrain.Callback):
    def __init__(self, step):
        self.step = step

    def on_log(self, state, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_keep_best_stopped_before_its_evaluation_ran_does_not_warn(tmp_path):
    """Ctrl-C before the monitored evaluation first ran (a combination-matrix
    row): the monitor is right, so no warning tells the user to change it,
    and the resumed run ranks its saves."""

    def ckpt():
        return pztrain.Checkpoints(
            tmp_path, every_steps=2, keep_last=1, keep_best=1, monitor="eval/loss"
        )

    kw = dict(eval_step=EVAL, eval_data=DATA, eval_every=4, log_every=2, num_steps=4)
    _, history = train(new_state(), ckpt(), callbacks=[_CtrlCAt(2)], **kw)
    assert history.stop_reason == "interrupted"
    resumed = ckpt()
    train(new_state(), resumed, resume=True, **kw)
    assert resumed.best_step() == 4


# ------------------------------------- one Checkpoints object, several runs


@pytest.mark.slow  # two runs
def test_a_resume_after_a_refused_fresh_run_keeps_its_checkpoints(tmp_path):
    """overwrite=True, then a refusal by the log, then resume=True: the
    checkpoint the resume restores is not deleted."""
    opts = dict(num_steps=4, log_every=2, run_dir=tmp_path / "run")
    train(new_state(), pztrain.Checkpoints(tmp_path / "c"), **opts)
    ckpt = pztrain.Checkpoints(tmp_path / "c", overwrite=True)
    with pytest.raises(ValueError, match="holds another run's log"):
        train(new_state(), ckpt, **opts)
    state, _ = train(new_state(), ckpt, resume=True, **{**opts, "num_steps": 6})
    assert int(state.step) == 6 and ckpt.steps() == [4, 6]


@pytest.mark.slow  # two runs
def test_a_checkpoints_object_serves_a_second_run(tmp_path):
    ckpt = pztrain.Checkpoints(tmp_path, every_steps=2, overwrite=True)
    train(new_state(), ckpt, num_steps=4, log_every=2)
    with pytest.warns(UserWarning, match=re.escape("Deleting checkpoints [2, 4]")):
        train(new_state(), ckpt, num_steps=4, log_every=2)
    assert ckpt.steps() == [2, 4]


def test_saving_an_older_step_than_the_newest_is_an_error(tmp_path):
    state, _ = STEP(new_state(), x=X)
    ckpt = pztrain.Checkpoints(tmp_path)
    ckpt.save(state, 10)
    with pytest.raises(CheckpointError, match="Checkpoint 8 is older than the newest"):
        ckpt.save(state, 8)
    assert ckpt.steps() == [10]


@pytest.mark.slow  # a run and its resume
def test_an_interruption_between_log_points_resumes_from_a_log_point(tmp_path):
    """Ctrl-C at step 6 with log_every=4: the resumed log equals an
    uninterrupted one (a checkpoint at 6 would average steps 7-8 alone)."""

    class Interrupt(pztrain.Callback):
        def on_advance(self, step, t):
            if step == 6:
                raise KeyboardInterrupt
            return step + 1  # a host point after every step

    data = pztrain.ArrayLoader({"x": np.arange(24.0).reshape(8, 3) / 24}, 2)
    opts = dict(num_steps=8, log_every=4, progress=False)
    pztrain.fit(new_state(), STEP, data, run_dir=tmp_path / "whole", **opts)
    ckpt = pztrain.Checkpoints(tmp_path / "c", every_steps=4)
    with pytest.raises(KeyboardInterrupt):
        pztrain.fit(
            new_state(), STEP, data, run_dir=tmp_path / "run", checkpoints=ckpt,
            callbacks=[Interrupt()], **opts,
        )  # fmt: skip
    assert ckpt.steps() == [4]
    pztrain.fit(
        new_state(), STEP, data, run_dir=tmp_path / "run", checkpoints=ckpt,
        resume=True, **opts,
    )  # fmt: skip
    assert _without_time(read_jsonl(tmp_path / "run")) == _without_time(
        read_jsonl(tmp_path / "whole")
    )


def test_resume_with_nothing_to_resume_keeps_the_log(tmp_path):
    train(new_state(), None, num_steps=4, log_every=2, run_dir=tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="holds another run's log"):
        train(
            new_state(),
            pztrain.Checkpoints(tmp_path / "misspelt"),
            num_steps=4,
            run_dir=tmp_path,
            resume=True,
        )
    assert (tmp_path / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # two runs
def test_keep_best_by_a_train_metric_with_an_early_evaluation(tmp_path):
    ckpt = pztrain.Checkpoints(tmp_path, keep_best=1, monitor="loss", on_eval=True)
    pztrain.fit(
        new_state(), STEP, DATA, num_steps=8, log_every=4, eval_every=2,
        eval_step=EVAL, eval_data=DATA, checkpoints=ckpt, progress=False,
    )  # fmt: skip
    assert ckpt.best_step() == 8
    # Resuming a finished run saves nothing and warns of nothing.
    train(new_state(), ckpt, num_steps=8, log_every=4, resume=True)


def test_resume_refuses_a_checkpoint_of_a_newer_format(tmp_path):
    ckpt = pztrain.Checkpoints(tmp_path, every_steps=2)
    train(new_state(), ckpt, num_steps=4, log_every=2)
    meta_file = tmp_path / "4" / "meta" / "metadata"
    meta_file.write_text(
        meta_file.read_text().replace('"format_version": 1', '"format_version": 99')
    )
    before = _files(tmp_path)
    with pytest.raises(CheckpointMismatchError, match="newer pztrain .*upgrade"):
        train(new_state(), ckpt, num_steps=6, log_every=2, resume=True)
    assert _files(tmp_path) == before  # not set aside as unreadable


@pytest.mark.slow  # a run and its resume
def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(tmp_path):
    """The checkpoint directory exists (the run started) but holds no checkpoint:
    resume=True starts over and its log replaces the killed attempt's records."""
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()  # what the killed run's start left
    train(new_state(), None, num_steps=4, log_every=2, run_dir=tmp_path / "run")
    train(
        new_state(), pztrain.Checkpoints(ckpt_dir, every_steps=8), num_steps=4,
        log_every=2, run_dir=tmp_path / "run", resume=True,
    )  # fmt: skip
    steps = [r["step"] for r in read_jsonl(tmp_path / "run")]
    assert steps == [2, 4]
