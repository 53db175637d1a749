"""A combination-matrix row run and checked against what the guides promise:
resume equals uninterrupted, a member equals its solo run, every evaluation at
its cadence and at the end, nothing written before a refusal, the same error
and notes in and out of `fit`; the evaluation job's rows too."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from matrix_parts import (
    LOG_EVERY,
    NUM_STEPS,
    STOP_AT,
    Boom,
    checkpoints,
    eval_loader,
    eval_step,
    evaluations,
    members,
    monitor,
    new_state,
    stoppers,
    train_data,
    train_step,
)

import pztrain
from pztrain.loggers import read_jsonl
from pztrain.records import TIMING_KEYS, jsonable

RESUMED = ("sigint", "sigterm", "raise")


def run_row(row: dict, tmp: Path) -> None:
    """Runs ``row`` in ``tmp`` and checks it (an AssertionError says what)."""
    stop = row["stop"]
    if stop == "refuse":
        return check_refusal(row, tmp)
    if stop == "badbatch":
        return check_bad_batch(row, tmp)
    if stop in RESUMED:
        return check_resume(row, tmp)
    return check_run(row, tmp)


def fit(row, state, step, run: Path, callbacks=(), **kw):
    """``fit`` with the row's data, evaluations and checkpoints, in ``run``
    (its log) and ``run``-ckpt."""
    ev_args, _ = evaluations(row, step)
    ckpt = checkpoints(row, run.with_name(run.name + "-ckpt"))
    return pztrain.fit(
        state,
        step,
        train_data(row),
        num_steps=NUM_STEPS,
        log_every=LOG_EVERY,
        callbacks=list(callbacks),
        checkpoints=ckpt,
        run_dir=run,
        progress=False,
        **ev_args,
        **kw,
    )


# -- the checks ---------------------------------------------------------------------


def check_run(row, tmp: Path) -> None:
    """A run to its end, an early stop or a NaN stop."""
    step = train_step(row)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a NaN stop warns: NaN is never saved
        state, history = fit(row, new_state(row), step, tmp / "run", stoppers(row))
    if row["stop"] != "nan":
        assert not caught, [str(w.message) for w in caught]
    final = int(np.asarray(state.step))
    assert final == expected_final(row, step), (final, history.stop_reason)
    if row["stop"] == "nan":
        assert str(first_nan_step(row, step)) in history.stop_reason, (
            history.stop_reason
        )
    check_log(row, step, tmp / "run", final, history)
    check_checkpoints(row, tmp / "run-ckpt", state, final)
    if members(row) and row["stop"] != "nan":
        check_member_equals_solo(row, state, final)


def check_resume(row, tmp: Path) -> None:
    """Stopped part-way (a signal, an exception in a callback), then resumed
    the documented way: the same params, state and log as uninterrupted;
    without checkpoints, the log lacks only the evaluations due at the stop
    step (stops.md: no checkpoint owes them, `fit(state, ...)` starts after)."""
    step = train_step(row)
    want, _ = fit(row, new_state(row), step, tmp / "whole")
    state = stopped(row, step, tmp / "cut")
    if row["ckpt"] != "none":
        got, history = fit(row, new_state(row), step, tmp / "cut", resume=True)
    else:  # without checkpoints, fit(state, ...) goes on from the state
        got, history = fit(row, state, step, tmp / "cut")
    assert int(np.asarray(got.step)) == NUM_STEPS
    for name in ("params", "opt_state", "loss_fn_state"):
        a, b = getattr(got, name), getattr(want, name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    whole, unrun = records(tmp / "whole"), ()
    if row["ckpt"] == "none":  # nothing owes the evaluations due at the stop
        unrun = (STOP_AT,)
        whole = [r for r in whole if (r["step"], r.get("split")) != (STOP_AT, "eval")]
    same_records(records(tmp / "cut"), whole)
    check_log(row, step, tmp / "cut", NUM_STEPS, None, unrun)
    if members(row):
        check_member_equals_solo(row, want, NUM_STEPS)


def stopped(row, step, run: Path) -> pztrain.TrainState:
    """The row's run stopped at `STOP_AT` by its signal or exception."""
    if row["stop"] == "raise":
        with pytest.raises(Boom) as err:
            fit(row, new_state(row), step, run, stoppers(row))
        assert any("train_state" in note for note in err.value.__notes__)
        state = err.value.train_state
    else:
        state, history = fit(row, new_state(row), step, run, stoppers(row))
        reason = "interrupted" if row["stop"] == "sigint" else "preempted"
        assert history.stop_reason == reason, history.stop_reason
    assert int(np.asarray(state.step)) == STOP_AT
    return state


def check_refusal(row, tmp: Path) -> None:
    """A monitor typo: refused, naming it, before anything is written; of a
    host function's metric (its names are known only once it runs): refused
    at its first evaluation, the error says so."""
    step = train_step(row)
    if row["evals"] == "hostfn":
        with pytest.raises(KeyError) as err:
            fit(row, new_state(row), step, tmp / "run", stoppers(row))
        assert monitor(row) + "_typo" in str(err.value), str(err.value)
        assert "checked at its first evaluation" in str(err.value), str(err.value)
        return
    with pytest.raises((KeyError, ValueError)) as err:
        fit(row, new_state(row), step, tmp / "run", stoppers(row))
    assert monitor(row) + "_typo" in str(err.value), str(err.value)
    assert sorted(p.name for p in tmp.iterdir()) == [], list(tmp.iterdir())


def check_bad_batch(row, tmp: Path) -> None:
    """A batch the loss cannot take: the step's error and notes, in and out
    of `fit`, and nothing written."""
    step = train_step(row)
    loader = train_data(row)
    batch = next(iter(loader.iter_from_step(0, step.steps_per_call)))
    try:
        step(new_state(row), **batch)
    except Exception as e:  # noqa: BLE001  the error the step raises, whatever it is
        alone = e
    else:
        raise AssertionError("the bad batch trained")
    with pytest.raises(type(alone)) as err:
        fit(row, new_state(row), step, tmp / "run")
    assert str(err.value) == str(alone)
    notes = getattr(err.value, "__notes__", [])
    for note in getattr(alone, "__notes__", []):
        assert note in notes, (note, notes)
    assert sorted(p.name for p in tmp.iterdir()) == [], list(tmp.iterdir())


# -- what the checks read ----------------------------------------------------------


def expected_final(row, step) -> int:
    if row["stop"] == "early":  # patience 1: the second check of its monitor
        return 2 * (evaluations(row, step)[1].get("probe/") or LOG_EVERY)
    if row["stop"] == "nan":  # the log point after the first NaN step
        return LOG_EVERY * math.ceil((first_nan_step(row, step) + 1) / LOG_EVERY)
    return NUM_STEPS


def first_nan_step(row, step) -> int:
    """The first step (0-based) whose batch holds the poisoned example."""
    loader = train_data(row)
    for s in range(NUM_STEPS):
        if np.isnan(np.asarray(loader.batch_at(s)["poison"])).any():
            return s
    raise AssertionError("no step trains on the poisoned example")


def records(run: Path) -> list[dict]:
    """The run's metrics.jsonl without the clock-dependent keys."""
    out = []
    for r in read_jsonl(run):
        out.append({k: v for k, v in r.items() if k not in TIMING_KEYS})
    return out


def check_log(row, step, run: Path, final: int, history, unrun=()) -> None:
    """Train records at each log point; each evaluation at its cadence and
    at the end (``metrics.jsonl``, and the History a run returned), but at
    the steps ``unrun``."""
    logged = records(run)
    train = [r["step"] for r in logged if r.get("split", "train") == "train"]
    want = sorted({*range(LOG_EVERY, final + 1, LOG_EVERY), final})
    assert train == want, (train, want)
    _, cadence = evaluations(row, step)
    evals = [r for r in logged if r.get("split") == "eval"]
    for prefix, every in cadence.items():
        ran = [
            r["step"] for r in evals if any(k.startswith(prefix) for k in r["metrics"])
        ]
        due = sorted({*(range(every, final + 1, every) if every else ()), final})
        due = [d for d in due if d not in unrun]
        assert ran == due, (prefix or "eval_step", ran, due)
    if history is not None:
        mine = [  # as JSON holds them: a NaN is "nan" in metrics.jsonl
            jsonable({k: v for k, v in r.items() if k not in TIMING_KEYS})
            for r in history.to_dicts()
        ]
        same_records(mine, logged)


def same_records(got: list[dict], want: list[dict]) -> None:
    """The same records, the first difference shown."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        assert a == b, f"record {i} differs:\n got  {a}\n want {b}"
    assert len(got) == len(want), [(r["step"], r.get("split")) for r in got]


def saved_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def check_checkpoints(row, directory: Path, state, final: int) -> None:
    """keep_last=1 keeps the newest; keep_best=1 the best by its monitor too
    (NaN params are never saved); an EMA checkpoint loads its EMA params."""
    if row["ckpt"] == "none":
        return
    saved = sorted({*range(4, final + 1, 4), final})
    if row["stop"] == "nan":  # the params at the stop are not finite
        saved = [s for s in saved if s < final]
    want = {saved[-1]} if saved else set()
    if row["ckpt"] == "keepbest" and saved:
        want.add(best_saved_step(row, directory.with_name("run"), saved))
    assert saved_steps(directory) == sorted(want), (saved_steps(directory), want)
    if row["ckpt"] == "ema" and row["stop"] != "nan":
        loaded = pztrain.load_params(directory, state, ema=True)
        for name, value in state.ema_params.items():
            np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)


def best_saved_step(row, run: Path, saved: list[int]) -> int:
    """The saved step whose monitored value is the lowest (the newest of ties)."""
    name = monitor(row)
    split, key = ("eval", name[5:]) if name.startswith("eval/") else ("train", name)
    values = {
        r["step"]: r["metrics"][key]
        for r in records(run)
        if r.get("split", "train") == split
        and r["step"] in saved
        and key in r["metrics"]
    }
    return min(values, key=lambda s: (values[s], -s))


def check_member_equals_solo(row, pop, final: int) -> None:
    """Member 1 of the population equals its run alone, to float rounding."""
    solo_step = train_step(row, solo=True)
    solo, _ = pztrain.fit(
        new_state(row, seed=1),
        solo_step,
        train_data(row, member=1),
        num_steps=final,
        log_every=LOG_EVERY,
        progress=False,
    )
    got = jax.tree_util.tree_leaves_with_path(pztrain.member(pop, 1).params)
    want = jax.tree_util.tree_leaves_with_path(solo.params)
    for (path, a), (_, b) in zip(got, want, strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=name)


# -- the evaluation job -------------------------------------------------------------


def run_job_row(job_row: dict, tmp: Path) -> None:
    """A run with checkpoints, then `evaluate_checkpoints` on them: one record
    per checkpoint, the final one equal to the run's own final evaluation."""
    row = {**job_row, "evals": "unnamed", "stop": "end", "step": "plain"}
    row["devices"] = "1dev"
    step = train_step(row)
    fit(row, new_state(row), step, tmp / "run")
    ev = pztrain.Evaluation("valid", eval_step(), eval_loader(row))
    job = pztrain.evaluate_checkpoints(
        tmp / "run-ckpt",
        new_state(row),
        [ev],
        run_dir=tmp / "job",
        follow=False,
        priority=None,  # in this process: the default would idle the test run
    )
    steps = [r["step"] for r in job.records]
    assert steps == saved_steps(tmp / "run-ckpt"), steps
    last = [r for r in records(tmp / "run") if r.get("split") == "eval"][-1]
    assert last["step"] == NUM_STEPS == steps[-1]
    for key, value in last["metrics"].items():
        np.testing.assert_allclose(
            job.records[-1]["metrics"]["valid/" + key], value, rtol=1e-6
        )
