"""The `Logger` protocol, and `flat_hparams` (hyperparameters as flat names)."""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from pztrain.records import jsonable

__all__ = ["Logger", "flat_hparams"]


@runtime_checkable
class Logger(Protocol):
    """What `pztrain.fit` calls on each logger.

    A logger may also have ``start_run(step, *, resumed)``, which `pztrain.fit`
    calls first, with the step the run starts from and whether it resumes from
    a checkpoint a run that went on past it (its records after ``step`` are
    then redone: a log continues from ``step``, dropping or superseding them).
    Otherwise (a fresh run, or ``fit(state, ...)`` going on from
    ``state.step``) records after ``step`` are another run's. Every built-in
    logger has it: a resumed run's log goes on where it stopped.

    A logger may also have ``check(info)``, which `pztrain.fit` calls before
    the run directory, a log or a checkpoint is touched, with the run's
    `pztrain.LoopInfo` (as `pztrain.Callback.check` gets it): it refuses
    settings that do not fit the run, and writes nothing.

    A logger may also have ``log_media(step, media)``: text and images (name →
    `pztrain.loggers.Text` or `pztrain.loggers.Image`) that an evaluation
    returned; `pztrain.loggers.log_media` warns once about a logger without it.

    Example:
      >>> from pztrain.loggers import Logger
      >>> class PrintLogger:  # any object with the three methods: fit(loggers=[...])
      ...     def log_hparams(self, hparams): print("hparams", hparams)
      ...     def log_record(self, record): print(record["step"], record["metrics"])
      ...     def close(self): pass
      ...
      >>> isinstance(PrintLogger(), Logger)
      True
      >>> PrintLogger().log_record({"step": 10, "metrics": {"loss": 0.5}})
      10 {'loss': 0.5}
    """

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """Records the run's hyperparameters (called once, at the start)."""

    def log_record(self, record: dict[str, Any]) -> None:
        """Records one log or eval point."""

    def close(self) -> None:
        """Flushes and releases files (called once, at the end)."""


def flat_hparams(hparams: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Hyperparameters as one flat dict of numbers, strings and bools.

    Nested dicts become ``"outer/inner"`` keys; other values (lists, ``None``,
    objects) become their JSON text.

    Example:
      >>> from pztrain.loggers import flat_hparams
      >>> flat_hparams({"opt": {"lr": 0.1, "b": (0.9, 0.99)}, "seed": None})
      {'opt/lr': 0.1, 'opt/b': '[0.9, 0.99]', 'seed': 'null'}
    """
    flat: dict[str, Any] = {}
    for key, value in jsonable(hparams).items():
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{prefix}{key}/"))
        elif isinstance(value, bool | int | float | str):
            flat[prefix + key] = value
        else:
            flat[prefix + key] = json.dumps(value)
    return flat
