"""Optuna: prune unpromising trials from inside `pztrain.fit`.

`OptunaPruning` reports an eval metric to the trial at each evaluation and ends
the run through `pztrain.Stop` when Optuna's pruner says so; `fit` then raises
``optuna.TrialPruned``, which ``study.optimize`` records as a pruned trial.
To train a batch of trials as one population, see
`pztrain.integrations.optuna_population`. Optuna is an optional extra:
``pip install 'pztrain[optuna]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pztrain.callbacks import Callback
from pztrain.callbacks._monitored import check_eval_monitor, eval_value
from pztrain.records import Stop

if TYPE_CHECKING:
    from pztrain.records import History, LoopInfo
    from pztrain.state import TrainState

__all__ = ["OptunaPruning", "import_optuna"]


def import_optuna() -> Any:
    """The ``optuna`` module, or an `ImportError` naming the extra to install.

    Example:
      >>> from pztrain.integrations.optuna import import_optuna
      >>> optuna = import_optuna()
      >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
      >>> optuna.create_study(direction="maximize").direction.name
      'MAXIMIZE'
    """
    try:
        import optuna
    except ImportError:
        raise ImportError(
            "pztrain.integrations.optuna needs Optuna: pip install 'pztrain[optuna]' "
            "(or pip install optuna)."
        ) from None
    return optuna


def _eval_metric_name(monitor: Any) -> str:
    split, _, name = str(monitor).partition("/")
    if not isinstance(monitor, str) or split != "eval" or not name:
        raise ValueError(
            "OptunaPruning reports at each evaluation: monitor an eval metric as "
            f"'eval/<name>' (e.g. 'eval/loss'); got {monitor!r}. To prune on a "
            "train metric, evaluate on (part of) the training data."
        )
    return name


class OptunaPruning(Callback):
    """Reports ``monitor`` to an Optuna trial at each evaluation; prunes the run.

    At each evaluation it calls ``trial.report(value, step)``. When
    ``trial.should_prune()`` it returns `pztrain.Stop`: `fit` ends as after an
    early stop (the point's other hooks run, `pztrain.Checkpoints` saves and
    finishes, loggers close), and ``history.stop_reason`` says why. Then, after
    every callback's ``on_train_end``, it raises ``optuna.TrialPruned`` out of
    `fit`, so ``study.optimize`` marks the trial pruned with no code of yours
    (as Optuna's Keras callback does). With ``raise_pruned=False`` `fit` returns
    ``(state, history)`` normally and you call `check_pruned` afterwards (as
    with Optuna's Lightning callback). If `fit` fails for another reason, that
    error is raised, not ``TrialPruned``.

    Args:
      trial: The ``optuna.Trial`` given to your objective.
      monitor: The eval metric to report, ``"eval/<name>"``; the study's
        direction says whether lower or higher is better.
      raise_pruned: Raise ``optuna.TrialPruned`` from `fit` when pruned.

    Attributes:
      reported: Step → value reported to the trial by this callback.
      pruned_step: The step at which the trial was pruned, or ``None``.

    Raises:
      ImportError: if Optuna is not installed (naming the extra).
      ValueError: for a monitor that is not ``"eval/<name>"``, or (at the start
        of `fit`) a run that does not evaluate.
      KeyError: at an evaluation whose metrics lack the monitored one.

    Example:
      >>> import optuna; from pztrain.integrations.optuna import OptunaPruning
      >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
      >>> study = optuna.create_study(pruner=optuna.pruners.NopPruner())
      >>> trial = study.ask()
      >>> pruning = OptunaPruning(trial, "eval/loss")
      >>> pruning.on_eval_end(None, {"step": 10, "split": "eval",
      ...                            "metrics": {"loss": 0.5}}) is None
      True
      >>> pruning.reported, study.trials[0].intermediate_values
      ({10: 0.5}, {10: 0.5})
    """

    def __init__(
        self, trial: Any, monitor: str = "eval/loss", *, raise_pruned: bool = True
    ):
        self._optuna = import_optuna()
        if not (hasattr(trial, "report") and hasattr(trial, "should_prune")):
            raise TypeError(
                "trial must be the optuna.Trial given to your objective (with "
                f"report and should_prune); got {type(trial).__name__}."
            )
        self.trial, self.monitor = trial, monitor
        self._name = _eval_metric_name(monitor)
        self.raise_pruned = bool(raise_pruned)
        self.reported: dict[int, float] = {}
        self.pruned_step: int | None = None
        self._evaluations: tuple[str, ...] = ("",)  # fit's, from on_train_start
        self._reason = ""

    @property
    def pruned(self) -> bool:
        """Whether Optuna pruned the trial during `fit`."""
        return self.pruned_step is not None

    def check(self, state: TrainState, info: LoopInfo) -> None:
        """Refuses a run that does not record the monitored eval metric."""
        if not info.evaluates:
            raise ValueError(
                f"OptunaPruning monitors {self.monitor!r} but fit runs no "
                "evaluation: pass eval_step and eval_data (and eval_every to "
                "report more often than once per epoch)."
            )
        check_eval_monitor("OptunaPruning", self.monitor, info)

    def on_train_start(self, state: TrainState, info: LoopInfo) -> None:
        self._evaluations = info.evaluation_names

    def on_eval_end(self, state: TrainState, record: dict[str, Any]) -> Stop | None:
        found = eval_value(record, self.monitor, self._evaluations)
        if found is None:  # its evaluation did not run at this point
            return None
        step, value = int(record["step"]), float(found)
        if step in self.reported:  # Optuna keeps the first value of a step
            return None
        self.trial.report(value, step)
        self.reported[step] = value
        if not self.trial.should_prune():
            return None
        self.pruned_step = step
        self._reason = (
            f"Optuna pruned trial {getattr(self.trial, 'number', '?')} at step "
            f"{step} ({self.monitor} = {value:.6g})"
        )
        return Stop(self._reason)

    def on_train_end(self, state: TrainState, history: History) -> None:
        # stop_reason is set only when fit's loop ended without an error.
        if self.raise_pruned and history.stop_reason is not None:
            self.check_pruned()

    def check_pruned(self) -> None:
        """Raises ``optuna.TrialPruned`` if the trial was pruned during `fit`.

        Needed only with ``raise_pruned=False``: call it after `fit` returns.
        """
        if self.pruned:
            raise self._optuna.TrialPruned(self._reason)
