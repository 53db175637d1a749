"""Optuna trials trained as one population: a batch of trials, one program.

`pztrain.population` trains ``K`` runs of one model as one jitted program, with
injected hyperparameters (``optax.inject_hyperparams``) one value per member.
Here each member runs one Optuna trial, through Optuna's ask-and-tell
interface:

- `ask_population` asks the study for one trial per member and collects the
  suggested hyperparameters, one value per member, for
  `pztrain.make_population`;
- `PopulationPruning`, a callback, reports member ``i``'s eval metric
  (``"eval/loss/member_<i>"``) to trial ``i`` at each evaluation, tells the
  trials that the pruner prunes, and stops `pztrain.fit` once all are pruned;
- `tell_population` tells each trial not pruned its member's final value;
- `optimize_population` runs these for batch after batch.

A batch's trials are asked together, as ``K`` parallel workers would: the
sampler chooses them knowing only the trials finished before (with TPE,
``TPESampler(constant_liar=True)`` keeps a batch's suggestions apart). Optuna
is an optional extra: ``pip install 'pztrain[optuna]'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any

from pztrain._members import member_key
from pztrain.callbacks import Callback
from pztrain.callbacks._monitored import eval_owner, eval_value
from pztrain.integrations.optuna import import_optuna
from pztrain.loop import fit
from pztrain.population import make_population, population_size
from pztrain.records import History, Stop

if TYPE_CHECKING:
    from pztrain.records import LoopInfo
    from pztrain.state import TrainState

__all__ = [
    "PopulationPruning",
    "ask_population",
    "optimize_population",
    "tell_population",
]

# A run these stopped did not finish: its trials fail, as in study.optimize.
_SIGNAL_STOPS = ("interrupted", "preempted")


def _metric_name(monitor: Any, who: str) -> str:
    """The eval metric ``"eval/<name>"`` names: ``<name>``."""
    split, _, name = str(monitor).partition("/")
    if not isinstance(monitor, str) or split != "eval" or not name:
        raise ValueError(
            f"{who} reads an eval metric per member: name it as 'eval/<name>' "
            f"(e.g. 'eval/loss'); got {monitor!r}."
        )
    return name


def _trials_of(trials: Sequence[Any], who: str) -> list[Any]:
    trials = list(trials)
    if not trials:
        raise ValueError(f"{who} needs one trial per member; got none.")
    for i, trial in enumerate(trials):
        if not all(hasattr(trial, a) for a in ("report", "should_prune", "study")):
            raise TypeError(
                f"{who}: trials[{i}] must be an optuna.Trial (from study.ask()); "
                f"got {type(trial).__name__}."
            )
    return trials


def _member_values(metrics: dict, name: str, size: int, who: str) -> list[float]:
    """Each member's value of the eval metric ``name`` (``"<name>/member_<i>"``)."""
    count = 0
    while member_key(name, count) in metrics:
        count += 1
    if count == 0:
        suffix = member_key("", 0)  # "/member_0"
        per_member = sorted(
            f"eval/{k.removesuffix(suffix)}" for k in metrics if k.endswith(suffix)
        )
        hint = "" if per_member else ": is the state a population?"
        raise KeyError(
            f"{who}'s monitor 'eval/{name}' is not among the population's eval "
            f"metrics {per_member} (each logged per member as "
            f"'<name>/member_<i>'){hint}"
        )
    if count != size:
        raise ValueError(
            f"{who} has {size} trials but the population evaluated has {count} "
            "members: give one trial per member, in the members' order."
        )
    return [float(metrics[member_key(name, i)]) for i in range(size)]


def _fail(study: Any, trials: Sequence[Any]) -> None:
    """Tells every unfinished trial it failed (the error at hand goes on)."""
    state = import_optuna().trial.TrialState.FAIL
    for trial in trials:
        with contextlib.suppress(Exception):
            study.tell(trial, state=state, skip_if_finished=True)


class PopulationPruning(Callback):
    """Reports each member's eval metric to its own trial; prunes trials.

    For a population (`pztrain.make_population`) whose member ``i`` runs the
    trial ``trials[i]`` (see `ask_population`). At each evaluation it reports
    member ``i``'s value of ``monitor`` (the eval record's ``"<name>/member_<i>"``)
    with ``trials[i].report(value, step)``, every member first, then asks each
    trial's pruner (``should_prune()``). A pruned trial is told at once
    (``study.tell(trial, state=TrialState.PRUNED)``, which keeps its last
    report as its value) and reported no more. Its member keeps computing: the
    population is one program, so the steps cost what they did and the pruned
    member's results are only ignored. When every trial is pruned it returns
    `pztrain.Stop` and `fit` ends as after an early stop, returning normally.
    After `fit`, `tell_population` tells the other trials their values.

    Pruners that compare a trial with the study's completed trials
    (``MedianPruner``, ``PercentilePruner``) prune nothing in a study's first
    batch, whose trials all run at once; ``ThresholdPruner`` does.

    Args:
      trials: One ``optuna.Trial`` per member, in the members' order.
      monitor: The eval metric to report, ``"eval/<name>"``.

    Attributes:
      reported: One dict per member: step → value reported to its trial.
      pruned_steps: Member → the step at which its trial was pruned.

    Raises:
      ImportError: if Optuna is not installed (naming the extra).
      TypeError: for a trial that is not an ``optuna.Trial``.
      ValueError: for a monitor that is not ``"eval/<name>"``, or (at the start
        of `fit`) a run that does not evaluate or a population of another size.
      KeyError: at an evaluation that lacks the monitored metric per member.

    Example:
      >>> from pztrain.integrations.optuna_population import PopulationPruning
      >>> import optuna
      >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
      >>> study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=1))
      >>> pruning = PopulationPruning([study.ask(), study.ask()], "eval/loss")
      >>> def evaluated(step, loss_0, loss_1):  # a population's eval record
      ...     return {"step": step, "split": "eval", "metrics": {
      ...         "loss": (loss_0 + loss_1) / 2,
      ...         "loss/member_0": loss_0, "loss/member_1": loss_1}}
      ...
      >>> pruning.on_eval_end(None, evaluated(10, 0.5, 2.0)) is None
      True
      >>> pruning.pruned_steps, [t.state.name for t in study.trials]
      ({1: 10}, ['RUNNING', 'PRUNED'])
      >>> pruning.on_eval_end(None, evaluated(20, 3.0, 0.1))  # doctest: +ELLIPSIS
      Stop(reason='Optuna pruned every trial of the population ([0, 1])...)
      >>> pruning.reported
      [{10: 0.5, 20: 3.0}, {10: 2.0}]
    """

    def __init__(self, trials: Sequence[Any], monitor: str = "eval/loss"):
        self._optuna = import_optuna()
        self.trials = _trials_of(trials, "PopulationPruning")
        self.monitor = monitor
        self._name = _metric_name(monitor, "PopulationPruning")
        self.reported: list[dict[int, float]] = [{} for _ in self.trials]
        self.pruned_steps: dict[int, int] = {}
        self._evaluations: tuple[str, ...] = ("",)  # fit's, from on_train_start

    def check(self, state: TrainState, info: LoopInfo) -> None:
        """Refuses a run without the monitored evaluation, or whose population
        is not one member per trial, before anything is written."""
        if not info.evaluates:
            raise ValueError(
                f"PopulationPruning monitors {self.monitor!r} but fit runs no "
                "evaluation: pass eval_step and eval_data."
            )
        size = population_size(state)
        if size != len(self.trials):
            raise ValueError(
                f"PopulationPruning has {len(self.trials)} trials but fit trains "
                + ("a single run" if size is None else f"a population of {size}")
                + ": give one trial per member (see ask_population)."
            )
        eval_owner(self.monitor, info.evaluation_names)  # names one of them

    def on_train_start(self, state: TrainState, info: LoopInfo) -> None:
        self._evaluations = info.evaluation_names

    def on_eval_end(self, state: TrainState, record: dict[str, Any]) -> Stop | None:
        with contextlib.suppress(KeyError):  # a missing metric: named below
            if (
                eval_value(record, member_key(self.monitor, 0), self._evaluations)
                is None
            ):
                return None  # its evaluation did not run at this point
        size, step = len(self.trials), int(record["step"])
        values = _member_values(
            record["metrics"], self._name, size, "PopulationPruning"
        )
        live = [
            i
            for i in range(size)  # Optuna keeps the first value of a step
            if i not in self.pruned_steps and step not in self.reported[i]
        ]
        for i in live:  # all first: a pruner may compare the running trials
            self.trials[i].report(values[i], step)
            self.reported[i][step] = values[i]
        pruned = self._optuna.trial.TrialState.PRUNED
        for i in live:
            if self.trials[i].should_prune():
                self.trials[i].study.tell(self.trials[i], state=pruned)
                self.pruned_steps[i] = step
        if len(self.pruned_steps) < size:
            return None
        numbers = [getattr(t, "number", "?") for t in self.trials]
        return Stop(
            f"Optuna pruned every trial of the population ({numbers}), the last "
            f"at step {max(self.pruned_steps.values())}"
        )


def ask_population(
    study: Any, suggest: Callable[[Any], dict[str, Any]], *, members: int
) -> tuple[list[Any], dict[str, list[Any]]]:
    """Asks ``study`` for one trial per member, and their hyperparameters.

    ``suggest(trial)`` gives a trial's values of the optimizer's injected
    hyperparameters, name → number (from ``trial.suggest_float`` and the
    like). Every trial must suggest the same names: the members share one
    program, and only values differ between them. A choice that changes the
    program (a width, another optimizer) needs a population of its own.

    Args:
      study: An ``optuna.Study``.
      suggest: ``trial -> {name: value}``.
      members: How many trials to ask.

    Returns:
      ``(trials, hyperparams)``: member ``i`` runs ``trials[i]``, and
      ``hyperparams`` maps each name to one value per member, for
      `pztrain.make_population` (``make_population(init, seeds=...,
      **hyperparams)``) or `pztrain.population.set_member_hyperparams`.

    Raises:
      ValueError: for fewer than one member, or trials that suggest different
        names.
      TypeError: if ``suggest`` gives anything but a dict of numbers.
      If ``suggest`` fails, the trials asked are told failed
      (``TrialState.FAIL``) before the error is raised.

    Example:
      >>> from pztrain.integrations.optuna_population import ask_population
      >>> import optuna
      >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
      >>> study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
      >>> def suggest(trial):
      ...     return {"learning_rate": trial.suggest_float("lr", 1e-3, 1.0, log=True)}
      ...
      >>> trials, hyperparams = ask_population(study, suggest, members=3)
      >>> [t.number for t in trials], len(hyperparams["learning_rate"])
      ([0, 1, 2], 3)
      >>> hyperparams["learning_rate"][2] == study.trials[2].params["lr"]
      True
    """
    import_optuna()
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"ask_population needs members >= 1; got {members!r}.")
    trials: list[Any] = []
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(members):
            trials.append(study.ask())
            rows.append(_suggested(suggest(trials[-1]), len(rows), rows))
    except BaseException:
        _fail(study, trials)
        raise
    return trials, {name: [row[name] for row in rows] for name in rows[0]}


def _suggested(values: Any, i: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``suggest``'s dict for member ``i``, checked against member 0's names."""
    if not isinstance(values, dict) or not all(
        isinstance(v, Real) for v in values.values()
    ):
        raise TypeError(
            "suggest(trial) must give a dict of hyperparameter name → number (one "
            f"member's values); for member {i} it gave {values!r}."
        )
    if rows and set(values) != set(rows[0]):
        raise ValueError(
            f"suggest gave member {i} the hyperparameters {sorted(values)} but "
            f"member 0 {sorted(rows[0])}: the members of a population share one "
            "program, so every trial must suggest the same names."
        )
    return dict(values)


def tell_population(
    study: Any, trials: Sequence[Any], history: History, monitor: str = "eval/loss"
) -> list[Any]:
    """Tells each trial its member's final value of ``monitor``.

    The value is member ``i``'s in the last evaluation of ``history`` (its
    record's ``"<name>/member_<i>"``). Trials already finished (those
    `PopulationPruning` pruned) are left as they are; a value Optuna cannot
    take (NaN) fails its trial, as in ``study.optimize``. A run that a signal
    stopped (``history.stop_reason`` ``"interrupted"`` or ``"preempted"``) did
    not finish: its trials are told failed (``TrialState.FAIL``).

    Args:
      study: The ``optuna.Study`` the trials came from.
      trials: One ``optuna.Trial`` per member, in the members' order.
      history: The `pztrain.History` that `pztrain.fit` returned.
      monitor: The eval metric to tell, ``"eval/<name>"``.

    Returns:
      The trials as told (``optuna.trial.FrozenTrial``), in the members' order.

    Raises:
      ValueError: for a monitor that is not ``"eval/<name>"``, a history with
        no evaluation, or a population of another size.
      KeyError: if the last evaluation lacks the monitored metric per member.

    Example:
      >>> from pztrain.integrations.optuna_population import tell_population
      >>> import optuna
      >>> from pztrain import History
      >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
      >>> study = optuna.create_study()
      >>> trials = [study.ask(), study.ask()]
      >>> history = History([{"step": 50, "split": "eval", "metrics": {
      ...     "loss": 0.3, "loss/member_0": 0.4, "loss/member_1": 0.2}}])
      >>> [(t.state.name, t.value) for t in tell_population(study, trials, history)]
      [('COMPLETE', 0.4), ('COMPLETE', 0.2)]
    """
    optuna = import_optuna()
    trials = _trials_of(trials, "tell_population")
    name = _metric_name(monitor, "tell_population")
    if history.stop_reason in _SIGNAL_STOPS:
        failed = optuna.trial.TrialState.FAIL
        return [study.tell(t, state=failed, skip_if_finished=True) for t in trials]
    last = history.last("eval")
    if last is None:
        raise ValueError(
            f"tell_population: the history has no evaluation, so no {monitor!r} "
            "to tell: fit with eval_step and eval_data."
        )
    values = _member_values(last["metrics"], name, len(trials), "tell_population")
    return [
        study.tell(t, v, skip_if_finished=True)
        for t, v in zip(trials, values, strict=True)
    ]


def optimize_population(
    study: Any,
    init: Callable[[int], TrainState],
    suggest: Callable[[Any], dict[str, Any]],
    *,
    members: int,
    n_batches: int = 1,
    monitor: str = "eval/loss",
    **fit_args: Any,
) -> list[tuple[list[Any], History]]:
    """Trains ``n_batches`` batches of ``members`` trials, each as one population.

    Per batch: `ask_population`, `pztrain.make_population` (member ``i`` is
    ``init(trials[i].number)``), `pztrain.fit` (`PopulationPruning` last),
    `tell_population`; failures tell unfinished trials failed, a stop ends all.

    Args:
      study: A single-objective ``optuna.Study``.
      init: ``seed -> TrainState``; its optimizer injects the hyperparameters.
      suggest: ``trial -> {name: value}`` (see `ask_population`).
      members, n_batches: Trials per batch; batches to run.
      monitor: The eval metric to prune on and to tell as each trial's value.
      **fit_args: `pztrain.fit`'s arguments by name but the state, ``run_dir``,
        ``checkpoints`` and ``resume`` (which every batch would share).

    Returns:
      One ``(trials, history)`` per batch: ``trials[i]`` ran member ``i``.

    Raises:
      ValueError: a bad monitor, n_batches, fit argument or hyperparameter.

    Example:
      >>> import jax, optax, optuna, pztrain.integrations.optuna_population
      >>> def init(seed):
      ...     tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      ...     model, key = {"w": jax.numpy.zeros(3)}, jax.random.key(seed)
      ...     return pztrain.TrainState.initial_state(model, tx, key)
      ...
      >>> def loss_fn(*, model, state, rng, x):
      ...     loss = jax.numpy.mean((x @ model["w"] - 1.0) ** 2)
      ...     return loss, state, {"loss": loss}
      ...
      >>> data = pztrain.ArrayLoader({"x": jax.numpy.ones((32, 3))}, 8)
      >>> study = optuna.create_study()
      >>> runs = pztrain.integrations.optuna_population.optimize_population(
      ...     study, init, lambda t: {"learning_rate": t.suggest_float("lr", 0, 0.1)},
      ...     members=3, train_step=pztrain.build_train_step(loss_fn),
      ...     train_data=data, num_epochs=2, eval_data=data, progress=False,
      ...     eval_step=pztrain.build_eval_step(lambda **kw: loss_fn(**kw)[2]))
      >>> final = runs[0][1].last("eval")["metrics"]  # one batch: trials 0, 1, 2
      >>> [t.value for t in study.trials] == [final[f"loss/member_{i}"] for i in "012"]
      True
    """
    callbacks = _batch_args(monitor, n_batches, fit_args)
    runs: list[tuple[list[Any], History]] = []
    for _ in range(n_batches):
        runs.append(_batch(study, init, suggest, members, monitor, callbacks, fit_args))
        if runs[-1][1].stop_reason in _SIGNAL_STOPS:
            break
    return runs


def _batch(study, init, suggest, members, monitor, callbacks, fit_args):
    """One batch of `optimize_population`: ``(trials, history)``."""
    trials, hyperparams = ask_population(study, suggest, members=members)
    try:
        seeds = [trial.number for trial in trials]
        population = make_population(init, seeds=seeds, **hyperparams)
        pruning = PopulationPruning(trials, monitor)
        _, history = fit(population, callbacks=[*callbacks, pruning], **fit_args)
        tell_population(study, trials, history, monitor)
    except BaseException:
        _fail(study, trials)
        raise
    return trials, history


def _batch_args(monitor: Any, n_batches: Any, fit_args: dict[str, Any]) -> list:
    """Checks `optimize_population`'s arguments; pops and gives the callbacks."""
    _metric_name(monitor, "optimize_population")
    if isinstance(n_batches, bool) or not isinstance(n_batches, int) or n_batches < 1:
        raise ValueError(
            f"optimize_population needs n_batches >= 1; got {n_batches!r}."
        )
    shared = sorted({"run_dir", "checkpoints", "resume"} & set(fit_args))
    if shared:
        raise ValueError(
            f"optimize_population does not take {shared}: every batch would share "
            "them. Write the loop with ask_population and tell_population to give "
            "each batch its own."
        )
    return list(fit_args.pop("callbacks", ()))
