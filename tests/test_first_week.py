"""A first week's rough edges (issue 33): what a new user meets after Ctrl-C,
in a log file, in the digits example, in a resumed log, on a second Ctrl-C
during a save, and with inputs of the wrong kind (a ``run_dir`` or checkpoint
path that is a file, a schedule that returns a string, a hook that returns
another model's state).
"""

from __future__ import annotations

import functools
import importlib.util
import io
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import ArrayLoader, Callback, Checkpoints, fit
from pztrain.checkpoint import CheckpointError
from pztrain.checkpoint._directory import refuse_used
from pztrain.loggers import read_jsonl
from pztrain.loop._signals import LocalFlag
from pztrain.loop._stops import stop_line

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)


def new_state(width=3):
    return pztrain.TrainState.initial_state(
        {"w": jnp.zeros(width, jnp.float32)}, optax.adam(0.05), jax.random.key(0)
    )


def run(state=None, **kw):
    kw.setdefault("progress", False)
    data = ArrayLoader({"x": X, "y": Y}, 4, seed=1)  # 8 steps per epoch
    return fit(new_state() if state is None else state, STEP, data, **kw)


class SignalAt(Callback):
    """Sends SIGINT to this process at the log point of ``step``."""

    def __init__(self, step):
        self.step = step

    def on_log(self, state, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


# ------------------------------------------------- the line after Ctrl-C


def test_the_stop_line_names_resume_true_once_a_checkpoint_is_saved():
    flag = LocalFlag()
    flag.signalled(signal.SIGINT)
    assert stop_line(flag, 651, Path("ckpt/651")) == (
        "pztrain.fit: interrupted (SIGINT) at step 651. Checkpoint saved: "
        "ckpt/651. fit(..., resume=True) goes on from there."
    )
    assert "fit(state, ...) goes on" in stop_line(flag, 651, None)  # no checkpoint


@pytest.mark.parametrize(
    "step, message",
    [
        (
            651,
            "ckpt already holds checkpoints [500, 600, 651], the newest at this "
            "state's step (651): a run that stopped there saved it. Pass "
            "resume=True to fit to go on from there",
        ),
        (
            700,
            "ckpt already holds checkpoints [500, 600, 651], up to step 651, "
            "before this state's step (700). Pass Checkpoints(..., "
            "overwrite=True) to go on from this state (it deletes them), "
            "resume=True to fit to go on from step 651",
        ),
        (
            600,
            "ckpt already holds checkpoints [500, 600, 651], up to step 651, "
            "after this state's step (600). Pass resume=True to fit to go on "
            "from step 651",
        ),
        (
            0,
            "ckpt already holds checkpoints [500, 600, 651] of another run (this "
            "state is at step 0). Pass resume=True to fit to continue it",
        ),
    ],
)
def test_a_used_directory_is_refused_relating_its_steps_to_the_states(step, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        refuse_used(Path("ckpt"), [500, 600, 651], step)


@pytest.mark.slow  # an interrupted run with checkpoints, and its resume
def test_after_ctrl_c_the_printed_call_goes_on_and_the_error_names_it(tmp_path, capsys):
    directory = tmp_path / "c"
    state, history = run(
        num_steps=16,
        log_every=2,
        checkpoints=Checkpoints(directory, every_steps=4),
        callbacks=[SignalAt(6)],
    )
    assert history.stop_reason == "interrupted" and int(state.step) == 6
    line = capsys.readouterr().out.strip()
    assert line == (
        f"pztrain.fit: interrupted (SIGINT) at step 6. Checkpoint saved: "
        f"{directory / '6'}. fit(..., resume=True) goes on from there."
    )
    # Without resume=True the run is refused; the error names the same call
    # and never calls this run "another".
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"{directory} already holds checkpoints [4, 6], the newest at this "
            "state's step (6): a run that stopped there saved it. Pass "
            "resume=True to fit to go on from there"
        ),
    ) as caught:
        run(state, num_steps=16, checkpoints=Checkpoints(directory))
    assert "another" not in str(caught.value)
    # The call the line names goes on, in this process.
    state, _ = run(
        state, num_steps=16, log_every=2, checkpoints=Checkpoints(directory),
        resume=True,
    )  # fmt: skip
    assert int(state.step) == 16


# ------------------------------------------------- the bar in a log file


def _draws(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


def test_a_bar_written_to_a_file_draws_nothing_that_times_the_compile():
    tqdm = pytest.importorskip("tqdm")
    out = io.StringIO()  # not a terminal: every draw stays in the file
    bar = pztrain.ProgressBar(make_bar=functools.partial(tqdm.tqdm, file=out))
    run(num_steps=40, log_every=20, progress=bar)
    draws = _draws(out.getvalue())
    steps = [int(re.search(r"(\d+)/40", d).group(1)) for d in draws]
    # Each count drawn once, in order (tqdm's close may draw the last again).
    assert steps[:-1] == sorted(set(steps[:-1])), draws
    assert steps[0] == 0 and steps[-1] == 40
    first_move = draws[1]  # after the first call, which compiled
    assert "?step/s" in first_move, draws  # no rate, no ETA: the clock restarted


@pytest.mark.slow  # sleeps 1 s
def test_the_first_move_of_a_bar_in_a_file_shows_no_compile_rate():
    tqdm = pytest.importorskip("tqdm")
    out = io.StringIO()
    bar = pztrain.ProgressBar(make_bar=functools.partial(tqdm.tqdm, file=out))
    info = pztrain.LoopInfo(
        start_step=0,
        end_step=1170,
        steps_per_epoch=None,
        steps_per_call=1,
        log_every=20,
        evaluates=False,
        run_dir=None,
    )
    bar.on_train_start(None, info)
    bar.on_advance(0, t=time.perf_counter())
    time.sleep(1.0)  # the first call: its compile
    bar.on_advance(2, t=time.perf_counter())
    draws = _draws(out.getvalue())
    bar.on_train_end(None, None)
    assert [d.split("|")[-1].strip() for d in draws] == [
        "0/1170 [00:00<?, ?step/s]",  # at the start
        "2/1170 [00:00<?, ?step/s]",  # after the compile: not 2.95s/step
    ]


# ------------------------------------------------- the digits example


@pytest.mark.slow  # trains the example for an epoch
def test_the_digits_example_prints_its_run_directory(tmp_path, capsys):
    path = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
    spec = importlib.util.spec_from_file_location("digits", path)
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    digits.main(epochs=1, run_dir=str(tmp_path / "run"), progress=False)
    out = capsys.readouterr().out
    assert f"run directory: {tmp_path / 'run'}\n" in out
    assert out.rstrip().endswith(f"the run's log: {tmp_path / 'run' / 'metrics.jsonl'}")


# ------------------------------------------------- time across a resume


class SlowLogs(Callback):
    """Sleeps at each log point, so that a run's time grows past a resume's
    compile."""

    def on_log(self, state, record):
        time.sleep(0.05)


@pytest.mark.slow  # an interrupted run with checkpoints, and its resume
def test_time_goes_on_across_a_resume(tmp_path):
    directory, log = tmp_path / "c", tmp_path / "run"
    opts = dict(num_steps=16, log_every=2, run_dir=log)
    run(checkpoints=Checkpoints(directory, every_steps=4),
        callbacks=[SlowLogs(), SignalAt(8)], **opts)  # fmt: skip
    before = read_jsonl(log)
    stored = pztrain.read_metadata(directory / "8")["metadata"]["time"]
    assert stored == before[-1]["time"] >= 3 * 0.05  # the stop record's
    run(checkpoints=Checkpoints(directory), resume=True, **opts)
    records = read_jsonl(log)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12, 14, 16]
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[4] > stored, times


# ------------------------------------------------- a second Ctrl-C in a save


def test_a_second_ctrl_c_while_a_save_is_written_gets_one_line(
    tmp_path, monkeypatch, caplog
):
    from orbax.checkpoint import checkpoint_manager

    manager = checkpoint_manager.CheckpointManager
    real_finalize = manager._finalize
    waiting = threading.Event()  # the main thread is about to wait for the save

    def interrupted_finalize(self, step, *args, **kwargs):
        assert waiting.wait(timeout=30)
        time.sleep(0.1)  # in the join by now
        os.kill(os.getpid(), signal.SIGINT)  # Python's handler: KeyboardInterrupt
        time.sleep(0.1)
        return real_finalize(self, step, *args, **kwargs)

    monkeypatch.setattr(manager, "_finalize", interrupted_finalize)
    caplog.set_level(logging.INFO)
    with pytest.raises(KeyboardInterrupt) as caught:
        with Checkpoints(tmp_path) as ckpts:  # saves in the background
            ckpts.save(new_state(), 5)
            waiting.set()
            ckpts.wait()  # the second Ctrl-C comes while this waits
    assert caught.value.__notes__ == [
        f"pztrain: interrupted while checkpoint 5 was being written to {tmp_path}; "
        "the save goes on until it is complete (an unfinished one is removed when "
        "the run resumes)."
    ]
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]  # no orbax traceback
    assert Checkpoints(tmp_path).steps() == [5]  # leaving the block finished it


# ------------------------------------------------- inputs of the wrong kind


def test_a_run_dir_that_is_a_file_is_refused_naming_it(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"fit(run_dir={str(file)!r}): {file} is a file, not a directory. "
            "run_dir is the directory of the run's log (metrics.jsonl) and lock"
        ),
    ):
        run(num_steps=2, run_dir=file, loggers=[])  # refused even without a log
    assert file.read_text() == "mine"


def test_a_run_dir_named_like_a_log_file_is_refused_before_it_is_made(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"fit(run_dir={str(path)!r}): {path} names a .jsonl file, not a "
            "directory. run_dir is the directory"
        ),
    ):
        run(num_steps=2, run_dir=path)
    assert not path.exists()  # the lock made no directory of that name


@pytest.mark.parametrize("call", ["load_params", "load_state"])
@pytest.mark.parametrize("name", ["weights.bin", "weights.safetensors"])
def test_loading_from_a_file_is_refused_naming_it(tmp_path, call, name):
    file = tmp_path / name
    file.write_bytes(b"\0")
    fix = (
        "read a .safetensors file with pztrain.import_safetensors(path, like)"
        if name.endswith(".safetensors")
        else "pass the directory that save_params, save_state or Checkpoints wrote"
    )
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"{call}({str(file)!r}, ...): {file} is a file, not a checkpoint "
            f"directory; {fix}."
        ),
    ):
        getattr(pztrain, call)(file, new_state())


@pytest.mark.parametrize(
    "schedule, shown",
    [
        (lambda step: "fast", "'fast' (str)"),
        (lambda step: None, "None (NoneType)"),
        (lambda step: jnp.ones(3), "an array float32[3]"),
    ],
)
def test_a_schedule_that_returns_no_number_names_the_callback(schedule, shown):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"LearningRateMonitor: its schedule returned {shown} for step 1; a "
            "schedule returns the learning rate: a real number"
        ),
    ):
        run(num_steps=2, log_every=2,
            callbacks=[pztrain.LearningRateMonitor(schedule)])  # fmt: skip


def test_a_learning_rate_monitor_refuses_a_string_at_once():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "LearningRateMonitor(schedule='1e-3'): a schedule is an optax "
            "schedule (step -> learning rate) or a number."
        ),
    ):
        pztrain.LearningRateMonitor("1e-3")


class Returns(Callback):
    """Returns ``make(state)`` from ``on_log``."""

    def __init__(self, make):
        self.make = make

    def on_log(self, state, record):
        return self.make(state)


@pytest.mark.parametrize(
    "make, differs",
    [
        (
            lambda state: new_state(width=4),
            "state.params['w'] is float32[4], was float32[3]; "
            "state.opt_state[0].mu['w'] is float32[4], was float32[3]; "
            "state.opt_state[0].nu['w'] is float32[4], was float32[3]",
        ),
        (
            lambda state: state.replace(params={"v": state.params["w"]}),
            "state.params['w'] is missing; state.params['v'] is new",
        ),
        (
            lambda state: state.replace(
                params={"w": state.params["w"].astype(jnp.bfloat16)}
            ),
            "state.params['w'] is bfloat16[3], was float32[3]",
        ),
    ],
    ids=["another-model", "another-name", "another-dtype"],
)
def test_a_hook_that_returns_another_models_state_is_named(make, differs):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Returns.on_log returned a TrainState of another structure than the "
            f"state it was given: {differs}. A hook may change the values"
        ),
    ) as caught:
        run(num_steps=4, log_every=2, callbacks=[Returns(make)])
    assert int(caught.value.train_state.step) == 2  # the state it was given


def test_a_hook_may_still_return_new_values_of_the_same_structure():
    halve = Returns(lambda state: state.replace(params={"w": state.params["w"] / 2}))
    state, _ = run(num_steps=4, log_every=2, callbacks=[halve])
    assert int(state.step) == 4


def test_a_batch_of_strings_is_refused_naming_its_key():
    def loss_fn(*, model, state, rng, x, label):
        return jnp.mean(model["w"] * x), state, {}

    def eval_fn(*, model, state, rng, x, label):
        return {"m": jnp.mean(model["w"] * x)}

    state = pztrain.TrainState.initial_state(
        {"w": jnp.ones(2)}, optax.sgd(0.1), jax.random.key(0)
    )
    batch = {"x": np.ones(2, np.float32), "label": np.array(["cat", "dog"])}
    want = r"got batch\['label'\] of strings .*encode it first"
    with pytest.raises(TypeError, match=want):
        pztrain.build_train_step(loss_fn)(state, batch)
    with pytest.raises(TypeError, match=want):
        pztrain.build_eval_step(eval_fn)(state, **batch)
    objects = {**batch, "label": np.array([{"a": 1}, None], dtype=object)}
    with pytest.raises(TypeError, match=r"batch\['label'\] of Python objects"):
        pztrain.build_train_step(loss_fn)(state, objects)
