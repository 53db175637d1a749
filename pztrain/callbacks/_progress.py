"""`ProgressBar`: a tqdm bar paced by wall time, reading nothing from the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pztrain._plot import SPREAD
from pztrain.callbacks._bar import check_tqdm, fit_width, pace, restart_clock, tqdm_bar
from pztrain.callbacks._base import Callback, record_only

__all__ = ["ProgressBar"]


def _shown(metrics: dict[str, float], names: Any) -> dict[str, str]:
    """The postfix of a record's metrics (``names`` only, if given). A
    population's metric shows its mean and, in brackets, its members' range
    (the best is one end): ``0.31 [0.12, 0.55]``; per-member values are left
    out."""
    shown = {}
    for k, v in metrics.items():
        if SPREAD.search(k) or (names is not None and k not in names):
            continue
        low, high = metrics.get(f"{k}/min"), metrics.get(f"{k}/max")
        spread = "" if low is None or high is None else f" [{low:.3g}, {high:.3g}]"
        shown[k] = f"{v:.4g}{spread}"
    return shown


class ProgressBar(Callback):
    """A tqdm progress bar (notebook-aware via ``tqdm.auto``).

    It paces itself: it asks the loop to stop by about every ``seconds`` of wall time at
    the step rate it has seen (ten times per log interval at first), moves there, and
    shows the last train metrics (the loss, the learning rate when logged) with the last
    eval metrics; for a population, each metric's mean over the members and their
    range, ``loss=0.31 [0.12, 0.55]``. It reads nothing from the device. Its line
    stays within the terminal's width (written to a pipe or a file: ``COLUMNS``,
    else 80 characters), and its rate and ETA count from its first move, after the
    compile.

    In a notebook it is a widget. A notebook run without a browser (the docs
    build, ``jupyter nbconvert --execute``) saves a widget as a reference that
    renders only where its script loads from the web; set ``PZTRAIN_PROGRESS=text``
    in the environment (before the kernel starts) for tqdm's text bar on standard
    output instead: the saved output is its last line, readable anywhere.

    Args:
      metrics: Names to show (default: all train metrics).
      make_bar: A tqdm-like factory (for tests); default ``tqdm.auto.tqdm``.
      seconds: The wall time between moves, once the step rate is known.

    Example:
      >>> from pztrain import ProgressBar
      >>> class Bar:
      ...     def __init__(self, **kw): self.moves = []
      ...     def update(self, n): self.moves.append(n)
      ...
      >>> from pztrain.records import LoopInfo
      >>> pb = ProgressBar(make_bar=Bar)  # paced by the clock fit gives it
      >>> info = LoopInfo(start_step=0, end_step=None, steps_per_epoch=None,
      ...     steps_per_call=1, log_every=100, evaluates=False, run_dir=None)
      >>> pb.on_train_start(None, info)
      >>> pb.on_advance(0, t=0.0)  # at first: a tenth of a log interval
      10
      >>> pb.on_advance(10, t=0.001)  # fast: the interval at most doubles
      20
      >>> pb.bar.moves
      [10]
    """

    def __init__(
        self,
        metrics: tuple[str, ...] | None = None,
        make_bar: Callable[..., Any] | None = None,
        *,
        seconds: float = 0.2,
    ):
        self.metrics = metrics
        self.seconds = seconds
        self._make_bar = make_bar
        self.bar: Any = None
        self._k = 1
        self._every = 1
        self._last: tuple[int, float] | None = None
        self._timed = False  # the clock restarted after the first call
        self._train: dict[str, str] = {}  # the postfix: last train metrics
        self._eval: dict[str, str] = {}  # and last eval metrics

    def check(self, state, info):
        """Refuses a bad ``PZTRAIN_PROGRESS`` and a missing tqdm (for the
        default bar) before the run."""
        if self._make_bar is None:
            check_tqdm()

    def on_train_start(self, state, info):
        make_bar = self._make_bar or tqdm_bar
        self.bar = make_bar(
            total=info.end_step,
            initial=info.start_step,
            unit="step",
            dynamic_ncols=True,
        )
        fit_width(self.bar)
        self._k = info.steps_per_call
        self._every = max(self._k, info.log_every // 10 // self._k * self._k)
        self._last, self._train, self._eval, self._timed = None, {}, {}, False

    def on_advance(self, step: int, t: float) -> int:
        """Moves the bar to ``step``; returns the step of the next move."""
        if self._last is not None:
            last_step, last_t = self._last
            if step > last_step:
                # The first move has the compile behind it: the clock restarts.
                if self._timed or not restart_clock(self.bar, step):
                    self.bar.update(step - last_step)
                self._timed = True
                self._every = pace(
                    self._every, self._k, self.seconds, step - last_step, t - last_t
                )
        self._last = (step, t)
        return (step // self._every + 1) * self._every

    @record_only
    def on_log(self, state, record):
        self._train = _shown(record["metrics"], self.metrics)
        self.bar.set_postfix({**self._train, **self._eval}, refresh=False)

    def on_eval_end(self, state, record):
        shown = _shown(record["metrics"], None)
        # each evaluation's last values: named ones run on their own cadences
        self._eval.update({f"eval/{k}": v for k, v in shown.items()})
        self.bar.set_postfix({**self._train, **self._eval}, refresh=False)

    def on_train_end(self, state, history):
        if self.bar is not None:
            self.bar.close()
