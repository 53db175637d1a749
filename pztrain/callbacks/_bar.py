"""What pztrain asks of a tqdm progress bar beyond tqdm's own arguments.

* A width: tqdm trims a bar's line to the terminal when it can read the
  terminal's size; writing to a pipe or a log file it cannot, and a line with a
  few metrics runs to 200 characters. `fit_width` gives such a bar the width
  ``shutil.get_terminal_size`` reports (``COLUMNS``, else 80).
* A clock that starts after the compile: `restart_clock` makes the rate and ETA
  count from now on, the steps so far aside, and draws the bar once, so a log
  file holds no line that times the compile.
* Its pace: `pace`, the steps between two moves of the bar.
* tqdm itself, an optional dependency: `tqdm_bar` names the extra to install.
* Text where a widget would not render: a notebook run with no browser (the
  docs build, ``jupyter nbconvert --execute``) saves a widget's output as a
  reference to a renderer loaded from the web, an empty box offline. With
  ``PZTRAIN_PROGRESS=text`` in the environment the bar is tqdm's text bar on
  standard output, in a notebook too, written once, in its final state, when it
  closes (`LastLine`): a saved output holds one line, not one per move (another
  output in between, a live plot's, keeps a notebook from folding the moves),
  and the whole line, all its metrics, not cut to a terminal's width.

A notebook's bar (a widget) sizes itself; a bar without tqdm's attributes (a
test's fake) is left alone.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

__all__ = [
    "PROGRESS_ENV",
    "LastLine",
    "check_tqdm",
    "fit_width",
    "pace",
    "restart_clock",
    "tqdm_bar",
]

PROGRESS_ENV = "PZTRAIN_PROGRESS"
_STYLES = ("auto", "text")


def check_tqdm() -> tuple[str, tuple[Any, Any]]:
    """The bar's style (``PZTRAIN_PROGRESS``) and tqdm's two bar classes
    (auto, text).

    Raises:
      ValueError: for another style than ``auto`` or ``text``.
      ImportError: without tqdm, naming the extra to install.
    """
    style = os.environ.get(PROGRESS_ENV, "") or "auto"
    if style not in _STYLES:
        raise ValueError(
            f"{PROGRESS_ENV}={style!r}: expected one of {_STYLES} ('text': a text "
            "progress bar on standard output, also in a notebook; 'auto': tqdm's "
            "choice, a widget in a notebook)."
        )
    try:
        from tqdm.auto import tqdm
        from tqdm.std import tqdm as text_tqdm
    except ImportError:
        raise ImportError(
            "The progress bar needs tqdm: pip install 'pztrain[progress]' "
            "(or pass progress=False to fit)."
        ) from None
    return style, (tqdm, text_tqdm)


def tqdm_bar(**kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(**kwargs)`` (a notebook's widget or a text bar), or
    tqdm's text bar on standard output with ``PZTRAIN_PROGRESS=text``."""
    style, (tqdm, text_tqdm) = check_tqdm()
    if style == "text":  # a saved line, read later: whole, not cut to a width
        kwargs["dynamic_ncols"] = False
        return text_tqdm(file=LastLine(sys.stdout), **kwargs)
    return tqdm(**kwargs)


class LastLine:
    """A text stream that writes each line's last state (after its last ``\\r``)
    once the line ends: a text bar's moves are not written, its final state is.

    Example:
      >>> import io
      >>> out = io.StringIO()
      >>> line = LastLine(out)
      >>> line.write("\\r 10%| 1/10"); line.write("\\r100%| 10/10"); out.getvalue()
      ''
      >>> line.write("\\n"); out.getvalue()
      '100%| 10/10\\n'
    """

    encoding = "utf-8"  # tqdm draws the bar with blocks, not "#"

    def __init__(self, out: Any):
        self.out = out
        self._pending = ""

    def write(self, text: str) -> None:
        self._pending += text
        while "\n" in self._pending:
            line, _, self._pending = self._pending.partition("\n")
            self.out.write(line.rpartition("\r")[2].strip() + "\n")

    def flush(self) -> None:
        self.out.flush()


def fit_width(bar: Any) -> None:
    """Gives a text bar that cannot read its terminal's width a fixed one."""
    dynamic = getattr(bar, "dynamic_ncols", None)
    if hasattr(bar, "container") or not callable(dynamic):  # a widget, a fake
        return
    if dynamic(bar.fp)[0] is None:  # not a terminal: tqdm would not trim
        bar.dynamic_ncols = False
        bar.ncols = shutil.get_terminal_size().columns - 1  # as tqdm's own


def restart_clock(bar: Any, step: int) -> bool:
    """Moves the bar to ``step`` with its rate and ETA counting from now (the
    first steps, which included the compile, do not count), drawn once: a log
    file gets no line that times the compile. ``False`` for a bar without
    tqdm's ``reset`` (moved by the caller)."""
    if not callable(getattr(bar, "reset", None)):
        return False
    bar.display = _no_display  # reset draws the bar at 0: not again
    try:
        bar.reset(total=bar.total)
    finally:
        del bar.display  # tqdm's own again
    bar.initial = bar.n = bar.last_print_n = step
    bar.refresh()
    return True


def _no_display(*args: Any, **kwargs: Any) -> None:
    """A bar's ``display`` that draws nothing."""


def pace(every: int, k: int, target: float, steps: int, seconds: float) -> int:
    """Steps between moves: about ``target`` seconds at the rate just seen
    (``steps`` in ``seconds``), from ``every`` steps so far.

    Each move ends the loop's run of calls, which costs a few µs: every 10
    steps that is several % of a 30 µs step; every 0.2 s it is nothing. The
    interval changes by at most 2x per move (the first one includes the
    compile), and stays a multiple of ``k`` (the steps per call).

    Example:
      >>> pace(10, 1, 0.2, steps=10, seconds=0.001)  # fast: at most doubles
      20
      >>> pace(64, 4, 0.2, steps=64, seconds=1.0)  # slow: at most halves
      32
    """
    if seconds <= 0:
        return every
    want = min(max(steps / seconds * target, every / 2), every * 2)
    return max(k, int(want) // k * k)
