"""Loggers and history (issue 13): History.from_jsonl and plot, LivePlot, loggers
that add to the run_dir log, CSV and MLflow loggers, throughput in the records,
the Profile callback."""

from __future__ import annotations

import csv
import json
import re
import struct

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
import pytest
from test_loop import d2h_guard  # noqa: F401 - a fixture, used by name

from pztrain.data import ArrayLoader
from pztrain.loggers import (
    CSVLogger,
    JsonlLogger,
    MLflowLogger,
    WandbLogger,
    read_jsonl,
)
from pztrain.loop import fit
from pztrain.loop._hooks import Hooks, RecordLog
from pztrain.loop._reporting import Reporter
from pztrain.metrics import MetricSums
from pztrain.monitors import LivePlot, Profile
from pztrain.records import THROUGHPUT_KEYS, TIMING_KEYS, History
from pztrain.state import TrainState
from pztrain.step import build_eval_step, build_train_step

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

_rng = np.random.default_rng(0)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
OPT = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"loss": jnp.mean((x @ model["w"] - y) ** 2), "acc": jnp.float32(0.5)}


STEP = build_train_step(loss_fn)
EVAL = build_eval_step(eval_fn)
DATA = ArrayLoader({"x": X, "y": Y}, 4, seed=1)  # 4 steps per epoch
EVAL_DATA = ArrayLoader({"x": X, "y": Y}, 8, shuffle=False)


def new_state() -> TrainState:
    model = {"w": jnp.zeros(3, jnp.float32)}
    return TrainState.initial_state(model, OPT, jax.random.key(0))


def run(**kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("log_every", 2)
    return fit(new_state(), STEP, DATA, num_steps=8, **kwargs)


def _without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------- History


def test_history_from_jsonl_and_plot(tmp_path):
    _, history = run(eval_step=EVAL, eval_data=EVAL_DATA, run_dir=tmp_path)
    loaded = History.from_jsonl(tmp_path)
    assert loaded.records == history.to_dicts()
    fig = loaded.plot()  # one axes per metric, the learning rate on its own
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["acc", "learning_rate", "loss"]
    by_title = dict(zip(titles, fig.axes, strict=True))
    loss_lines = by_title["loss"].get_lines()
    assert [line.get_label() for line in loss_lines] == ["train", "eval"]
    assert list(loss_lines[1].get_xdata()) == [4, 8]
    assert list(loss_lines[1].get_ydata()) == history.series("loss", "eval")[1]
    assert [x.get_label() for x in by_title["acc"].get_lines()] == ["eval"]
    # Only what was asked.
    fig = loaded.plot(["loss"], split="eval")
    assert [ax.get_title() for ax in fig.axes] == ["loss"]
    assert [x.get_label() for x in fig.axes[0].get_lines()] == ["eval"]
    fig = loaded.plot(["eval/acc", "learning_rate"])
    assert [ax.get_title() for ax in fig.axes] == ["acc", "learning_rate"]
    with pytest.raises(ValueError, match=re.escape("no 'eval/learning_rate'")):
        loaded.plot(["eval/learning_rate"])
    with pytest.raises(ValueError, match=re.escape("split must be 'train', 'eval'")):
        loaded.plot(split="test")


# ------------------------------------------------------------------ LivePlot


@pytest.mark.usefixtures("d2h_guard")
def test_live_plot_draws_from_the_records_alone():
    live = LivePlot(names=["loss"])
    assert live.on_log.record_only  # log points still need not wait
    with jax.transfer_guard_device_to_host("disallow"):
        _, history = run(eval_step=EVAL, eval_data=EVAL_DATA, callbacks=[live])
    assert live.draws == len(history.records) == 4 + 2
    assert _without_timing(live.history.records) == _without_timing(history.records)
    (ax,) = live.figure.axes
    train, evals = ax.get_lines()
    assert list(train.get_xdata()) == [2, 4, 6, 8]
    assert list(evals.get_ydata()) == history.series("loss", "eval")[1]


@pytest.mark.slow  # a run with evaluations, drawn
def test_live_plot_draws_an_eval_metric_from_the_first_eval():
    live = LivePlot(names=["eval/acc", "loss"])
    _, history = run(
        eval_step=EVAL, eval_data=EVAL_DATA, eval_every=4, callbacks=[live]
    )
    assert live.draws == len(history.records)  # train records before any eval too
    assert [ax.get_title() for ax in live.figure.axes] == ["acc", "loss"]
    acc, loss = live.figure.axes
    assert list(acc.get_lines()[0].get_xdata()) == [4, 8]
    assert [x.get_label() for x in loss.get_lines()] == ["train", "eval"]


def test_live_plot_in_a_notebook_updates_one_display(monkeypatch):
    import IPython
    import IPython.display

    shown = []

    class Handle:
        def update(self, fig):
            shown.append(("update", fig))

    def display(fig, display_id=False):
        shown.append(("display", fig))
        return Handle()

    class Kernel:
        kernel = object()

    monkeypatch.setattr(IPython, "get_ipython", lambda: Kernel())
    monkeypatch.setattr(IPython.display, "display", display)
    live = LivePlot()
    _, history = run(callbacks=[live])
    assert [kind for kind, _ in shown] == ["display"] + ["update"] * 4
    assert all(fig is live.figure for _, fig in shown)
    assert plt.get_fignums() == []  # not a pyplot figure: shown once, not twice
    assert [ax.get_title() for ax in live.figure.axes] == ["learning_rate", "loss"]


# ------------------------------------------------------------------- loggers


def test_loggers_add_to_the_run_dir_log(tmp_path):
    csv_log = CSVLogger(tmp_path / "csv")
    _, history = run(run_dir=tmp_path / "run", loggers=[csv_log])
    assert read_jsonl(tmp_path / "run") == history.to_dicts()
    assert len(_csv_rows(tmp_path / "csv")) == 4
    # A JsonlLogger among them is the run's log (not written twice) ...
    _, history = run(run_dir=tmp_path / "own", loggers=[JsonlLogger(tmp_path / "own")])
    assert read_jsonl(tmp_path / "own") == history.to_dicts()
    # ... and loggers=[] turns the default log off.
    run(run_dir=tmp_path / "none", loggers=[])
    assert not (tmp_path / "none" / "metrics.jsonl").exists()


def _csv_rows(directory):
    with (directory / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_grows_its_columns(tmp_path):
    _, history = run(
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        loggers=[CSVLogger(tmp_path)],
        hparams={"opt": {"lr": 0.05}, "tag": None},
    )
    rows = _csv_rows(tmp_path)
    header = list(rows[0])
    assert header[:4] == ["step", "epoch", "split", "time"]
    assert header[4:9] == list(THROUGHPUT_KEYS)
    assert header[9:] == ["loss", "learning_rate", "acc"]  # acc came with eval
    assert len(rows) == len(history.records)
    for row, record in zip(rows, history.records, strict=True):
        assert (int(row["step"]), row["split"]) == (record["step"], record["split"])
        for name in ("learning_rate", "loss", "acc"):
            want = record["metrics"].get(name)
            assert row[name] == ("" if want is None else str(want))
    hparams = (tmp_path / "hparams.csv").read_text().splitlines()
    assert hparams == [
        "name,value",
        "steps_per_call,1",
        "log_every,2",
        "opt/lr,0.05",
        "tag,null",
    ]
    # A resumed run keeps the rows up to its step; another run is refused.
    CSVLogger(tmp_path, resume_step=4).close()
    assert [int(r["step"]) for r in _csv_rows(tmp_path)] == [2, 4, 4]
    with pytest.raises(ValueError, match="metrics.csv holds another run's log"):
        CSVLogger(tmp_path).start_run(0, resumed=False)


@pytest.mark.slow  # imports mlflow and writes a file store
def test_mlflow_logger_writes_a_run_mlflow_reads_back(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLflowLogger("digits", run_name="first", tracking_uri=uri)
    _, history = run(
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        loggers=[logger],
        hparams={"opt": {"lr": 0.05}},
    )
    client = MlflowClient(tracking_uri=uri)
    got = client.get_run(logger.run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "first"
    assert got.data.params == {
        "opt/lr": "0.05",
        "log_every": "2",
        "steps_per_call": "1",
    }
    for split, name in [("train", "loss"), ("eval", "loss"), ("eval", "acc")]:
        metric = client.get_metric_history(logger.run_id, f"{split}/{name}")
        steps, values = history.series(name, split)
        assert [m.step for m in metric] == steps
        assert [m.value for m in metric] == pytest.approx(values)
    rates = client.get_metric_history(logger.run_id, "time/steps_per_sec")
    assert [m.step for m in rates] == [2, 4, 6, 8]


# ---------------------------------------------------------------- throughput


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_records_carry_throughput_from_the_loop_clock(steps_per_call):
    ticks = iter([10.0, 12.0, 13.0, 14.0])
    history = History()
    state = new_state()
    reporter = Reporter(Hooks([RecordLog(history, [])]), lambda: next(ticks), state)
    batch = {"x": np.zeros((steps_per_call, 8, 3)[2 - steps_per_call :])}
    reporter.note_batch(batch, steps_per_call)
    sums = jax.jit(MetricSums.add)(MetricSums.zeros(["loss"]), 2.0, {}, 0)
    reporter.log(state, sums, step=4, epoch=0)  # 4 steps in 2 s
    reporter.log(state, sums, step=6, epoch=0)  # 2 steps in 1 s
    reporter.evaluation(state, {"loss": 1.0}, step=6, epoch=0)
    train = [r for r in history.records if r["split"] == "train"]
    assert [r["steps_per_sec"] for r in train] == [2.0, 2.0]
    assert [r["examples_per_sec"] for r in train] == [16.0, 16.0]
    assert [r["time"] for r in history.records] == [2.0, 3.0, 4.0]
    assert "steps_per_sec" not in history.records[-1]  # an eval record


def test_fit_records_throughput_with_the_batch_size():
    _, history = run()
    for r in history.records:
        assert r["steps_per_sec"] > 0
        assert r["examples_per_sec"] == pytest.approx(4 * r["steps_per_sec"], 1e-3)


# ------------------------------------------------------------------- Profile


def test_profile_traces_the_steps_asked_for(tmp_path):
    profile = Profile(start_step=2, num_steps=4, log_dir=tmp_path)
    _, history = run(callbacks=[profile], log_every=8)
    assert profile.traced == (2, 6)
    assert [r["step"] for r in history.records] == [8]  # the log points as asked
    traces = list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    with pytest.raises(ValueError, match=re.escape("num_steps >= 1; got")):
        Profile(0, 0, tmp_path)


@pytest.mark.slow  # imports wandb and writes an offline run
def test_wandb_logger_offline_writes_a_run_file(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger("digits", name="first", dir=tmp_path, mode="offline")
    _, history = run(
        eval_step=EVAL,
        eval_data=EVAL_DATA,
        loggers=[logger],
        hparams={"opt": {"lr": 0.05}},
    )
    import wandb

    wandb.teardown()  # W&B's service process writes the file: let it finish
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    logged: dict[str, list[tuple[int, float]]] = {}
    config = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): i.value_json
                for i in record.history.item
            }
            step = int(items.pop("_step"))
            for key, value in items.items():
                if not key.startswith("_"):
                    logged.setdefault(key, []).append((step, json.loads(value)))
        elif kind == "config":
            config.update(
                {i.key: json.loads(i.value_json) for i in record.config.update}
            )
    assert config["opt"] == {"lr": 0.05} and config["log_every"] == 2
    for split, name in [("train", "loss"), ("eval", "loss"), ("eval", "acc")]:
        steps, values = history.series(name, split)
        got = logged[f"{split}/{name}"]
        assert [s for s, _ in got] == steps
        assert [v for _, v in got] == pytest.approx(values)
    assert [s for s, _ in logged["time/steps_per_sec"]] == [2, 4, 6, 8]


def _wandb_records(path):
    """The protobuf records of a W&B run file: LevelDB's log format (32 KiB
    blocks of chunks: crc u32, length u16, type u8) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def test_named_panels_bring_the_ema_and_the_per_parameter_norms():
    """Notebook 07's figure: plot(["loss", "accuracy", "grad_norm"]) shows the
    EMA's lines and a line per parameter's grad norm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = []
    for s in (1, 2):
        records.append(
            {
                "step": s,
                "split": "train",
                "metrics": {
                    "loss": 1.0 / s,
                    "grad_norm": 2.0,
                    "grad_norm/w": 1.0,
                    "grad_norm/b": 0.5,
                },
            }
        )
        records.append(
            {
                "step": s,
                "split": "eval",
                "metrics": {
                    "loss": 1.5 / s,
                    "ema/loss": 1.2 / s,
                    "accuracy": 0.5,
                    "ema/accuracy": 0.6,
                },
            }
        )
    fig = History(records).plot(["loss", "accuracy", "grad_norm"])
    panels = {
        ax.get_title(): [line.get_label() for line in ax.lines] for ax in fig.axes
    }
    assert panels == {
        "loss": ["train", "eval", "eval EMA"],
        "accuracy": ["eval", "eval EMA"],
        "grad_norm": ["train"],
        "grad_norm per param": ["b", "w"],
    }
    plt.close(fig)


def test_plot_keeps_one_colour_per_series_and_legends_off_the_data():
    """``eval test`` is the third series on the loss panel and the second on the
    accuracy panel (val logs no accuracy): one colour on both; a population's
    members, drawn before the mean, do not move the mean's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = []
    for step in (1, 2):
        records += [
            {"step": step, "split": "train", "metrics": {"loss": 1.0, "acc": 0.5}},
            {
                "step": step,
                "split": "eval",
                "metrics": {"val/loss": 1.1, "test/loss": 1.2, "test/acc": 0.4},
            },
        ]
    fig = History(records).plot(["loss", "acc"])
    colours = [{ln.get_label(): ln.get_color() for ln in ax.lines} for ax in fig.axes]
    assert set(colours[1]) == {"train", "eval test"}
    for label, colour in colours[1].items():
        assert colours[0][label] == colour, label
    assert len(set(colours[0].values())) == 3
    for ax in fig.axes:
        legend_box = ax.get_legend().get_window_extent()
        assert legend_box.x0 >= ax.get_window_extent().x1  # right of the data
    plt.close(fig)

    members = {f"loss/member_{i}": 1.0 + i for i in range(3)}
    pop = History(
        [
            {
                "step": s,
                "split": "train",
                "metrics": {"loss": 2.0, **members, "lr": 0.1},
            }
            for s in (1, 2)
        ]
    )
    fig = pop.plot(["loss", "lr"])
    loss, lr = ({ln.get_label(): ln.get_color() for ln in ax.lines} for ax in fig.axes)
    assert loss["train"] == lr["train"] == loss["train members"]
    plt.close(fig)
