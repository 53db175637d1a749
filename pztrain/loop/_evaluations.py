"""Named evaluations: `Evaluation`, checked once, and run at their points.

A run may have any number of evaluations, each with a name, an eval step and
its data (or a host function of the state) and a cadence. ``fit``'s
single-evaluation arguments (``eval_step=``, ``eval_data=``, ``eval_every=``
…) make one more, the unnamed one, whose records keep their names
(``eval/<metric>``). At a point every evaluation due runs, in the order given,
and their values make one eval record (``eval/<name>/<metric>``), so that a
callback's ``on_eval_end`` sees one record per point, as before.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pztrain.data._kinds import as_fit_data
from pztrain.ema import NoEmaError, has_ema
from pztrain.loggers._media import split_media
from pztrain.loop._evaluate import evaluate_until
from pztrain.loop._hooks import host_reads
from pztrain.loop._schedule import Cadence
from pztrain.loop._signals import StopFlag
from pztrain.metric_states import is_metric_state, metric_entries
from pztrain.state import TrainState
from pztrain.step import EvalStep, TrainStep

__all__ = [
    "EvalRunner",
    "Evaluation",
    "cadence_of",
    "check_evaluations",
    "evaluation_values",
    "unnamed_evaluation",
]

_RESERVED = ("ema",)  # "eval/ema/<metric>" are the unnamed evaluation's EMA's


@dataclasses.dataclass(frozen=True, eq=False)  # data may hold arrays
class Evaluation:
    """One evaluation that `pztrain.fit` runs on its own cadence.

    Its records are named ``eval/<name>/<metric>`` (``eval/<name>/ema/<metric>``
    for ``ema="both"``'s EMA), the names ``Checkpoints(monitor=)``,
    ``EarlyStopping`` and `pztrain.History.plot` take.

    Args:
      name: Its name: no ``/``, not ``"ema"`` (``""``: the unnamed evaluation,
        recorded as ``eval/<metric>``, as ``fit(eval_step=...)`` makes it).
      step: An eval step (`pztrain.build_eval_step`), averaged over ``data``
        as `pztrain.evaluate` does; or a host function ``state -> dict``
        whose numbers are recorded like metrics, and whose text (``str``) and
        images (a matplotlib figure, an array of shape (H, W), (H, W, 3) or
        (H, W, 4)) go to the loggers (`pztrain.loggers.split_media`).
      data: The eval step's data (any `pztrain.evaluate` takes); ``None``
        with a function.
      every: Steps between runs (a multiple of ``steps_per_call``).
      every_epochs: Epoch ends between runs. With neither, it runs at each
        epoch end (or at the end only, when the data has no epochs).
      at_end: Also run at the run's last step (unless it just ran there),
        whatever ended the run: its schedule, `pztrain.EarlyStopping`, a
        `pztrain.NanPolicy` stop or any `pztrain.Stop` a hook returns. A
        signal before the end leaves it to the resumed run's end; an
        exception is an error, not a stop: nothing runs after it.
      ema: As `pztrain.evaluate`'s: ``False``, ``True`` (the EMA params) or
        ``"both"``; a function is then given `TrainState.using_ema` 's state.

    Raises:
      TypeError, ValueError: for a bad field, naming the evaluation.

    Example:
      >>> import numpy as np, pztrain
      >>> def eval_fn(*, model, state, rng, x):
      ...     return {"mean": (x * model["w"]).mean()}
      ...
      >>> val = pztrain.Evaluation("val", pztrain.build_eval_step(eval_fn),
      ...                          [{"x": np.ones(4)}], every=100)
      >>> norm = pztrain.Evaluation("norm", lambda state: {"w": state.params["w"]},
      ...                           every_epochs=1)
      >>> val.name, norm.data, norm.at_end
      ('val', None, True)
    """

    name: str
    step: EvalStep | Callable[[TrainState], Mapping[str, Any]]
    data: Iterable[Any] | None = None
    _: dataclasses.KW_ONLY
    every: int | None = None
    every_epochs: int | None = None
    at_end: bool = True
    ema: bool | str = False

    def __post_init__(self) -> None:
        who = f"Evaluation({self.name!r})"
        _check_name(self.name)
        if isinstance(self.step, EvalStep):
            if self.data is None:
                raise ValueError(
                    f"{who} has an eval step but no data: pass "
                    f"Evaluation({self.name!r}, eval_step, data)."
                )
        elif isinstance(self.step, TrainStep):
            raise TypeError(
                f"{who}: step is a TrainStep; an evaluation takes an eval step "
                "(pztrain.build_eval_step(eval_fn)) or a function state -> dict."
            )
        elif callable(self.step):
            if self.data is not None:
                raise ValueError(
                    f"{who} has a host function and data: a function is called "
                    "with the state alone (state -> dict); drop data, or pass an "
                    "eval step (pztrain.build_eval_step) to average over it."
                )
        else:
            raise TypeError(
                f"{who}: step must be an EvalStep (pztrain.build_eval_step) or a "
                f"function state -> dict; got {type(self.step).__name__}."
            )
        _check_cadence(who, self.every, self.every_epochs, self.at_end)
        if not (self.ema is False or self.ema is True or self.ema == "both"):
            raise ValueError(
                f"{who}: ema must be False, True or 'both'; got {self.ema!r}."
            )


def cadence_of(ev: Evaluation) -> Cadence:
    """When ``ev`` runs, for the `Schedule`."""
    return Cadence(ev.name, ev.every, ev.every_epochs, ev.at_end)


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"An Evaluation's name is a str; got {name!r}.")
    if "/" in name or name != name.strip() or name in _RESERVED:
        why = "'ema' names EMA records" if name in _RESERVED else "no '/', no spaces"
        raise ValueError(
            f"Evaluation name {name!r} cannot be used ({why}): its records are "
            f"'eval/<name>/<metric>'; choose a name such as 'val' or 'test'."
        )


def _check_cadence(who: str, every: Any, every_epochs: Any, at_end: Any) -> None:
    for field, value in (("every", every), ("every_epochs", every_epochs)):
        if value is not None and (not _is_count(value) or value < 1):
            raise ValueError(
                f"{who}: {field} must be an int >= 1 or None; got {value!r}."
            )
    if every is not None and every_epochs is not None:
        raise ValueError(
            f"{who}: pass every (steps) or every_epochs, not both; got every={every!r},"
            f" every_epochs={every_epochs!r}."
        )
    if not isinstance(at_end, bool):
        raise TypeError(f"{who}: at_end must be True or False; got {at_end!r}.")


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def unnamed_evaluation(eval_step, eval_data, every, every_epochs, ema) -> Evaluation:
    """The evaluation of ``fit``'s ``eval_step=`` arguments (already checked)."""
    return Evaluation(
        "",
        eval_step,
        eval_data,
        every=every,
        every_epochs=every_epochs,
        ema="both" if ema else False,
    )


def check_evaluations(
    evaluations: Any, unnamed: Evaluation | None, state: TrainState, steps_per_call: int
) -> tuple[Evaluation, ...]:
    """``fit``'s evaluations: ``unnamed`` (from ``eval_step=``) first, then
    ``evaluations``; each one's data as the loop reads it.

    Raises:
      TypeError, ValueError: naming the evaluation: not an `Evaluation`, two
        with one name, ``every`` not a multiple of ``steps_per_call``.
      NoEmaError: ``ema`` asked of a state without an EMA.
    """
    if isinstance(evaluations, Evaluation) or not isinstance(evaluations, Sequence):
        raise TypeError(
            "evaluations must be a list of pztrain.Evaluation (evaluations=[...]); "
            f"got {type(evaluations).__name__}."
        )
    for i, ev in enumerate(evaluations):
        if not isinstance(ev, Evaluation):
            raise TypeError(
                f"evaluations[{i}] is a {type(ev).__name__}; pass "
                "pztrain.Evaluation(name, eval_step, data, every=...)."
            )
    out, seen = [], {}
    for ev in [*([unnamed] if unnamed is not None else []), *evaluations]:
        who = f"Evaluation({ev.name!r})"
        if ev.name in seen:
            also = " (the unnamed one is eval_step=...'s)" if ev.name == "" else ""
            raise ValueError(
                f"Two evaluations are named {ev.name!r}{also}; names make their "
                "records (eval/<name>/<metric>): give each its own."
            )
        seen[ev.name] = ev
        if ev.every is not None and ev.every % steps_per_call:
            raise ValueError(
                f"{who}: every={ev.every} must be a multiple of steps_per_call="
                f"{steps_per_call}."
            )
        if ev.ema is not False and not has_ema(state.opt_state):
            raise NoEmaError(
                f"{who} has ema={ev.ema!r}, but the state keeps no EMA of its "
                "params: build its optimizer with pztrain.with_ema(optimizer, "
                "decay=0.999), or drop ema."
            )
        if ev.data is not None:
            data = as_fit_data(ev.data, f"{who}.data", train=False)
            ev = dataclasses.replace(ev, data=data) if data is not ev.data else ev
        out.append(ev)
    return tuple(out)


class EvalRunner:
    """Runs a run's evaluations at their points and reports them.

    Args:
      evaluations: The checked evaluations (`check_evaluations`).
      schedule: The run's `Schedule` (their cadences).
      reporter: The run's `Reporter` (records, media, what is owed).
      flag: The run's stop flag, read before each evaluation and eval batch.
    """

    def __init__(self, evaluations, schedule, reporter, flag: StopFlag):
        self.by_name = {ev.name: ev for ev in evaluations}
        self.schedule, self.reporter, self.flag = schedule, reporter, flag
        # name -> the step it last ran at; the start's are done (or owed)
        self.ran: dict[str, int] = dict.fromkeys(self.by_name, schedule.start)
        self._owed: tuple[int | None, tuple[str, ...]] = (None, ())  # (step, names)

    def at_point(self, state, step: int, ended: bool, epoch: int, stop=None):
        """The evaluations due at ``step``: ``(state, stop)``. At the run's
        last point (``stop``: none so far), those due at the end run too, in
        the same record."""
        s = self.schedule
        names = s.due_at(step, ended, epoch)
        if stop is None and s.done(step, s.next_epoch(step, epoch) if ended else epoch):
            ran = {**self.ran, **dict.fromkeys(names, step)}
            names += s.due_at_end(step, ran)
        names = tuple(n for n in self.by_name if n in names)  # in their order
        return self.run(state, names, step, epoch) if names else (state, None)

    def at_end(self, state: TrainState, step: int, epoch: int):
        """The evaluations due at the end ``step``: ``(state, stop)``."""
        names = self.schedule.due_at_end(step, self.ran)
        return self.run(state, names, step, epoch) if names else (state, None)

    def owed(self, state: TrainState, owed_eval: tuple) -> Any:
        """The evaluations a stop left owed at the start step (from its
        checkpoint: ``(step, epoch)``, or ``(step, epoch, names)``)."""
        step, epoch = owed_eval[:2]
        if len(owed_eval) > 2:
            names = tuple(n for n in owed_eval[2] if n in self.by_name)
        else:  # all of them owed, or a checkpoint older than names
            names = self.schedule.owed_at(step, epoch)
        return self.run(state, names, step, epoch)

    def run(self, state: TrainState, names: Sequence[str], step: int, epoch: int):
        """Runs ``names`` in order, one record of all their values. Those a
        stop skips or cuts short are owed (`Reporter.evaluation`)."""
        values: dict[str, float] = {}
        media: dict[str, Any] = {}
        owed: tuple[str, ...] = ()
        for i, name in enumerate(names):
            out = None if self.flag.stopped else self._one(name, state, step)
            if out is None:
                owed = tuple(names[i:])
                break
            self.ran[name] = step
            prefix = f"{name}/" if name else ""
            values.update({prefix + k: v for k, v in out[0].items()})
            media.update({f"eval/{prefix}{k}": v for k, v in out[1].items()})
        if owed:  # with those owed at this step before (the end's, after a stop)
            before = self._owed[1] if self._owed[0] == step else ()
            owed = tuple(n for n in self.by_name if n in {*owed, *before})
            self._owed = (step, owed)
            # unnamed if all of them are: the format of a single evaluation
            every = owed == tuple(self.by_name)
            owed_eval = (step, epoch) if every else (step, epoch, owed)
        else:
            owed_eval = None
        return self.reporter.evaluation(state, values, step, epoch, owed_eval, media)

    def _one(self, name: str, state: TrainState, step: int):
        return evaluation_values(self.by_name[name], state, step, self.flag)


def _host_values(ev: Evaluation, state: TrainState) -> tuple[dict, dict]:
    """A host function's numbers (a metric state's computed entries among
    them: `pztrain.metric_states`) and media (``ema``: on the EMA params, or
    both, the EMA's named ``ema/<key>``)."""
    who = f"Evaluation({ev.name!r})"
    states = {} if ev.ema is True else {"": state}
    if ev.ema is not False:
        states["ema/" if ev.ema == "both" else ""] = state.using_ema()
    numbers_, media = {}, {}
    for prefix, s in states.items():
        with host_reads():
            out = ev.step(s)
            if not isinstance(out, Mapping):
                raise TypeError(
                    f"{who}'s function returned a {type(out).__name__}; it returns "
                    "a dict name -> number, text (str) or image."
                )
            kept, got_media = split_media(dict(out), who, keep=is_metric_state)
            got = {}
            for k, v in kept.items():  # a metric state: its entries, computed
                got.update(metric_entries(k, v) if is_metric_state(v) else {k: v})
        numbers_.update({prefix + k: float(v) for k, v in got.items()})
        media.update({prefix + k: v for k, v in got_media.items()})
    return numbers_, media


def evaluation_values(ev: Evaluation, state: TrainState, step: int, flag: StopFlag):
    """``(numbers, media)`` of evaluation ``ev`` on ``state`` (its names
    without the evaluation's prefix), or ``None`` if ``flag`` asked to stop
    before an eval batch. An error says which evaluation failed, at which
    step."""
    try:
        if isinstance(ev.step, EvalStep):
            values = evaluate_until(state, ev.step, ev.data, flag, ev.ema)
            return None if values is None else (values, {})
        return _host_values(ev, state)
    except Exception as e:
        e.add_note(f"pztrain: in Evaluation({ev.name!r}) at step {step}.")
        raise
