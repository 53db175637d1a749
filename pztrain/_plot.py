"""`pztrain.History.plot`'s drawing: a panel per metric, one colour per
series on every panel, a population's members as thin lines under their mean.

matplotlib is imported when a plot is drawn (the optional extra ``plot``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SPREAD", "plot_history"]


def plot_history(history: Any, names: Any, split: str | None, fig: Any) -> Any:
    """Draws ``history``'s metrics on ``fig`` (a new figure if ``None``): the
    work of `pztrain.History.plot`, whose docstring says what it draws."""
    plt = _pyplot()
    panels = _panels(history, names, split)
    fig = plt.figure() if fig is None else fig
    fig.clear()
    cols = min(len(panels), 3) or 1
    rows = -(-len(panels) // cols)
    fig.set_size_inches(4.5 * cols, 3.2 * rows)
    colours = _series_colours(panels)
    for i, (title, lines) in enumerate(panels.items()):
        _draw(history, fig.add_subplot(rows, cols, i + 1), title, lines, colours)
    fig.tight_layout()
    return fig


def _draw(history: Any, ax: Any, title: str, lines: list, colours: dict) -> None:
    """One panel: its lines, in their series' colours (a population's
    members thin, in their mean's), the legend right of the data."""
    means = {(s, n): label for s, n, label in lines if SPREAD.search(n) is None}
    for s, name, label in lines:
        member = SPREAD.search(name) is not None
        mean = means.get((s, SPREAD.sub("", name))) if member else label
        ax.plot(
            *history.series(name, s),
            label=label,
            color=colours.get(mean),
            marker="." if s == "eval" and not member else "",
            **(_MEMBER_LINE if member else {}),
        )
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _panels(history: Any, names, split) -> dict[str, list[tuple[str, str, str]]]:
    """Panel title → its lines: ``(split, metric name, label)``."""
    if split not in (None, "train", "eval"):
        raise ValueError(f"split must be 'train', 'eval' or None; got {split!r}.")
    splits = ("train", "eval") if split is None else (split,)
    logged = {s: history.metric_names(s) for s in splits}
    every = {SPREAD.sub("", n) for n in set().union(*logged.values())}
    tails = [n.partition("/")[2] for n in every]  # "val/loss" and "test/loss"
    shared = every | {t for t in tails if t and tails.count(t) > 1}
    wanted = sorted(every) if names is None else names
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    panels: dict[str, list[tuple[str, str, str]]] = {}
    evals = {SPREAD.sub("", n) for n in logged.get("eval", ())}
    for entry in _with_companions(wanted, every, evals):
        first, _, rest = entry.partition("/")
        only = first if rest and first in ("train", "eval") else None
        name = rest if only else entry
        found = [
            s
            for s in splits
            if (name in logged[s] or _members_of(name, logged[s])) and only in (None, s)
        ]
        if not found:
            raise ValueError(
                f"History.plot: no {entry!r} among the logged metrics "
                f"{ {s: sorted(n) for s, n in logged.items()} }; name a "
                "metric as 'loss' (every split) or 'eval/loss'."
            )
        title, label = _panel_of(name, shared)
        lines = panels.setdefault(title, [])
        for s in found:
            for i, member in enumerate(_members_of(name, logged[s])):
                tag = f"{s} members" if i == 0 else "_nolegend_"
                lines.append((s, member, tag))
            line = (s, name, label.format(split=s))
            if name in logged[s] and line not in lines:
                lines.append(line)
    return panels


# The entries a population's metric has beside its mean (its members' values,
# min and max, the count of diverged members: `pztrain._members.spread`); plots
# draw them as thin lines on the metric's own panel, and the progress bar
# leaves them out.
SPREAD = re.compile(r"/(member_\d+|min|max|diverged)$")
_MEMBER_LINE = {"linewidth": 0.8, "alpha": 0.45}


def _series_colours(panels: dict[str, list[tuple[str, str, str]]]) -> dict[str, str]:
    """A series' label (``"train"``, ``"eval val"``) -> its one colour on every
    panel, in the order the series first appear."""
    colours: dict[str, str] = {}
    for lines in panels.values():
        for _, name, label in lines:
            if SPREAD.search(name) is None and label not in colours:
                colours[label] = f"C{len(colours) % 10}"
    return colours


def _with_companions(
    wanted: list[str], logged: set[str], evals: set[str] = frozenset()
) -> list[str]:
    """``wanted`` with, after each metric, the lines drawn with it: its EMA's
    (``"ema/<name>"``), each named evaluation's (``"<evaluation>/<name>"``
    among the ``evals`` names, in their place if ``<name>`` itself is not
    logged) and, after ``"grad_norm"``, every parameter's
    (``"grad_norm/<param>"``)."""
    out: list[str] = []
    for entry in wanted:
        first, _, rest = entry.partition("/")
        prefix, name = (
            (f"{first}/", rest) if first in ("train", "eval") else ("", entry)
        )
        named = sorted(
            n for n in evals if n.partition("/")[2] == name and n != f"ema/{name}"
        ) if prefix != "train/" else []  # fmt: skip
        more = [f"ema/{name}"] if f"ema/{name}" in logged else []
        if name == "grad_norm":
            more += sorted(n for n in logged if n.startswith("grad_norm/"))
        first_items = [entry] if name in logged or not named else []
        for item in [*first_items, *(prefix + m for m in more + named)]:
            if item not in out:
                out.append(item)
    return out


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "History.plot needs matplotlib: pip install 'pztrain[plot]'."
        ) from None
    return plt


def _members_of(name: str, logged: Any) -> list[str]:
    """The logged per-member entries of ``name``, in member order."""
    found = [n for n in logged if n.startswith(f"{name}/member_")]
    return sorted(found, key=lambda n: int(n.rpartition("_")[2]))


def _panel_of(name: str, logged: set[str] = frozenset()) -> tuple[str, str]:
    """The panel a metric is drawn on, and its line's label (``{split}``). A
    named evaluation's ``"<evaluation>/<metric>"`` goes on ``<metric>``'s panel
    when ``<metric>`` is logged too (``logged``: every name)."""
    if name.startswith("grad_norm/"):
        return "grad_norm per param", name.removeprefix("grad_norm/")
    if name.startswith("ema/"):
        return name.removeprefix("ema/"), "{split} EMA"
    head, _, tail = name.partition("/")
    if tail and (tail in logged or tail.removeprefix("ema/") in logged):
        title, label = _panel_of(tail)
        return title, label.replace("{split}", "{split} " + head)
    return name, "{split}"
