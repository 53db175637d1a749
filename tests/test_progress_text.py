"""A progress bar readable where a widget cannot render.

A notebook executed without a browser (the docs build, ``nbconvert --execute``)
saves a tqdm widget as a reference to a renderer loaded from the web: offline,
an empty box. ``PZTRAIN_PROGRESS=text`` makes `ProgressBar` draw tqdm's text bar
on standard output, in a notebook too, written once in its final state, so the
saved output is one readable line.
"""

from __future__ import annotations

import re

import pytest
import tqdm.auto

from pztrain import ProgressBar
from pztrain.callbacks._bar import PROGRESS_ENV, tqdm_bar
from pztrain.records import LoopInfo

INFO = LoopInfo(
    start_step=0,
    end_step=40,
    steps_per_epoch=None,
    steps_per_call=1,
    log_every=10,
    evaluates=False,
    run_dir=None,
)


class Widget:
    """What ``tqdm.auto.tqdm`` is in a notebook: a widget (recorded here)."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        Widget.made.append(kwargs)


@pytest.fixture
def in_a_notebook(monkeypatch):
    Widget.made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", Widget)


def _run_bar(times) -> ProgressBar:
    bar = ProgressBar()
    bar.on_train_start(None, INFO)
    step = 0
    for t in times:
        step = bar.on_advance(step, t=t) if step < 40 else step
    bar.on_advance(40, t=times[-1] + 1.0)
    bar.on_log(None, {"split": "train", "step": 40, "metrics": {"loss": 0.25}})
    bar.on_train_end(None, None)
    return bar


def test_text_bar_on_stdout_in_a_notebook(in_a_notebook, monkeypatch, capsys):
    monkeypatch.setenv(PROGRESS_ENV, "text")
    _run_bar([0.0, 0.5, 1.0, 1.5])
    assert Widget.made == []  # no widget
    out = capsys.readouterr().out  # one line: the bar's final state
    assert out.count("\n") == 1 and "\r" not in out, repr(out)
    assert re.search(r"^100%\|.*\| 40/40 \[", out), repr(out)
    assert "step/s" in out and "loss=0.25" in out, repr(out)
    assert "|██████████|" in out  # tqdm's blocks, its default width: not cut


@pytest.mark.parametrize("value", [None, "", "auto"])
def test_tqdm_chooses_without_the_variable(in_a_notebook, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_ENV, value)
    tqdm_bar(total=3, unit="step")
    assert Widget.made == [{"total": 3, "unit": "step"}]  # tqdm.auto's widget


def test_an_unknown_style_names_the_variable(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "widget")
    with pytest.raises(ValueError, match=r"PZTRAIN_PROGRESS='widget': expected one"):
        ProgressBar().on_train_start(None, INFO)
