"""The records of a run: `History`, `LoopInfo` and `Stop`.

Leaf types that the loop, the callbacks, the loggers and the checkpoints all
speak of; this module imports nothing else of pztrain but the drawing of
`History.plot`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pztrain._plot import plot_history

__all__ = [
    "THROUGHPUT_KEYS",
    "TIMING_KEYS",
    "History",
    "LoopInfo",
    "Stop",
    "jsonable",
    "read_jsonl",
]


TIMING_KEYS = ("time", "steps_per_sec", "examples_per_sec", "flops_per_sec", "mfu")
"""The keys of a record that depend on the clock, not on the run's math: leave
them out to compare two runs' records."""

THROUGHPUT_KEYS = (
    "steps_per_sec",
    "examples_per_sec",
    "flops_per_step",
    "flops_per_sec",
    "mfu",
)
"""The keys of a train record's throughput: what loggers show as ``time/...``."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Returned by a hook to end training.

    Attributes:
      reason: Why; recorded in ``History.stop_reason``.
      state: A `pztrain.TrainState` to finish with (e.g. the best params), or
        ``None`` (`pztrain.fit` refuses anything else, naming the hook).

    Raises:
      TypeError: if ``reason`` is not a string (e.g. ``Stop(state)``).

    Example:
      >>> from pztrain import Stop
      >>> Stop("loss is low enough").reason
      'loss is low enough'
    """

    reason: str
    state: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str):
            raise TypeError(
                "Stop(reason, state=None) takes the reason as a string first; got "
                f"a {type(self.reason).__name__}. To finish with a state, pass "
                "Stop('why', state=state)."
            )


@dataclasses.dataclass(frozen=True)
class LoopInfo:
    """What a run will do; given to ``Callback.on_train_start``, and before
    the run to ``Callback.check`` (where a resumed run's ``start_step`` and
    ``end_step`` are still the given state's: its checkpoint is not read yet).

    Attributes:
      start_step: The step the run starts at (``state.step``).
      end_step: The step it will stop at unless stopped earlier (``None`` when
        the data decides).
      steps_per_epoch: Steps in an epoch, or ``None`` if the data does not say.
      steps_per_call: Steps fused in each call of the train step.
      log_every: Steps between log points.
      evaluates: Whether the run evaluates.
      run_dir: The run directory, or ``None``.
      hparams: The hyperparameters given to `fit`.
      callbacks: The callbacks given to `fit`, in order (e.g. for a callback
        that checkpoints the others' `pztrain.Callback.state_dict`).
      train_step: The train step given to `fit` (``None`` outside `fit`).
      train_data: The train data given to `fit` (``None`` outside `fit`).
      checkpoints: The `pztrain.Checkpoints` given to `fit`, or ``None``.
      evaluations: The names of the run's evaluations (`pztrain.Evaluation`;
        ``""``: the unnamed one of ``eval_step=``), in the order they run
        (empty with ``evaluates``: the unnamed one alone).
      eval_metrics: Evaluation name → the names its values take in an eval
        record (``"<name>/<metric>"``; the unnamed one's ``"<metric>"``),
        found before the run by tracing its eval step on its first batch
        (``jax.eval_shape``: nothing runs); ``None`` for an evaluation whose
        names are known only once it runs (a host function, data that can be
        read once, a step built with ``jit=False``).
      resume: Whether `fit` was asked to resume (``resume=True``).
      train_metrics: The names a train record's metrics may take, each with
        its entries (``"loss"`` covers ``"loss/min"``...): the train step's,
        found before the run by tracing it on its first batch, the learning
        rate the loop adds (an injected one), and those the callbacks declare
        (`pztrain.Callback.train_metrics`); ``None`` when the first batch
        cannot be read ahead (data read once).

    Example:
      A callback reads it at the start (here given one as `fit` would):

      >>> from pztrain import LoopInfo
      >>> class Plan:
      ...     def on_train_start(self, state, info):
      ...         print(f"steps {info.start_step}-{info.end_step}, "
      ...               f"{info.end_step // info.log_every} log points")
      ...
      >>> info = LoopInfo(start_step=0, end_step=1000, steps_per_epoch=100,
      ...                 steps_per_call=1, log_every=100, evaluates=False,
      ...                 run_dir=None)
      >>> Plan().on_train_start(None, info)
      steps 0-1000, 10 log points
    """

    start_step: int
    end_step: int | None
    steps_per_epoch: int | None
    steps_per_call: int
    log_every: int
    evaluates: bool
    run_dir: str | None
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: tuple[Any, ...] = ()
    train_step: Any = None
    train_data: Any = None
    checkpoints: Any = None
    evaluations: tuple[str, ...] = ()
    eval_metrics: dict[str, tuple[str, ...] | None] = dataclasses.field(
        default_factory=dict
    )
    resume: bool = False
    train_metrics: tuple[str, ...] | None = None

    @property
    def evaluation_names(self) -> tuple[str, ...]:
        """`evaluations`, or the unnamed one alone if the run evaluates and
        they are not given."""
        return self.evaluations or (("",) if self.evaluates else ())


@dataclasses.dataclass
class History:
    """The records a run logged, in order.

    Each record is a dict: ``step``, ``epoch``, ``split`` (``"train"`` or
    ``"eval"``), ``time`` (wall time in seconds since the run started, going on
    across a resume from a checkpoint)
    and ``metrics``. A train record also has ``steps_per_sec`` since the last
    log point, ``examples_per_sec`` when the batch size is known, and the
    step's FLOPs (``flops_per_step``, ``flops_per_sec``, and ``mfu`` when the
    devices' peak is known: see `pztrain.fit`'s ``peak_flops``); see
    `TIMING_KEYS` and `THROUGHPUT_KEYS`.

    Attributes:
      records: The records.
      stop_reason: Why the run ended early, or ``None``: a `Stop`'s reason,
        ``"interrupted"`` (SIGINT) or ``"preempted"`` (a preemption signal),
        or that the training data ran out.

    Example:
      >>> from pztrain import History
      >>> h = History([{"step": 10, "split": "train", "metrics": {"loss": 0.9}},
      ...              {"step": 20, "split": "train", "metrics": {"loss": 0.4}},
      ...              {"step": 20, "split": "eval", "metrics": {"loss": 0.5}}])
      >>> h.series("loss")
      ([10, 20], [0.9, 0.4])
      >>> h.last("eval")["metrics"], h.metric_names()
      ({'loss': 0.5}, {'loss'})
    """

    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stop_reason: str | None = None

    def to_dicts(self) -> list[dict[str, Any]]:
        """The records as plain dicts (copies)."""
        return [{**r, "metrics": dict(r["metrics"])} for r in self.records]

    def series(self, name: str, split: str = "train") -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one metric of one split."""
        pairs = [
            (r["step"], r["metrics"][name])
            for r in self.records
            if r["split"] == split and name in r["metrics"]
        ]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def metric_names(self, split: str | None = None) -> set[str]:
        """Names logged (for one split, or all)."""
        return {
            k
            for r in self.records
            if split is None or r["split"] == split
            for k in r["metrics"]
        }

    def last(self, split: str = "train") -> dict[str, Any] | None:
        """The last record of ``split``."""
        found = [r for r in self.records if r["split"] == split]
        return found[-1] if found else None

    @classmethod
    def from_jsonl(cls, run_dir: str | os.PathLike) -> History:
        """The history a run logged to ``run_dir/metrics.jsonl`` (see
        `pztrain.loggers.JsonlLogger`)."""
        return cls(records=read_jsonl(run_dir))

    def plot(
        self,
        names: Sequence[str] | None = None,
        split: str | None = None,
        *,
        fig: Any = None,
        member_labels: Sequence[str] | dict[int, str] | None = None,
    ) -> Any:
        """Plots metrics against steps with matplotlib (optional extra ``plot``).

        One axes per metric: a train metric and the eval metrics of the same name share
        one (the EMA's, ``"ema/<name>"``, and `pztrain.Evaluation` s'), the learning
        rate has its own, and the per-parameter grad norms (``"grad_norm/<param>"``)
        share one, a line per parameter. A metric named in ``names`` brings its EMA's
        line, and ``"grad_norm"`` the per-parameter panel, when they were logged. For a
        population (`pztrain.population`) a metric's panel has a thin line per member
        (``"loss/member_<i>"``) under its mean, drawn bold. Each series (train, an
        evaluation, an EMA) has one colour on every panel. With ``member_labels``
        each member has its own colour and a legend entry saying what sets it
        apart (its learning rate, its seed), its eval line dotted.

        Args:
          names: Metrics to plot: ``"loss"`` (train and eval) or
            ``"eval/loss"`` (one split); default: every metric logged.
          split: ``"train"`` or ``"eval"`` alone (default: both).
          fig: A matplotlib figure to clear and draw on (default: a new one).
          member_labels: A population's members' legend entries, one per member in
            member order (``[f"lr={r:g}" for r in rates]``) or ``{member: label}``;
            default: the members share one entry, ``"train members"``.

        Returns:
          The figure.

        Raises:
          ValueError: for a name that was not logged, an unknown split, or a
            plotted member that ``member_labels`` does not label.

        Example:
          >>> import matplotlib; matplotlib.use("Agg"); from pztrain import History
          >>> h = History([{"step": 1, "split": "train", "metrics": {"loss": 1.0}},
          ...              {"step": 1, "split": "eval", "metrics": {"loss": 2.0}}])
          >>> [ax.get_title() for ax in h.plot().axes]
          ['loss']
          >>> import matplotlib.pyplot as plt; plt.close("all")

          A population's history: one line per member, and the mean.

          >>> import matplotlib.pyplot as plt; from pztrain import History
          >>> pop = History([{"step": s, "split": "train", "metrics": {
          ...     "loss": 1.5 / s, "loss/member_0": 1.0 / s, "loss/member_1": 2.0 / s}}
          ...     for s in (1, 2)])
          >>> [line.get_label() for line in pop.plot().axes[0].lines]
          ['train members', '_nolegend_', 'train']
          >>> fig = pop.plot(member_labels=["lr=0.1", "lr=0.01"])
          >>> [line.get_label() for line in fig.axes[0].lines]
          ['lr=0.1', 'lr=0.01', 'train']
          >>> plt.close("all")
        """
        return plot_history(self, names, split, fig, member_labels)


def read_jsonl(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads the records a `pztrain.loggers.JsonlLogger` wrote.

    A last line cut short (a run killed while writing it) is not a record and
    is left out; any other line that is not JSON is an error.

    Example:
      >>> import pathlib, tempfile; from pztrain.loggers import read_jsonl
      >>> with tempfile.TemporaryDirectory() as d:
      ...     text = '{"step": 1}\\n{"step": 2}\\n{"st'  # killed mid-line
      ...     _ = pathlib.Path(d, "metrics.jsonl").write_text(text)
      ...     print(read_jsonl(d))
      [{'step': 1}, {'step': 2}]
    """
    path = Path(run_dir) / "metrics.jsonl"
    text = path.read_text()
    lines = text.split("\n")
    complete, last = lines[:-1], lines[-1]  # ``last`` lacks its newline
    records = [json.loads(line) for line in complete if line]
    with contextlib.suppress(ValueError):
        records += [json.loads(last)] if last else []
    return records


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: NumPy and JAX scalars as floats, tuples as
    lists, non-finite floats and other objects as strings.

    Example:
      >>> import numpy as np; from pztrain.records import jsonable
      >>> jsonable({"lr": np.float32(0.5), "pair": (1, 2), "x": float("nan")})
      {'lr': 0.5, 'pair': [1, 2], 'x': 'nan'}
    """
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return repr(value)
    return f if math.isfinite(f) else str(f)
