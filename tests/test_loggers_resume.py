"""Loggers resume (issue 32): every built-in logger given to `fit` goes on with
a resumed run's log where it stopped, and with ``fit(state, ...)`` continuing a
returned state; file loggers take a directory or a file name, and refuse a path
of another kind before anything is written."""

from __future__ import annotations

import csv
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_callbacks_loggers import _read_events

import pztrain
from pztrain import ArrayLoader, Callback, Checkpoints, fit
from pztrain.loggers import CSVLogger, JsonlLogger, TensorBoardLogger, read_jsonl
from pztrain.records import TIMING_KEYS

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    noise = 0.01 * jax.random.normal(rng, y.shape)
    loss = jnp.mean((x @ model["w"] + model["b"] + noise - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"mse": jnp.mean((x @ model["w"] + model["b"] - y) ** 2)}


STEP = pztrain.build_train_step(loss_fn)
EVAL = pztrain.build_eval_step(eval_fn)
EVAL_DATA = [{"x": X[:16], "y": Y[:16]}]


def new_state():
    model = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return pztrain.TrainState.initial_state(model, optax.adam(0.05), jax.random.key(0))


def run(state=None, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("num_steps", 16)
    kw.setdefault("log_every", 2)
    kw.setdefault("eval_every", 4)
    return fit(
        new_state() if state is None else state,
        STEP,
        ArrayLoader({"x": X, "y": Y}, 4, seed=1),  # 8 steps per epoch
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        **kw,
    )


class InterruptAt(Callback):
    """Ctrl-C as an exception from a callback at the log point of ``step``."""

    def __init__(self, step):
        self.step = step

    def on_log(self, state, record):
        if record["step"] == self.step:
            raise KeyboardInterrupt


def csv_rows(path):
    """The rows of a CSV log without the columns that depend on the clock."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def without_time(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ------------------------------------------------------------------ resume


def test_an_interrupted_run_resumes_its_csv_log_where_it_stopped(tmp_path):
    run(loggers=[CSVLogger(tmp_path / "whole")], run_dir=tmp_path / "whole")
    whole = csv_rows(tmp_path / "whole" / "metrics.csv")
    assert [(r["step"], r["split"]) for r in whole][:4] == [
        ("2", "train"),
        ("4", "train"),
        ("4", "eval"),
        ("6", "train"),
    ]
    assert len(whole) == 8 + 4

    def interrupted_then_resumed(interrupt_at):
        # A new process would build the same loggers again: so does each fit.
        opts = dict(
            checkpoints=Checkpoints(tmp_path / "ckpt", every_steps=8),
            run_dir=tmp_path / "run",
        )
        with pytest.raises(KeyboardInterrupt):
            run(
                loggers=[CSVLogger(tmp_path / "run")],
                callbacks=[InterruptAt(interrupt_at)],
                **opts,
            )
        stopped = csv_rows(tmp_path / "run" / "metrics.csv")
        # The record of the point where the callback raised reaches the loggers
        # too (past the checkpoint: the resumed run redoes it).
        assert stopped[-1]["step"] == str(interrupt_at)
        state, _ = run(loggers=[CSVLogger(tmp_path / "run")], resume=True, **opts)
        return state

    state = interrupted_then_resumed(14)  # checkpoint at 8: rows 10-12 redone
    assert int(state.step) == 16
    assert csv_rows(tmp_path / "run" / "metrics.csv") == whole  # each step once
    assert without_time(read_jsonl(tmp_path / "run")) == without_time(
        read_jsonl(tmp_path / "whole")
    )
    assert (tmp_path / "run" / "hparams.csv").read_text() == (
        tmp_path / "whole" / "hparams.csv"
    ).read_text()


def test_fit_continues_a_returned_state_with_the_same_loggers(tmp_path):
    run(loggers=[CSVLogger(tmp_path / "whole")])
    loggers = [CSVLogger(tmp_path / "run"), JsonlLogger(tmp_path / "run")]
    state, _ = run(num_steps=8, loggers=loggers)
    state, _ = run(state, loggers=loggers)  # the same logger objects
    assert int(state.step) == 16
    whole = csv_rows(tmp_path / "whole" / "metrics.csv")
    assert csv_rows(tmp_path / "run" / "metrics.csv") == whole
    assert [r["step"] for r in read_jsonl(tmp_path / "run")] == [
        int(r["step"]) for r in whole
    ]
    # New loggers on the same files go on too (fit(state) from step 16) ...
    state, _ = run(state, num_steps=18, loggers=[CSVLogger(tmp_path / "run")])
    assert csv_rows(tmp_path / "run" / "metrics.csv")[-1]["step"] == "18"
    # ... but a fresh run from step 0 refuses the log, before anything is written.
    before = (tmp_path / "run" / "metrics.csv").read_bytes()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{tmp_path / 'run' / 'metrics.csv'} holds another run's log (14 rows, "
            "up to step 18). Continue that run (fit(..., resume=True) with its "
            "checkpoints), pass another path, or move the file away."
        ),
    ):
        run(loggers=[JsonlLogger(tmp_path / "other"), CSVLogger(tmp_path / "run")])
    assert (tmp_path / "run" / "metrics.csv").read_bytes() == before
    assert not (tmp_path / "other").exists()  # the logger before it wrote nothing


def _tensorboard_view(directory):
    """Scalars as TensorBoard shows them: event files in name order, a restart
    marker (``SessionLog.START`` at step s) dropping the events from step s on,
    and the newest value of a step kept."""
    from tensorboardX.proto.event_pb2 import SessionLog

    view: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for ev in _read_events(path):
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                for series in view.values():
                    for s in [s for s in series if s >= ev.step]:
                        del series[s]
            for v in ev.summary.value:
                if v.HasField("simple_value") and not v.tag.startswith("time/"):
                    view.setdefault(v.tag, {})[ev.step] = v.simple_value
    return view


def test_tensorboard_supersedes_the_steps_a_resumed_run_redoes(tmp_path):
    run(loggers=[TensorBoardLogger(tmp_path / "whole")])
    opts = dict(checkpoints=Checkpoints(tmp_path / "ckpt", every_steps=8))
    with pytest.raises(KeyboardInterrupt):
        run(
            loggers=[TensorBoardLogger(tmp_path / "run")],
            callbacks=[InterruptAt(14)],
            **opts,
        )
    run(loggers=[TensorBoardLogger(tmp_path / "run")], resume=True, **opts)
    first, second = sorted((tmp_path / "run").glob("events.out.tfevents.*"))
    restart = [e for e in _read_events(second) if e.HasField("session_log")]
    assert [e.step for e in restart] == [9]  # after the checkpoint's step
    assert max(e.step for e in _read_events(first)) == 14  # redone from 9 on
    whole = _tensorboard_view(tmp_path / "whole")
    assert set(whole) == {"train/loss", "eval/mse"}
    assert _tensorboard_view(tmp_path / "run") == whole


@pytest.mark.slow  # imports mlflow and writes a file store
def test_mlflow_continues_the_run_it_is_given(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    first = pztrain.loggers.MLflowLogger("resume", tracking_uri=uri)
    opts = dict(checkpoints=Checkpoints(tmp_path / "ckpt", every_steps=8))
    with pytest.raises(KeyboardInterrupt):
        run(loggers=[first], callbacks=[InterruptAt(14)], **opts)
    again = pztrain.loggers.MLflowLogger(tracking_uri=uri, run_id=first.run_id)
    run(loggers=[again], resume=True, **opts)
    client = MlflowClient(uri)
    steps = [m.step for m in client.get_metric_history(first.run_id, "train/loss")]
    # the interrupted run's 2-14, then the resumed run's 10-16: 10, 12, 14 twice
    assert sorted(steps) == [2, 4, 6, 8, 10, 10, 12, 12, 14, 14, 16]
    assert client.get_run(first.run_id).info.status == "FINISHED"
    with pytest.raises(
        ValueError, match=re.escape("MLflowLogger(run_id='nope'): no such run in")
    ):
        pztrain.loggers.MLflowLogger(tracking_uri=uri, run_id="nope")


# ------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    ("logger", "default", "hparams"),
    [
        (CSVLogger, "metrics.csv", "hparams.csv"),
        (JsonlLogger, "metrics.jsonl", "hparams.json"),
    ],
)
def test_a_file_logger_takes_a_directory_or_a_file_name(
    tmp_path, logger, default, hparams
):
    record = {"step": 1, "split": "train", "metrics": {"loss": 0.5}}
    suffix = default.rsplit(".", 1)[1]
    for given, file, beside in [
        (tmp_path / "a", tmp_path / "a" / default, tmp_path / "a" / hparams),
        (tmp_path / "b" / default, tmp_path / "b" / default, tmp_path / "b" / hparams),
        (
            tmp_path / "c" / f"train.{suffix}",
            tmp_path / "c" / f"train.{suffix}",
            tmp_path / "c" / f"train.{hparams}",
        ),
    ]:
        log = logger(str(given))
        assert (log.path, log.run_dir, log.hparams_path) == (file, file.parent, beside)
        log.log_hparams({"lr": 0.1})
        log.log_record(record)
        log.close()
        assert file.is_file() and beside.is_file()
    assert not (tmp_path / "b" / default).is_dir()  # no directory named so


def test_paths_of_another_kind_are_refused_before_anything_is_written(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "old" / "metrics.csv").mkdir(parents=True)
    cases = [
        (
            lambda: CSVLogger(tmp_path / "run" / "metrics.jsonl"),
            f"CSVLogger('{tmp_path}/run/metrics.jsonl'): 'metrics.jsonl' names a "
            ".jsonl file, but CSVLogger takes a directory (metrics.csv is written "
            "in it) or a file name ending in .csv.",
        ),
        (
            lambda: JsonlLogger(tmp_path / "run" / "metrics.csv"),
            f"JsonlLogger('{tmp_path}/run/metrics.csv'): 'metrics.csv' names a .csv "
            "file, but JsonlLogger takes a directory (metrics.jsonl is written in "
            "it) or a file name ending in .jsonl.",
        ),
        (
            lambda: TensorBoardLogger(tmp_path / "run" / "metrics.csv"),
            f"TensorBoardLogger('{tmp_path}/run/metrics.csv'): 'metrics.csv' names "
            "a .csv file, but TensorBoardLogger takes a directory.",
        ),
        (
            lambda: CSVLogger(tmp_path / "notes.txt"),
            f"CSVLogger('{tmp_path}/notes.txt'): {tmp_path}/notes.txt is a file, "
            "not a directory; CSVLogger takes a directory (metrics.csv is written "
            "in it) or a file name ending in .csv.",
        ),
        (
            lambda: TensorBoardLogger(tmp_path / "notes.txt"),
            f"TensorBoardLogger('{tmp_path}/notes.txt'): {tmp_path}/notes.txt is a "
            "file, not a directory; TensorBoardLogger takes a directory.",
        ),
        (
            lambda: CSVLogger(tmp_path / "old" / "metrics.csv"),
            f"CSVLogger('{tmp_path}/old/metrics.csv'): {tmp_path}/old/metrics.csv "
            "is a directory, not a .csv file. Remove or rename it, or pass another "
            "path.",
        ),
        (
            lambda: JsonlLogger(tmp_path / "old"),
            None,  # a directory: fine
        ),
    ]
    for make, message in cases:
        if message is None:
            make().close()
            continue
        with pytest.raises(ValueError, match=re.escape(message)):
            make()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "old"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_file_that_is_not_such_a_log_is_refused_by_fit(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "data.jsonl").write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{tmp_path / 'data.csv'} is not a log that CSVLogger writes (its header "
            "['a', 'b'] has no 'step' column). Pass another path, or move the file "
            "away."
        ),
    ):
        run(loggers=[CSVLogger(tmp_path / "data.csv")])
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{tmp_path / 'data.jsonl'} is not a log that JsonlLogger writes (line 2 "
            "is no record with an integer 'step')."
        ),
    ):
        run(loggers=[JsonlLogger(tmp_path / "data.jsonl")])
    assert (tmp_path / "data.csv").read_text() == "a,b\n1,2\n"
    assert (tmp_path / "data.jsonl").read_text() == '{"step": 1}\n[1, 2]\n'


def test_a_log_is_checked_when_the_run_starts_not_when_the_logger_is_made(tmp_path):
    log = CSVLogger(tmp_path)
    log.log_record({"step": 2, "split": "train", "metrics": {"loss": 1.0}})
    log.close()
    later = CSVLogger(tmp_path)  # a resumed run builds it before fit: not refused
    with pytest.raises(ValueError, match="metrics.csv holds another run's log"):
        later.start_run(0, resumed=False)  # a fresh run: refused
    later.start_run(0, resumed=True)  # a run resumed from step 0: rows dropped
    later.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
    assert [(r["step"], r["loss"]) for r in csv_rows(tmp_path / "metrics.csv")] == [
        ("1", "0.5")
    ]
    jsonl = JsonlLogger(tmp_path)
    jsonl.log_record({"step": 2, "split": "train", "metrics": {"loss": 1.0}})
    jsonl.close()
    with pytest.raises(ValueError, match="metrics.jsonl holds another run's log"):
        JsonlLogger(tmp_path).log_record({"step": 1, "split": "train", "metrics": {}})
