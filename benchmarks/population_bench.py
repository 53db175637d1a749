"""Populations: K runs of one model trained as one program, against K separate
runs and a hand-written ``jax.jit(jax.vmap(step))``.

Run from the repository root::

    python benchmarks/population_bench.py --quick      # < 60 s on 2 CPU cores
    python benchmarks/population_bench.py              # full: 4-7 minutes
    python benchmarks/population_bench.py --gc off --json out.json

Every column trains the same dict-of-arrays MLP (``step_bench.py``'s W0 or W1:
He-normal weights, zero biases, ReLU, softmax cross-entropy) with Adam through
``optax.inject_hyperparams(optax.adam)``, member ``i`` starting from
``init_params(seed=i)`` with its own learning rate (log-spaced from 1e-4 to
1e-2), all on one batch kept on the device and shared by the members. The
speed is in member-steps per second (one optimizer step of one member).

Columns (sections 1-3):

* ``hand`` (the baseline): a hand-written step (``value_and_grad`` + optax
  update + ``fold_in(key, step)``) mapped with ``jax.vmap`` over a stacked
  params / optimizer-state / key pytree (the step counter shared) and
  jitted with ``donate_argnums`` on the counter, params and optimizer state.
* ``hand_min``: the minimal hand-written step: ``jax.jit(jax.vmap(step),
  donate_argnums=(0, 1))`` taking params and optimizer state (and the batch)
  and returning them with the loss per member; no step counter, no keys.
  What ``hand`` adds (the counter taken, donated and returned, the keys) is
  what a train state carries; ``population / hand_min`` is the population's
  pace against the least a vmapped step can do.
* ``separate``: K pztrain runs as a user writes them: K `pztrain.TrainState` s
  (one optimizer object shared, each with its learning rate set by
  ``with_hyperparams``), one ``train_step``, and each step a Python loop over
  the K states.
* ``population``: ``pztrain.make_population`` + ``train_step(pop, x=x, y=y)``
  (one jitted program, ``jax.vmap`` over the members inside, donation on).
* ``single``: one pztrain run alone (a reference: the most that K separate runs
  called one after another could reach, each at a single run's speed).

Section 4: ``pztrain.fit`` on a W0 population of 16 (an on-device
``ArrayLoader`` of 4096 examples, ``log_every=100``, ``progress=False``, no
logger or run directory) against a hand-written loop of the ``hand`` step over
the same batches (``loader.batch_at(step)``, put on the device beforehand).
Each trial is one ``fit`` call of ``--fit-steps`` more steps (3000 by default)
so that its fixed cost per call (set-up, the first epoch's permutation, the
end) is small; that fixed cost is measured apart and printed.

Section 5: ``train_step.lower(pop, ...).compile().memory_analysis()`` against
K × (params + optimizer state of one member) + K × one batch's activations
(4 bytes × batch × (Σ layer inputs + Σ layer outputs): the values the backward
pass reads), and against the hand-written step's.

Timing: each runner is built and called once (compiled), then its trial is
sized to ``--trial-seconds``. Each round runs, for each garbage-collector mode
(``--gc both``: off, then on), every column once in a shuffled (seeded) order
with a baseline trial before and after each one (B X B Y B …); a trial makes
its calls with no host sync and blocks on the last output. A column's figure is
the median over rounds of its member-steps/s over the mean of the two baseline
trials around it; a ratio of two columns (``population / separate``) is the
median over rounds of the quotient of their two paired ratios. With the
collector off (as ``timeit`` does) ``gc.collect()`` runs between rounds only;
with it on, collections happen where the allocations make them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pztrain

SEED = 0
FIT_EXAMPLES = 4096
FIT_LOG_EVERY = 100


# ----------------------------------------------------------------------------
# the model, data and optimizer


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    sizes: tuple[int, ...]
    batch: int


WORKLOADS = {
    "W0": Workload("W0", "MLP 8-8-8-2, batch 8", (8, 8, 8, 2), 8),
    "W1": Workload("W1", "MLP 64-256-256-10, batch 128", (64, 256, 256, 10), 128),
}


def init_params(sizes: tuple[int, ...], seed: int) -> dict[str, jax.Array]:
    """A dict-of-arrays MLP: He-normal weights, zero biases."""
    params = {}
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    for i, (k, n_in, n_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = jax.random.normal(k, (n_in, n_out)) * np.sqrt(2.0 / n_in)
        params[f"b{i}"] = jnp.zeros((n_out,))
    return params


def mlp_apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    for i in range(len(params) // 2):
        if i:
            x = jax.nn.relu(x)
        x = x @ params[f"w{i}"] + params[f"b{i}"]
    return x


def mlp_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    logits = mlp_apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def loss_fn(*, model, state, rng, x, y):
    """pztrain's (penzai's) loss-function contract; the key is not used."""
    del rng
    loss = mlp_loss(model, x, y)
    return loss, state, {"loss": loss}


def make_tx() -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


def learning_rates(k: int) -> np.ndarray:
    return np.geomspace(1e-4, 1e-2, k).astype(np.float32)


def _tree_nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


class Problem:
    """One workload with K members: the shared batch and the initial states.

    Every ``*_state`` / ``population`` call makes new arrays, so a runner that
    donates them harms no other.
    """

    def __init__(self, workload: Workload, k: int):
        self.workload, self.k = workload, k
        key_x, key_y = jax.random.split(jax.random.key(SEED + 1000))
        w = workload
        self.x = jax.random.normal(key_x, (w.batch, w.sizes[0]))
        self.y = jax.random.randint(key_y, (w.batch,), 0, w.sizes[-1])
        self.lrs = learning_rates(k)

    def init(self, seed: int, tx: Any = None) -> pztrain.TrainState:
        """One run's state (``make_population``'s ``init``)."""
        return pztrain.TrainState.initial_state(
            init_params(self.workload.sizes, seed),
            make_tx() if tx is None else tx,
            jax.random.key(seed),
        )

    def population(self) -> pztrain.TrainState:
        return pztrain.make_population(
            self.init, seeds=range(self.k), learning_rate=list(self.lrs)
        )

    def stacked(self) -> tuple[dict[str, jax.Array], Any, jax.Array, Any]:
        """The hand-written step's ``(params, opt_state, keys, tx)``: the same
        params, learning rates and keys as the population's."""
        tx = make_tx()
        members = [init_params(self.workload.sizes, s) for s in range(self.k)]
        params = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
        opt_state = jax.vmap(tx.init)(params)
        hyper = dict(opt_state.hyperparams)
        hyper["learning_rate"] = jnp.asarray(self.lrs, jnp.float32)
        opt_state = opt_state._replace(hyperparams=hyper)
        keys = jnp.stack([jax.random.key(s) for s in range(self.k)])
        return params, opt_state, keys, tx

    def activation_bytes(self) -> int:
        """4 bytes × batch × (Σ layer inputs + Σ layer outputs)."""
        sizes = self.workload.sizes
        return 4 * self.workload.batch * (sum(sizes[:-1]) + sum(sizes[1:]))


# ----------------------------------------------------------------------------
# runners


@dataclasses.dataclass
class Runner:
    """A ready training loop.

    Attributes:
      run: ``run(n)`` makes ``n`` calls (``n * member_steps`` member-steps)
        without a host sync, keeps the new state, returns something to block on.
      member_steps: Member-steps per call.
      lower: Lowers the jitted step for the current state (memory statistics).
      state_bytes: Bytes of params + optimizer state (all members).
    """

    run: Callable[[int], Any]
    member_steps: int
    lower: Callable[[], Any] | None = None
    state_bytes: int | None = None
    train_step: Any = None  # pztrain's, for TrainStep.memory
    holder: list[Any] | None = None  # the current state (and steps done)


def hand_step(tx: Any) -> Callable[..., Any]:
    """The hand-written population step: ``(step, params, opt_state, keys, x,
    y) -> (step + 1, params, opt_state, losses)``, jitted, donating the step,
    params and optimizer state."""

    def one(step, params, opt_state, key, x, y):
        rng = jax.random.fold_in(key, step)  # the step's key, as pztrain makes it
        del rng  # the loss does not use it (nor does pztrain's loss_fn)
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mapped = jax.vmap(one, in_axes=(None, 0, 0, 0, None, None))

    def step_fn(step, params, opt_state, keys, x, y):
        params, opt_state, losses = mapped(step, params, opt_state, keys, x, y)
        return step + 1, params, opt_state, losses

    return jax.jit(step_fn, donate_argnums=(0, 1, 2))


def build_hand_min(problem: Problem) -> Runner:
    """The minimal hand-written population step: params and optimizer state in
    (donated), params, optimizer state and the loss per member out."""
    params, opt_state, _, tx = problem.stacked()

    def one(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mapped = jax.vmap(one, in_axes=(0, 0, None, None))
    step = jax.jit(mapped, donate_argnums=(0, 1))
    carry = [params, opt_state]
    x, y = problem.x, problem.y

    def run(n: int) -> Any:
        p, o = carry
        losses = None
        for _ in range(n):
            p, o, losses = step(p, o, x, y)
        carry[:] = [p, o]
        return losses

    return Runner(run, problem.k, lower=lambda: step.lower(*carry, x, y))


def build_hand(problem: Problem) -> Runner:
    params, opt_state, keys, tx = problem.stacked()
    step = hand_step(tx)
    carry = [jnp.zeros((), jnp.int32), params, opt_state]
    x, y = problem.x, problem.y
    state_bytes = _tree_nbytes((params, opt_state))

    def run(n: int) -> Any:
        s, p, o = carry
        losses = None
        for _ in range(n):
            s, p, o, losses = step(s, p, o, keys, x, y)
        carry[:] = [s, p, o]
        return losses

    return Runner(
        run,
        problem.k,
        lower=lambda: step.lower(*carry, keys, x, y),
        state_bytes=state_bytes,
    )


def build_population(problem: Problem) -> Runner:
    holder = [problem.population()]
    step = pztrain.build_train_step(loss_fn)
    x, y = problem.x, problem.y
    state_bytes = _tree_nbytes((holder[0].params, holder[0].opt_state))

    def run(n: int) -> Any:
        pop, aux = holder[0], None
        for _ in range(n):
            pop, aux = step(pop, x=x, y=y)
        holder[0] = pop
        return aux["loss"]

    return Runner(
        run,
        problem.k,
        lower=lambda: step.lower(holder[0], x=x, y=y),
        state_bytes=state_bytes,
        train_step=step,
        holder=holder,
    )


def build_separate(problem: Problem) -> Runner:
    """K runs, one optimizer object, one train step, a Python loop over them."""
    tx = make_tx()
    states = [
        problem.init(s, tx).with_hyperparams(learning_rate=float(lr))
        for s, lr in enumerate(problem.lrs)
    ]
    step = pztrain.build_train_step(loss_fn)
    x, y, k = problem.x, problem.y, problem.k

    def run(n: int) -> Any:
        losses = None
        for _ in range(n):
            losses = []
            for i in range(k):
                states[i], aux = step(states[i], x=x, y=y)
                losses.append(aux["loss"])
        return losses

    return Runner(run, k)


def build_single(problem: Problem) -> Runner:
    """One pztrain run (member 0) alone."""
    holder = [problem.init(0).with_hyperparams(learning_rate=float(problem.lrs[0]))]
    step = pztrain.build_train_step(loss_fn)
    x, y = problem.x, problem.y

    def run(n: int) -> Any:
        state, aux = holder[0], None
        for _ in range(n):
            state, aux = step(state, x=x, y=y)
        holder[0] = state
        return aux["loss"][None]

    return Runner(run, 1)


STEP_COLUMNS = {
    "hand": ("hand-written jit(vmap) (baseline)", build_hand),
    "hand_min": ("minimal hand-written jit(vmap): no counter, no keys", build_hand_min),
    "separate": ("K separate pztrain runs", build_separate),
    "population": ("pztrain population", build_population),
    "single": ("one pztrain run alone", build_single),
}


# fit against a hand-written loop


class FitData:
    """The fit section's data: ``FIT_EXAMPLES`` examples, an on-device
    ``ArrayLoader`` and the same batches, step by step, on the device."""

    def __init__(self, problem: Problem, steps: int):
        w = problem.workload
        rng = np.random.default_rng(SEED)
        self.arrays = {
            "x": rng.normal(size=(FIT_EXAMPLES, w.sizes[0])).astype(np.float32),
            "y": rng.integers(0, w.sizes[-1], size=FIT_EXAMPLES).astype(np.int32),
        }
        self.loader = pztrain.ArrayLoader(
            self.arrays, w.batch, seed=SEED, on_device=True
        )
        # The hand loop's batches: those of steps 0 .. steps - 1 (then again).
        self.batches = [
            jax.device_put(self.loader.batch_at(s)) for s in range(max(1, steps))
        ]


def build_fit(problem: Problem, data: FitData) -> Runner:
    """One ``pztrain.fit`` call of ``n`` more steps per ``run(n)``."""
    step = pztrain.build_train_step(loss_fn)
    holder = [problem.population(), 0]

    def run(n: int) -> Any:
        pop, done = holder
        pop, _ = pztrain.fit(
            pop,
            step,
            data.loader,
            num_steps=done + n,
            log_every=FIT_LOG_EVERY,
            progress=False,
            loggers=[],
        )
        holder[:] = [pop, done + n]
        return pop.params

    return Runner(run, problem.k, train_step=step, holder=holder)


def build_hand_loop(problem: Problem, data: FitData) -> Runner:
    """The ``hand`` step called on the fit section's batches, in fit's order."""
    params, opt_state, keys, tx = problem.stacked()
    step = hand_step(tx)
    carry = [jnp.zeros((), jnp.int32), params, opt_state, 0]
    batches = data.batches

    def run(n: int) -> Any:
        s, p, o, done = carry
        for i in range(done, done + n):
            b = batches[i % len(batches)]
            s, p, o, _ = step(s, p, o, keys, b["x"], b["y"])
        carry[:] = [s, p, o, done + n]
        return p

    return Runner(run, problem.k, holder=carry)


# ----------------------------------------------------------------------------
# measuring


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int
    trial_seconds: float
    fit_steps: int
    gc_modes: tuple[str, ...]
    fixed_cost_samples: int


QUICK = Settings(3, 0.03, 200, ("off", "on"), 3)
FULL = Settings(21, 0.25, 3000, ("off", "on"), 15)

_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _timed(runner: Runner, n: int) -> float:
    start = time.perf_counter()
    jax.block_until_ready(runner.run(n))
    return time.perf_counter() - start


def _size(runner: Runner, seconds: float) -> int:
    """Calls per trial for about ``seconds`` (at least one)."""
    n = 1
    elapsed = _timed(runner, n)
    while elapsed < seconds / 3 and n < 1 << 16:
        n *= 2
        elapsed = _timed(runner, n)
    # The fastest of three, so that one slow stretch does not shorten trials.
    elapsed = min(elapsed, _timed(runner, n), _timed(runner, n))
    return max(1, round(seconds * n / elapsed))


def _first_losses(out: Any) -> np.ndarray:
    if isinstance(out, list):
        out = jnp.stack(out)
    return np.asarray(out, dtype=np.float64).ravel()


def interleave(
    runners: dict[str, Runner],
    calls: dict[str, int],
    baseline: str,
    settings: Settings,
    label: str,
) -> dict[str, Any]:
    """Interleaved rounds; per GC mode, each column's member-steps/s and its
    ratios to the baseline trials around it."""
    others = [k for k in runners if k != baseline]
    order = random.Random(SEED)
    out: dict[str, Any] = {}
    for mode in settings.gc_modes:
        out[mode] = {
            "rates": {k: [] for k in runners},
            "ratios": {k: [] for k in others},
        }

    def trial(key: str, mode: str) -> float:
        if mode == "off":
            gc.disable()
        try:
            elapsed = _timed(runners[key], calls[key])
        finally:
            gc.enable()
        rate = calls[key] * runners[key].member_steps / elapsed
        out[mode]["rates"][key].append(rate)
        return rate

    for rnd in range(settings.rounds):
        for mode in settings.gc_modes:
            gc.collect()
            order.shuffle(others)
            before = trial(baseline, mode)
            for key in others:
                rate = trial(key, mode)
                after = trial(baseline, mode)
                out[mode]["ratios"][key].append(rate / ((before + after) / 2))
                before = after
        _log(f"  {label}: round {rnd + 1}/{settings.rounds} done")
    for mode in settings.gc_modes:
        res = out[mode]
        res["median_rate"] = {k: statistics.median(v) for k, v in res["rates"].items()}
        res["median_ratio"] = {
            k: statistics.median(v) for k, v in res["ratios"].items()
        }
        res["median_ratio"][baseline] = 1.0
    return out


def paired(result: dict[str, Any], mode: str, a: str, b: str, baseline: str) -> float:
    """Median over rounds of column ``a``'s paired ratio over column ``b``'s."""
    ratios = result[mode]["ratios"]
    if a == baseline:
        return statistics.median(1 / r for r in ratios[b])
    if b == baseline:
        return statistics.median(ratios[a])
    return statistics.median(x / y for x, y in zip(ratios[a], ratios[b], strict=True))


def measure_steps(
    workload: Workload, k: int, columns: list[str], settings: Settings
) -> dict[str, Any]:
    """Sections 1-3: the step columns on one workload and population size."""
    label = f"{workload.name} K={k}"
    problem = Problem(workload, k)
    runners: dict[str, Runner] = {}
    calls: dict[str, int] = {}
    first: dict[str, np.ndarray] = {}
    compile_s: dict[str, float] = {}
    for key in columns:
        gc.collect()
        start = time.perf_counter()
        runner = STEP_COLUMNS[key][1](problem)
        out = jax.block_until_ready(runner.run(1))
        compile_s[key] = time.perf_counter() - start
        first[key] = _first_losses(out)
        calls[key] = _size(runner, settings.trial_seconds)
        runners[key] = runner
    _log(f"  {label}: runners built and sized")
    result = interleave(runners, calls, "hand", settings, label)
    ref = first["hand"]
    spread = max(float(np.max(np.abs(v - ref[: len(v)]))) for key, v in first.items())
    return {
        "name": label,
        "workload": workload.name,
        "title": workload.title,
        "k": k,
        "columns": columns,
        "calls_per_trial": calls,
        "build_and_first_call_s": compile_s,
        "first_loss_spread": spread,
        "timing": result,
        "runners": runners,  # dropped before JSON
        "problem": problem,
    }


def measure_fit(workload: Workload, k: int, settings: Settings) -> dict[str, Any]:
    """Section 4: fit against the hand-written loop over the same batches."""
    label = f"fit {workload.name} K={k}"
    problem = Problem(workload, k)
    data = FitData(problem, min(settings.fit_steps, 8 * 512))
    runners = {
        "hand_loop": build_hand_loop(problem, data),
        "fit": build_fit(problem, data),
    }
    # The first call of each (compiles); then both have trained FIT_LOG_EVERY
    # steps on the same batches and must agree.
    for runner in runners.values():
        jax.block_until_ready(runner.run(FIT_LOG_EVERY))
    fit_params = runners["fit"].holder[0].params
    hand_params = runners["hand_loop"].holder[1]
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(fit_params), jax.tree.leaves(hand_params), strict=True
        )
    )
    calls = dict.fromkeys(runners, settings.fit_steps)
    _log(f"  {label}: runners built")
    result = interleave(runners, calls, "hand_loop", settings, label)

    # fit's fixed cost per call (set-up, the epoch's device permutation, the
    # end): a fit call of one step less one step of the hand loop, paired.
    gc.collect()
    fixed = []
    for _ in range(settings.fixed_cost_samples):
        a = _timed(runners["hand_loop"], 1)
        b = _timed(runners["fit"], 1)
        c = _timed(runners["hand_loop"], 1)
        fixed.append(b - (a + c) / 2)
    return {
        "name": label,
        "workload": workload.name,
        "title": workload.title,
        "k": k,
        "steps_per_trial": settings.fit_steps,
        "log_every": FIT_LOG_EVERY,
        "params_max_abs_diff_after_first_call": diff,
        "fixed_cost_s": fixed,
        "median_fixed_cost_s": statistics.median(fixed),
        "timing": result,
    }


def measure_memory(section: dict[str, Any]) -> dict[str, Any]:
    """Section 5 for one configuration of sections 1-3."""
    problem: Problem = section["problem"]
    pop = section["runners"]["population"]
    hand = section["runners"]["hand"]
    k = problem.k
    ma = pop.lower().compile().memory_analysis()
    step_memory = pop.train_step.memory(pop.holder[0], x=problem.x, y=problem.y)
    hand_ma = hand.lower().compile().memory_analysis()
    one = problem.init(0)
    member_state = _tree_nbytes((one.params, one.opt_state))
    member_params = _tree_nbytes(one.params)
    act = problem.activation_bytes()
    bound = k * (member_state + act)

    def total(m: Any) -> int:
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    need = total(ma)
    return {
        "name": section["name"],
        "k": k,
        "arguments": ma.argument_size_in_bytes,
        "outputs": ma.output_size_in_bytes,
        "temporaries": ma.temp_size_in_bytes,
        "aliased": ma.alias_size_in_bytes,
        "total": need,
        "train_step_memory_total": step_memory.total,
        "member_state_bytes": member_state,
        "population_state_bytes": pop.state_bytes,
        "activation_bytes_per_batch": act,
        "bound": bound,
        "holds": need <= bound,
        "member_params_bytes": member_params,
        "bound_with_grads": bound + k * member_params,
        "holds_with_grads": need <= bound + k * member_params,
        "state_donated": ma.alias_size_in_bytes >= pop.state_bytes,
        "hand_total": total(hand_ma),
        "hand_temporaries": hand_ma.temp_size_in_bytes,
        "hand_arguments": hand_ma.argument_size_in_bytes,
    }


# ----------------------------------------------------------------------------
# reporting


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _rate(r: float) -> str:
    return f"{r:,.0f}" if r >= 100 else f"{r:.3g}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _quartiles(values: list[float]) -> str:
    if len(values) < 4:
        return ""
    lo, _, hi = statistics.quantiles(values, n=4)
    return f" [{lo:.2f}–{hi:.2f}]"


def render_steps(section: dict[str, Any], modes: tuple[str, ...]) -> str:
    header = ["column"]
    for mode in modes:
        header += [f"member-steps/s, GC {mode}", f"× hand, GC {mode}"]
    rows = []
    for key in section["columns"]:
        row = [STEP_COLUMNS[key][0]]
        for mode in modes:
            t = section["timing"][mode]
            row.append(_rate(t["median_rate"][key]))
            ratio = t["median_ratio"][key]
            row.append(f"{ratio:.3f}" + _quartiles(t["ratios"].get(key, [])))
        rows.append(row)
    title = (
        f"### {section['name']}: {section['title']}, {section['k']} members "
        f"(calls per trial {section['calls_per_trial']})"
    )
    return f"{title}\n\n{_table(header, rows)}"


def render_fit(section: dict[str, Any], modes: tuple[str, ...]) -> str:
    header = ["column"]
    for mode in modes:
        header += [f"member-steps/s, GC {mode}", f"× hand loop, GC {mode}"]
    rows = []
    labels = {"hand_loop": "hand-written loop (baseline)", "fit": "pztrain.fit"}
    for key in ("hand_loop", "fit"):
        row = [labels[key]]
        for mode in modes:
            t = section["timing"][mode]
            row.append(_rate(t["median_rate"][key]))
            ratio = t["median_ratio"][key]
            row.append(f"{ratio:.3f}" + _quartiles(t["ratios"].get(key, [])))
        rows.append(row)
    per_trial = section["steps_per_trial"]
    hand_rate = section["timing"][modes[0]]["median_rate"]["hand_loop"]
    trial_s = per_trial * section["k"] / hand_rate
    fixed = section["median_fixed_cost_s"]
    return (
        f"### {section['name']}: fit on a {section['workload']} population of "
        f"{section['k']}, {per_trial} steps per fit call, log_every="
        f"{section['log_every']}\n\n{_table(header, rows)}\n\n"
        f"fit's fixed cost per call (a one-step fit call less one step of the "
        f"hand loop, median of {len(section['fixed_cost_s'])}): "
        f"{fixed * 1e3:.1f} ms, "
        f"{100 * fixed / trial_s:.1f}% of a {per_trial}-step trial "
        f"({trial_s * 1e3:.0f} ms). Params after the first "
        f"{section['log_every']} steps, fit against the hand loop: max |diff| "
        f"{section['params_max_abs_diff_after_first_call']:.1e}."
    )


def render_memory(rows_in: list[dict[str, Any]]) -> str:
    header = [
        "configuration",
        "arguments",
        "outputs",
        "temporaries",
        "aliased (donated)",
        "total",
        "K × state",
        "K × activations",
        "bound",
        "holds",
        "bound + K × grads",
        "holds",
        "hand-written total (temps)",
    ]
    rows = []
    for m in rows_in:
        rows.append(
            [
                m["name"],
                _bytes(m["arguments"]),
                _bytes(m["outputs"]),
                _bytes(m["temporaries"]),
                _bytes(m["aliased"])
                + ("" if m["state_donated"] else " (**not all the state**)"),
                _bytes(m["total"]),
                _bytes(m["k"] * m["member_state_bytes"]),
                _bytes(m["k"] * m["activation_bytes_per_batch"]),
                _bytes(m["bound"]),
                "yes" if m["holds"] else "**no**",
                _bytes(m["bound_with_grads"]),
                "yes" if m["holds_with_grads"] else "**no**",
                f"{_bytes(m['hand_total'])} ({_bytes(m['hand_temporaries'])})",
            ]
        )
    return (
        "### Memory of the population step (`train_step.lower(pop, ...).compile()"
        ".memory_analysis()`)\n\n"
        "total = arguments + outputs + temporaries − aliased (what "
        "`TrainStep.memory` calls total); state = params + optimizer state of "
        "one member; activations = one batch's, 4 B × batch × (Σ layer inputs + "
        "Σ layer outputs); bound = K × state + K × activations; grads = one "
        "member's params' bytes. The last column is the hand-written "
        "jit(vmap) step's.\n\n" + _table(header, rows)
    )


TARGETS = [
    # (section name, column a, column b, minimum of a / b)
    ("W0 K=16", "population", "separate", 10.0),
    ("W0 K=16", "population", "hand", 0.9),
    ("W0 K=16", "population", "hand_min", 0.9),
    ("W1 K=16", "population", "hand", 0.95),
    ("W1 K=16", "population", "hand_min", 0.9),
    ("W0 K=64", "population", "hand_min", 0.0),  # reported
    ("fit W0 K=16", "fit", "hand_loop", 0.9),
]


def check_targets(
    sections: list[dict[str, Any]], memory: list[dict[str, Any]], modes
) -> tuple[list[str], dict[str, Any]]:
    by_name = {s["name"]: s for s in sections}
    lines, results = [], {}
    for name, a, b, minimum in TARGETS:
        s = by_name.get(name)
        if s is None:
            continue
        base = "hand_loop" if name.startswith("fit") else "hand"
        parts, oks = [], []
        for mode in modes:
            got = paired(s["timing"], mode, a, b, base)
            results[f"{name} {a}/{b} gc {mode}"] = got
            oks.append(got >= minimum)
            parts.append(f"{got:.3f} (GC {mode})")
        verdict = "met" if all(oks) else ("**missed**" if not any(oks) else "mixed")
        lines.append(
            f"- {name}: {a} / {b} = {', '.join(parts)}; target ≥ {minimum}: {verdict}"
        )
    for s in sections:
        if "separate" in s.get("columns", ()):
            parts = [
                f"{paired(s['timing'], mode, 'population', 'single', 'hand'):.2f} "
                f"(GC {mode})"
                for mode in modes
            ]
            lines.append(
                f"- {s['name']} (no target): population / one run alone = "
                + ", ".join(parts)
            )
            parts = [
                f"{paired(s['timing'], mode, 'single', 'separate', 'hand'):.2f} "
                f"(GC {mode})"
                for mode in modes
            ]
            lines.append(
                f"- {s['name']} (no target): one run alone / separate (what a "
                "call of one of K states loses to a call of one state) = "
                + ", ".join(parts)
            )
    for m in memory:
        results[f"memory {m['name']}"] = m["holds"]
        same = "the same as" if m["total"] == m["hand_total"] else "against"
        lines.append(
            f"- memory {m['name']}: {_bytes(m['total'])} against K × state + K × "
            f"activations = {_bytes(m['bound'])}: "
            + ("holds" if m["holds"] else "**does not hold**")
            + f"; with K × grads added ({_bytes(m['bound_with_grads'])}): "
            + ("holds" if m["holds_with_grads"] else "**does not hold**")
            + f"; {same} the hand-written step's {_bytes(m['hand_total'])}"
        )
    return lines, results


def environment() -> dict[str, Any]:
    versions = {}
    for dist in ("jax", "jaxlib", "optax", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "devices": [str(d) for d in jax.devices()],
        "load_average_at_start": os.getloadavg(),
        "versions": versions,
    }


def _jsonable(section: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if k not in ("runners", "problem")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="3 short rounds, 200-step fit calls"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--trial-seconds", type=float, help="length of a step trial")
    parser.add_argument("--fit-steps", type=int, help="steps per fit call (trial)")
    parser.add_argument(
        "--gc",
        choices=("both", "off", "on"),
        default="both",
        help="Python's garbage collector during trials (default: both, in turn)",
    )
    parser.add_argument("--json", help="write every sample to this file")
    args = parser.parse_args(argv)

    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = dataclasses.replace(settings, rounds=max(1, args.rounds))
    if args.trial_seconds:
        settings = dataclasses.replace(settings, trial_seconds=args.trial_seconds)
    if args.fit_steps:
        settings = dataclasses.replace(settings, fit_steps=max(1, args.fit_steps))
    if args.gc != "both":
        settings = dataclasses.replace(settings, gc_modes=(args.gc,))
    modes = settings.gc_modes

    jax.config.update("jax_enable_compilation_cache", False)
    start = time.perf_counter()
    env = environment()
    all_columns = ["hand", "hand_min", "separate", "population", "single"]
    plan = [
        (WORKLOADS["W0"], 16, all_columns),
        (WORKLOADS["W0"], 64, all_columns),
        (WORKLOADS["W1"], 16, ["hand", "hand_min", "population"]),
    ]
    sections = []
    memory = []
    for workload, k, columns in plan:
        _log(f"{workload.name} K={k}: {workload.title}")
        section = measure_steps(workload, k, columns, settings)
        memory.append(measure_memory(section))
        section["runners"] = section["problem"] = None  # free the states
        sections.append(section)
    _log("fit W0 K=16")
    fit = measure_fit(WORKLOADS["W0"], 16, settings)
    elapsed = time.perf_counter() - start
    env["load_average_at_end"] = os.getloadavg()

    load = env["load_average_at_start"][0], env["load_average_at_end"][0]
    print(
        f"\n## population_bench ({'quick' if args.quick else 'full'}): "
        f"{env['cpu_count']} CPU cores, jax {env['versions']['jax']}, "
        f"{settings.rounds} interleaved rounds per GC mode ({', '.join(modes)}), "
        f"step trials of ~{settings.trial_seconds:g} s, {elapsed:.0f} s, 1-min "
        f"load average {load[0]:.1f} → {load[1]:.1f}\n"
    )
    print(
        "Member-steps/s: median over trials; × hand: median over rounds of the "
        "paired ratio to the hand-written jit(vmap) trials around it "
        "[quartiles].\n"
    )
    for section in sections:
        print(render_steps(section, modes))
        print(
            f"\nSame start: step-0 losses of every column within "
            f"{section['first_loss_spread']:.1e} of the hand-written step's.\n"
        )
    print(render_fit(fit, modes))
    print()
    print(render_memory(memory))
    lines, results = check_targets([*sections, fit], memory, modes)
    print("\n### Targets (ratios: medians over rounds of paired ratios)\n")
    print("\n".join(lines))
    if args.json:
        report = {
            "mode": "quick" if args.quick else "full",
            "settings": dataclasses.asdict(settings),
            "environment": env,
            "seconds": elapsed,
            "sections": [_jsonable(s) for s in sections],
            "fit": fit,
            "memory": memory,
            "targets": results,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
