"""Stops that lose nothing (issue 21), in one process: Ctrl-C (SIGINT) and
preemption signals stop `fit` before the next call, save, and return; a second
SIGINT raises at once; the previous handlers are chained and come back; an
error keeps the newest state; bad ``preempt_on`` values are refused.

The signals are real: a callback, a batch source, the loss function (while it
is traced) or a save sends them to this process with ``os.kill``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import ArrayLoader, Callback, Checkpoints, fit
from pztrain.checkpoint._writer import Writer
from pztrain.loggers import read_jsonl
from pztrain.records import TIMING_KEYS

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
OPT = optax.adam(0.05)


def loss_fn(*, model, state, rng, x, y):
    noise = 0.01 * jax.random.normal(rng, y.shape)
    loss = jnp.mean((x @ model["w"] + model["b"] + noise - y) ** 2)
    return loss, state + 1, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"mse": jnp.mean((x @ model["w"] + model["b"] - y) ** 2)}


STEP = pztrain.build_train_step(loss_fn)
EVAL = pztrain.build_eval_step(eval_fn)
EVAL_DATA = [{"x": X[:8], "y": Y[:8]}, {"x": X[8:16], "y": Y[8:16]}]


def new_state():
    model = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return pztrain.TrainState.initial_state(
        model, OPT, jax.random.key(0), jnp.zeros((), jnp.int32)
    )


def loader(**kw):
    return ArrayLoader({"x": X, "y": Y}, 4, seed=1, **kw)  # 8 steps per epoch


def run(state=None, data=None, **kw):
    kw.setdefault("progress", False)
    return fit(
        new_state() if state is None else state,
        STEP,
        loader() if data is None else data,
        **kw,
    )


def host(state):
    return {k: np.asarray(v) for k, v in state.params.items()}


def assert_same_state(a, b):
    for name in ("w", "b"):
        np.testing.assert_array_equal(a.params[name], b.params[name])
    assert int(a.step) == int(b.step)
    np.testing.assert_array_equal(a.loss_fn_state, b.loss_fn_state)


def kill_self(sig=signal.SIGINT):
    os.kill(os.getpid(), sig)


class SignalAt(Callback):
    """Sends ``sig`` to this process at the log point of ``step`` (``times``
    signals in a row)."""

    def __init__(self, step, sig=signal.SIGINT, times=1):
        self.step, self.sig, self.times = step, sig, times

    def on_log(self, state, record):
        if record["step"] == self.step:
            for _ in range(self.times):
                kill_self(self.sig)


class SignalingBatches:
    """Batches of ``loader()`` from step 0, with no end of pass; sends ``sig``
    just before `fit` gets batch ``at`` (0-based), which is then not trained
    on (`fit` reads one batch ahead of the one it hands to the step)."""

    def __init__(self, at, sig=signal.SIGINT):
        self.at, self.sig = at, sig

    def __iter__(self):
        for i, batch in enumerate(loader().iter_from_step(0)):
            if i == self.at + 1:
                kill_self(self.sig)
            yield batch


def reference(num_steps, **kw):
    return run(num_steps=num_steps, **kw)


def without_time(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# --------------------------------------------------------------------- SIGINT


def test_without_checkpoints_a_stop_says_the_due_evaluation_did_not_run(capsys):
    kw = dict(num_steps=8, log_every=2, eval_step=EVAL, eval_data=EVAL_DATA)
    state, history = run(callbacks=[SignalAt(4)], eval_every=4, **kw)
    assert int(state.step) == 4 and history.stop_reason == "interrupted"
    assert [(r["step"], r["split"]) for r in history.records] == [
        (2, "train"),
        (4, "train"),
    ]  # the evaluation due at step 4 did not run: nothing owes it
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(
            "The evaluation due at step 4 did not run (without checkpoints nothing "
            "owes it): pztrain.evaluate(state, ...) runs it."
        )
    )
    _, history = run(state, eval_every=4, **kw)  # goes on after step 4
    assert [(r["step"], r["split"]) for r in history.records] == [
        (6, "train"),
        (8, "train"),
        (8, "eval"),
    ]
    run(callbacks=[SignalAt(2)], eval_every=4, **kw)  # nothing due at 2
    assert capsys.readouterr().out.strip().endswith("goes on from there.")


def test_sigint_stops_before_the_next_call_and_keeps_the_state(capsys):
    before = signal.getsignal(signal.SIGINT)
    state, history = run(
        data=SignalingBatches(at=7), num_steps=8, log_every=3, prefetch=0
    )
    assert history.stop_reason == "interrupted"
    assert int(state.step) == 7  # batch 7 came with the signal: not trained on
    assert [r["step"] for r in history.records] == [3, 6, 7]  # the partial stretch
    assert signal.getsignal(signal.SIGINT) is before
    out = capsys.readouterr().out
    assert out.strip() == (
        "pztrain.fit: interrupted (SIGINT) at step 7. The returned state is that "
        "step's: fit(state, ...) goes on from there."
    )
    # The partial record is exact: the mean of the losses of steps 7 alone.
    want, _ = reference(7, log_every=1)
    assert_same_state(state, want)
    # And fit(state, ...) goes on from there, to the uninterrupted result.
    state, _ = run(state, num_steps=16, log_every=3)
    whole, _ = reference(16, log_every=3)
    assert_same_state(state, whole)


def test_the_partial_record_holds_the_steps_since_the_last_log_point():
    _, history = run(data=SignalingBatches(at=5), num_steps=8, log_every=3, prefetch=0)
    _, each = reference(5, log_every=1)
    losses = [r["metrics"]["loss"] for r in each.records]
    (partial,) = [r for r in history.records if r["step"] == 5]
    np.testing.assert_allclose(
        partial["metrics"]["loss"], np.mean(losses[3:5]), rtol=1e-6
    )


def test_a_signal_while_fit_checks_the_first_batch_stops_before_the_first_call(
    tmp_path,
):
    traced = []

    def signaling_loss(**kw):
        if not traced:  # fit traces the step on the first batch, before the run
            kill_self()
        traced.append(1)
        return loss_fn(**kw)

    state, history = fit(
        new_state(),
        pztrain.build_train_step(signaling_loss),
        loader(),
        num_steps=8,
        progress=False,
        run_dir=tmp_path / "run",
    )
    assert history.stop_reason == "interrupted" and int(state.step) == 0
    assert history.records == []


@pytest.mark.slow  # a run stopped during its first compile
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_a_signal_during_the_first_compile_stops_after_the_first_call(on_device):
    traced = []

    def signaling_loss(**kw):
        if len(traced) == 1:  # while the step compiles, before its first call
            kill_self()  # (traced once before: fit checks the first batch)
        traced.append(1)
        return loss_fn(**kw)

    step = pztrain.build_train_step(signaling_loss)
    state, history = fit(
        new_state(),
        step,
        loader(on_device=on_device),
        num_steps=8,
        log_every=4,
        progress=False,
    )
    assert history.stop_reason == "interrupted"
    assert int(state.step) == 1
    assert [r["step"] for r in history.records] == [1]


@pytest.mark.slow  # an interrupted run and its resume
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_interrupted_with_checkpoints_saves_the_step_and_resumes(tmp_path, on_device):
    data = loader(on_device=on_device)
    whole, whole_h = run(data=data, num_steps=16, log_every=4, run_dir=tmp_path / "w")
    ckpt = Checkpoints(tmp_path / "c", every_steps=100)

    class SavedBeforeTheEnd(Callback):
        def on_train_end(self, state, history):
            self.steps = sorted(
                int(p.name) for p in ckpt.directory.iterdir() if p.name.isdigit()
            )

    end = SavedBeforeTheEnd()
    state, history = run(
        data=data,
        num_steps=16,
        log_every=4,
        checkpoints=ckpt,
        callbacks=[SignalAt(8), end],
        run_dir=tmp_path / "r",
    )
    assert history.stop_reason == "interrupted"
    assert int(state.step) == 8 and end.steps == [8]  # on disk before on_train_end
    resumed, _ = run(
        data=data,
        num_steps=16,
        log_every=4,
        checkpoints=ckpt,
        resume=True,
        run_dir=tmp_path / "r",
    )
    assert_same_state(resumed, whole)
    assert without_time(read_jsonl(tmp_path / "r")) == without_time(
        read_jsonl(tmp_path / "w")
    )
    # fit(state, ...) goes on from the returned state too.
    state, _ = run(state, data=data, num_steps=16, log_every=4)
    assert_same_state(state, whole)


@pytest.mark.slow  # a run with checkpoints, interrupted twice
def test_a_second_sigint_raises_at_once_and_the_disk_stays_valid(tmp_path):
    whole, _ = reference(16, log_every=2)
    ckpt = Checkpoints(tmp_path, every_steps=4)
    with pytest.raises(KeyboardInterrupt) as caught:
        run(
            num_steps=16,
            log_every=2,
            checkpoints=ckpt,
            callbacks=[SignalAt(6, times=2)],
        )
    err = caught.value
    assert int(err.train_state.step) == 6
    assert any("state = err.train_state" in note for note in err.__notes__)
    assert ckpt.steps() == [4]  # the periodic one; the stop save never began
    assert not (tmp_path / ".pztrain.lock").exists()
    resumed, _ = run(num_steps=16, log_every=2, checkpoints=ckpt, resume=True)
    assert_same_state(resumed, whole)
    state, _ = run(err.train_state, num_steps=16, log_every=2)
    assert_same_state(state, whole)


@pytest.mark.slow  # a run with checkpoints, interrupted twice
def test_a_second_sigint_during_the_stop_save_leaves_the_older_checkpoints(
    tmp_path, monkeypatch
):
    ckpt = Checkpoints(tmp_path, every_steps=4)
    real_save = Writer.save
    stop_saves = []

    def interrupted_save(self, step, args, *, wait):
        if step == 6:  # the stop save: a second Ctrl-C while it writes
            stop_saves.append(wait)
            kill_self()
        return real_save(self, step, args, wait=wait)

    monkeypatch.setattr(Writer, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        run(num_steps=16, log_every=2, checkpoints=ckpt, callbacks=[SignalAt(6)])
    monkeypatch.undo()
    assert stop_saves == [True]  # the first Ctrl-C led to a synchronous save
    assert Checkpoints(tmp_path).steps() == [4]
    resumed, _ = run(num_steps=16, log_every=2, checkpoints=ckpt, resume=True)
    assert_same_state(resumed, reference(16, log_every=2)[0])


def test_the_previous_sigint_handler_is_chained_and_restored():
    seen = []

    def custom(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, custom)
    try:

        class Twice(Callback):
            def on_log(self, state, record):
                if record["step"] == 2:
                    kill_self()  # fit's: a flag
                    assert seen == []
                    kill_self()  # the custom handler, then KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            run(num_steps=8, log_every=2, callbacks=[Twice()])
        assert seen == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is custom
    finally:
        signal.signal(signal.SIGINT, previous)


def test_handlers_come_back_after_an_error():
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    class Fails(Callback):
        def on_log(self, state, record):
            self.during = (
                signal.getsignal(signal.SIGINT),
                signal.getsignal(signal.SIGTERM),
            )
            raise RuntimeError("boom")

    fails = Fails()
    with pytest.raises(RuntimeError, match="boom"):
        run(num_steps=4, log_every=2, callbacks=[fails])
    assert fails.during[0] is not sigint and fails.during[1] is not sigterm
    assert signal.getsignal(signal.SIGINT) is sigint
    assert signal.getsignal(signal.SIGTERM) is sigterm


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGINT)

    class Look(Callback):
        def on_log(self, state, record):
            self.seen = signal.getsignal(signal.SIGINT)

    look, out = Look(), {}
    thread = threading.Thread(
        target=lambda: out.update(
            result=run(num_steps=4, log_every=2, callbacks=[look])
        )
    )
    thread.start()
    thread.join()
    assert look.seen is before
    assert out["result"][1].stop_reason is None


class SignalAtEnd(Callback):
    """Sends ``sig`` to this process in ``on_train_end``: after the loop's
    last read of the stop flag."""

    def __init__(self, sig=signal.SIGINT):
        self.sig = sig

    def on_train_end(self, state, history):
        kill_self(self.sig)


def test_a_late_sigterm_reaches_the_previous_handler_once_fit_is_over(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:

        class Look(SignalAtEnd):
            def on_train_end(self, state, history):
                super().on_train_end(state, history)
                self.seen_then = list(seen)  # fit's handler holds it

        look = Look(signal.SIGTERM)
        ckpts = pztrain.Checkpoints(tmp_path, every_steps=4)
        state, history = run(num_steps=8, callbacks=[look], checkpoints=ckpts)
        assert look.seen_then == [] and seen == [signal.SIGTERM]
        assert int(state.step) == 8 and ckpts.steps()[-1] == 8  # all saved first
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_late_sigint_raises_once_fit_is_over_and_keeps_the_state():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as caught:
        run(num_steps=8, log_every=4, callbacks=[SignalAtEnd()])
    assert int(caught.value.train_state.step) == 8
    assert "state = err.train_state" in "\n".join(caught.value.__notes__)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_late_sigint_during_evaluate_raises_after_it():
    def batches():
        yield EVAL_DATA[0]
        yield EVAL_DATA[1]
        kill_self()  # after the last batch was read

    with pytest.raises(KeyboardInterrupt) as caught:
        pztrain.evaluate(new_state(), EVAL, batches())
    assert "evaluate was interrupted" not in str(caught.value)


def test_evaluate_alone_stops_between_batches_on_sigint():
    before = signal.getsignal(signal.SIGINT)

    def batches():
        yield EVAL_DATA[0]
        kill_self()
        yield EVAL_DATA[1]

    with pytest.raises(
        KeyboardInterrupt, match=re.escape("evaluate was interrupted between two")
    ):
        pztrain.evaluate(new_state(), EVAL, batches())
    assert signal.getsignal(signal.SIGINT) is before


def test_accumulate_skips_the_calls_after_a_stop_request():
    class After:
        def __init__(self, n):
            self.reads, self.n = 0, n

        @property
        def requested(self):
            self.reads += 1
            return self.reads > self.n

    state = new_state()
    batch = next(iter(loader()))
    sums = STEP.metric_sums(state, batch)
    flag = After(2)
    state, sums = STEP.accumulate(state, sums, batch, calls=10, stop_flag=flag)
    assert int(state.step) == 3 and flag.reads == 3  # read before calls 2, 3, 4


# ----------------------------------------------------------------- preemption


@pytest.mark.slow  # three runs with evaluations
def test_sigterm_preempts_saves_synchronously_and_resumes_exactly(tmp_path, capsys):
    opts = dict(
        num_steps=24, log_every=4, eval_step=EVAL, eval_data=EVAL_DATA, eval_every=8
    )
    whole, _ = run(run_dir=tmp_path / "whole", **opts)
    ckpt = Checkpoints(tmp_path / "c", every_steps=8)
    data = SignalingBatches(at=10, sig=signal.SIGTERM)
    state, history = run(
        data=data, checkpoints=ckpt, run_dir=tmp_path / "run", prefetch=0, **opts
    )
    assert history.stop_reason == "preempted"
    assert int(state.step) == 10 and ckpt.steps() == [8, 10]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    line = capsys.readouterr().out.strip()
    assert line == (
        f"pztrain.fit: preempted (SIGTERM) at step 10. Checkpoint saved: "
        f"{tmp_path / 'c' / '10'}. fit(..., resume=True) goes on from there."
    )
    resumed, _ = run(checkpoints=ckpt, resume=True, run_dir=tmp_path / "run", **opts)
    assert_same_state(resumed, whole)
    got = without_time(read_jsonl(tmp_path / "run"))
    want = without_time(read_jsonl(tmp_path / "whole"))
    # Exact: every record but the two around the stop is the uninterrupted one,
    # and those two together hold the steps of its record at 12.
    around = [r for r in got if r["step"] in (10, 12) and r["split"] == "train"]
    assert [r for r in got if r not in around] == [
        r for r in want if r["step"] != 12 or r["split"] != "train"
    ]
    (at12,) = [r for r in want if r["step"] == 12 and r["split"] == "train"]
    mean = (2 * around[0]["metrics"]["loss"] + 2 * around[1]["metrics"]["loss"]) / 4
    np.testing.assert_allclose(mean, at12["metrics"]["loss"], rtol=1e-6)


def test_preempt_on_other_signals(tmp_path):
    class Look(Callback):
        def on_train_start(self, state, info):
            self.sigterm = signal.getsignal(signal.SIGTERM)

    look = Look()
    ckpt = Checkpoints(tmp_path)
    state, history = run(
        num_steps=8,
        log_every=2,
        checkpoints=ckpt,
        callbacks=[look, SignalAt(4, signal.SIGUSR1)],
        preempt_on=["SIGUSR1"],
    )
    assert history.stop_reason == "preempted" and int(state.step) == 4
    assert look.sigterm == signal.SIG_DFL  # not asked for: left alone
    assert ckpt.steps() == [4]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    _, history = run(num_steps=4, log_every=2, preempt_on=[], callbacks=[look])
    assert look.sigterm == signal.SIG_DFL


@pytest.mark.slow  # an interrupted run and its resume
def test_a_signal_during_an_evaluation_cuts_it_short_and_resume_does_it(tmp_path):
    opts = dict(
        num_steps=16,
        log_every=4,
        eval_step=EVAL,
        eval_every=8,
        checkpoints=Checkpoints(tmp_path / "c", every_steps=8),  # saves at 8 too
    )
    whole, _ = run(
        run_dir=tmp_path / "whole",
        eval_data=EVAL_DATA,
        **{k: v for k, v in opts.items() if k != "checkpoints"},
    )
    calls = []

    def slow_eval_data():
        for i, batch in enumerate(EVAL_DATA):
            calls.append(i)
            if len(calls) == 2:  # the first evaluation's second batch
                kill_self(signal.SIGTERM)
            yield batch

    class Data:
        def __iter__(self):
            return slow_eval_data()

    state, history = run(eval_data=Data(), run_dir=tmp_path / "run", **opts)
    assert history.stop_reason == "preempted" and int(state.step) == 8
    assert [r["split"] for r in history.records] == ["train", "train"]  # no eval
    meta = pztrain.read_metadata(tmp_path / "c" / "8")["metadata"]
    assert meta["owed_eval"] == {"step": 8, "epoch": 0}
    resumed, _ = run(eval_data=EVAL_DATA, resume=True, run_dir=tmp_path / "run", **opts)
    assert_same_state(resumed, whole)
    assert without_time(read_jsonl(tmp_path / "run")) == without_time(
        read_jsonl(tmp_path / "whole")
    )


def test_a_signal_during_a_save_stops_right_after_it(tmp_path, monkeypatch):
    ckpt = Checkpoints(tmp_path, every_steps=4, async_save=False)
    real_save = Writer.save

    def long_save(self, step, args, *, wait):
        if step == 4:
            kill_self(signal.SIGTERM)  # while the (synchronous) save runs
        return real_save(self, step, args, wait=wait)

    monkeypatch.setattr(Writer, "save", long_save)
    state, history = run(num_steps=16, log_every=2, checkpoints=ckpt)
    assert history.stop_reason == "preempted" and int(state.step) == 4
    assert ckpt.steps() == [4]  # the periodic save was the stop's too


# ------------------------------------------------------ errors keep the state


class FailAt(Callback):
    def __init__(self, step, hook="on_log"):
        self.step, self.hook = step, hook

    def on_log(self, state, record):
        if self.hook == "on_log" and record["step"] == self.step:
            raise RuntimeError("callback failed")

    def on_train_end(self, state, history):
        if self.hook == "on_train_end":
            raise RuntimeError("callback failed at the end")


class FailingLogger:
    def log_hparams(self, hparams):
        pass

    def log_record(self, record):
        if record["step"] == 6:
            raise OSError("disk full")

    def close(self):
        pass


def bad_eval(*, model, state, rng, x, y):
    if x.shape[0] == 4:  # its second batch: the first is checked before the run
        raise ValueError("eval_fn failed")
    return {"mse": jnp.mean((x @ model["w"] + model["b"] - y) ** 2)}


@pytest.mark.parametrize(
    "kw, error, step",
    [
        (dict(callbacks=[FailAt(6)]), RuntimeError, 6),
        (dict(callbacks=[FailAt(0, "on_train_end")]), RuntimeError, 16),
        # Loggers get records late (log points need not wait): the record of
        # step 6 is emitted at the point of step 8, and the state is that one.
        (dict(loggers=[FailingLogger()]), OSError, 8),
        (
            dict(
                eval_step=pztrain.build_eval_step(bad_eval),
                eval_data=[EVAL_DATA[0], {"x": X[16:20], "y": Y[16:20]}],
                eval_every=6,
            ),
            ValueError,
            6,
        ),
    ],
    ids=["callback", "on_train_end", "logger", "eval_fn"],
)
def test_an_error_keeps_the_newest_state_on_it(kw, error, step):
    with pytest.raises(error) as caught:
        run(num_steps=16, log_every=2, **kw)
    err = caught.value
    state = err.train_state
    assert int(state.step) == step
    assert_same_state(state, reference(step, log_every=2)[0])
    assert err.__notes__[-1] == (
        f"pztrain.fit: the newest state (step {step}) is kept on this error: "
        "state = err.train_state (in a notebook, after the cell failed: state = "
        "sys.last_value.train_state); fit(state, ...) goes on from there."
    )
    if step < 16:
        state, _ = run(state, num_steps=16, log_every=2)
        assert_same_state(state, reference(16, log_every=2)[0])


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "value, error, message",
    [
        (["SIGFOO"], ValueError, "preempt_on: unknown signal 'SIGFOO'. Name one of"),
        (["SIGKILL"], ValueError, "preempt_on: SIGKILL cannot be caught"),
        ([signal.SIGSTOP], ValueError, "preempt_on: SIGSTOP cannot be caught"),
        ([999], ValueError, "preempt_on: unknown signal 999."),
        (["SIGINT"], ValueError, "preempt_on: SIGINT is the interrupt (Ctrl-C)"),
        ("SIGTERM", TypeError, "preempt_on must be a list of signal names"),
    ],
)
def test_bad_preempt_on_is_refused_at_the_start(value, error, message):
    state = new_state()
    with pytest.raises(error, match=re.escape(message)):
        run(state, num_steps=4, preempt_on=value)
    assert int(state.step) == 0  # nothing ran


# ----------------------------------------------------------------- the locks


def test_the_lock_holds_a_record_and_goes_away(tmp_path):
    class Look(Callback):
        def on_log(self, state, record):
            self.ckpt = json.loads((tmp_path / "c" / ".pztrain.lock").read_text())
            self.run = json.loads((tmp_path / "r" / ".pztrain.lock").read_text())

    look = Look()
    run(
        num_steps=4,
        log_every=2,
        callbacks=[look],
        checkpoints=Checkpoints(tmp_path / "c"),
        run_dir=tmp_path / "r",
    )
    for record in (look.ckpt, look.run):
        assert record["pid"] == os.getpid() and set(record) >= {"host", "started"}
    assert not (tmp_path / "c" / ".pztrain.lock").exists()
    assert not (tmp_path / "r" / ".pztrain.lock").exists()


def test_a_second_run_in_the_same_directory_is_refused(tmp_path):
    class Nested(Callback):
        def on_log(self, state, record):
            with pytest.raises(
                pztrain.DirectoryInUseError,
                match=re.escape(
                    f"{tmp_path / 'r'} is in use by another run: this "
                    "process (another fit running in it)"
                ),
            ):
                run(num_steps=4, run_dir=tmp_path / "r")
            with pytest.raises(pztrain.DirectoryInUseError, match="Two runs writing"):
                run(num_steps=4, checkpoints=Checkpoints(tmp_path / "c"))

    run(
        num_steps=2,
        log_every=2,
        callbacks=[Nested()],
        run_dir=tmp_path / "r",
        checkpoints=Checkpoints(tmp_path / "c"),
    )


@pytest.mark.slow  # a second or more (compiles, imports)
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    (tmp_path / "c").mkdir()
    record = {"host": os.uname().nodename, "pid": pid, "started": "then"}
    (tmp_path / "c" / ".pztrain.lock").write_text(json.dumps(record))
    with pytest.warns(
        UserWarning,
        match=re.escape(f"Taking over the lock of {tmp_path / 'c'} from pid {pid} on"),
    ):
        run(num_steps=4, checkpoints=Checkpoints(tmp_path / "c"))
    assert not (tmp_path / "c" / ".pztrain.lock").exists()


def test_run_dir_equal_to_the_checkpoint_directory_is_locked_once(tmp_path):
    _, history = run(
        num_steps=4, log_every=2, run_dir=tmp_path, checkpoints=Checkpoints(tmp_path)
    )
    assert [r["step"] for r in history.records] == [2, 4]


def test_the_stop_line_does_not_guess_who_got_jax_s_sigterm():
    """With several processes, JAX's preemption service holds SIGTERM: the flag
    learns of the stop with no signal name, whichever process got it (process 0
    itself too), so the line must not say another process got it."""
    from pztrain.loop._signals import StopFlag
    from pztrain.loop._stops import stop_line

    flag = StopFlag()
    flag.stopped = True
    line = stop_line(flag, 12, None)
    assert line.startswith(
        "pztrain.fit: preempted (SIGTERM to this process or another, through JAX) "
        "at step 12."
    )
