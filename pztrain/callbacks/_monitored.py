"""Monitored names: which evaluation's records hold ``"eval/..."``.

A run's eval record at a point holds the values of the evaluations due there
(`pztrain.Evaluation`: ``"<name>/<metric>"``; the unnamed one's ``"<metric>"``),
so a monitor (`EarlyStopping`, ``Checkpoints(keep_best=...)``) reads its value
only from the records of the points where its evaluation ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pztrain.records import LoopInfo

__all__ = [
    "check_eval_monitor",
    "check_monitor",
    "check_train_monitor",
    "eval_owner",
    "eval_value",
]


def eval_value(
    record: dict[str, Any], monitor: str, evaluations: Sequence[str] = ("",)
) -> float | None:
    """The value of ``monitor`` in an eval ``record`` (``"eval/<metric>"``
    of the unnamed evaluation, ``"eval/<name>/<metric>"`` of a named one), or
    ``None`` if the record is not of the eval split or its evaluation did not
    run at that point (named evaluations keep their own cadences).

    Args:
      record: A record, as hooks get it.
      monitor: The monitored name, ``"eval/..."``.
      evaluations: The run's evaluation names (`LoopInfo.evaluation_names`).

    Raises:
      ValueError: if ``monitor`` names no evaluation of ``evaluations``.
      KeyError: if its evaluation ran at that point without that metric.

    Example:
      >>> r = {"split": "eval", "metrics": {"val/loss": 0.5}}
      >>> eval_value(r, "eval/val/loss", ["val", "test"])
      0.5
      >>> print(eval_value(r, "eval/test/loss", ["val", "test"]))  # not run here
      None
    """
    owner = eval_owner(monitor, evaluations)
    if record["split"] != "eval":
        return None
    metric, metrics = monitor.partition("/")[2], record["metrics"]
    if metric in metrics:
        return metrics[metric]
    named = [f"{n}/" for n in evaluations if n]
    if owner:
        ran = [k for k in metrics if k.startswith(f"{owner}/")]
    else:
        ran = [k for k in metrics if not k.startswith(tuple(named))]
    if not ran:
        return None
    raise KeyError(
        f"Monitored metric {monitor!r} is not among the eval metrics "
        f"{sorted(ran)}; prefix eval metrics with 'eval/' (a named evaluation's "
        "with 'eval/<name>/'). (A monitor of an evaluation whose names are known "
        "only once it runs, a host function's, is checked at its first "
        "evaluation, not before the run.)"
    )


def eval_owner(monitor: str, evaluations: Sequence[str]) -> str | None:
    """The evaluation whose records hold ``monitor`` (``None``: not an eval
    metric).

    Raises:
      ValueError: if ``monitor`` is ``"eval/..."`` and names none of
        ``evaluations`` (and there is no unnamed one).
    """
    split, _, rest = monitor.partition("/")
    if split != "eval" or not rest:
        return None
    head, _, tail = rest.partition("/")
    if tail and head and head in evaluations:
        return head
    if "" in evaluations:
        return ""
    names = [n for n in evaluations if n]
    raise ValueError(
        f"The monitor {monitor!r} names no evaluation of this run: its "
        f"evaluations are {names}; monitor 'eval/<name>/<metric>' of one of "
        "them, or a train metric such as 'loss'."
    )


def check_eval_monitor(who: str, monitor: str, info: LoopInfo) -> None:
    """Refuses an eval ``monitor`` (``"eval/..."``) that no evaluation of the
    run records, before the run (`pztrain.Callback.check`): one naming no
    evaluation, or a metric its evaluation does not record (when the names
    are known: `pztrain.LoopInfo.eval_metrics`).

    Args:
      who: The callback, as the message names it (``"EarlyStopping"``).
      monitor: The monitored name, ``"eval/..."``.
      info: The run's `pztrain.LoopInfo`.

    Raises:
      ValueError: naming ``monitor`` and the eval metrics the run records.

    Example:
      >>> from pztrain import LoopInfo
      >>> info = LoopInfo(0, 10, None, 1, 5, True, None,
      ...                 evaluations=("val",), eval_metrics={"val": ("val/mse",)})
      >>> check_eval_monitor("EarlyStopping", "eval/val/mse", info)
      >>> check_eval_monitor("EarlyStopping", "eval/val/loss", info)
      Traceback (most recent call last):
      ...
      ValueError: EarlyStopping monitors 'eval/val/loss', which evaluation 'val' \
does not record: the run's eval metrics are ['eval/val/mse']. Monitor one of them.
    """
    try:
        owner = eval_owner(monitor, info.evaluation_names)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
    known = info.eval_metrics.get(owner) if owner is not None else None
    if known is None or monitor.partition("/")[2] in known:
        return  # the names of a host function's values are known when it runs
    which = f"evaluation {owner!r}" if owner else "the evaluation of eval_step="
    every = [f"eval/{n}" for names in info.eval_metrics.values() for n in names or ()]
    raise ValueError(
        f"{who} monitors {monitor!r}, which {which} does not record: the run's "
        f"eval metrics are {every}. Monitor one of them."
    )


def check_train_monitor(who: str, monitor: str, info: LoopInfo) -> None:
    """Refuses a train ``monitor`` that no train record of the run holds,
    before the run (`pztrain.Callback.check`), when the names are known
    (`pztrain.LoopInfo.train_metrics`: each covers its entries, ``"loss"``
    covers ``"loss/min"``).

    Args:
      who: The callback, as the message names it (``"EarlyStopping"``).
      monitor: The monitored name, a train metric (``"loss"``).
      info: The run's `pztrain.LoopInfo`.

    Raises:
      ValueError: naming ``monitor`` and the train metrics the run records.

    Example:
      >>> from pztrain import LoopInfo
      >>> info = LoopInfo(0, 10, None, 1, 5, False, None, train_metrics=("loss",))
      >>> check_train_monitor("EarlyStopping", "loss/min", info)
      >>> check_train_monitor("EarlyStopping", "los", info)
      Traceback (most recent call last):
      ...
      ValueError: EarlyStopping monitors 'los', which no train record of this \
run holds: its train metrics are ['loss']. Monitor one of them, or 'eval/<metric>' \
(a callback that adds a metric in on_log declares it: train_metrics = ('name',)).
    """
    known, parts = info.train_metrics, monitor.split("/")
    heads = ("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    if known is None or any(head in known for head in heads):
        return
    raise ValueError(
        f"{who} monitors {monitor!r}, which no train record of this run holds: "
        f"its train metrics are {list(known)}. Monitor one of them, or "
        "'eval/<metric>' (a callback that adds a metric in on_log declares it: "
        "train_metrics = ('name',))."
    )


def check_monitor(who: str, monitor: str, info: LoopInfo) -> None:
    """`check_eval_monitor` for ``"eval/..."``, else `check_train_monitor`."""
    if monitor.partition("/")[0] == "eval" and monitor.partition("/")[2]:
        return check_eval_monitor(who, monitor, info)
    return check_train_monitor(who, monitor, info)
