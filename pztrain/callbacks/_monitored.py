"""Monitored names: which evaluation's records hold ``"eval/..."``.

A run's eval record at a point holds the values of the evaluations due there
(`pztrain.Evaluation`: ``"<name>/<metric>"``; the unnamed one's ``"<metric>"``),
so a monitor (`EarlyStopping`, ``Checkpoints(keep_best=...)``) reads its value
only from the records of the points where its evaluation ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["eval_owner", "eval_value"]


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
        "with 'eval/<name>/')."
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
