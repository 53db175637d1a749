"""Metric states that merge (`pztrain.metric_states`): through `fit`'s train and
eval records and `evaluate`, each equal to the same metric computed over the
whole set at once; for a population, on a mesh, and the errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai import pz
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score

import pztrain
from pztrain.metric_states import (
    Confusion,
    Histogram,
    Last,
    Max,
    Mean,
    MetricStateError,
    Min,
    Perplexity,
    Ratio,
    Sum,
)

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _whole(labels: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """The four metrics over the whole set at once (scikit-learn)."""
    macro = {"average": "macro", "zero_division": 0}
    return {
        "accuracy": accuracy_score(labels, predicted),
        "precision": precision_score(labels, predicted, **macro),
        "recall": recall_score(labels, predicted, **macro),
        "f1": f1_score(labels, predicted, **macro),
    }


def _classes(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: metrics[f"classes/{k}"] for k in ("accuracy", "precision", "recall", "f1")
    }


def test_digits_f1_through_fit_and_evaluate_equals_the_whole_set():
    digits = _example("digits")
    train, valid, test = digits.load(0)
    model = digits.simple_mlp.MLP.from_config(
        name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[64, 32, 10]
    )
    state = pztrain.TrainState.initial_state(model, optax.adam(1e-2), jax.random.key(0))
    eval_step = pztrain.build_eval_step(digits.eval_fn)
    state, history = pztrain.fit(
        state,
        pztrain.build_train_step(digits.loss_fn),
        pztrain.ArrayLoader(train, 64, seed=0),
        num_steps=30,
        eval_step=eval_step,  # 48, 48, 48 and a last batch of 36
        eval_data=pztrain.ArrayLoader(valid, 48, shuffle=False, drop_remainder=False),
        eval_every=30,
        log_every=30,
        progress=False,
        loggers=[],
    )
    logits = jax.jit(digits.logits_of)

    def at_once(split):
        model = pz.freeze_params(state.model)
        predicted = np.argmax(logits(model, split["images"]), -1)
        return _whole(split["labels"], predicted)

    got = _classes(history.last("eval")["metrics"])
    assert got == pytest.approx(at_once(valid), rel=1e-12, abs=1e-12)
    assert 0.5 < got["f1"] < 1.0  # trained, and not every class right
    for batch_size in (50, 360):  # a last batch of 10, or one batch
        data = pztrain.ArrayLoader(
            test, batch_size, shuffle=False, drop_remainder=False
        )
        result = pztrain.evaluate(state, eval_step, data)
        assert _classes(result) == pytest.approx(at_once(test), rel=1e-12, abs=1e-12)
        assert result["accuracy"] == pytest.approx(result["classes/accuracy"], abs=1e-6)


def test_confusion_in_train_records_equals_the_steps_batches_at_once():
    """The train records' states over a log window: with a zero learning rate
    the model is the same at every step, so the window's batches at once are
    the reference."""
    digits = _example("digits")
    train = digits.load(0)[0]

    def loss_fn(*, model, state, rng, images, labels):
        logits = images @ model["w"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, state, {"classes": Confusion.of(labels, logits, 10)}

    w = jax.random.normal(jax.random.key(1), (64, 10))
    state = pztrain.TrainState.initial_state(
        {"w": w}, optax.sgd(0.0), jax.random.key(0)
    )
    _, history = pztrain.fit(
        state,
        pztrain.build_train_step(loss_fn),
        pztrain.ArrayLoader(train, 100, shuffle=False),
        num_steps=12,
        log_every=6,
        progress=False,
        loggers=[],
    )
    records = [r for r in history.records if r["split"] == "train"]
    assert [r["step"] for r in records] == [6, 12]
    for i, record in enumerate(records):
        rows = slice(600 * i, 600 * (i + 1))
        predicted = np.argmax(train["images"][rows] @ np.asarray(w), -1)
        want = _whole(train["labels"][rows], predicted)
        assert _classes(record["metrics"]) == pytest.approx(want, rel=1e-12)


def test_token_weighted_perplexity_on_the_char_lm():
    lm = _example("char_lm")
    vocab, _, held_out = lm.prepare(16)
    rows = 40  # batches of 16, 16 and 8 rows
    tokens, targets = held_out["tokens"][:rows], held_out["targets"][:rows]
    lengths = np.random.default_rng(0).integers(1, 17, size=rows)
    mask = (np.arange(16)[None, :] < lengths[:, None]).astype(np.float32)

    def eval_fn(*, model, state, rng, tokens, targets, mask):
        logits = lm.logits_of(model, tokens)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        per_batch = jnp.exp(jnp.sum(nll * mask) / jnp.sum(mask))
        return {"ppl": Perplexity.of(nll, mask), "batch_ppl": per_batch}

    model = lm.build_model(len(vocab), seed=0)
    state = pztrain.TrainState.initial_state(model, optax.sgd(0.0), jax.random.key(0))
    data = {"tokens": tokens, "targets": targets, "mask": mask}
    loader = pztrain.ArrayLoader(data, 16, shuffle=False, drop_remainder=False)
    result = pztrain.evaluate(state, pztrain.build_eval_step(eval_fn), loader)

    model = pz.freeze_params(state.model)
    logits = np.asarray(jax.jit(lm.logits_of)(model, tokens), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    want = math.exp((nll * mask).sum() / mask.sum())
    assert result["ppl"] == pytest.approx(want, rel=1e-5)
    token_counts = [mask[i : i + 16].sum() for i in (0, 16, 32)]
    assert len(set(token_counts)) == 3  # the batches' token counts differ
    assert abs(result["batch_ppl"] - want) > 1e-3  # a mean of batch means is off


def _stream_loss(*, model, state, rng, x):
    y = x * model["w"]
    return (
        jnp.mean(y**2),
        state,
        {
            "top": Max.of(y),
            "low": Min.of(y),
            "last": Last.of(y[-1]),
            "total": Sum.of(y),
            "hist": Histogram.of(y, edges=(0.0, 10.0, 20.0, 40.0)),
            "mean": Mean.of(y),
        },
    )


@pytest.mark.parametrize(
    "options", [{}, {"microbatches": 2}, {"steps_per_call": 3}], ids=str
)
def test_max_min_last_sum_histogram_per_log_window(options):
    x = np.arange(48, dtype=np.float32)
    state = pztrain.TrainState.initial_state(
        {"w": jnp.array(0.5)}, optax.sgd(0.0), jax.random.key(0)
    )
    _, history = pztrain.fit(
        state,
        pztrain.build_train_step(_stream_loss, **options),
        pztrain.ArrayLoader({"x": x}, 4, shuffle=False),
        num_steps=12,
        log_every=6,
        progress=False,
        loggers=[],
    )
    records = [r["metrics"] for r in history.records if r["split"] == "train"]
    for i, metrics in enumerate(records):
        y = 0.5 * x[24 * i : 24 * (i + 1)]  # the window's six batches of 4
        counts = np.histogram(y, bins=[0.0, 10.0, 20.0, 40.0])[0]
        assert metrics["top"] == y.max() and metrics["low"] == y.min()
        assert metrics["last"] == y[-1] and metrics["total"] == y.sum()
        assert metrics["mean"] == pytest.approx(y.mean())
        assert [metrics[f"hist/bin_{b}"] for b in range(3)] == counts.tolist()


class CountTraces(pztrain.Callback):
    """The loss function's traces so far, at each log point."""

    def __init__(self, traces):
        self.traces, self.at_logs = traces, []

    def on_log(self, state, record):
        self.at_logs.append(len(self.traces))


def test_states_make_no_host_read_and_no_retrace_between_log_points(monkeypatch):
    traces = []

    def loss_fn(**kw):
        traces.append(1)
        return _stream_loss(**kw)

    counter = CountTraces(traces)
    state = pztrain.TrainState.initial_state(
        {"w": jnp.array(0.5)}, optax.sgd(0.1), jax.random.key(0)
    )
    x = np.arange(48, dtype=np.float32)
    _emulate_the_read_guard(monkeypatch)
    with jax.transfer_guard_device_to_host("disallow"):  # reads: log points only
        with pytest.raises(RuntimeError, match="Disallowed"):  # the guard is on
            float(jnp.ones(()) + 1)
        pztrain.fit(
            state,
            pztrain.build_train_step(loss_fn),
            pztrain.ArrayLoader({"x": x}, 4, shuffle=False),
            num_steps=12,
            log_every=3,
            eval_step=pztrain.build_eval_step(lambda **kw: _stream_loss(**kw)[2]),
            eval_data=pztrain.ArrayLoader({"x": x}, 5, shuffle=False),
            eval_every=6,
            progress=False,
            loggers=[],
            callbacks=[counter],
        )
    assert len(counter.at_logs) == 4
    assert len(set(counter.at_logs)) == 1, counter.at_logs  # traced before step 1


def _emulate_the_read_guard(monkeypatch):
    """On CPU, JAX's device-to-host guard never fires (an array is in host
    memory): route every read of an array through it, as on an accelerator
    (see tests/test_loop.py's ``d2h_guard``)."""
    from jax._src import array as jax_array
    from jax._src import config as jax_config

    original = jax_array.ArrayImpl._value.fget

    def guarded(self):
        level = jax_config.transfer_guard_device_to_host.value
        explicit = jax_config.guard_lib.thread_local_state().explicit_device_get
        if level == "disallow_explicit" or (level == "disallow" and not explicit):
            raise RuntimeError("Disallowed device-to-host transfer (emulated)")
        return original(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(guarded))


def test_a_population_computes_each_member_and_spreads_them():
    def loss_fn(*, model, state, rng, x):
        y = x * model["w"]
        return (
            jnp.mean(y**2),
            state,
            {"top": Max.of(y), "frac": Ratio.of(y > 1, jnp.ones_like(y))},
        )

    def eval_fn(*, model, state, rng, x):
        return loss_fn(model=model, state=state, rng=rng, x=x)[2]

    def one(w):
        params = {"w": jnp.array(w)}
        return pztrain.TrainState.initial_state(
            params, optax.sgd(0.0), jax.random.key(0)
        )

    population = pztrain.stack_members([one(1.0), one(3.0)])
    x = np.linspace(0.0, 1.0, 20, dtype=np.float32)
    loader = pztrain.ArrayLoader({"x": x}, 5, shuffle=False, drop_remainder=False)
    _, history = pztrain.fit(
        population,
        pztrain.build_train_step(loss_fn),
        pztrain.ArrayLoader({"x": x}, 5, shuffle=False),
        num_steps=4,
        log_every=4,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=loader,
        eval_every=4,
        progress=False,
        loggers=[],
    )
    want = {
        "top": 2.0,
        "top/min": 1.0,
        "top/max": 3.0,
        "top/member_0": 1.0,
        "top/member_1": 3.0,
        "frac/member_0": 0.0,
        "frac/member_1": float(np.mean(3 * x > 1)),
    }
    for split in ("train", "eval"):
        metrics = history.last(split)["metrics"]
        assert {k: metrics[k] for k in want} == pytest.approx(want), split


MESH_CASE = """
import jax, jax.numpy as jnp, numpy as np, optax, pztrain
from jax.sharding import NamedSharding, PartitionSpec as P
from sklearn.datasets import load_digits
from pztrain.metric_states import Confusion, Max

assert jax.device_count() == 8
digits = load_digits()
x, y = (digits.data / 16).astype(np.float32)[:1600], digits.target[:1600]

traces = []

def loss_fn(*, model, state, rng, x, y):
    traces.append(1)
    logits = x @ model["w"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    aux = {"classes": Confusion.of(y, logits, 10), "top": Max.of(logits)}
    return loss, state, aux

class Traces(pztrain.Callback):
    def __init__(self):
        self.at_logs = []

    def on_log(self, state, record):
        self.at_logs.append(len(traces))

def eval_fn(*, model, state, rng, x, y):
    return loss_fn(model=model, state=state, rng=rng, x=x, y=y)[2]

mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
w = jax.random.normal(jax.random.key(1), (64, 10))
state = pztrain.TrainState.initial_state({"w": w}, optax.sgd(0.0), jax.random.key(0))
state = jax.device_put(state, NamedSharding(mesh, P()))
rows = NamedSharding(mesh, P("data"))
logits = x @ np.asarray(w)
want = Confusion.of(y, logits, 10).compute()
for m in (1, 2):
    step = pztrain.build_train_step(loss_fn, mesh=mesh, microbatches=m)
    data = pztrain.ArrayLoader({"x": x, "y": y}, 80, shuffle=False, sharding=rows)
    start = state.with_hyperparams()  # a copy: each fit donates its own
    counter = Traces()
    _, history = pztrain.fit(start, step, data, num_steps=20, log_every=5,
                             progress=False, loggers=[], callbacks=[counter])
    assert len(set(counter.at_logs)) == 1, counter.at_logs  # no retrace
    windows = [r["metrics"] for r in history.records if r["split"] == "train"]
    merged = Confusion.of(y[:400], logits[:400], 10).compute()
    assert abs(windows[0]["classes/f1"] - merged["f1"]) < 1e-12
    step = pztrain.build_train_step(loss_fn, mesh=mesh, microbatches=m)
    _, history = pztrain.fit(state.with_hyperparams(), step, data, num_steps=20,
                             log_every=20, progress=False, loggers=[])
    got = history.last("train")["metrics"]
    for k, v in want.items():
        assert abs(got["classes/" + k] - v) < 1e-12, (m, k, got, want)
    assert abs(got["top"] - logits.max()) < 1e-4, (got["top"], logits.max())
result = pztrain.evaluate(state, pztrain.build_eval_step(eval_fn),
                          pztrain.ArrayLoader({"x": x, "y": y}, 160, shuffle=False,
                                              sharding=rows))
for k, v in want.items():
    assert abs(result["classes/" + k] - v) < 1e-12, (k, result, want)
print("mesh ok")
"""


@pytest.mark.slow  # a subprocess with 8 devices
def test_states_on_a_mesh_of_eight_devices_equal_the_whole_set():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", MESH_CASE],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "mesh ok" in result.stdout


MULTI_PROCESS_CASE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax, pztrain
from sklearn.datasets import load_digits
from pztrain.metric_states import Confusion, Max

pid, port = int(sys.argv[1]), int(sys.argv[2])
address = f"127.0.0.1:{port}"
jax.distributed.initialize(coordinator_address=address, num_processes=2,
                           process_id=pid, coordinator_bind_address=address)
digits = load_digits()
x, y = (digits.data / 16).astype(np.float32)[:1600], digits.target[:1600]

def loss_fn(*, model, state, rng, x, y):
    logits = x @ model["w"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state, {"classes": Confusion.of(y, logits, 10), "top": Max.of(logits)}

def eval_fn(*, model, state, rng, x, y):
    return loss_fn(model=model, state=state, rng=rng, x=x, y=y)[2]

def make_state():
    w = jax.random.normal(jax.random.key(1), (64, 10))
    return pztrain.TrainState.initial_state({"w": w}, optax.sgd(0.0), jax.random.key(0))

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rules = pztrain.ShardingRules(fsdp="data")
out = {}
for m in (1, 2):
    state = pztrain.sharded_initial_state(make_state, mesh, rules)
    step = pztrain.build_train_step(loss_fn, mesh=mesh, microbatches=m)
    data = pztrain.ArrayLoader({"x": x, "y": y}, 80, shuffle=False,
                               sharding=step.batch_sharding)
    state, history = pztrain.fit(state, step, data, num_steps=20, log_every=20,
                                 progress=False, loggers=[])
    out[f"train{m}"] = history.last("train")["metrics"]
eval_data = pztrain.ArrayLoader({"x": x, "y": y}, 160, shuffle=False,
                                sharding=step.batch_sharding)
out["eval"] = pztrain.evaluate(state, pztrain.build_eval_step(eval_fn), eval_data)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # two processes
def test_states_with_two_processes_equal_the_whole_set():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI_PROCESS_CASE, str(i), str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        done = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    digits = _example("digits")
    images, labels = digits.load_digits().data / 16, digits.load_digits().target
    w = np.asarray(jax.random.normal(jax.random.key(1), (64, 10)))
    logits = images[:1600].astype(np.float32) @ w
    want = _whole(labels[:1600], np.argmax(logits, -1))
    for p, (out, err) in zip(procs, done, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-5000:]
        line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
        for name, metrics in json.loads(line[7:]).items():
            assert _classes(metrics) == pytest.approx(want, rel=1e-12), name
            assert metrics["top"] == pytest.approx(logits.max(), rel=1e-5), name


def _x_state():
    params = {"w": jnp.array(1.0)}
    return pztrain.TrainState.initial_state(params, optax.sgd(0.1), jax.random.key(0))


def test_a_state_whose_shape_changes_between_batches_is_named():
    def eval_fn(*, model, state, rng, x):
        return {"kept": Last.of(x * model["w"])}  # one value per example

    data = pztrain.ArrayLoader(
        {"x": np.arange(10.0)}, 4, shuffle=False, drop_remainder=False
    )
    message = "Metric 'kept': this batch's state cannot be merged"
    with pytest.raises(MetricStateError, match=re.escape(message)) as err:
        pztrain.evaluate(_x_state(), pztrain.build_eval_step(eval_fn), data)
    assert "shapes changed from [(4,)] to [(2,)]" in str(err.value)

    def loss_fn(*, model, state, rng, x):
        return jnp.mean(x * model["w"]), state, {"kept": Last.of(x)}

    step = pztrain.build_train_step(loss_fn)
    state = _x_state()
    sums = step.metric_sums(state, x=np.zeros(4, np.float32))
    with pytest.raises(MetricStateError, match=re.escape(message)):
        step.accumulate(state, sums, x=np.zeros(3, np.float32))


def test_a_metric_that_appears_later_is_named():
    step = pztrain.build_eval_step(lambda **kw: {"m": Max.of(kw["x"])})
    state = _x_state()
    sums = pztrain.metrics.EvalSums().add(step(state, x=np.ones(3)), 3)
    with pytest.raises(MetricStateError, match=re.escape("new ['extra'], missing []")):
        sums.add({"m": Max.of(jnp.ones(3)), "extra": Max.of(jnp.ones(3))}, 3)


def test_a_leaf_that_is_not_a_metric_is_named_by_its_aux_key():
    def loss_fn(*, model, state, rng, x):
        return jnp.mean(x * model["w"]), state, {"ok": 1.0, "note": "epoch 1"}

    step = pztrain.build_train_step(loss_fn)
    with pytest.raises(
        TypeError, match=re.escape("aux['note'] is a str ('epoch 1')")
    ) as e:
        step(_x_state(), x=np.ones(4, np.float32))
    assert "flat_run" not in str(e.value)
    with pytest.raises(TypeError, match=re.escape("aux['note'] is a str")):
        pztrain.fit(
            _x_state(),
            step,
            pztrain.ArrayLoader({"x": np.ones(8, np.float32)}, 4),
            num_steps=2,
            progress=False,
            loggers=[],
        )

    def eval_fn(*, model, state, rng, x):
        return {"mean": jnp.mean(x), "tag": object()}

    eval_step = pztrain.build_eval_step(eval_fn)
    with pytest.raises(TypeError, match=re.escape("metrics['tag'] is a object")):
        eval_step(_x_state(), x=np.ones(4, np.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Longest:
    """A user's own state (duck-typed): the longest run seen, and text."""

    length: jax.Array

    def merge(self, other):
        return Longest(jnp.maximum(self.length, other.length))

    def compute(self):
        return {"length": float(self.length), "text": "many"}


class NotAPytree:
    def merge(self, other):
        return self

    def compute(self):
        return 1.0


def test_a_users_state_merges_and_bad_ones_are_named():
    eval_step = pztrain.build_eval_step(lambda **kw: {"run": Longest(jnp.max(kw["x"]))})
    state = _x_state()
    sums = pztrain.metrics.EvalSums()
    for x in ([1.0, 4.0], [2.0]):
        sums = sums.add(eval_step(state, x=np.array(x, np.float32)), len(x))
    message = "Metric 'run/text': compute() returned str"
    with pytest.raises(MetricStateError, match=re.escape(message)):
        sums.read()
    assert float(sums.states["run"].length) == 4.0
    with pytest.raises(TypeError, match=re.escape("aux['s'] is a metric state (NotA")):
        pztrain.metrics.check_metric_leaves({"s": NotAPytree()}, "aux")
