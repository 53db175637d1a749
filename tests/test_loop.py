"""fit and evaluate: length, fusion, data sources, exact math, logging, evaluation,
option errors, and the no-sync guarantee."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fakes import FakeBar, steps_of
from jax._src import array as jax_array
from jax._src import config as jax_config

from pztrain import (
    ArrayLoader,
    BatchError,
    Callback,
    EarlyStopping,
    JsonlLogger,
    LearningRateMonitor,
    LoopInfo,
    NanPolicy,
    ProgressBar,
    TrainState,
    build_eval_step,
    build_train_step,
    evaluate,
    fit,
)
from pztrain.loggers import read_jsonl
from pztrain.records import TIMING_KEYS

_rng = np.random.default_rng(0)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
OPT = optax.sgd(0.05)  # one object: states built with it share compiled steps
SCHEDULE = optax.linear_schedule(0.1, 0.0, 10)
OPT_LR = optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)
METRICS = ["loss", "mae", "counter"]


def loss_fn(*, model, state, rng, x, y):
    noise = 0.01 * jax.random.normal(rng, y.shape)  # the step key matters too
    err = x @ model["w"] + model["b"] + noise - y
    loss = jnp.mean(err**2)
    aux = {"loss": loss, "mae": jnp.mean(jnp.abs(err)), "counter": state, "err": err}
    return loss, state + 1, aux


def eval_fn(*, model, state, rng, x, y):
    err = x @ model["w"] + model["b"] - y
    return {"mse": jnp.mean(err**2), "mae": jnp.mean(jnp.abs(err))}


STEP = build_train_step(loss_fn)
STEP2 = build_train_step(loss_fn, steps_per_call=2)
EVAL = build_eval_step(eval_fn)
EVAL_DATA = ArrayLoader(
    {"x": X[:10], "y": Y[:10]}, 4, shuffle=False, drop_remainder=False
)


def new_state(opt=OPT, w=(0.0, 0.0, 0.0), b=0.0) -> TrainState:
    model = {"w": jnp.array(w, jnp.float32), "b": jnp.array(b, jnp.float32)}
    return TrainState.initial_state(
        model, opt, jax.random.key(0), jnp.zeros((), jnp.int32)
    )


def loader(**kwargs) -> ArrayLoader:
    return ArrayLoader({"x": X, "y": Y}, 4, seed=1, **kwargs)  # 4 steps per epoch


def run(state=None, step=STEP, data=None, **kwargs):
    kwargs.setdefault("progress", False)
    return fit(
        new_state() if state is None else state,
        step,
        loader() if data is None else data,
        **kwargs,
    )


def manual(batches, state=None):
    """The same steps without fit: ``(state, [host aux per step])``."""
    state = new_state() if state is None else state
    auxes = []
    for batch in batches:
        state, aux = STEP(state, **batch)
        auxes.append(jax.device_get(aux))
    return state, auxes


def assert_same_params(a: TrainState, b: TrainState) -> None:
    for name in ("w", "b"):
        np.testing.assert_array_equal(a.params[name], b.params[name])


def train_records(history):
    return [r for r in history.records if r["split"] == "train"]


class Recorder(Callback):
    """Records every hook call; ``on_log`` also keeps a host copy of the params."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.params: dict[int, dict[str, np.ndarray]] = {}

    def on_train_start(self, state, info):
        self.calls.append(("on_train_start", info))

    def on_log(self, state, record):
        self.calls.append(("on_log", record["step"]))
        # A device read at a log point: allowed by the loop.
        self.params[record["step"]] = {
            k: np.array(v, copy=True) for k, v in state.params.items()
        }
        assert int(state.step) == record["step"]

    def on_eval_end(self, state, record):
        self.calls.append(("on_eval_end", record["step"]))

    def on_epoch_end(self, state, epoch):
        self.calls.append(("on_epoch_end", epoch))

    def on_train_end(self, state, history):
        self.calls.append(("on_train_end", history))

    def hooks(self, name):
        return [arg for hook, arg in self.calls if hook == name]


# ------------------------------------------------------------------ length


def test_num_steps():
    state, history = run(num_steps=6, log_every=2)
    assert int(state.step) == 6 and int(state.loss_fn_state) == 6
    assert steps_of(history) == [2, 4, 6]
    assert [r["epoch"] for r in train_records(history)] == [0, 0, 1]
    assert steps_of(history, "eval") == []
    assert history.stop_reason is None
    assert history.metric_names("train") == set(METRICS)  # "err" is not a scalar


def test_num_epochs():
    rec = Recorder()
    state, history = run(num_epochs=2, log_every=4, callbacks=[rec])
    assert int(state.step) == 8
    assert steps_of(history) == [4, 8]
    assert rec.hooks("on_epoch_end") == [0, 1]
    (info,) = rec.hooks("on_train_start")
    assert isinstance(info, LoopInfo)
    assert (info.start_step, info.end_step, info.steps_per_epoch) == (0, 8, 4)
    assert (info.steps_per_call, info.log_every) == (1, 4)
    assert info.evaluates is False and info.run_dir is None


def test_resumed_run_equals_uninterrupted_run():
    whole, h_whole = run(num_steps=10, log_every=2)
    half, _ = run(num_steps=6, log_every=2)
    rec = Recorder()
    resumed, h_resumed = run(half, num_steps=10, log_every=2, callbacks=[rec])
    assert int(resumed.step) == 10
    assert rec.hooks("on_train_start")[0].start_step == 6
    assert_same_params(resumed, whole)
    assert steps_of(h_resumed) == [8, 10]
    assert [r["epoch"] for r in train_records(h_resumed)] == [1, 2]
    assert [r["metrics"] for r in train_records(h_resumed)] == [
        r["metrics"] for r in train_records(h_whole)[-2:]
    ]


def test_fit_adds_nothing_to_the_math():
    ld = loader()
    state, history = run(num_steps=7, log_every=3)
    want, auxes = manual(ld.batch_at(s) for s in range(7))
    assert_same_params(state, want)  # bitwise: the same steps on the same batches
    assert int(state.step) == int(want.step) == 7
    assert int(state.loss_fn_state) == int(want.loss_fn_state) == 7
    # Each log record holds the means of the per-step aux since the last one.
    assert steps_of(history) == [3, 6, 7]
    prev = 0
    for rec in train_records(history):
        chunk = auxes[prev : rec["step"]]
        for name in METRICS:
            total = np.float32(0)
            for aux in chunk:
                total = np.float32(total + np.float32(aux[name]))
            assert rec["metrics"][name] == pytest.approx(
                float(total) / len(chunk), rel=1e-6
            ), (rec["step"], name)
        prev = rec["step"]
    assert [r["metrics"]["counter"] for r in train_records(history)] == [1.0, 4.0, 6.0]


def test_prefetch_off_gives_the_same_run():
    a, h_a = run(num_steps=5, log_every=2)
    b, h_b = run(num_steps=5, log_every=2, prefetch=0)
    assert_same_params(a, b)
    assert [r["metrics"] for r in h_a.records] == [r["metrics"] for r in h_b.records]


@pytest.mark.slow  # steps_per_call=2: a step of its own to compile
def test_steps_per_call_fuses_k_steps():
    ld = loader()
    rec = Recorder()
    state, history = run(step=STEP2, num_steps=8, log_every=4, callbacks=[rec], data=ld)
    assert int(state.step) == 8 and int(state.loss_fn_state) == 8
    assert steps_of(history) == [4, 8]
    assert rec.hooks("on_train_start")[0].steps_per_call == 2
    want, auxes = manual(ld.batch_at(s) for s in range(8))
    for name in ("w", "b"):
        np.testing.assert_allclose(
            state.params[name], want.params[name], rtol=1e-5, atol=1e-7
        )
    for rec_, lo in zip(train_records(history), (0, 4), strict=True):
        want_loss = np.mean([a["loss"] for a in auxes[lo : lo + 4]])
        assert rec_["metrics"]["loss"] == pytest.approx(want_loss, rel=1e-5)
        assert rec_["metrics"]["counter"] == np.mean(range(lo, lo + 4))


@pytest.mark.slow  # steps_per_call=2: a step of its own to compile
def test_steps_per_call_bar_advances_by_k(monkeypatch):
    bars = []

    def make_bar(**kwargs):
        bars.append(FakeBar(**kwargs))
        return bars[-1]

    monkeypatch.setattr("tqdm.auto.tqdm", make_bar)
    state, _ = run(step=STEP2, num_steps=6, log_every=2, progress=True)
    (bar,) = bars
    assert bar.updates == [2, 2, 2]
    assert bar.kwargs["total"] == 6 and bar.kwargs["initial"] == 0
    assert bar.closed == 1


def test_steps_per_call_needs_drop_remainder():
    with pytest.raises(BatchError, match=re.escape("use drop_remainder=True.")):
        run(step=STEP2, data=loader(drop_remainder=False), num_steps=4, log_every=2)


# --------------------------------------------------------- generic iterables


def _batches(n):
    ld = loader()
    return [ld.batch_at(s) for s in range(n)]


def test_reiterable_list_makes_epochs():
    batches = _batches(3)
    rec = Recorder()
    state, history = run(data=batches, num_epochs=2, log_every=2, callbacks=[rec])
    assert int(state.step) == 6
    assert rec.hooks("on_epoch_end") == [0, 1]
    assert history.stop_reason is None
    assert_same_params(state, manual(batches * 2)[0])
    info = rec.hooks("on_train_start")[0]
    assert info.end_step is None and info.steps_per_epoch is None

    state, history = run(data=batches, num_steps=5, log_every=5)
    assert int(state.step) == 5 and history.stop_reason is None
    assert_same_params(state, manual(batches + batches[:2])[0])


def test_reiterable_list_epoch_end_at_the_last_step():
    """num_steps ending exactly at the end of a pass still ends that epoch."""
    rec = Recorder()
    state, _ = run(data=_batches(3), num_steps=6, log_every=3, callbacks=[rec])
    assert int(state.step) == 6
    assert rec.hooks("on_epoch_end") == [0, 1]


def test_one_shot_generator_runs_out():
    batches = _batches(3)
    state, history = run(data=(b for b in batches), num_steps=10, log_every=2)
    assert int(state.step) == 3
    assert history.stop_reason == "the training data ran out"
    assert steps_of(history) == [2, 3]
    assert_same_params(state, manual(batches)[0])

    state, history = run(data=iter(batches), num_epochs=1, log_every=2)
    assert int(state.step) == 3 and history.stop_reason is None


@pytest.mark.slow  # steps_per_call=2: a step of its own to compile
def test_iterable_with_steps_per_call_stacks_and_drops_the_rest():
    state, _ = run(step=STEP2, data=_batches(5), num_epochs=2, log_every=2)
    assert int(state.step) == 8  # 2 calls of 2 steps per pass; the 5th is dropped


def test_iterable_batches_must_keep_their_keys():
    batches = _batches(2)
    batches[1] = {**batches[1], "z": batches[1]["y"]}
    with pytest.raises(
        BatchError,
        match=re.escape(
            "Batch has unexpected key(s) ['z']; the first batch had ['x', 'y']."
        ),
    ):
        run(data=batches, num_steps=2, log_every=1)
    with pytest.raises(BatchError, match=re.escape("Batch is missing key(s) ['y']")):
        run(data=[_batches(1)[0], {"x": X[:4]}], num_steps=2, log_every=1)


# ---------------------------------------------------------------- logging


@pytest.mark.slow  # a second or more (compiles, imports)
def test_injected_learning_rate_is_logged():
    state, history = run(new_state(OPT_LR), num_steps=6, log_every=2)
    steps, lrs = history.series("learning_rate")
    assert steps == [2, 4, 6]
    # The rate the last update of each interval used: schedule(step - 1).
    want = [float(np.float32(SCHEDULE(s - 1))) for s in steps]
    assert lrs == pytest.approx(want, rel=1e-6)
    assert lrs == pytest.approx([0.09, 0.07, 0.05], rel=1e-6)
    _, plain = run(num_steps=2, log_every=2)
    assert "learning_rate" not in plain.metric_names()


class WaitOnLog(Callback):
    """A callback that reads log records: fit must stop at each log point."""

    def on_log(self, state, record):
        return None


def _without_time(history):
    return [
        {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in history.records
    ]


@pytest.mark.parametrize(
    "on_device",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # fast: one
)
def test_log_points_read_late_give_the_records_a_waiting_loop_gives(on_device):
    def go(callbacks):
        data = loader(on_device=on_device, drop_remainder=True)
        return run(
            new_state(OPT_LR),
            data=data,
            num_steps=14,
            log_every=2,
            eval_step=EVAL,
            eval_data=EVAL_DATA,
            eval_every=4,
            callbacks=callbacks,
        )

    late_state, late = go([])
    waiting_state, waiting = go([WaitOnLog()])
    assert _without_time(late) == _without_time(waiting)
    assert [(r["step"], r["split"]) for r in late.records][:4] == [
        (2, "train"),
        (4, "train"),
        (4, "eval"),
        (6, "train"),
    ]
    assert late.records[-1]["step"] == 14
    assert_same_params(late_state, waiting_state)


@pytest.mark.slow  # a run whose accumulate is wrapped: compiles
def test_log_points_do_not_wait_for_the_device_unless_a_callback_reads_them():
    class Dispatches:
        """Counts the steps handed to the device; loggers see the count."""

        def __init__(self, step):
            self.count, self._accumulate = 0, step.accumulate

        def __call__(self, state, sums, batch, *, calls=1):
            self.count += calls
            return self._accumulate(state, sums, batch, calls=calls)

    class SeenAt:
        def __init__(self, counter):
            self.counter, self.seen = counter, []

        def log_hparams(self, hparams):
            pass

        def log_record(self, record):
            self.seen.append((record["step"], self.counter.count))

        def close(self):
            pass

    for callbacks, late in (([], True), ([WaitOnLog()], False)):
        step = build_train_step(loss_fn)
        step.accumulate = counter = Dispatches(step)
        logger = SeenAt(counter)
        run(step=step, num_steps=8, log_every=2, callbacks=callbacks, loggers=[logger])
        assert [s for s, _ in logger.seen] == [2, 4, 6, 8]
        if late:  # emitted once the next steps were handed over
            assert all(count > s for s, count in logger.seen[:-1])
        else:
            assert all(count == s for s, count in logger.seen)


def test_a_failing_run_still_emits_the_log_points_it_computed():
    class FailAtEpochEnd(Callback):
        def on_epoch_end(self, state, epoch):
            if epoch == 1:
                raise RuntimeError("boom")

    class Keep:
        def __init__(self):
            self.steps = []

        def log_hparams(self, hparams):
            pass

        def log_record(self, record):
            self.steps.append(record["step"])

        def close(self):
            pass

    keep = Keep()
    with pytest.raises(RuntimeError, match="boom"):
        run(num_steps=16, log_every=2, callbacks=[FailAtEpochEnd()], loggers=[keep])
    assert keep.steps == [2, 4, 6, 8]  # 8: logged just before the failing hook


# ------------------------------------------------------------------- eval


def test_eval_at_epoch_ends():
    state, history = run(num_epochs=3, log_every=2, eval_step=EVAL, eval_data=EVAL_DATA)
    assert steps_of(history, "eval") == [4, 8, 12]
    assert [r["epoch"] for r in history.records if r["split"] == "eval"] == [0, 1, 2]
    assert history.metric_names("eval") == {"mse", "mae"}
    assert history.last("eval")["metrics"] == evaluate(state, EVAL, EVAL_DATA)
    # At a step with both, the train record comes first.
    at4 = [r["split"] for r in history.records if r["step"] == 4]
    assert at4 == ["train", "eval"]


def test_eval_every_n_steps_and_at_the_end():
    state, history = run(
        num_steps=10, log_every=2, eval_every=4, eval_step=EVAL, eval_data=EVAL_DATA
    )
    assert steps_of(history, "eval") == [4, 8, 10]
    assert history.last("eval")["metrics"] == evaluate(state, EVAL, EVAL_DATA)
    # Without eval_every: at the epoch end (step 4) and at the end (step 6).
    _, history = run(num_steps=6, log_every=2, eval_step=EVAL, eval_data=EVAL_DATA)
    assert steps_of(history, "eval") == [4, 6]


def test_evaluate_weights_a_partial_batch_by_its_size():
    state = new_state(w=(0.5, -1.0, 0.0), b=1.0)
    err = X[:10].astype(np.float64) @ [0.5, -1.0, 0.0] + 1.0 - Y[:10]
    exact = {"mse": np.mean(err**2), "mae": np.mean(np.abs(err))}
    batches = list(EVAL_DATA.epoch(0))
    assert [len(b["y"]) for b in batches] == [4, 4, 2]
    # An unweighted mean of batch means is measurably different.
    naive = np.mean(
        [np.mean((b["x"] @ [0.5, -1.0, 0.0] + 1.0 - b["y"]) ** 2) for b in batches]
    )
    assert abs(naive - exact["mse"]) > 1e-3 * exact["mse"]
    for data in (EVAL_DATA, batches, iter(batches)):
        got = evaluate(state, EVAL, data)
        assert set(got) == {"mse", "mae"}
        for k in exact:
            assert got[k] == pytest.approx(exact[k], rel=1e-5)
    shuffled = ArrayLoader({"x": X[:10], "y": Y[:10]}, 3, drop_remainder=False)
    assert evaluate(state, EVAL, shuffled)["mse"] == pytest.approx(
        exact["mse"], rel=1e-5
    )
    with pytest.raises(
        BatchError, match=re.escape("evaluate got no batches: the eval data is empty.")
    ):
        evaluate(state, EVAL, [])


def test_evaluate_names_nested_metrics_by_path():
    nested = build_eval_step(
        lambda *, model, state, rng, x, y: {"a": {"b": jnp.mean(x)}, "c": x.sum()}
    )
    got = evaluate(new_state(), nested, [{"x": X[:4], "y": Y[:4]}])
    assert set(got) == {"a/b", "c"}
    assert got["a/b"] == pytest.approx(float(np.mean(X[:4])), rel=1e-6)


# ------------------------------------------------------------ option errors


def test_option_errors():
    def msg(text):
        return re.escape(text)

    with pytest.raises(
        ValueError,
        match=msg("log_every must be a positive multiple of steps_per_call=2; got 3."),
    ):
        run(step=STEP2, num_steps=4, log_every=3)
    with pytest.raises(
        ValueError,
        match=msg("eval_every must be a positive multiple of steps_per_call=2; got 5."),
    ):
        run(
            step=STEP2,
            num_steps=4,
            log_every=2,
            eval_every=5,
            eval_step=EVAL,
            eval_data=EVAL_DATA,
        )
    with pytest.raises(ValueError, match=msg("log_every must be a positive multiple")):
        run(num_steps=4, log_every=0)
    with pytest.raises(
        ValueError,
        match=msg("eval_step and eval_data go together: pass both or neither."),
    ):
        run(num_steps=4, eval_step=EVAL)
    with pytest.raises(ValueError, match=msg("eval_step and eval_data go together")):
        run(num_steps=4, eval_data=EVAL_DATA)
    with pytest.raises(
        ValueError, match=msg("Say how long to train: pass num_steps or num_epochs.")
    ):
        run()
    with pytest.raises(
        ValueError, match=msg("Pass num_steps or num_epochs, not both.")
    ):
        run(num_steps=4, num_epochs=1)
    with pytest.raises(
        ValueError,
        match=msg(
            "The run covers 7 steps (from step 0 to 7), not a multiple of "
            "steps_per_call=2; choose num_steps accordingly."
        ),
    ):
        run(step=STEP2, num_steps=7, log_every=2)
    with pytest.raises(TypeError, match=msg("unexpected keyword argument 'log_evry'")):
        run(num_steps=4, log_evry=2)


# ------------------------------------------------------- the no-sync guarantee


def _real_guard_fires() -> bool:
    x = jnp.ones(()) + 1
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            float(x)
    except Exception:
        return True
    return False


@pytest.fixture
def d2h_guard(monkeypatch):
    """Makes ``jax.transfer_guard_device_to_host`` effective on the CPU backend.

    On CPU a jax.Array already lives in host memory, so reading it is zero-copy and
    JAX's guard never fires. Here every host read of an array (``ArrayImpl._value``:
    float/int/bool, ``np.asarray``, ``.tolist()``, ``jax.device_get``, printing)
    goes through the guard level JAX has in effect in the calling thread, with
    JAX's semantics: ``"disallow"`` refuses implicit reads and lets explicit
    ``jax.device_get`` through; ``"disallow_explicit"`` refuses both. Where the
    real guard fires (GPU, TPU) nothing is patched.

    One path stays open on CPU: numpy reads a CPU jax.Array through the buffer
    protocol (``np.asarray(x)``, ``np.stack([x, ...])``) without calling
    ``_value``, and a C++ type's buffer protocol cannot be patched.
    """
    if _real_guard_fires():
        return
    original = jax_array.ArrayImpl._value.fget

    def guarded(self):
        level = jax_config.transfer_guard_device_to_host.value
        explicit = jax_config.guard_lib.thread_local_state().explicit_device_get
        if level == "disallow_explicit" or (level == "disallow" and not explicit):
            raise RuntimeError(
                f"Disallowed device-to-host transfer (emulated): aval={self.aval}"
            )
        return original(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(guarded))


DISALLOWED = "Disallowed device-to-host transfer"


def test_control_the_guard_is_really_active(d2h_guard):
    x = jnp.ones(3) * 2
    with jax.transfer_guard_device_to_host("disallow"):
        with pytest.raises(Exception, match=DISALLOWED):
            float(jnp.ones(()))
        with pytest.raises(Exception, match=DISALLOWED):
            x.__array__()  # np.asarray(x), jax.device_get(x) implicitly
        with pytest.raises(Exception, match=DISALLOWED):
            bool(x[0] > 0)
        with pytest.raises(Exception, match=DISALLOWED):
            x.tolist()
        with pytest.raises(Exception, match=DISALLOWED):
            int(jnp.zeros((), jnp.int32))
        with jax.transfer_guard_device_to_host("allow"):
            assert float(x[0]) == 2.0  # the loop's way of reading
        y = x + 1  # device work and host→device transfers are fine
        assert isinstance(jax.device_get(y), np.ndarray)  # explicit: allowed
    with jax.transfer_guard_device_to_host("disallow_explicit"):
        with pytest.raises(Exception, match=DISALLOWED):
            jax.device_get(y)
    assert x.tolist() == [2.0, 2.0, 2.0]  # outside the guard


class ReadingLogger:
    """A logger that (wrongly) reads the device: loggers get host values only."""

    def __init__(self):
        self.closed = False

    def log_hparams(self, hparams):
        pass

    def log_record(self, record):
        float(jnp.ones(()) * record["step"])

    def close(self):
        self.closed = True


def test_control_the_guard_reaches_inside_fit(d2h_guard):
    reader = ReadingLogger()
    with jax.transfer_guard_device_to_host("disallow"):
        with pytest.raises(Exception, match=DISALLOWED):
            run(num_steps=2, log_every=2, loggers=[reader])
    assert reader.closed
    run(num_steps=2, log_every=2, loggers=[ReadingLogger()])  # no guard: fine


class ReadsDevice(Callback):
    """Reads the device in every hook (allowed: hooks run at read points)."""

    def __init__(self):
        self.b = []

    def on_train_start(self, state, info):
        float(state.params["b"])

    def on_log(self, state, record):
        self.b.append(float(state.params["b"]))

    def on_eval_end(self, state, record):
        float(state.params["b"])

    def on_epoch_end(self, state, epoch):
        float(state.params["b"])

    def on_train_end(self, state, history):
        float(state.params["b"])


@pytest.mark.parametrize("level", ["disallow", "disallow_explicit"])
@pytest.mark.parametrize(
    "source",
    [
        "loader",
        # 2 steps per call: a step of their own to compile
        pytest.param("list", marks=pytest.mark.slow),
        pytest.param("on_device", marks=pytest.mark.slow),
    ],
)
def test_fit_makes_no_device_to_host_read_between_log_points(
    d2h_guard, tmp_path, level, source
):
    if source == "loader":
        step, data = STEP, loader()
    elif source == "on_device":  # the step slices its batch from device arrays
        step, data = STEP2, loader(on_device=True)
    else:  # a re-iterable list with 2 steps per call (stacked on the host)
        step, data = STEP2, _batches(4)
    bar = ProgressBar(make_bar=FakeBar)
    rec, reads = Recorder(), ReadsDevice()
    callbacks = [
        EarlyStopping("eval/mse", patience=100, restore_best=True),
        NanPolicy("stop"),
        LearningRateMonitor(SCHEDULE),
        bar,
        rec,
        reads,
    ]
    with jax.transfer_guard_device_to_host(level):
        state, history = fit(
            new_state(OPT_LR),
            step,
            data,
            num_steps=12,
            log_every=4,
            eval_step=EVAL,
            eval_data=EVAL_DATA,
            eval_every=4,
            callbacks=callbacks,
            loggers=[JsonlLogger(tmp_path)],
            hparams={"schedule": "linear 0.1 -> 0"},
            progress=False,
        )
        with pytest.raises(Exception, match=DISALLOWED):
            float(state.step)  # the guard was on all along
    assert int(state.step) == 12
    assert steps_of(history) == [4, 8, 12]
    assert steps_of(history, "eval") == [4, 8, 12]
    assert len(reads.b) == 3 and all(np.isfinite(reads.b))
    assert read_jsonl(tmp_path) == history.to_dicts()
    assert history.stop_reason is None
    assert bar.bar.closed == 1


def test_a_device_read_in_on_log_is_allowed(d2h_guard):
    reads = ReadsDevice()
    with jax.transfer_guard_device_to_host("disallow"):
        state, history = run(num_steps=6, log_every=2, callbacks=[reads])
    assert reads.b[-1] == float(state.params["b"])
    assert len(reads.b) == 3
