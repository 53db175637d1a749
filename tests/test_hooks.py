"""The loop's pieces around the hooks: one ordered list, record-only hooks and
late reads, the clock, state dicts in checkpoints, the progress option."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fakes import FakeBar

import pztrain
from pztrain import Callback, History, ProgressBar, TrainState
from pztrain.callbacks import record_only
from pztrain.loop._hooks import Hooks, RecordLog
from pztrain.loop._reporting import Reporter
from pztrain.metrics import MetricSums

HERE = Path(__file__).resolve().parent
_rng = np.random.default_rng(2)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


STEP = pztrain.build_train_step(loss_fn)


def new_state() -> TrainState:
    return TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.05), jax.random.key(0)
    )


def loader(**kw) -> pztrain.ArrayLoader:
    return pztrain.ArrayLoader({"x": X, "y": Y}, 4, seed=1, **kw)


class Log:
    """A logger that notes what it got, in a shared list of events."""

    def __init__(self, events):
        self.events = events

    def log_hparams(self, hparams):
        self.events.append(("hparams",))

    def log_record(self, record):
        self.events.append(("logger", record["split"], record["step"]))

    def close(self):
        self.events.append(("close",))


class Note(Callback):
    def __init__(self, events, name):
        self.events, self.name = events, name

    def on_log(self, state, record):
        self.events.append((self.name, "train", record["step"]))

    def on_eval_end(self, state, record):
        self.events.append((self.name, "eval", record["step"]))

    def on_train_end(self, state, history):
        self.events.append((self.name, "end"))


class NotingCheckpoints(pztrain.Checkpoints):
    def __init__(self, events, directory):
        super().__init__(directory, every_steps=4)
        self.events = events

    def save(self, state, step, metrics=None):
        self.events.append(("save", step))
        super().save(state, step, metrics)


def test_hooks_run_as_one_ordered_list(tmp_path):
    """Bar, callbacks in order, loggers, checkpoints: a checkpoint at step s is
    taken once the loggers have the record of s."""
    events = []
    bar = ProgressBar(make_bar=FakeBar)
    pztrain.fit(
        new_state(),
        STEP,
        loader(),
        num_steps=8,
        log_every=4,
        callbacks=[Note(events, "a"), Note(events, "b")],
        loggers=[Log(events)],
        checkpoints=NotingCheckpoints(events, tmp_path / "c"),
        progress=bar,
    )
    at4 = [e for e in events if e[-1] == 4 or e == ("save", 4)]
    assert at4 == [
        ("a", "train", 4),
        ("b", "train", 4),
        ("logger", "train", 4),
        ("save", 4),
    ]
    assert events.index(("save", 8)) > events.index(("logger", "train", 8))
    assert events[-3:] == [("a", "end"), ("b", "end"), ("close",)]
    assert bar.bar.closed == 1


def test_every_on_train_end_runs_when_one_raises(tmp_path):
    events = []

    class Fails(Callback):
        def on_train_end(self, state, history):
            raise ValueError("first")

    class FailsToo(Callback):
        def on_train_end(self, state, history):
            raise KeyError("second")

    with pytest.raises(ValueError, match="first"):
        pztrain.fit(
            new_state(),
            STEP,
            loader(),
            num_steps=4,
            log_every=2,
            callbacks=[Fails(), Note(events, "a"), FailsToo()],
            loggers=[Log(events)],
            checkpoints=pztrain.Checkpoints(tmp_path / "c"),
            progress=False,
        )
    assert ("a", "end") in events and events[-1] == ("close",)
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["4"]  # the final save


def test_the_record_where_a_callback_raised_still_reaches_the_loggers():
    events = []

    class FailsAt4(Callback):
        def on_log(self, state, record):
            if record["step"] == 4:
                raise ValueError("at 4")

    with pytest.raises(ValueError, match="at 4"):
        pztrain.fit(
            new_state(),
            STEP,
            loader(),
            num_steps=8,
            log_every=2,
            callbacks=[FailsAt4()],
            loggers=[Log(events)],
            progress=False,
        )
    logged = [e[2] for e in events if e[0] == "logger"]
    assert logged == [2, 4]  # step 4's record too, then the error
    assert events[-1] == ("close",)


class ShowsRecords(Callback):
    """A record-only on_log: it reads the record and returns nothing."""

    def __init__(self):
        self.steps = []

    @record_only
    def on_log(self, state, record):
        self.steps.append(record["step"])


def test_record_only_callbacks_let_log_points_run_late():
    hooks = Hooks([ShowsRecords(), ProgressBar(), RecordLog(History(), [])])
    assert hooks.record_only
    assert not Hooks([ShowsRecords(), Note([], "x")]).record_only
    assert Hooks([Callback()]).record_only  # no on_log at all

    class Instance(Callback):
        pass

    instance = Instance()
    instance.on_log = lambda state, record: None  # an instance-level hook counts
    assert not Hooks([instance]).record_only

    class ReadsState(ProgressBar):  # overrides a record-only on_log, unmarked
        def on_log(self, state, record):
            record["metrics"]["w0"] = float(state.params["w"][0])

    assert not Hooks([ReadsState()]).record_only

    shows = ShowsRecords()
    _, history = pztrain.fit(
        new_state(),
        STEP,
        loader(),
        num_steps=8,
        log_every=2,
        callbacks=[shows],
        progress=False,
    )
    assert shows.steps == [2, 4, 6, 8] == [r["step"] for r in history.records]


def test_records_take_their_times_from_the_loop_clock():
    """Time-based behaviour with an injected clock: nothing sleeps."""
    ticks = iter([100.0, 100.5, 101.25])
    history = History()
    hooks = Hooks([RecordLog(history, [])])
    state = new_state()
    reporter = Reporter(hooks, lambda: next(ticks), state)  # t0 = 100.0
    sums = jax.jit(MetricSums.add)(MetricSums.zeros(["loss"]), 2.0, {}, 0)
    reporter.log(state, sums, step=1, epoch=0)  # at 100.5
    reporter.evaluation(state, {"loss": 1.0}, step=1, epoch=0)  # at 101.25
    assert [(r["split"], r["time"]) for r in history.records] == [
        ("train", 0.5),
        ("eval", 1.25),
    ]
    assert history.records[0]["metrics"] == {"loss": 2.0}


def test_a_late_log_point_is_emitted_once_computed_and_keeps_its_time():
    ticks = iter([0.0, 1.0, 2.0])
    history = History()
    state = new_state()
    reporter = Reporter(Hooks([RecordLog(history, [])]), lambda: next(ticks), state)
    assert reporter.late
    sums = jax.jit(MetricSums.add)(MetricSums.zeros(["loss"]), 3.0, {}, 0)
    reporter.log(state, sums, step=5, epoch=0)
    assert history.records == []  # not read yet
    sums.packed.block_until_ready()
    reporter.poll(state)
    assert [(r["step"], r["time"]) for r in history.records] == [(5, 1.0)]


class Counter(Callback):
    def __init__(self, start=0):
        self.count = start

    def on_log(self, state, record):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, saved):
        self.count = saved["count"]


@pytest.mark.slow  # a run and its resume
def test_callback_state_dicts_travel_with_checkpoints(tmp_path):
    def run(num_steps, counter, resume):
        pztrain.fit(
            new_state(),
            STEP,
            loader(),
            num_steps=num_steps,
            log_every=2,
            callbacks=[Callback(), counter],
            checkpoints=pztrain.Checkpoints(tmp_path / "c", every_steps=2),
            resume=resume,
            progress=False,
        )
        return counter.count

    assert run(6, Counter(), resume=False) == 3
    assert run(10, Counter(), resume=True) == 5  # 3 restored, 2 more
    meta = pztrain.read_metadata(tmp_path / "c")
    assert meta["metadata"]["callbacks"] == {"1:Counter": {"count": 5}}

    class SavesOnly(Callback):
        def state_dict(self):
            return {"x": 1}

    pztrain.fit(
        new_state(),
        STEP,
        loader(),
        num_steps=4,
        callbacks=[SavesOnly()],
        checkpoints=pztrain.Checkpoints(tmp_path / "d"),
        progress=False,
    )
    with pytest.raises(
        NotImplementedError,
        match=re.escape(
            "SavesOnly defines state_dict() but not load_state_dict(); define both"
        ),
    ):
        pztrain.Checkpoints(tmp_path / "d").restore_latest(new_state(), [SavesOnly()])
    assert Callback().state_dict() is None


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.slow
@pytest.mark.parametrize("inside_with", [False, True])
def test_saves_outside_fit_are_on_disk_when_the_program_ends(tmp_path, inside_with):
    """Outside a with-block, save waits for the disk; a with-block finishes its
    background saves when it ends. Either way the program may end right after."""
    save = "ckpt.save(state, 3)"
    if inside_with:
        body = f"with pztrain.Checkpoints('c') as ckpt:\n    {save}\n"
    else:
        body = f"ckpt = pztrain.Checkpoints('c')\n{save}\n"
        body += "import pathlib; assert not list(pathlib.Path('c').glob('*tmp*'))\n"
    code = (
        "import jax, jax.numpy as jnp, optax, pztrain\n"
        "state = pztrain.TrainState.initial_state({'w': jnp.ones((1000, 1000))},"
        " optax.adam(0.1), jax.random.key(0))\n" + body
    )
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert not list((tmp_path / "c").glob("*tmp*"))
    back = pztrain.load_params(tmp_path / "c", {"w": jnp.zeros((1000, 1000))})
    np.testing.assert_array_equal(back["w"], np.ones((1000, 1000)))


def test_progress_takes_a_bar_and_a_bar_in_callbacks_is_the_only_one(monkeypatch):
    bar = ProgressBar(metrics=("loss",), make_bar=FakeBar)
    pztrain.fit(new_state(), STEP, loader(), num_steps=4, log_every=2, progress=bar)
    assert sum(bar.bar.updates) == 4 and bar.bar.closed == 1
    made = []
    monkeypatch.setattr("tqdm.auto.tqdm", lambda **kw: made.append(FakeBar(**kw)))
    mine = ProgressBar(make_bar=FakeBar)
    pztrain.fit(new_state(), STEP, loader(), num_steps=4, callbacks=[mine])
    assert made == [] and sum(mine.bar.updates) == 4  # no second, default bar
    with pytest.raises(
        TypeError,
        match=re.escape(
            "callbacks[0] is a Log; callbacks subclass pztrain.Callback (override "
            "the hooks you need). Loggers go in loggers=."
        ),
    ):
        pztrain.fit(new_state(), STEP, loader(), num_steps=4, callbacks=[Log([])])


def test_on_advance_asks_for_host_points():
    class Every3(Callback):
        def __init__(self):
            self.seen = []

        def on_advance(self, step, t):
            self.seen.append(step)
            return step + 3

    every3 = Every3()
    _, history = pztrain.fit(
        new_state(),
        STEP,
        loader(),
        num_steps=10,
        log_every=5,
        callbacks=[every3],
        progress=False,
    )
    # Host points: the start, the steps asked for (3 at the start, 6 at 3 is
    # passed over by the epoch end at 4, 7 by the log point at 5, 8 is an epoch
    # end too, 11 by the end at 10).
    assert every3.seen == [0, 3, 4, 5, 8, 10]
    assert [r["step"] for r in history.records] == [5, 10]


def test_an_error_mid_stretch_leaves_the_hooks_the_last_state(tmp_path):
    """on_train_end gets the state of the last call made (not one the step
    consumed); no checkpoint is saved at it, between log points (a resume
    from there would average the next record over fewer steps)."""

    class Breaks:
        def __iter__(self):
            for i in range(10):
                if i == 5:
                    raise RuntimeError("the data broke")
                yield {"x": X[:4], "y": Y[:4]}

    class End(Callback):
        def on_train_end(self, state, history):
            self.step = int(state.step)

    end = End()
    with pytest.raises(RuntimeError, match="the data broke"):
        pztrain.fit(
            new_state(),
            STEP,
            Breaks(),
            num_steps=100,
            log_every=50,
            callbacks=[end],
            checkpoints=pztrain.Checkpoints(tmp_path / "c"),
            prefetch=0,
            progress=False,
        )
    # Batch 5 fails while the source looks one batch ahead for the pass's end:
    # 4 steps ran.
    assert end.step == 4
    assert [p.name for p in (tmp_path / "c").iterdir()] == []


def test_a_wish_between_calls_is_rounded_to_a_whole_call():
    class EveryStep(Callback):
        def on_advance(self, step, t):
            return step + 1  # steps_per_call is 2: no call ends there

    step2 = pztrain.build_train_step(loss_fn, steps_per_call=2)
    state, history = pztrain.fit(
        new_state(),
        step2,
        loader(on_device=True),
        num_steps=8,
        log_every=4,
        callbacks=[EveryStep()],
        progress=False,
    )
    assert int(state.step) == 8 and [r["step"] for r in history.records] == [4, 8]
    sums = STEP.metric_sums(state, x=X[:4], y=Y[:4])
    same, _ = STEP.accumulate(state, sums, x=X[:4], y=Y[:4], calls=0)
    assert same is state  # no call: nothing ran, nothing was donated
