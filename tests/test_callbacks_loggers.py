"""Callbacks (hooks, Stop, EarlyStopping, NanPolicy, LearningRateMonitor,
ProgressBar), loggers (JSONL, TensorBoard event files) and History."""

from __future__ import annotations

import json
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fakes import FakeBar, steps_of

from pztrain import (
    ArrayLoader,
    Callback,
    EarlyStopping,
    History,
    JsonlLogger,
    LearningRateMonitor,
    LoopInfo,
    NanPolicy,
    ProgressBar,
    Stop,
    TensorBoardLogger,
    TrainState,
    build_eval_step,
    build_train_step,
    fit,
)
from pztrain.loggers import read_jsonl
from pztrain.records import TIMING_KEYS

_rng = np.random.default_rng(1)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
OPT = optax.sgd(0.05)
OPT_SKIP = optax.apply_if_finite(OPT, max_consecutive_errors=100)
SCHEDULE = optax.linear_schedule(0.1, 0.0, 10)
NEVER = 10**6
TABLE_LEN = 32
# Record step s (log_every=1) carries the score of step s-1, i.e. SCORES[s - 1].
SCORES = [5.0, 4.0, 3.0, 3.5, 3.2, 2.9, 3.0, 3.0, 3.0, 3.0]


def loss_fn(*, model, state, rng, x, y):
    """MSE; aux "score" is read from a table in the loss-function state, and the
    loss (and so the grads) turn NaN from step ``state["nan_from"]`` on."""
    i = state["i"]
    err = x @ model["w"] + model["b"] - y
    loss = jnp.mean(err**2) * jnp.where(i >= state["nan_from"], jnp.nan, 1.0)
    score = state["table"][jnp.minimum(i, TABLE_LEN - 1)]
    new_state = {**state, "i": i + 1}
    return loss, new_state, {"loss": loss, "score": score, "neg_score": -score}


def eval_fn(*, model, state, rng, x, y):
    err = x @ model["w"] + model["b"] - y
    score = state["table"][jnp.minimum(state["i"], TABLE_LEN - 1)]
    return {"loss": jnp.mean(err**2), "score": score}


STEP = build_train_step(loss_fn)
EVAL = build_eval_step(eval_fn)
EVAL_DATA = [{"x": X[:8], "y": Y[:8]}, {"x": X[8:], "y": Y[8:]}]


def new_state(scores=SCORES, nan_from=NEVER, opt=OPT, w=0.0) -> TrainState:
    table = np.full(TABLE_LEN, scores[-1], np.float32)
    table[: len(scores)] = scores
    lfs = {
        "i": jnp.zeros((), jnp.int32),
        "table": jnp.asarray(table),
        "nan_from": jnp.array(nan_from, jnp.int32),
    }
    model = {"w": jnp.full((3,), w, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return TrainState.initial_state(model, opt, jax.random.key(0), lfs)


def loader() -> ArrayLoader:
    return ArrayLoader({"x": X, "y": Y}, 4, seed=1)  # 4 steps per epoch


def run(state=None, **kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("log_every", 1)
    data = kwargs.pop("data", None) or loader()
    step = kwargs.pop("step", STEP)
    return fit(new_state() if state is None else state, step, data, **kwargs)


def _info_fields(info: LoopInfo) -> dict:
    names = ["start_step", "end_step", "steps_per_epoch", "steps_per_call"]
    names += ["log_every", "evaluates", "run_dir"]
    return {n: getattr(info, n) for n in names}


class Recorder(Callback):
    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.params: dict[int, dict[str, np.ndarray]] = {}
        self.state_steps: list[int] = []

    def on_train_start(self, state, info):
        self.calls.append(("start", info))

    def on_log(self, state, record):
        self.calls.append(("log", record["step"]))
        self.params[record["step"]] = {
            k: np.array(v, copy=True) for k, v in state.params.items()
        }
        self.state_steps.append(int(state.step))

    def on_eval_end(self, state, record):
        self.calls.append(("eval", record["step"]))

    def on_epoch_end(self, state, epoch):
        self.calls.append(("epoch", epoch))

    def on_train_end(self, state, history):
        self.calls.append(("end", history))

    def hooks(self, name):
        return [arg for hook, arg in self.calls if hook == name]


class CountingLogger:
    def __init__(self):
        self.hparams, self.records, self.closed = [], [], 0

    def log_hparams(self, hparams):
        self.hparams.append(hparams)

    def log_record(self, record):
        self.records.append(record)

    def close(self):
        self.closed += 1


# ------------------------------------------------------------------ hooks


def test_hooks_are_called_in_order_with_their_arguments():
    rec, logger = Recorder(), CountingLogger()
    state, history = run(
        num_epochs=2,
        log_every=2,
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        callbacks=[rec],
        loggers=[logger],
        hparams={"lr": 0.05},
    )
    (info,) = rec.hooks("start")
    assert isinstance(info, LoopInfo)
    assert _info_fields(info) == {
        "start_step": 0,
        "end_step": 8,
        "steps_per_epoch": 4,
        "steps_per_call": 1,
        "log_every": 2,
        "evaluates": True,
        "run_dir": None,
    }
    assert rec.calls == [
        ("start", info),
        ("log", 2),
        ("log", 4),
        ("epoch", 0),
        ("eval", 4),
        ("log", 6),
        ("log", 8),
        ("epoch", 1),
        ("eval", 8),
        ("end", history),
    ]
    assert rec.hooks("end")[0] is history
    assert rec.state_steps == [2, 4, 6, 8]
    assert logger.hparams == [{"steps_per_call": 1, "log_every": 2, "lr": 0.05}]
    assert logger.records == history.records and logger.closed == 1


def _raising_loss(*, model, state, rng, x, y):
    if x.shape[0] == 3:  # a batch of another size: traced again, at its step
        raise RuntimeError("the loss failed while tracing")
    loss = jnp.mean((x @ model["w"] + model["b"] - y) ** 2)
    return loss, state, {"loss": loss}


def test_on_train_end_runs_when_the_loss_raises(tmp_path):
    rec, logger, jsonl = Recorder(), CountingLogger(), JsonlLogger(tmp_path)
    batches = [{"x": X[:4], "y": Y[:4]}, {"x": X[4:7], "y": Y[4:7]}]
    with pytest.raises(RuntimeError, match=re.escape("the loss failed while tracing")):
        run(
            step=build_train_step(_raising_loss),
            data=batches,
            num_steps=4,
            callbacks=[rec],
            loggers=[logger, jsonl],
        )
    assert [h for h, _ in rec.calls] == ["start", "log", "end"]
    assert logger.closed == 1
    assert jsonl._file.closed


def test_a_loss_that_fails_on_the_first_batch_is_refused_before_the_run(tmp_path):
    rec, logger = Recorder(), CountingLogger()
    with pytest.raises(RuntimeError, match=re.escape("the loss failed while tracing")):
        run(
            step=build_train_step(_raising_loss),
            data=[{"x": X[:3], "y": Y[:3]}],
            num_steps=4,
            callbacks=[rec],
            loggers=[logger],
            run_dir=tmp_path / "run",
        )
    assert rec.calls == [] and logger.closed == 0  # no run started
    assert not (tmp_path / "run").exists()


class Interrupt(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_log(self, state, record):
        if record["step"] == self.at:
            raise KeyboardInterrupt


def test_keyboard_interrupt_propagates_and_everything_is_closed(monkeypatch):
    bars = []
    monkeypatch.setattr(
        "tqdm.auto.tqdm", lambda **kw: bars.append(FakeBar(**kw)) or bars[-1]
    )
    rec, logger = Recorder(), CountingLogger()
    with pytest.raises(KeyboardInterrupt):
        run(
            num_steps=8,
            log_every=2,
            callbacks=[Interrupt(4), rec],
            loggers=[logger],
            progress=True,
        )
    assert rec.hooks("log") == [2]  # a callback after the one that raised: not
    (history,) = rec.hooks("end")  # the history and loggers: step 4's record too
    assert [r["step"] for r in history.records] == [2, 4]
    assert logger.closed == 1 and [r["step"] for r in logger.records] == [2, 4]
    assert bars[0].closed == 1


def test_loggers_are_closed_when_on_train_end_raises():
    class Fails(Callback):
        def on_train_end(self, state, history):
            raise ValueError("on_train_end failed")

    logger = CountingLogger()
    with pytest.raises(ValueError, match="on_train_end failed"):
        run(num_steps=2, callbacks=[Fails()], loggers=[logger])
    assert logger.closed == 1


class Returns(Callback):
    """Returns ``make(state, record)`` from on_log at step ``at``."""

    def __init__(self, at, make, hook="on_log"):
        self.at, self.make = at, make
        setattr(self, hook, self._hook)

    def _hook(self, state, arg):
        step = arg["step"] if isinstance(arg, dict) else arg
        if step == self.at:
            return self.make(state)
        return None


def test_a_hook_returning_a_state_changes_the_run():
    def bump(state):
        return state.replace(loss_fn_state={**state.loss_fn_state, "i": jnp.array(100)})

    state, _ = run(num_steps=6, log_every=2, callbacks=[Returns(2, bump)])
    assert int(state.loss_fn_state["i"]) == 104
    assert int(state.step) == 6

    class Start(Callback):
        def on_train_start(self, state, info):
            return state.replace(params={**state.params, "w": jnp.ones(3)})

    started, _ = run(num_steps=3, callbacks=[Start()])
    want, _ = run(new_state(w=1.0), num_steps=3)
    for k in ("w", "b"):
        np.testing.assert_array_equal(started.params[k], want.params[k])


def test_a_hook_returning_stop_ends_the_run():
    rec = Recorder()
    state, history = run(
        num_steps=20,
        log_every=2,
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        callbacks=[Returns(4, lambda s: Stop("enough")), rec],
    )
    assert history.stop_reason == "enough"
    assert int(state.step) == 4
    assert steps_of(history) == [2, 4]
    assert steps_of(history, "eval") == [4]  # the epoch end at step 4 still ran
    assert len(rec.hooks("end")) == 1

    # Stop with a state: the run finishes with that state.
    def swap(state):
        return Stop(
            "swapped",
            state.replace(loss_fn_state={**state.loss_fn_state, "i": jnp.array(-5)}),
        )

    state, history = run(num_steps=20, log_every=2, callbacks=[Returns(2, swap)])
    assert history.stop_reason == "swapped" and int(state.loss_fn_state["i"]) == -5

    # The first Stop's reason wins; the others still run.
    state, history = run(
        num_steps=20,
        callbacks=[
            Returns(3, lambda s: Stop("first")),
            Returns(3, lambda s: Stop("2")),
        ],
    )
    assert history.stop_reason == "first" and int(state.step) == 3

    # From on_epoch_end and from on_train_start.
    state, history = run(
        num_steps=20,
        log_every=2,
        callbacks=[Returns(0, lambda s: Stop("epoch"), hook="on_epoch_end")],
    )
    assert history.stop_reason == "epoch" and int(state.step) == 4

    class StopAtStart(Callback):
        def on_train_start(self, state, info):
            return Stop("not today")

    rec = Recorder()
    state, history = run(num_steps=20, callbacks=[StopAtStart(), rec])
    assert history.stop_reason == "not today"
    assert int(state.step) == 0 and history.records == []
    assert [h for h, _ in rec.calls] == ["start", "end"]


def test_a_hook_returning_a_bad_type_is_a_type_error():
    class BadReturn(Callback):
        def on_log(self, state, record):
            return 3

    logger = CountingLogger()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "BadReturn.on_log returned a int; hooks return None, a TrainState or "
            "pztrain.callbacks.Stop."
        ),
    ):
        run(num_steps=2, callbacks=[BadReturn()], loggers=[logger])
    assert logger.closed == 1


# ---------------------------------------------------------- EarlyStopping


@pytest.mark.parametrize(
    "monitor, mode, patience, min_delta, stop_step, reason",
    [
        ("score", "min", 2, 0.0, 5, "score did not improve on 3 (step 3) for 2 checks"),
        (
            "score",
            "min",
            3,
            0.0,
            9,
            "score did not improve on 2.9 (step 6) for 3 checks",
        ),
        ("score", "min", 3, 0.2, 6, "score did not improve on 3 (step 3) for 3 checks"),
        (
            "neg_score",
            "max",
            2,
            0.0,
            5,
            "neg_score did not improve on -3 (step 3) for 2 checks",
        ),
        (
            "neg_score",
            "max",
            3,
            -0.2,  # its sign does not matter
            6,
            "neg_score did not improve on -3 (step 3) for 3 checks",
        ),
    ],
)
def test_early_stopping(monitor, mode, patience, min_delta, stop_step, reason):
    stopper = EarlyStopping(monitor, mode=mode, patience=patience, min_delta=min_delta)
    state, history = run(num_steps=20, callbacks=[stopper])
    assert history.stop_reason == reason
    assert int(state.step) == stop_step
    assert steps_of(history)[-1] == stop_step


def test_early_stopping_restore_best_returns_the_best_params():
    rec = Recorder()
    stopper = EarlyStopping("score", patience=2, restore_best=True)
    state, history = run(num_steps=20, callbacks=[rec, stopper])
    assert int(state.step) == 5 and stopper.best_step == 3
    assert stopper.best == 3.0
    for k in ("w", "b"):
        np.testing.assert_array_equal(state.params[k], rec.params[3][k])
    assert not np.array_equal(state.params["w"], rec.params[5]["w"])
    # Without restore_best the run ends with the last params.
    rec = Recorder()
    state, _ = run(num_steps=20, callbacks=[rec, EarlyStopping("score", patience=2)])
    np.testing.assert_array_equal(state.params["w"], rec.params[5]["w"])


def test_early_stopping_on_an_eval_metric():
    # The eval score at step s is SCORES[s]: 4, 3, 3.5, ...
    stopper = EarlyStopping("eval/score", patience=1)
    state, history = run(
        num_steps=20,
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        eval_every=1,
        callbacks=[stopper],
    )
    assert (
        history.stop_reason == "eval/score did not improve on 3 (step 2) for 1 checks"
    )
    assert int(state.step) == 3


def test_early_stopping_errors():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "EarlyStopping monitors 'scor', which no train record of this run "
            "holds: its train metrics are ['loss', "
        ),
    ) as err:  # refused before the run
        run(num_steps=2, callbacks=[EarlyStopping("scor")])
    assert "'neg_score'" in str(err.value) and "'score'" in str(err.value)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "EarlyStopping monitors 'eval/los', which the evaluation of eval_step= "
            "does not record: the run's eval metrics are ['eval/loss', 'eval/score']"
        ),
    ):
        run(
            num_steps=2,
            eval_step=EVAL,
            eval_data=EVAL_DATA,
            callbacks=[EarlyStopping("eval/los")],
        )
    rec = Recorder()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "EarlyStopping monitors 'eval/loss' but fit runs no evaluation: pass "
            "eval_step and eval_data, or monitor a train metric such as 'loss'."
        ),
    ):
        run(num_steps=2, callbacks=[EarlyStopping("eval/loss"), rec])
    assert rec.calls == []  # refused before the run: no hook ran
    with pytest.raises(ValueError, match=re.escape("mode must be 'min' or 'max'")):
        EarlyStopping("loss", mode="avg")
    with pytest.raises(ValueError, match=re.escape("patience must be >= 1; got 0")):
        EarlyStopping("loss", patience=0)


# -------------------------------------------------------------- NanPolicy


def test_nan_policy_stop_names_the_first_nonfinite_step():
    state, history = run(
        new_state(nan_from=7), num_steps=20, log_every=5, callbacks=[NanPolicy("stop")]
    )
    assert history.stop_reason == (
        "non-finite loss at step 7: params non-finite in ['b', 'w'] at step 10; "
        "no checkpoint at or before step 7 to replay from (fit(checkpoints="
        "Checkpoints(dir, every_steps=N))); or re-run a state from before the step "
        "with pztrain.step.find_nonfinite"
    )
    assert int(state.step) == 10
    first, second = history.records
    assert "nonfinite_steps" not in first and np.isfinite(first["metrics"]["loss"])
    assert second["step"] == 10
    assert second["nonfinite_steps"] == 3 and second["first_nonfinite_step"] == 7
    assert np.isnan(second["metrics"]["loss"])

    state, history = run(
        new_state(nan_from=7), num_steps=20, log_every=1, callbacks=[NanPolicy()]
    )
    assert history.stop_reason.startswith("non-finite loss at step 7: params non")
    assert int(state.step) == 8  # step 7 is the 8th step

    # Without the policy the run goes on; each interval names its first bad step.
    _, history = run(new_state(nan_from=7), num_steps=15, log_every=5)
    assert history.stop_reason is None
    assert [r.get("first_nonfinite_step") for r in history.records] == [None, 7, 10]


def test_nan_policy_skip_needs_apply_if_finite():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "NanPolicy('skip') needs the optimizer wrapped to skip non-finite "
            "updates: optimizer_def=optax.apply_if_finite(tx, "
            "max_consecutive_errors=10)."
        ),
    ):
        run(num_steps=2, callbacks=[NanPolicy("skip")])
    with pytest.raises(ValueError, match=re.escape("mode must be 'stop' or 'skip'")):
        NanPolicy("ignore")


@pytest.mark.slow  # a run over NaN batches (test_checkpoint_policy keeps one fast)
def test_nan_policy_skip_keeps_params_finite_and_logs_skips():
    state, history = run(
        new_state(nan_from=7, opt=OPT_SKIP),
        num_steps=10,
        log_every=5,
        callbacks=[NanPolicy("skip")],
    )
    assert history.stop_reason is None and int(state.step) == 10
    assert history.series("skipped_updates") == ([5, 10], [0.0, 3.0])
    for k in ("w", "b"):
        assert np.all(np.isfinite(state.params[k]))
    # The three bad updates were dropped: the params are those after step 7.
    seven, _ = run(new_state(nan_from=7, opt=OPT_SKIP), num_steps=7)
    for k in ("w", "b"):
        np.testing.assert_array_equal(state.params[k], seven.params[k])


# --------------------------------------------------- LearningRateMonitor


def test_learning_rate_monitor_logs_the_schedule():
    _, history = run(
        num_steps=6, log_every=2, callbacks=[LearningRateMonitor(SCHEDULE)]
    )
    steps, lrs = history.series("learning_rate")
    assert steps == [2, 4, 6]
    # The rate the last update used, as optax.inject_hyperparams reports it.
    assert lrs == [float(SCHEDULE(s - 1)) for s in steps]
    assert lrs == pytest.approx([0.09, 0.07, 0.05], rel=1e-6)
    _, history = run(num_steps=4, log_every=2, callbacks=[LearningRateMonitor(0.05)])
    assert history.series("learning_rate") == ([2, 4], [0.05, 0.05])


# ------------------------------------------------------------ ProgressBar


@pytest.fixture
def fake_tqdm(monkeypatch):
    bars = []

    def make_bar(**kwargs):
        bars.append(FakeBar(**kwargs))
        return bars[-1]

    monkeypatch.setattr("tqdm.auto.tqdm", make_bar)
    return bars


def _shown(metrics, prefix=""):
    return {f"{prefix}{k}": f"{v:.4g}" for k, v in metrics.items()}


def test_progress_bar_default(fake_tqdm):
    state, history = run(
        num_steps=8, log_every=2, eval_step=EVAL, eval_data=EVAL_DATA, progress=True
    )
    (bar,) = fake_tqdm
    assert bar.kwargs["total"] == 8 and bar.kwargs["initial"] == 0
    assert bar.kwargs["unit"] == "step"
    assert sum(bar.updates) == 8 and min(bar.updates) >= 1
    train, evals = history.last("train"), history.last("eval")
    first_eval = [r for r in history.records if r["split"] == "eval"][0]
    # The train loss (and learning rate) is shown with the last eval metrics.
    assert bar.postfixes[-2] == {
        **_shown(train["metrics"]),
        **_shown(first_eval["metrics"], "eval/"),
    }
    assert bar.postfixes[-1] == {
        **_shown(train["metrics"]),
        **_shown(evals["metrics"], "eval/"),
    }
    assert len(bar.postfixes) == 4 + 2  # 4 log points, 2 evaluations
    assert bar.closed == 1

    # A resumed run starts the bar at its step.
    fake_tqdm.clear()
    state, _ = run(state, num_steps=12, log_every=2, progress=True)
    (bar,) = fake_tqdm
    assert (bar.kwargs["initial"], bar.kwargs["total"]) == (8, 12)
    assert sum(bar.updates) == 4 and bar.closed == 1


def test_progress_bar_with_make_bar_and_metrics():
    """A ProgressBar passed as a callback (progress=False) is the run's bar."""
    pb = ProgressBar(metrics=("loss",), make_bar=FakeBar)
    _, history = run(num_steps=6, log_every=3, callbacks=[pb])
    bar = pb.bar
    assert (bar.kwargs["total"], bar.kwargs["initial"]) == (6, 0)
    assert bar.postfixes == [
        {"loss": f"{r['metrics']['loss']:.4g}"} for r in history.records
    ]
    assert bar.closed == 1
    assert sum(bar.updates) == 6  # it advanced with the steps


def _bar_info(k: int, log_every: int) -> LoopInfo:
    return LoopInfo(
        start_step=0,
        end_step=None,
        steps_per_epoch=None,
        steps_per_call=k,
        log_every=log_every,
        evaluates=False,
        run_dir=None,
    )


def test_progress_bar_paces_itself_by_the_clock_it_is_given():
    """It asks to move about every 0.2 s at the rate it saw; the times are given
    (as the loop gives them), so nothing sleeps."""
    pb = ProgressBar(make_bar=FakeBar)
    pb.on_train_start(None, _bar_info(1, 100))
    assert pb.on_advance(0, t=0.0) == 10  # a tenth of a log interval at first
    assert pb.on_advance(10, t=0.001) == 20  # 10,000 steps/s: at most doubles
    assert pb.on_advance(20, t=0.101) == 40  # 100 steps/s: 20 steps per 0.2 s
    assert pb.on_advance(40, t=1.101) == 50  # 20 steps/s: at most halves
    assert pb.on_advance(40, t=2.0) == 50  # no step since: no move, same pace
    assert pb.bar.updates == [10, 10, 20]

    pb = ProgressBar(make_bar=FakeBar, seconds=1.0)
    pb.on_train_start(None, _bar_info(1, 100))
    # At 100 steps/s and one move a second, the interval doubles its way up to
    # 100 steps; the loop stops where the bar asked (step / 100 seconds).
    asked = [pb.on_advance(0, t=0.0)]
    for _ in range(6):
        asked.append(pb.on_advance(asked[-1], t=asked[-1] / 100))
    assert asked == [10, 20, 40, 80, 100, 200, 300]
    assert pb.bar.updates == [10, 10, 20, 40, 20, 100]


def test_progress_bar_moves_by_multiples_of_steps_per_call():
    pb = ProgressBar(make_bar=FakeBar)
    pb.on_train_start(None, _bar_info(4, 8))
    assert pb.on_advance(0, t=0.0) == 4  # never less than one call
    assert pb.on_advance(4, t=1e-5) == 8  # fast: doubles, still a multiple of 4
    assert pb.on_advance(8, t=100.0) == 12  # slow: never below one call
    pb = ProgressBar(make_bar=FakeBar)
    pb.on_train_start(None, _bar_info(2, 2))
    pb.on_advance(0, t=0.0)
    assert pb.on_advance(2, t=10.0) == 4
    assert pb.bar.updates == [2]


def test_progress_true_with_real_tqdm(capsys):
    state, _ = run(num_steps=4, log_every=2, progress=True)
    assert int(state.step) == 4
    err = capsys.readouterr().err
    assert "4/4" in err and "step" in err


# ---------------------------------------------------------------- loggers


def _without_time(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def test_jsonl_logger_reads_back_the_history(tmp_path):
    hparams = {"lr": 0.05, "name": "run", "f32": np.float32(0.5), "pair": (1, 2)}
    _, history = run(
        num_steps=8,
        log_every=2,
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        loggers=[JsonlLogger(tmp_path)],
        hparams=hparams,
    )
    assert read_jsonl(tmp_path) == history.to_dicts()
    assert len(history.records) == 4 + 2
    assert json.loads((tmp_path / "hparams.json").read_text()) == {
        "steps_per_call": 1,
        "log_every": 2,
        "lr": 0.05,
        "name": "run",
        "f32": 0.5,
        "pair": [1, 2],
    }


def test_fit_with_run_dir_logs_jsonl_by_default(tmp_path):
    rec = Recorder()
    _, history = run(num_steps=4, log_every=2, run_dir=tmp_path, callbacks=[rec])
    assert read_jsonl(tmp_path) == history.to_dicts()
    assert [r["step"] for r in read_jsonl(tmp_path)] == [2, 4]
    assert json.loads((tmp_path / "hparams.json").read_text())["log_every"] == 2
    assert rec.hooks("start")[0].run_dir == str(tmp_path)
    # An explicit logger list replaces the default.
    other = tmp_path / "other"
    run(num_steps=2, log_every=2, run_dir=other, loggers=[])
    assert not (other / "metrics.jsonl").exists()


def test_jsonl_logger_resume_step_drops_records_after_it(tmp_path):
    log = JsonlLogger(tmp_path)
    for step, split in [
        (2, "train"),
        (4, "train"),
        (4, "eval"),
        (6, "train"),
        (8, "train"),
        (8, "eval"),
    ]:
        log.log_record({"step": step, "split": split, "metrics": {"loss": step}})
    log.close()
    log = JsonlLogger(tmp_path, resume_step=6)
    log.log_record({"step": 7, "split": "train", "metrics": {"loss": 0.5}})
    log.close()
    got = [(r["step"], r["split"]) for r in read_jsonl(tmp_path)]
    # Kept: up to and including the step the run resumes from (that record was
    # made from the resumed state); dropped: 8 and 8-eval.
    assert got == [(2, "train"), (4, "train"), (4, "eval"), (6, "train"), (7, "train")]
    JsonlLogger(tmp_path, resume_step=3).close()
    assert [r["step"] for r in read_jsonl(tmp_path)] == [2]
    # Without resume_step, a log that holds records is another run's: refused,
    # and left as it was.
    with pytest.raises(
        ValueError,
        match=r"metrics.jsonl holds another run.s log \(1 records, up to step 2\)",
    ):
        JsonlLogger(tmp_path).start_run(0, resumed=False)
    assert [r["step"] for r in read_jsonl(tmp_path)] == [2]


def test_resumed_run_dir_equals_an_uninterrupted_one(tmp_path):
    """Resuming from step 4 neither repeats nor skips a record."""
    opts = dict(log_every=2, eval_step=EVAL, eval_data=EVAL_DATA)
    run(num_steps=8, run_dir=tmp_path / "whole", **opts)
    half, _ = run(num_steps=4, run_dir=tmp_path / "resumed", **opts)
    run(half, num_steps=8, run_dir=tmp_path / "resumed", **opts)
    whole = _without_time(read_jsonl(tmp_path / "whole"))
    resumed = _without_time(read_jsonl(tmp_path / "resumed"))
    assert [(r["step"], r["split"]) for r in whole] == [
        (2, "train"),
        (4, "train"),
        (4, "eval"),
        (6, "train"),
        (8, "train"),
        (8, "eval"),
    ]
    assert [(r["step"], r["split"]) for r in resumed] == [
        (r["step"], r["split"]) for r in whole
    ]
    assert resumed == whole


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(path):
    """Parses TFRecord framing by hand: len u64, crc u32, payload, crc u32."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    events, i = [], 0
    while i < len(data):
        header = data[i : i + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[i + 8 : i + 12])
        assert header_crc == _masked_crc32c(header)
        payload = data[i + 12 : i + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[i + 12 + length : i + 16 + length])
        assert payload_crc == _masked_crc32c(payload)
        events.append(event_pb2.Event.FromString(payload))
        i += 16 + length
    assert i == len(data)
    return events


def test_tensorboard_logger_writes_scalars_and_hparams(tmp_path):
    _, history = run(
        num_steps=6,
        log_every=2,
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        eval_every=6,
        loggers=[TensorBoardLogger(tmp_path)],
        hparams={"lr": 0.05},
    )
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = _read_events(path)
    assert events[0].file_version == "brain.Event:2"
    scalars: dict[str, list[tuple[int, float]]] = {}
    texts = {}
    for ev in events[1:]:
        for v in ev.summary.value:
            if v.HasField("tensor"):
                texts[v.tag] = [s.decode() for s in v.tensor.string_val]
            elif v.metadata.plugin_data.plugin_name != "hparams":
                scalars.setdefault(v.tag, []).append((ev.step, v.simple_value))
    want_tags = {f"train/{m}" for m in ("loss", "score", "neg_score")}
    want_tags |= {"eval/loss", "eval/score"}
    throughput = {t: scalars.pop(t) for t in list(scalars) if t.startswith("time/")}
    assert set(scalars) == want_tags
    assert [s for s, _ in throughput["time/steps_per_sec"]] == [2, 4, 6]
    assert [v for _, v in throughput["time/steps_per_sec"]] == [
        pytest.approx(r["steps_per_sec"])
        for r in history.records
        if "steps_per_sec" in r
    ]
    for split in ("train", "eval"):
        for name in history.metric_names(split):
            steps, values = history.series(name, split)
            got = scalars[f"{split}/{name}"]
            assert [s for s, _ in got] == steps
            assert [v for _, v in got] == [float(np.float32(v)) for v in values]
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in scalars["eval/loss"]] == [6]
    # Hyperparameters go to the HParams tab, in this run's event file.
    assert not texts and [p for p in tmp_path.iterdir() if p.is_dir()] == []
    plugin = _hparams_plugin_data(events)
    start = plugin["_hparams_/session_start_info"].session_start_info.hparams
    assert {k: v.number_value for k, v in start.items()} == {
        "log_every": 2.0,
        "lr": 0.05,
        "steps_per_call": 1.0,
    }
    experiment = plugin["_hparams_/experiment"].experiment
    assert {m.name.tag for m in experiment.metric_infos} == want_tags
    assert {h.name for h in experiment.hparam_infos} == set(start)
    assert "_hparams_/session_end_info" in plugin


def _hparams_plugin_data(events):
    """Tag → the decoded ``HParamsPluginData`` of each hparams summary."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    found = {}
    for ev in events:
        for v in ev.summary.value:
            if v.metadata.plugin_data.plugin_name == "hparams":
                content = v.metadata.plugin_data.content
                found[v.tag] = HParamsPluginData.FromString(content)
    return found


# ---------------------------------------------------------------- History


def _history() -> History:
    def rec(step, split, **metrics):
        return {
            "step": step,
            "epoch": 0,
            "split": split,
            "time": 0.0,
            "metrics": metrics,
        }

    return History(
        records=[
            rec(2, "train", loss=1.0, acc=0.5),
            rec(4, "train", loss=0.5, acc=0.7),
            rec(4, "eval", loss=0.6),
            rec(6, "train", loss=0.25),
        ]
    )


def test_history_accessors():
    h = _history()
    dicts = h.to_dicts()
    assert dicts == h.records and dicts[0] is not h.records[0]
    dicts[0]["metrics"]["loss"] = 99.0  # a copy: the history is unchanged
    assert h.records[0]["metrics"]["loss"] == 1.0
    assert h.series("loss") == ([2, 4, 6], [1.0, 0.5, 0.25])
    assert h.series("acc") == ([2, 4], [0.5, 0.7])
    assert h.series("loss", "eval") == ([4], [0.6])
    assert h.series("nope") == ([], [])
    assert h.metric_names() == {"loss", "acc"}
    assert h.metric_names("eval") == {"loss"}
    assert h.last()["step"] == 6 and h.last("eval")["metrics"] == {"loss": 0.6}
    assert History().last() is None and History().stop_reason is None


def test_history_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = _history()
    try:
        fig = h.plot()  # one axes per metric; train and eval of one share it
        assert [ax.get_title() for ax in fig.axes] == ["acc", "loss"]
        acc, loss = fig.axes
        assert [line.get_label() for line in loss.get_lines()] == ["train", "eval"]
        assert [line.get_label() for line in acc.get_lines()] == ["train"]
        assert loss.get_xlabel() == "step"
        line = loss.get_lines()[0]
        assert list(line.get_xdata()) == [2, 4, 6]
        assert list(line.get_ydata()) == [1.0, 0.5, 0.25]

        assert h.plot(names=["loss"], fig=fig) is fig  # redrawn in place
        assert [ax.get_title() for ax in fig.axes] == ["loss"]
        fig3 = h.plot(names=["eval/loss"])
        (ax,) = fig3.axes
        assert [x.get_label() for x in ax.get_lines()] == ["eval"]
        (ax,) = h.plot(split="train", names=["loss"]).axes
        assert [x.get_label() for x in ax.get_lines()] == ["train"]
    finally:
        plt.close("all")
