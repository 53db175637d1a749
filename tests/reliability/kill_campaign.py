"""A randomized SIGKILL campaign against resumable training (issue 11).

The driver runs ``kill_worker.py`` (a real training process with asynchronous
checkpoints, evaluation and a JSON-lines log) once without interruption, as the
reference. Then, for each trial, it starts the worker in a fresh run directory,
kills it with SIGKILL at a random moment, restarts it with ``resume=True``, possibly
kills it again, and lets it finish. A trial passes if the final params, optimizer
state, loss-function state, step and key are bitwise equal to the reference's (every
array ``np.array_equal``, same dtype), and ``metrics.jsonl`` holds exactly the
reference's records (the same steps and splits in the same order, none missing or
repeated, every value equal; only the wall-clock ``time`` field may differ) and
``hparams.json`` is the same.

Kinds of kill, drawn from a seeded ``random.Random`` (the seed is printed):

- ``run``: at a random point of a random step: after the worker reports step
  ``k`` (uniform over the steps left; ``ready`` for the first), within the time
  the reference run took from there to the next step (to ``done`` after the last);
- ``save``: while an asynchronous checkpoint save is in progress: the driver polls
  the checkpoint directory for an orbax temporary (``<step>.orbax-checkpoint-tmp``)
  that the running process made (not one left by an earlier kill) and kills at
  once;
- ``eval``: during an evaluation at a checkpointed step, once that checkpoint is
  complete (the resumed run starts at that step: its eval record must survive);
  at the run's last such evaluation, after 80% of an evaluation's time anyway;
- ``start``: at a random time between launch and the workers' median time to
  ``ready`` (imports, restoring the checkpoint, cutting back the log).

Any kill counts as landing during a save if an orbax temporary
(``<step>.orbax-checkpoint-tmp``) that the killed process made existed just before
the kill and is still there once the process is dead.

Reduced mode (CI: ``test_kill_campaign.py``): one trial with three kills (a save
and a run kill in a seeded order, then an eval kill), five worker processes in all.
Full mode (``python tests/reliability/kill_campaign.py --full``): 20 trials, at
least 20 kills of which at least 5 land during saves; trials are added (up to 5)
if planned kills missed (the process ended first) and these figures are not
reached.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pztrain.records import TIMING_KEYS  # the clock-dependent keys of a record

HERE = Path(__file__).resolve().parent
WORKER = HERE / "kill_worker.py"
ROOT = HERE.parents[1]
TMP_MARK = ".orbax-checkpoint-tmp"
PROCESS_TIMEOUT = 600.0  # seconds for one worker process


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """The worker's options (all passed on its command line)."""

    num_steps: int = 40
    log_every: int = 2
    eval_every: int = 6
    every_steps: int = 4
    keep_last: int = 2
    step_sleep: float = 0.05
    eval_sleep: float = 0.05

    def argv(self) -> list[str]:
        out = []
        for field in dataclasses.fields(self):
            out += ["--" + field.name.replace("_", "-"), str(getattr(self, field.name))]
        return out


@dataclasses.dataclass(frozen=True)
class Mode:
    """How big a campaign is."""

    name: str
    trials: int
    kills_per_trial: tuple[int, ...]  # drawn from for each trial
    min_kills: int
    min_save_kills: int
    max_extra_trials: int
    kinds: tuple[str, ...] = ()  # the kinds of a single trial, in a random order


REDUCED = Mode("reduced", 1, (3,), 3, 1, 2, kinds=("save", "eval", "run"))
FULL = Mode("full", 20, (1, 1, 2), 20, 5, 5)

KIND_WEIGHTS = {"run": 0.45, "save": 0.35, "eval": 0.1, "start": 0.1}


@dataclasses.dataclass
class Kill:
    """One SIGKILL (or a planned one that missed: the process ended first)."""

    kind: str
    landed: bool = False  # a SIGKILL was sent to a live process
    during_save: bool = False
    at: float = 0.0  # seconds after launch
    where: str = ""  # what the worker was doing, from its last events
    saving: str = ""  # the temporary of the save in progress, for a save kill
    checkpoints_before: list[str] = dataclasses.field(default_factory=list)
    checkpoints_after: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if not self.landed:
            return f"{self.kind} kill missed (the process ended first)"
        text = f"{self.kind} kill at {self.at:.2f} s, {self.where}"
        if self.during_save:
            text += f", landed during the save {self.saving}"
        elif self.kind == "save":
            text += f", missed the save {self.saving or '(none seen)'}"
        return (
            f"{text}; checkpoint dir before {self.checkpoints_before}, "
            f"after {self.checkpoints_after}"
        )


@dataclasses.dataclass
class Trial:
    """One run directory: kills, restarts, the final comparison."""

    index: int
    seed: int
    plan: list[str]
    run_dir: Path
    kills: list[Kill] = dataclasses.field(default_factory=list)
    processes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def landed(self) -> list[Kill]:
        return [k for k in self.kills if k.landed]

    def describe(self) -> str:
        n, saves = len(self.landed), sum(k.during_save for k in self.landed)
        head = (
            f"trial {self.index} (seed {self.seed}, plan {self.plan}): "
            f"{n} kill{'' if n == 1 else 's'}, "
            f"{saves} during saves, {self.processes} processes, {self.seconds:.1f} s: "
            f"{'PASS' if self.passed else 'FAIL'}"
        )
        lines = [head]
        lines += [f"  kill {i + 1}: {k.describe()}" for i, k in enumerate(self.kills)]
        lines += [f"  problem: {p}" for p in self.problems]
        if self.problems:
            lines.append(f"  run dir: {self.run_dir}")
        return "\n".join(lines)


@dataclasses.dataclass
class Campaign:
    """A campaign's trials and figures."""

    mode: Mode
    seed: int
    config: WorkerConfig
    pztrain_dir: Path = ROOT  # the directory holding the pztrain package tested
    trials: list[Trial] = dataclasses.field(default_factory=list)
    reference_ready: float = 0.0  # launch -> ready, seconds
    ready_times: list[float] = dataclasses.field(default_factory=list)  # all workers
    reference_train: float = 0.0  # ready -> done, seconds
    reference_marks: dict[int, float] = dataclasses.field(default_factory=dict)
    reference_done: float = 0.0  # launch -> done
    reference_eval: float = 0.0  # an evaluation's median time (eval -> evaluated)
    seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def kills(self) -> int:
        return sum(len(t.landed) for t in self.trials)

    @property
    def save_kills(self) -> int:
        return sum(k.during_save for t in self.trials for k in t.landed)

    @property
    def passes(self) -> int:
        return sum(t.passed for t in self.trials)

    @property
    def killed_trials(self) -> int:
        """Trials with at least one kill that landed."""
        return sum(bool(t.landed) for t in self.trials)

    def shortfall(self) -> list[str]:
        """What the mode asks for and the campaign did not reach."""
        out = []
        if self.killed_trials < self.mode.trials:
            out.append(f"{self.killed_trials} trials with a kill < {self.mode.trials}")
        if self.kills < self.mode.min_kills:
            out.append(f"{self.kills} kills < {self.mode.min_kills}")
        if self.save_kills < self.mode.min_save_kills:
            out.append(
                f"{self.save_kills} kills during saves < {self.mode.min_save_kills}"
            )
        return out

    @property
    def ok(self) -> bool:
        return (
            not self.problems
            and self.passes == len(self.trials)
            and not self.shortfall()
        )

    def summary(self) -> str:
        missed = sum(not k.landed for t in self.trials for k in t.kills)
        lines = [
            f"kill campaign, {self.mode.name} mode, seed {self.seed}: "
            f"{self.passes}/{len(self.trials)} trials passed "
            f"({self.killed_trials} of them killed at least once); {self.kills} kills "
            f"({self.save_kills} during async saves, {missed} planned kills missed); "
            f"wall time {self.seconds:.1f} s on {os.cpu_count()} cores "
            f"(reference: {self.reference_ready:.1f} s to ready, "
            f"{self.reference_train:.1f} s of training, "
            f"{self.config.num_steps} steps)",
        ]
        lines += [f"problem: {p}" for p in self.problems]
        if self.shortfall():
            lines.append("not reached: " + "; ".join(self.shortfall()))
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


# ----------------------------------------------------------------------------
# one worker process


class Worker:
    """A running ``kill_worker.py`` and the events it printed, read live."""

    def __init__(
        self, run_dir: Path, config: WorkerConfig, number: int, pztrain_dir: Path
    ):
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "ckpt"
        self.events: list[tuple[float, list[str]]] = []
        self.ready = threading.Event()
        self.start_step: int | None = None
        self.ready_at: float | None = None  # seconds from launch to 'ready'
        self.leftovers = _tmp_entries(self.ckpt_dir)  # from earlier kills
        self.stderr_path = run_dir / f"worker-{number}.stderr"
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pztrain_dir), env.get("PYTHONPATH")) if p
        )
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        self._stderr = self.stderr_path.open("w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(run_dir), *config.argv()],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            words = line.split()
            if not words:
                continue
            self.events.append((self.elapsed(), words))
            if words[0] == "ready":
                self.start_step, self.ready_at = int(words[1]), self.elapsed()
                self.ready.set()
        self.ready.set()  # the process ended (maybe before ready)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float | None = PROCESS_TIMEOUT) -> int | None:
        """The exit code, or ``None`` if still running after ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def finish(self) -> None:
        """Waits for the reader and closes the files."""
        self._reader.join(timeout=10)
        self.proc.stdout.close()
        self._stderr.close()

    def stderr_tail(self, lines: int = 15) -> str:
        text = self.stderr_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def seen(self, event: str, step: int) -> bool:
        """Whether the worker printed ``event step``."""
        return any(w[0] == event and w[1:] == [str(step)] for _, w in self.events)

    def where(self) -> str:
        """What the worker was doing, from its events so far."""
        step, evaluating, ready = None, None, False
        for _, words in list(self.events):
            if words[0] == "ready":
                ready, step = True, int(words[1])
            elif words[0] == "step":
                step = int(words[1])
            elif words[0] == "eval":
                evaluating = int(words[1])
            elif words[0] == "evaluated":
                evaluating = None
            elif words[0] == "done":
                return "after writing final.npz"
        if not ready:
            return "during start-up (before 'ready': imports, restore, log cut)"
        if evaluating is not None:
            return f"during the evaluation at step {evaluating}"
        return f"after step {step} (started at step {self.start_step})"


def _tmp_entries(ckpt_dir: Path) -> dict[str, int]:
    """The orbax temporaries in ``ckpt_dir``: name -> inode."""
    out = {}
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if TMP_MARK in name:
            try:
                out[name] = os.stat(ckpt_dir / name).st_ino
            except FileNotFoundError:
                pass
    return out


def _listing(ckpt_dir: Path) -> list[str]:
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return sorted(
        names, key=lambda n: (int(n.split(".")[0]) if n[0].isdigit() else -1, n)
    )


def _tmp_step(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


# ----------------------------------------------------------------------------
# kills


def _kill_now(worker: Worker, kill: Kill, saving: str | None = None) -> None:
    """SIGKILL now. The kill landed during a save if an orbax temporary that this
    process made (``saving`` first, if given) existed just before the kill and
    is still there once the process is dead."""
    kill.checkpoints_before = _listing(worker.ckpt_dir)
    live = {
        name: ino
        for name, ino in _tmp_entries(worker.ckpt_dir).items()
        if worker.leftovers.get(name) != ino
    }
    kill.where = worker.where()
    kill.at = worker.elapsed()
    worker.kill()
    kill.landed = True
    kill.checkpoints_after = _listing(worker.ckpt_dir)
    after = _tmp_entries(worker.ckpt_dir)
    unfinished = [name for name, ino in live.items() if after.get(name) == ino]
    if saving is not None:
        kill.saving = saving
        unfinished = [name for name in unfinished if name == saving]
    elif unfinished:
        kill.saving = unfinished[0]
    kill.during_save = bool(unfinished)


def _wait_ready(worker: Worker, trial: Trial) -> bool:
    worker.ready.wait(PROCESS_TIMEOUT)
    if worker.start_step is None:
        worker.wait()
        trial.problems.append(
            f"worker exited with {worker.proc.returncode} before 'ready':\n"
            + worker.stderr_tail()
        )
        return False
    return True


def _run_kill(
    worker: Worker, kind: str, rng: random.Random, campaign: Campaign, trial: Trial
) -> Kill:
    """Kills ``worker`` as ``kind`` says; the `Kill` says where it landed."""
    kill = Kill(kind)
    if kind == "start":
        delay = rng.uniform(0.0, float(np.median(campaign.ready_times)))
        if worker.wait(delay) is None:
            _kill_now(worker, kill)
        return kill
    if not _wait_ready(worker, trial):
        return kill
    left = campaign.config.num_steps - worker.start_step
    if left <= 0:
        return kill  # resumed from the final checkpoint: nothing left to kill
    if kind == "run":
        _kill_in_run(worker, kill, rng, campaign)
    elif kind == "save":
        _kill_in_save(worker, kill, rng, campaign.config, left)
    elif kind == "eval":
        _kill_in_eval(worker, kill, rng, campaign)
    else:
        raise ValueError(f"unknown kind of kill {kind!r}")
    return kill


def _kill_in_run(worker, kill, rng, campaign: Campaign) -> None:
    """At a random point of a random step: after the worker reports step ``k``
    (``k`` uniform over the steps left, ``ready`` for the first), within the time
    the reference took from there to the next step (to ``done`` after the last)."""
    marks, n = campaign.reference_marks, campaign.config.num_steps
    k = rng.randint(worker.start_step, n)
    if k == n:
        window = 0.9 * (campaign.reference_done - marks[n])
    elif k == worker.start_step:
        window = marks[1] - marks[0]  # compilation and the first step
    else:
        window = marks[k + 1] - marks[k]
    while k > worker.start_step and not worker.seen("step", k):
        if not worker.alive():
            return
        time.sleep(0.001)
    if worker.wait(rng.uniform(0.0, window)) is None:
        _kill_now(worker, kill)


def _kill_in_save(worker, kill, rng, config: WorkerConfig, left: int) -> None:
    """While a save this process started is in progress (the ``skip``-th from now
    on): its orbax temporary exists just before the kill."""
    skip = rng.randrange(max(left // config.every_steps, 1))
    seen: list[str] = []
    while worker.alive():
        for name, ino in _tmp_entries(worker.ckpt_dir).items():
            key = f"{name}#{ino}"
            if worker.leftovers.get(name) == ino or key in seen:
                continue  # left by an earlier kill, or a save already skipped
            if _tmp_step(name) <= worker.start_step:
                continue
            seen.append(key)
            if len(seen) <= skip or _inode(worker.ckpt_dir / name) != ino:
                continue  # skipped, or finished meanwhile
            _kill_now(worker, kill, saving=name)
            return
        time.sleep(0.001)


def _kill_in_eval(worker, kill, rng, campaign: Campaign) -> None:
    """During an evaluation at a checkpointed step: once that checkpoint is complete
    (an evaluation that ends first is let go), or, at the last such step, after
    80% of the reference's evaluation time in any case."""
    config, start = campaign.config, worker.start_step
    n = config.num_steps
    targets = [
        s
        for s in range(start + 1, n + 1)
        if s % config.every_steps == 0 and (s % config.eval_every == 0 or s == n)
    ]
    targets = targets[rng.randrange(len(targets)) :] if targets else []
    began = None
    while targets and worker.alive():
        step = targets[0]
        if worker.seen("evaluated", step):
            targets.pop(0)  # its checkpoint was not complete in time: the next
            began = None
        elif worker.seen("eval", step):
            began = began or time.monotonic()
            last_call = len(targets) == 1 and (
                time.monotonic() - began > 0.8 * campaign.reference_eval
            )
            if last_call or (worker.ckpt_dir / str(step)).is_dir():
                _kill_now(worker, kill)
                return
        time.sleep(0.001)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


# ----------------------------------------------------------------------------
# comparison


def compare_runs(reference: Path, run: Path) -> list[str]:
    """What differs between a run directory and the reference's (empty if none)."""
    problems = _compare_arrays(reference / "final.npz", run / "final.npz")
    problems += _compare_records(reference, run)
    ref_h, run_h = reference / "hparams.json", run / "hparams.json"
    if not run_h.exists():
        problems.append("hparams.json missing")
    elif json.loads(ref_h.read_text()) != json.loads(run_h.read_text()):
        problems.append(
            f"hparams.json differs: {run_h.read_text()!r} != {ref_h.read_text()!r}"
        )
    return problems


def _compare_arrays(ref_path: Path, run_path: Path) -> list[str]:
    if not run_path.exists():
        return ["final.npz missing"]
    with np.load(ref_path) as a, np.load(run_path) as b:
        if sorted(a.files) != sorted(b.files):
            return [
                f"final.npz arrays differ: {sorted(set(a.files) ^ set(b.files))} "
                "are not in both"
            ]
        out = []
        for name in a.files:
            x, y = a[name], b[name]
            if x.dtype != y.dtype or x.shape != y.shape:
                out.append(
                    f"final state {name}: {y.dtype}{list(y.shape)} != reference "
                    f"{x.dtype}{list(x.shape)}"
                )
            elif not np.array_equal(x, y):
                diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
                out.append(
                    f"final state {name} not bitwise equal: {int((x != y).sum())} of "
                    f"{x.size} elements differ, max |diff| {diff.max():.3g}"
                )
        return out


def _read_records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    records, problems = [], []
    for i, line in enumerate(path.read_text().splitlines()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            problems.append(f"metrics.jsonl line {i + 1} is not JSON: {line!r}")
    return records, problems


def _key(record: dict[str, Any]) -> str:
    return f"{record.get('split')}@{record.get('step')}"


def _compare_records(reference: Path, run: Path) -> list[str]:
    if not (run / "metrics.jsonl").exists():
        return ["metrics.jsonl missing"]
    ref, _ = _read_records(reference / "metrics.jsonl")
    got, problems = _read_records(run / "metrics.jsonl")
    ref_keys, got_keys = [_key(r) for r in ref], [_key(r) for r in got]
    ref_n, got_n = collections.Counter(ref_keys), collections.Counter(got_keys)
    missing = sorted((ref_n - got_n).elements(), key=ref_keys.index)
    extra = sorted((got_n - ref_n).elements(), key=got_keys.index)
    if missing:
        problems.append(f"metrics.jsonl lacks records {missing}")
    if extra:
        dup = [k for k in extra if k in ref_n]
        new = [k for k in extra if k not in ref_n]
        if dup:
            problems.append(f"metrics.jsonl repeats records {dup}")
        if new:
            problems.append(f"metrics.jsonl has records not in the reference {new}")
    if not missing and not extra and ref_keys != got_keys:
        i = next(
            i for i, (a, b) in enumerate(zip(ref_keys, got_keys, strict=True)) if a != b
        )
        problems.append(
            f"metrics.jsonl records out of order at line {i + 1}: {got_keys[i]} "
            f"where the reference has {ref_keys[i]}"
        )
    got_by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in got:
        got_by_key[_key(r)].append(r)
    differing = []
    for r in ref:
        others = got_by_key.get(_key(r))
        if not others:
            continue
        other = others.pop(0)
        a = {k: v for k, v in r.items() if k not in TIMING_KEYS}
        b = {k: v for k, v in other.items() if k not in TIMING_KEYS}
        if a != b:
            fields = sorted(
                f"{k}: {b.get(k)!r} != reference {a.get(k)!r}"
                for k in set(a) | set(b)
                if a.get(k) != b.get(k)
            )
            differing.append(f"{_key(r)} ({'; '.join(fields)})")
    if differing:
        problems.append(
            f"metrics.jsonl values differ in {len(differing)} records: "
            + ", ".join(differing[:3])
            + (" ..." if len(differing) > 3 else "")
        )
    return problems


# ----------------------------------------------------------------------------
# the campaign


def plan_kills(mode: Mode, seed: int, trials: int | None = None) -> list[list[str]]:
    """The kinds of kill of each trial, from ``seed``: ``mode.kinds`` in a random
    order, or drawn by `KIND_WEIGHTS` with at least ``mode.min_save_kills + 2``
    save kills (a margin for saves that finish before the kill lands). An eval
    kill comes last in its trial: it may land in the final evaluation, after
    which nothing is left to kill."""
    rng = random.Random(seed)
    if mode.kinds:
        plan = [rng.sample(mode.kinds, len(mode.kinds))]
    else:
        kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
        plan = [
            rng.choices(kinds, weights, k=rng.choice(mode.kills_per_trial))
            for _ in range(trials if trials is not None else mode.trials)
        ]
        want = mode.min_save_kills + 2
        slots = [(t, i) for t, kills in enumerate(plan) for i in range(len(kills))]
        rng.shuffle(slots)
        have = sum(k == "save" for kills in plan for k in kills)
        for t, i in slots:
            if have >= want:
                break
            if plan[t][i] != "save":
                plan[t][i] = "save"
                have += 1
    return [sorted(kills, key=lambda kind: kind == "eval") for kills in plan]


def _reference(campaign: Campaign, work_dir: Path) -> Path:
    run_dir = work_dir / "reference"
    worker = Worker(run_dir, campaign.config, 0, campaign.pztrain_dir)
    code = worker.wait()
    worker.finish()
    if code != 0:
        raise RuntimeError(
            f"the reference run failed ({code}):\n{worker.stderr_tail(40)}"
        )
    ready = [t for t, w in worker.events if w[0] == "ready"]
    done = [t for t, w in worker.events if w[0] == "done"]
    campaign.reference_ready, campaign.reference_train = ready[0], done[0] - ready[0]
    campaign.ready_times.append(ready[0])
    campaign.reference_done = done[0]
    campaign.reference_marks = {0: ready[0]}  # when step k was reported
    campaign.reference_marks.update(
        (int(w[1]), t) for t, w in worker.events if w[0] == "step"
    )
    began = {w[1]: t for t, w in worker.events if w[0] == "eval"}
    took = [t - began[w[1]] for t, w in worker.events if w[0] == "evaluated"]
    campaign.reference_eval = float(np.median(took))
    return run_dir


def run_trial(campaign: Campaign, reference: Path, trial: Trial) -> Trial:
    """Runs one trial: its kills, the restarts until a run ends, the comparison."""
    t0 = time.monotonic()
    rng = random.Random(trial.seed)
    plan = list(trial.plan)
    while not trial.problems:
        trial.processes += 1
        worker = Worker(
            trial.run_dir, campaign.config, trial.processes, campaign.pztrain_dir
        )
        try:
            if plan:
                kill = _run_kill(worker, plan.pop(0), rng, campaign, trial)
                trial.kills.append(kill)
                if kill.landed:
                    continue  # restart: resume from the newest checkpoint
            if trial.problems:
                break
            code = worker.wait()
            if code is None:
                trial.problems.append(f"worker timed out after {PROCESS_TIMEOUT} s")
            elif code != 0:
                trial.problems.append(
                    f"worker {trial.processes} exited with {code}:\n"
                    + worker.stderr_tail()
                )
            break  # the run ended
        finally:
            if worker.alive():
                worker.kill()
            worker.finish()
            if worker.ready_at is not None:
                campaign.ready_times.append(worker.ready_at)
    if not trial.problems:
        trial.problems += compare_runs(reference, trial.run_dir)
        trial.problems += _diagnose(trial)
    trial.seconds = time.monotonic() - t0
    return trial


def _diagnose(trial: Trial) -> list[str]:
    """Notes on lost eval records that a kill during that evaluation explains."""
    notes = []
    for problem in trial.problems:
        if not problem.startswith("metrics.jsonl lacks records"):
            continue
        for key in problem.split("[", 1)[1].rstrip("]").split(", "):
            split, step = key.strip("'").split("@")
            for i, k in enumerate(trial.landed):
                if (
                    split != "eval"
                    or k.where != f"during the evaluation at step {step}"
                ):
                    continue
                complete = step in k.checkpoints_before
                notes.append(
                    f"diagnosis: eval@{step} was lost after kill {i + 1}, during the "
                    f"evaluation at step {step} with checkpoint {step} "
                    + (
                        "complete: the resumed run starts at that step and does "
                        "not evaluate it again"
                        if complete
                        else "not complete"
                    )
                )
    return notes


def run_campaign(
    work_dir: str | os.PathLike,
    *,
    full: bool = False,
    seed: int | None = None,
    config: WorkerConfig = WorkerConfig(),
    pztrain_dir: str | os.PathLike = ROOT,
    log: Callable[[str], None] = print,
) -> Campaign:
    """Runs the campaign in ``work_dir``; returns its trials and figures.

    Args:
      work_dir: Where the run directories go (``reference``, ``trial-NN``).
      full: Full mode (20 trials, >= 20 kills, >= 5 during saves) instead of the
        reduced one (1 trial, 3 kills, >= 1 during a save).
      seed: The campaign's seed (default: from the clock); logged.
      config: The worker's options.
      pztrain_dir: The directory the workers import pztrain from.
      log: Where progress lines go.
    """
    t0 = time.monotonic()
    mode = FULL if full else REDUCED
    seed = int(time.time() * 1000) % 1_000_000 if seed is None else seed
    work_dir = Path(work_dir)
    campaign = Campaign(mode, seed, config, Path(pztrain_dir).resolve())
    plan = plan_kills(mode, seed)
    log(
        f"kill campaign, {mode.name} mode, seed {seed}, pztrain from "
        f"{campaign.pztrain_dir}, plan {plan}"
    )
    reference = _reference(campaign, work_dir)
    log(
        f"reference: {campaign.reference_ready:.1f} s to ready, "
        f"{campaign.reference_train:.1f} s of training"
    )
    extra_rng = random.Random(seed + 1)
    index = 0
    while True:
        if index < len(plan):
            kinds = plan[index]
        elif index < len(plan) + mode.max_extra_trials and campaign.shortfall():
            short = campaign.save_kills < mode.min_save_kills
            kinds = ["save"] if short else [extra_rng.choice(list(KIND_WEIGHTS))]
            log(f"adding trial {index + 1}: {'; '.join(campaign.shortfall())}")
        else:
            break
        trial = Trial(
            index + 1, seed * 1000 + index, kinds, work_dir / f"trial-{index + 1:02d}"
        )
        campaign.trials.append(run_trial(campaign, reference, trial))
        log(trial.describe())
        index += 1
    campaign.seconds = time.monotonic() - t0
    log(campaign.summary())
    return campaign


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full campaign")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--work-dir", default=None, help="default: a temporary dir")
    parser.add_argument(
        "--pztrain",
        default=str(ROOT),
        help="the directory holding the pztrain package to test (default: this "
        "checkout; e.g. a `git archive` of a commit, away from edits in progress)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run directories after success"
    )
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="pztrain-kills-"))
    campaign = run_campaign(
        work_dir, full=args.full, seed=args.seed, pztrain_dir=args.pztrain
    )
    if campaign.ok and not args.keep and args.work_dir is None:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        print(f"run directories: {work_dir}")
    return 0 if campaign.ok else 1


if __name__ == "__main__":
    sys.exit(main())
