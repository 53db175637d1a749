"""Which checkpoints to keep: a pure function of the saved steps and metrics."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

__all__ = ["Retention"]

Saved = Mapping[int, Mapping[str, float] | None]
"""The checkpoints on disk: step → the metrics stored with it (or ``None``)."""


@dataclasses.dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep_last`` checkpoints and the best ``keep_best``.

    The newest checkpoint is always kept (``keep_last >= 1``), so ranking never
    deletes what a resume needs. A checkpoint ranks by ``metrics[monitor]``;
    one without that metric, or with a value that is not finite, does not rank.
    Ties go to the newer step.

    Attributes:
      keep_last: How many of the newest checkpoints to keep (at least 1).
      keep_best: How many of the best to keep (0: none ranked).
      monitor: The metric that ranks them.
      mode: ``"min"`` or ``"max"``: whether smaller or larger is better.

    Example:
      >>> policy = Retention(keep_last=1, keep_best=1, monitor="loss")
      >>> policy.keep({10: {"loss": 0.5}, 20: {"loss": 0.2}, 30: {"loss": 0.9}})
      [20, 30]
      >>> policy.delete({10: {"loss": 0.5}, 20: {"loss": 0.2}, 30: None})
      [10]
    """

    keep_last: int = 2
    keep_best: int = 0
    monitor: str = "eval/loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {self.mode!r}.")
        for name, least in (("keep_last", 1), ("keep_best", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}; got {value!r}.")

    def best(self, saved: Saved) -> list[int]:
        """The ranked steps, best first (all of them, not only those kept)."""
        ranked = []
        for step, metrics in saved.items():
            value = None if metrics is None else metrics.get(self.monitor)
            if isinstance(value, int | float) and math.isfinite(value):
                ranked.append((value if self.mode == "min" else -value, -step))
        return [-negative for _, negative in sorted(ranked)]

    def keep(self, saved: Saved) -> list[int]:
        """The steps to keep, in order."""
        newest = sorted(saved)[-self.keep_last :]
        return sorted({*newest, *self.best(saved)[: self.keep_best]})

    def delete(self, saved: Saved) -> list[int]:
        """The steps to delete, in order."""
        return sorted(set(saved) - set(self.keep(saved)))
