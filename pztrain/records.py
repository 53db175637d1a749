"""The records of a run: `History`, `LoopInfo` and `Stop`.

Leaf types that the loop, the callbacks, the loggers and the checkpoints all
speak of; this module imports nothing else of pztrain.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["History", "LoopInfo", "Stop", "jsonable"]


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
    """What a run will do; given to ``Callback.on_train_start``.

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


@dataclasses.dataclass
class History:
    """The records a run logged, in order.

    Each record is a dict: ``step``, ``epoch``, ``split`` (``"train"`` or
    ``"eval"``), ``time`` (seconds since the start) and ``metrics``.

    Attributes:
      records: The records.
      stop_reason: Why the run ended early, or ``None``.
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

    def plot(self, names: Sequence[str] | None = None, ax: Any = None) -> Any:
        """Plots metrics against steps with matplotlib (optional extra).

        Args:
          names: Metrics to plot (default: every train and eval metric).
          ax: A matplotlib axes to draw on (default: a new figure).

        Returns:
          The axes.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "History.plot needs matplotlib: pip install 'pztrain[plot]'."
            ) from None
        if ax is None:
            _, ax = plt.subplots()
        for split in ("train", "eval"):
            for name in sorted(self.metric_names(split)):
                if names is None or name in names or f"{split}/{name}" in names:
                    steps, values = self.series(name, split)
                    ax.plot(steps, values, label=f"{split}/{name}")
        ax.set_xlabel("step")
        ax.legend()
        return ax


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: NumPy and JAX scalars as floats, tuples as
    lists, non-finite floats and other objects as strings.

    Example:
      >>> import numpy as np
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
