"""Refusals before anything is written (issue 38, point 2; DESIGN.md contract
8): every hook's and logger's ``check``, monitors of the evaluations' metric
names (traced before the run) and a bad first batch are refused before the
run directory, a log or a checkpoint is touched."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import (
    ArrayLoader,
    Callback,
    Checkpoints,
    EarlyStopping,
    Evaluation,
    NanPolicy,
    fit,
)

_rng = np.random.default_rng(0)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"mse": jnp.mean((x @ model["w"] - y) ** 2)}


STEP = pztrain.build_train_step(loss_fn)
EVAL = pztrain.build_eval_step(eval_fn)
DATA = [{"x": X[:8], "y": Y[:8]}]


def new_state(opt=None):
    return pztrain.TrainState.initial_state(
        {"w": jnp.zeros(3, jnp.float32)}, opt or optax.sgd(0.1), jax.random.key(0)
    )


def refused(tmp_path, error, message, train_data=None, **kw):
    """Runs fit into ``tmp_path / "run"`` (and ``"ckpt"``, if ``checkpoints``
    is ``True``): it must raise ``error`` matching ``message`` and leave
    ``tmp_path`` as it was."""
    before = sorted(tmp_path.rglob("*"))
    if kw.get("checkpoints") is True:
        kw["checkpoints"] = Checkpoints(
            tmp_path / "ckpt", keep_best=1, monitor=kw.pop("monitor")
        )
    with pytest.raises(error, match=re.escape(message)) as caught:
        fit(
            kw.pop("state", None) or new_state(),
            STEP,
            ArrayLoader({"x": X, "y": Y}, 4) if train_data is None else train_data,
            num_steps=4,
            run_dir=tmp_path / "run",
            progress=False,
            **kw,
        )
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing made
    return caught.value


def test_a_typo_of_a_named_evaluations_metric_in_checkpoints(tmp_path):
    err = refused(
        tmp_path,
        ValueError,
        "Checkpoints(keep_best=1): The monitor 'eval/tset/mse' names no evaluation",
        checkpoints=True,
        monitor="eval/tset/mse",
        evaluations=[Evaluation("test", EVAL, DATA)],
    )
    assert "['test']" in str(err)


def test_a_typo_of_a_metric_of_a_named_evaluation(tmp_path):
    err = refused(
        tmp_path,
        ValueError,
        "Checkpoints(keep_best=1) monitors 'eval/test/loss', which evaluation "
        "'test' does not record: the run's eval metrics are ['eval/test/mse'].",
        checkpoints=True,
        monitor="eval/test/loss",
        evaluations=[Evaluation("test", EVAL, DATA)],
    )
    assert err is not None


@pytest.mark.parametrize("callback", ["early_stopping", "checkpoints"])
def test_a_typo_of_the_unnamed_evaluations_metric(tmp_path, callback):
    kw = {"eval_step": EVAL, "eval_data": DATA, "eval_ema": True}
    kw["state"] = new_state(pztrain.with_ema(optax.sgd(0.1), decay=0.9))
    if callback == "checkpoints":
        kw.update(checkpoints=True, monitor="eval/mse_")
        who = "Checkpoints(keep_best=1)"
    else:
        kw["callbacks"] = [EarlyStopping("eval/mse_")]
        who = "EarlyStopping"
    refused(
        tmp_path,
        ValueError,
        f"{who} monitors 'eval/mse_', which the evaluation of eval_step= does "
        "not record: the run's eval metrics are ['eval/mse', 'eval/ema/mse'].",
        **kw,
    )


def test_the_metrics_an_evaluation_records_are_known_before_the_run(tmp_path):
    seen = []

    class Look(Callback):
        def check(self, state, info):
            seen.append((dict(info.eval_metrics), (tmp_path / "run").exists()))

    fit(
        new_state(),
        STEP,
        ArrayLoader({"x": X, "y": Y}, 4),
        num_steps=4,
        eval_step=EVAL,
        eval_data=DATA,
        evaluations=[
            Evaluation("test", EVAL, ArrayLoader({"x": X, "y": Y}, 8)),
            Evaluation("norm", lambda s: {"w": s.params["w"][0]}),  # known later
        ],
        callbacks=[Look(), EarlyStopping("eval/test/mse")],
        run_dir=tmp_path / "run",
        progress=False,
    )
    expected = {"": ("mse",), "test": ("test/mse",), "norm": None}
    assert seen == [(expected, False)]


@pytest.mark.parametrize("callback", ["early_stopping", "checkpoints"])
def test_a_typo_of_a_train_metric(tmp_path, callback):
    if callback == "checkpoints":
        kw = {"checkpoints": True, "monitor": "loss_typo"}
        who = "Checkpoints(keep_best=1)"
    else:
        kw = {"callbacks": [EarlyStopping("loss_typo")]}
        who = "EarlyStopping"
    refused(
        tmp_path,
        ValueError,
        f"{who} monitors 'loss_typo', which no train record of this run holds: "
        "its train metrics are ['loss'].",
        **kw,
    )


def test_a_train_monitor_may_name_what_the_loop_and_the_callbacks_add(tmp_path):
    seen = []

    class Look(Callback):
        def check(self, state, info):
            seen.append(info.train_metrics)

    class AddsScore(Callback):
        train_metrics = ("score",)

        def on_log(self, state, record):
            record["metrics"]["score"] = -record["metrics"]["loss"]

    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    _, history = fit(
        new_state(opt),
        STEP,
        ArrayLoader({"x": X, "y": Y}, 4),
        num_steps=4,
        log_every=2,
        callbacks=[
            Look(),
            AddsScore(),
            pztrain.LearningRateMonitor(0.1),
            EarlyStopping("score", mode="max"),
            EarlyStopping("learning_rate"),
        ],
        progress=False,
        loggers=[],
    )
    assert seen == [("loss", "learning_rate", "score")]
    assert history.last("train")["metrics"]["score"] < 0
    refused(  # undeclared: not known before the run
        tmp_path,
        ValueError,
        "EarlyStopping monitors 'score', which no train record",
        callbacks=[EarlyStopping("score")],
    )


def test_a_monitor_of_a_host_function_is_checked_when_it_runs(tmp_path):
    with pytest.raises(KeyError, match="checked at its first evaluation"):
        fit(
            new_state(),
            STEP,
            ArrayLoader({"x": X, "y": Y}, 4),
            num_steps=4,
            evaluations=[Evaluation("norm", lambda s: {"w": s.params["w"][0]})],
            callbacks=[EarlyStopping("eval/norm/v")],
            progress=False,
            loggers=[],
        )


def test_nan_policy_skip_without_apply_if_finite(tmp_path):
    refused(
        tmp_path,
        ValueError,
        "NanPolicy('skip') needs the optimizer wrapped",
        callbacks=[NanPolicy("skip")],
    )


def test_a_loggers_check_and_a_callbacks_check_run_before_the_run_dir(tmp_path):
    class Picky:
        def check(self, info):
            raise ValueError(f"Picky: no run of {info.end_step} steps.")

        def log_hparams(self, hparams):
            pass

        def log_record(self, record):
            pass

        def close(self):
            pass

    refused(tmp_path, ValueError, "Picky: no run of 4 steps.", loggers=[Picky()])

    class Refuses(Callback):
        def check(self, state, info):
            raise ValueError("Refuses: no.")

    refused(tmp_path, ValueError, "Refuses: no.", callbacks=[Refuses()])


_SHAPE = ({"x": X[:4, :2], "y": Y[:4]}, TypeError, "dot_general")
_MISSING = ({"x": X[:4]}, TypeError, "'y'")
_TEXT = ({"x": X[:4], "y": np.array(["a"] * 4)}, TypeError, "batch['y'] of strings")


@pytest.mark.parametrize(
    ("batch", "error", "message", "kind"),
    [
        (*_SHAPE, "list"),
        (*_SHAPE, "loader"),
        (*_MISSING, "list"),
        (*_MISSING, "loader"),
        (*_TEXT, "list"),  # an ArrayLoader refuses text itself
    ],
    ids=["shape-list", "shape-loader", "key-list", "key-loader", "dtype-list"],
)
def test_a_bad_first_batch_is_refused_before_the_run_dir(
    tmp_path, batch, error, message, kind
):
    data = [batch] * 2 if kind == "list" else ArrayLoader(batch, 2, shuffle=False)
    err = refused(tmp_path, error, message, train_data=data)
    notes = "".join(getattr(err, "__notes__", []))
    if "strings" not in str(err):
        assert "pztrain: the step's inputs when train_step(state, ...) raised" in notes
        assert "x: float32[" in notes


def test_a_bad_first_eval_batch_is_refused_before_the_run_dir(tmp_path):
    err = refused(
        tmp_path,
        TypeError,
        "dot_general",
        evaluations=[Evaluation("test", EVAL, [{"x": X[:4, :2], "y": Y[:4]}])],
    )
    notes = "".join(err.__notes__)
    assert "in Evaluation('test'), on its first batch" in notes
    assert "x: float32[4, 2]" in notes


def test_a_log_of_another_run_is_left_as_it_was(tmp_path):
    fit(
        new_state(),
        STEP,
        DATA * 4,
        num_steps=4,
        run_dir=tmp_path / "run",
        progress=False,
    )
    files = {p: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(ValueError, match=re.escape("'eval/los'")):
        fit(
            new_state(),
            STEP,
            DATA * 4,
            num_steps=8,
            eval_step=EVAL,
            eval_data=DATA,
            callbacks=[EarlyStopping("eval/los")],
            run_dir=tmp_path / "run",
            progress=False,
        )
    assert {p: p.read_bytes() for p in (tmp_path / "run").iterdir()} == files


def test_a_fresh_run_into_used_checkpoints_leaves_a_new_run_dir_unmade(tmp_path):
    ckpt = Checkpoints(tmp_path / "ckpt", every_steps=2)
    fit(new_state(), STEP, DATA * 4, num_steps=4, checkpoints=ckpt, progress=False)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(pztrain.CheckpointError, match="already holds checkpoints"):
        fit(
            new_state(),
            STEP,
            DATA * 4,
            num_steps=4,
            checkpoints=Checkpoints(tmp_path / "ckpt", every_steps=2),
            run_dir=tmp_path / "run",
            progress=False,
        )
    assert sorted(tmp_path.rglob("*")) == before and not (tmp_path / "run").exists()
