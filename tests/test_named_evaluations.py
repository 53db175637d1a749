"""Named evaluations in `fit` (issue 32, points 1 and 2): any number of
`pztrain.Evaluation` s, each with its own cadence, an eval step with data or a
host function of the state; records ``eval/<name>/<metric>``; checked before
anything is written; owed per evaluation across a stop and a resume.
"""

from __future__ import annotations

import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import ArrayLoader, Callback, Checkpoints, EarlyStopping, Evaluation, fit
from pztrain.ema import NoEmaError
from pztrain.loggers import read_jsonl, read_media

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] + model["b"] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"mse": jnp.mean((x @ model["w"] + model["b"] - y) ** 2)}


STEP = pztrain.build_train_step(loss_fn)
EVAL = pztrain.build_eval_step(eval_fn)
VAL = [{"x": X[:8], "y": Y[:8]}]
TEST = [{"x": X[8:16], "y": Y[8:16]}, {"x": X[16:20], "y": Y[16:20]}]


def new_state(opt=None):
    model = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return pztrain.TrainState.initial_state(
        model, opt or optax.adam(0.05), jax.random.key(0), jnp.zeros((), jnp.int32)
    )


def loader():
    return ArrayLoader({"x": X, "y": Y}, 4, seed=1)  # 8 steps per epoch


def run(state=None, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("loggers", [])
    return fit(new_state() if state is None else state, STEP, loader(), **kw)


def evals(history):
    return [(r["step"], sorted(r["metrics"])) for r in of_eval(history)]


def of_eval(history):
    return [r for r in history.records if r["split"] == "eval"]


def norm(state):
    return {"w_norm": jnp.linalg.norm(state.params["w"]), "note": "text"}


def test_two_evaluations_with_their_own_cadences():
    val = Evaluation("val", EVAL, VAL, every=4, at_end=False)
    test = Evaluation("test", EVAL, TEST, every_epochs=2)
    state, history = run(num_steps=20, log_every=10, evaluations=[val, test])
    assert evals(history) == [
        (4, ["val/mse"]),
        (8, ["val/mse"]),
        (12, ["val/mse"]),
        (16, ["test/mse", "val/mse"]),  # the end of epoch 2
        (20, ["test/mse", "val/mse"]),  # val's cadence; test at the end
    ]
    last = of_eval(history)[-1]["metrics"]  # evaluate's values, named
    assert last["test/mse"] == pztrain.evaluate(state, EVAL, TEST)["mse"]
    assert last["val/mse"] == pztrain.evaluate(state, EVAL, VAL)["mse"]


def test_the_unnamed_evaluation_keeps_its_names_beside_named_ones(tmp_path):
    _, history = run(
        num_steps=8,
        log_every=4,
        eval_step=EVAL,
        eval_data=VAL,
        eval_every=4,
        evaluations=[Evaluation("norm", norm, every=8)],
        run_dir=tmp_path,
        loggers=None,
    )
    assert evals(history) == [(4, ["mse"]), (8, ["mse", "norm/w_norm"])]
    logged = [r for r in read_jsonl(tmp_path) if r["split"] == "eval"]
    assert sorted(logged[-1]["metrics"]) == ["mse", "norm/w_norm"]
    media = read_media(tmp_path)
    assert [(m["step"], m["key"]) for m in media] == [(8, "eval/norm/note")]


def test_a_host_function_may_return_a_metric_state():
    from pztrain.metric_states import Ratio

    ev = Evaluation("r", lambda s: {"acc": Ratio.of(3, 4), "n": 2})
    _, history = run(num_steps=4, evaluations=[ev])
    assert of_eval(history)[-1]["metrics"] == {"r/acc": 0.75, "r/n": 2.0}


def test_a_host_function_feeds_history_and_a_monitor():
    seen = []

    class Watch(Callback):
        def on_eval_end(self, state, record):
            seen.append(record["metrics"]["norm/w_norm"])

    stopper = EarlyStopping("eval/norm/w_norm", mode="min", patience=1)
    state, history = run(
        num_steps=16,
        log_every=4,
        evaluations=[Evaluation("norm", lambda s: {"w_norm": s.params["w"].sum()})],
        callbacks=[Watch(), stopper],
    )
    assert seen == [r["metrics"]["norm/w_norm"] for r in of_eval(history)]
    assert len(seen) == 2 and stopper.best_step == 8  # the sum grows: stop at 16
    assert history.stop_reason.startswith("eval/norm/w_norm did not improve")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(evaluations=[Evaluation("a", EVAL, VAL), Evaluation("a", norm)]),
            ValueError,
            "Two evaluations are named 'a'; names make their records",
        ),
        (
            dict(eval_step=EVAL, eval_data=VAL, evaluations=[Evaluation("", norm)]),
            ValueError,
            "Two evaluations are named '' (the unnamed one is eval_step=...'s)",
        ),
        (
            dict(evaluations=[Evaluation("v", EVAL, VAL, ema=True)]),
            NoEmaError,
            "Evaluation('v') has ema=True, but the state keeps no EMA",
        ),
        (
            dict(evaluations=Evaluation("v", EVAL, VAL)),
            TypeError,
            "evaluations must be a list of pztrain.Evaluation",
        ),
        (
            dict(evaluations=[EarlyStopping()]),
            TypeError,
            "evaluations[0] is a EarlyStopping; pass pztrain.Evaluation(",
        ),
    ],
    ids=["same-name", "unnamed-twice", "no-ema", "not-a-list", "not-one"],
)
def test_bad_evaluations_are_refused_before_anything_is_written(
    tmp_path, kwargs, error, message
):
    with pytest.raises(error, match=re.escape(message)):
        run(num_steps=4, run_dir=tmp_path / "run", loggers=None, **kwargs)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Evaluation("v", EVAL), ValueError, "Evaluation('v') has an eval"),
        (lambda: Evaluation("v", norm, VAL), ValueError, "has a host function and"),
        (lambda: Evaluation("v", 3), TypeError, "step must be an EvalStep"),
        (lambda: Evaluation("v", STEP, VAL), TypeError, "step is a TrainStep"),
        (lambda: Evaluation("v", norm, every=0), ValueError, "every must be an int"),
        (
            lambda: Evaluation("v", norm, every=2, every_epochs=1),
            ValueError,
            "pass every (steps) or every_epochs, not both",
        ),
        (lambda: Evaluation("a/b", norm), ValueError, "name 'a/b' cannot be used"),
        (lambda: Evaluation("ema", norm), ValueError, "'ema' names EMA records"),
        (lambda: Evaluation("v", norm, ema="x"), ValueError, "ema must be False"),
    ],
)
def test_a_bad_evaluation_names_itself(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_every_is_a_multiple_of_steps_per_call():
    fused = pztrain.build_train_step(loss_fn, steps_per_call=2)
    with pytest.raises(ValueError, match=re.escape("Evaluation('v'): every=3 must")):
        fit(
            new_state(),
            fused,
            loader(),
            num_steps=4,
            evaluations=[Evaluation("v", norm, every=3)],
            progress=False,
        )


def test_a_host_function_returning_something_else_is_named():
    bad = Evaluation("bad", lambda s: {"x": [1, 2]})
    with pytest.raises(TypeError, match="bad") as caught:
        run(num_steps=4, evaluations=[bad])
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert "in Evaluation('bad') at step 4" in notes
    with pytest.raises(TypeError, match=re.escape("function returned a list")):
        run(num_steps=4, evaluations=[Evaluation("bad", lambda s: [1.0])])


def test_a_monitor_naming_no_evaluation_is_refused():
    with pytest.raises(ValueError, match=re.escape("'eval/tset/mse'")) as caught:
        run(
            num_steps=4,
            evaluations=[Evaluation("test", EVAL, TEST)],
            callbacks=[EarlyStopping("eval/tset/mse")],
        )
    assert "'test'" in str(caught.value)
    with pytest.raises(ValueError, match=re.escape("are ['eval/test/mse']")):
        run(
            num_steps=4,
            evaluations=[Evaluation("test", EVAL, TEST)],
            callbacks=[EarlyStopping("eval/test/loss")],
        )


def test_keep_best_by_a_named_evaluation(tmp_path):
    ckpt = Checkpoints(
        tmp_path, every_steps=4, keep_last=1, keep_best=1, monitor="eval/val/mse"
    )
    run(
        num_steps=16,
        log_every=4,
        evaluations=[
            Evaluation("val", EVAL, VAL, every=4),
            Evaluation("n", norm, every=8),
        ],
        checkpoints=ckpt,
    )
    assert ckpt.best_step() is not None and ckpt.best_step() % 4 == 0


class SigintInEval:
    """A host-function evaluation that sends SIGINT while it runs, once."""

    def __init__(self):
        self.calls = []

    def __call__(self, state):
        self.calls.append(int(state.step))
        if len(self.calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return {"w0": state.params["w"][0]}


@pytest.mark.slow  # a stopped run and its resume
def test_a_stop_owes_the_evaluations_it_skipped_and_resume_runs_them_once(tmp_path):
    first, calls = SigintInEval(), []

    def slow_test(state):
        calls.append(int(state.step))
        return {"w1": state.params["w"][1]}

    def opts(a):
        return dict(
            num_steps=16,
            log_every=4,
            evaluations=[
                Evaluation("a", a, every=8),
                Evaluation("b", slow_test, every=8),
            ],
            checkpoints=Checkpoints(tmp_path / "c", every_steps=8),
            run_dir=tmp_path / "run",
            loggers=None,
        )

    state, history = run(**opts(first))
    assert history.stop_reason == "interrupted" and int(state.step) == 8
    assert evals(history) == [(8, ["a/w0"])] and calls == []  # b skipped: owed
    meta = pztrain.read_metadata(tmp_path / "c" / "8")["metadata"]
    assert meta["owed_eval"] == {"step": 8, "epoch": 0, "names": ["b"]}
    again = SigintInEval()
    again.calls.append(-1)  # no more signals
    state, history = run(resume=True, **opts(again))
    assert calls == [8, 16] and again.calls == [-1, 16]  # b at 8 once, a not again
    assert evals(history) == [(8, ["b/w1"]), (16, ["a/w0", "b/w1"])]


@pytest.mark.slow  # a stopped run and its resume
def test_an_old_checkpoint_owing_an_evaluation_resumes(tmp_path):
    """A checkpoint written before evaluations had names owes (step, epoch):
    every evaluation due at that point runs first."""
    ckpt = Checkpoints(tmp_path / "c")
    state, _ = run(num_steps=8)
    ckpt.save_stopped(state, 8, (8, 0))
    meta = pztrain.read_metadata(tmp_path / "c" / "8")["metadata"]
    assert meta["owed_eval"] == {"step": 8, "epoch": 0}  # the old format
    _, history = run(
        num_steps=12,
        log_every=4,
        resume=True,
        checkpoints=Checkpoints(tmp_path / "c"),
        evaluations=[
            Evaluation("val", EVAL, VAL, every=4, at_end=False),
            Evaluation("test", EVAL, TEST, every_epochs=1, at_end=False),
            Evaluation("late", norm, every=12),
        ],
    )
    assert evals(history) == [
        (8, ["test/mse", "val/mse"]),
        (12, ["late/w_norm", "val/mse"]),
    ]


def test_history_plot_draws_named_evaluations_with_their_metric():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = pztrain.History(
        [
            {"step": 4, "split": "train", "metrics": {"loss": 1.0}},
            {
                "step": 4,
                "split": "eval",
                "metrics": {"val/loss": 1.1, "test/loss": 1.2, "val/acc": 0.5},
            },
        ]
    )
    fig = history.plot()
    panels = {ax.get_title(): [ln.get_label() for ln in ax.lines] for ax in fig.axes}
    assert panels == {"loss": ["train", "eval test", "eval val"], "val/acc": ["eval"]}
    fig = history.plot(["eval/val/loss"])
    assert [ax.get_title() for ax in fig.axes] == ["loss"]
    history.records[1]["metrics"]["test/acc"] = 0.6
    fig = history.plot(["loss", "acc"])  # each evaluation's line, by its metric
    panels = {ax.get_title(): [ln.get_label() for ln in ax.lines] for ax in fig.axes}
    assert panels == {
        "loss": ["train", "eval test", "eval val"],
        "acc": ["eval test", "eval val"],
    }
    plt.close("all")


def test_callbacks_see_the_evaluation_names():
    class Look(Callback):
        def on_train_start(self, state, info):
            self.names = info.evaluations

    look = Look()
    run(
        num_steps=4,
        eval_step=EVAL,
        eval_data=VAL,
        evaluations=[Evaluation("n", norm)],
        callbacks=[look],
    )
    assert look.names == ("", "n")


@pytest.mark.slow  # a stopped run and its resume
def test_a_stop_at_the_last_point_owes_the_end_evaluations(tmp_path):
    def at_16(state):  # sends SIGINT while it runs at step 16
        if int(state.step) == 16:
            os.kill(os.getpid(), signal.SIGINT)
        return {"w0": state.params["w"][0]}

    ends = []

    def end(state):
        ends.append(int(state.step))
        return {"b": state.params["b"]}

    opts = dict(
        num_steps=16,
        log_every=8,
        evaluations=[
            Evaluation("a", at_16, every=8),
            Evaluation("end", end, every=10**6),  # at the end only
        ],
        checkpoints=Checkpoints(tmp_path / "c", every_steps=8),
    )
    state, history = run(**opts)
    assert history.stop_reason == "interrupted" and int(state.step) == 16
    assert evals(history) == [(8, ["a/w0"]), (16, ["a/w0"])] and ends == []
    meta = pztrain.read_metadata(tmp_path / "c" / "16")["metadata"]
    assert meta["owed_eval"] == {"step": 16, "epoch": 2, "names": ["end"]}
    _, history = run(resume=True, **opts)
    assert evals(history) == [(16, ["end/b"])] and ends == [16]


def test_the_progress_bar_keeps_each_evaluations_last_values():
    class Bar:
        def __init__(self, **kw):
            self.postfix = {}

        def update(self, n):
            pass

        def close(self):
            pass

        def set_postfix(self, postfix, refresh=False):
            self.postfix = dict(postfix)

    bar = pztrain.ProgressBar(make_bar=Bar)
    _, history = run(
        num_steps=6,
        log_every=2,
        evaluations=[
            Evaluation("a", lambda s: {"x": 1.0}, every=2, at_end=False),
            Evaluation("b", lambda s: {"y": 2.0}, every=4, at_end=False),
        ],
        progress=bar,
    )
    assert evals(history)[-1] == (6, ["a/x"])  # b's value stays shown
    assert {k for k in bar.bar.postfix if k.startswith("eval/")} == {
        "eval/a/x",
        "eval/b/y",
    }
