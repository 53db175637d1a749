"""Bad inputs, one table: each is refused with one clear error that names the
offending argument, key, column or file (issue 11, options and inputs).

Every case is a callable of a `Paths` (a fresh directory and two checkpoints
saved once), the exception type, and a regex that the message must match. The
models are tiny and nothing compiles: the errors come before a step runs, or
while the step is traced.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import (
    ArrayLoader,
    BatchError,
    Callback,
    CheckpointError,
    Checkpoints,
    EarlyStopping,
    NanPolicy,
    Stop,
    TrainState,
    build_eval_step,
    build_train_step,
    evaluate,
)
from pztrain.data import check_batch
from pztrain.partition import PartitionError


def loss_x(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"]) ** 2)
    return loss, state, {"loss": loss}


def loss_xy(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


def eval_x(*, model, state, rng, x):
    return {"mean": jnp.mean(x @ model["w"])}


# Nothing is donated, so every case can share STATE.
STEP = build_train_step(loss_x, donate=False)
STEP_XY = build_train_step(loss_xy, donate=False)
STEP_K2 = build_train_step(loss_x, donate=False, steps_per_call=2)
EVAL = build_eval_step(eval_x)
KEY = jax.random.key(0)
STATE = TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), KEY)
X = jnp.ones((4, 3))
DATA = [{"x": X}]
E = re.escape


@dataclasses.dataclass(frozen=True)
class Paths:
    tmp: Path  # a fresh directory
    params: Path  # save_params(STATE)
    state: Path  # save_state(STATE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("saved")
    return pztrain.save_params(root / "p", STATE), pztrain.save_state(root / "s", STATE)


def fit(**options):
    """`pztrain.fit` on one tiny batch for one step, with ``options`` changed."""
    state = options.pop("state", STATE)
    train_step = options.pop("train_step", STEP)
    data = options.pop("train_data", DATA)
    options = {"num_steps": 1, "progress": False, **options}
    return pztrain.fit(state, train_step, data, **options)


class Returns(Callback):
    """Returns ``make(state)`` from ``on_train_start``."""

    def __init__(self, make):
        self.make = make

    def on_train_start(self, state, info):
        return self.make(state)


class MemoryLogger:
    """A `pztrain.loggers.Logger` that keeps nothing open."""

    def log_hparams(self, hparams):
        pass

    def log_record(self, record):
        pass

    def close(self):
        pass


def apply_fn(variables, x):
    return x @ variables["params"]["w"]


P = pytest.param
CASES = [
    # ---------------------------------------------------------------- fit: length
    P(
        lambda p: fit(num_steps=-1),
        ValueError,
        E("num_steps must be an int >= 0 (the total to reach); got -1."),
        id="fit-num_steps-negative",
    ),
    P(
        lambda p: fit(num_steps=2.5),
        ValueError,
        E("num_steps must be an int >= 0") + ".*got 2.5",
        id="fit-num_steps-float",
    ),
    P(
        lambda p: fit(num_steps="3"),
        ValueError,
        E("num_steps must be an int >= 0") + ".*got '3'",
        id="fit-num_steps-str",
    ),
    P(
        lambda p: fit(num_steps=True),
        ValueError,
        E("num_steps must be an int >= 0") + ".*got True",
        id="fit-num_steps-bool",
    ),
    P(
        lambda p: fit(num_steps=None, num_epochs=-1),
        ValueError,
        E("num_epochs must be an int >= 0") + ".*got -1",
        id="fit-num_epochs-negative",
    ),
    P(
        lambda p: fit(num_steps=None, num_epochs=1.5),
        ValueError,
        E("num_epochs must be an int >= 0") + ".*got 1.5",
        id="fit-num_epochs-float",
    ),
    P(
        lambda p: fit(num_steps=None),
        ValueError,
        E("Say how long to train: pass num_steps or num_epochs."),
        id="fit-no-length",
    ),
    P(
        lambda p: fit(num_epochs=1),
        ValueError,
        E("Pass num_steps or num_epochs, not both."),
        id="fit-two-lengths",
    ),
    # --------------------------------------------------------------- fit: options
    P(
        lambda p: fit(eval_every=2),
        ValueError,
        E("eval_every=2 needs eval_step and eval_data: pass both, or drop eval_every."),
        id="fit-eval_every-without-eval",
    ),
    P(
        lambda p: fit(eval_step=EVAL),
        ValueError,
        E("eval_step and eval_data go together"),
        id="fit-eval_step-alone",
    ),
    P(
        lambda p: fit(eval_data=DATA),
        ValueError,
        E("eval_step and eval_data go together"),
        id="fit-eval_data-alone",
    ),
    P(
        lambda p: fit(eval_step=EVAL, eval_data=DATA, eval_every=0),
        ValueError,
        E("eval_every must be a positive multiple of steps_per_call=1; got 0."),
        id="fit-eval_every-zero",
    ),
    P(
        lambda p: fit(log_every=0),
        ValueError,
        E("log_every must be a positive multiple of steps_per_call=1; got 0."),
        id="fit-log_every-zero",
    ),
    P(
        lambda p: fit(log_every=1.5),
        ValueError,
        E("log_every must be a positive multiple") + ".*got 1.5",
        id="fit-log_every-float",
    ),
    P(
        lambda p: fit(log_every=True),
        ValueError,
        E("log_every must be a positive multiple") + ".*got True",
        id="fit-log_every-bool",
    ),
    P(
        lambda p: fit(train_step=STEP_K2, num_steps=4, log_every=3),
        ValueError,
        E("log_every must be a positive multiple of steps_per_call=2; got 3."),
        id="fit-log_every-not-multiple",
    ),
    P(
        lambda p: fit(prefetch=-1),
        ValueError,
        E("prefetch must be an int >= 0") + ".*got -1",
        id="fit-prefetch-negative",
    ),
    P(
        lambda p: fit(prefetch=1.5),
        ValueError,
        E("prefetch must be an int >= 0") + ".*got 1.5",
        id="fit-prefetch-float",
    ),
    P(
        lambda p: fit(hparams="lr=0.1"),
        TypeError,
        E("hparams must be a dict name -> value, or None; got str."),
        id="fit-hparams-str",
    ),
    P(
        lambda p: fit(resume=True),
        ValueError,
        E("resume=True needs checkpoints=Checkpoints(directory)."),
        id="fit-resume-without-checkpoints",
    ),
    # ------------------------------------------------------------ fit: arguments
    P(
        lambda p: fit(state={"w": jnp.ones(3)}),
        TypeError,
        E("state must be a pztrain.TrainState") + ".*got dict",
        id="fit-state-not-a-TrainState",
    ),
    P(
        lambda p: fit(train_step=loss_x),
        TypeError,
        E("train_step must be a TrainStep (build_train_step); got function."),
        id="fit-train_step-a-function",
    ),
    P(
        lambda p: fit(train_step=EVAL),
        TypeError,
        E("train_step must be a TrainStep") + ".*got EvalStep",
        id="fit-train_step-an-EvalStep",
    ),
    P(
        lambda p: fit(eval_step=STEP, eval_data=DATA),
        TypeError,
        E("eval_step must be an EvalStep or None; got TrainStep."),
        id="fit-eval_step-a-TrainStep",
    ),
    P(
        lambda p: fit(train_data={"x": X}),
        TypeError,
        E("train_data is a dict, one batch; pass ArrayLoader(arrays, batch_size)"),
        id="fit-train_data-one-batch",
    ),
    P(
        lambda p: fit(train_data=None),
        TypeError,
        E("train_data is None"),
        id="fit-train_data-None",
    ),
    P(
        lambda p: fit(train_data=3),
        TypeError,
        E("train_data must be an ArrayLoader or an iterable of batch dicts; got int."),
        id="fit-train_data-int",
    ),
    P(
        lambda p: fit(eval_step=EVAL, eval_data={"x": X}),
        TypeError,
        E("eval_data is a dict, one batch"),
        id="fit-eval_data-one-batch",
    ),
    P(
        lambda p: fit(callbacks=EarlyStopping("loss")),
        TypeError,
        E(
            "callbacks must be a list of pztrain.Callback (callbacks=[...]); got "
            "EarlyStopping."
        ),
        id="fit-callbacks-not-a-list",
    ),
    P(
        lambda p: fit(callbacks=[lambda s, r: None]),
        TypeError,
        E("callbacks[0] is a function; callbacks subclass pztrain.Callback"),
        id="fit-callback-a-function",
    ),
    P(
        lambda p: fit(callbacks=[MemoryLogger()]),
        TypeError,
        E("callbacks[0] is a MemoryLogger") + ".*" + E("Loggers go in loggers="),
        id="fit-callback-a-logger",
    ),
    P(
        lambda p: fit(loggers=MemoryLogger()),
        TypeError,
        E("loggers must be a list of loggers (loggers=[...]); got MemoryLogger."),
        id="fit-loggers-not-a-list",
    ),
    P(
        lambda p: fit(loggers=[object()]),
        TypeError,
        E("loggers[0] has type object; a logger has log_hparams, log_record and close"),
        id="fit-logger-not-a-logger",
    ),
    P(
        lambda p: fit(loggers=[NanPolicy()]),
        TypeError,
        E("loggers[0] is a NanPolicy, a Callback; callbacks go in callbacks=."),
        id="fit-logger-a-callback",
    ),
    P(
        lambda p: fit(checkpoints=str(p.tmp)),
        TypeError,
        E("checkpoints must be a pztrain.Checkpoints") + ".*got str",
        id="fit-checkpoints-a-path",
    ),
    # ---------------------------------------------------- fit: what hooks return
    P(
        lambda p: fit(callbacks=[Returns(lambda s: Stop("done", state={"w": 1}))]),
        TypeError,
        E(
            "Returns.on_train_start returned Stop(state=<dict>); Stop.state is a "
            "TrainState"
        ),
        id="hook-Stop-state-a-dict",
    ),
    P(
        lambda p: fit(callbacks=[Returns(lambda s: Stop(s))]),
        TypeError,
        E(
            "Stop(reason, state=None) takes the reason as a string first; got a "
            "TrainState."
        ),
        id="hook-Stop-of-a-state",
    ),
    P(
        lambda p: fit(callbacks=[Returns(lambda s: {"stop": True})]),
        TypeError,
        E("Returns.on_train_start returned a dict; hooks return None, a TrainState or"),
        id="hook-returns-a-dict",
    ),
    P(
        lambda p: fit(callbacks=[Returns(lambda s: s.replace(step=1.5))]),
        TypeError,
        E(
            "Returns.on_train_start returned a state whose step is float; a step is "
            "an integer scalar"
        ),
        id="hook-step-a-float",
    ),
    P(
        lambda p: fit(
            callbacks=[Returns(lambda s: s.replace(step=jnp.zeros(2, jnp.int32)))]
        ),
        TypeError,
        E("returned a state whose step is int32[2]"),
        id="hook-step-a-vector",
    ),
    P(
        lambda p: fit(callbacks=[EarlyStopping("eval/loss")]),
        ValueError,
        E("EarlyStopping monitors 'eval/loss' but fit runs no evaluation"),
        id="hook-early-stopping-without-eval",
    ),
    # ------------------------------------------------------------ fit: batches
    P(
        lambda p: fit(train_data=[{"x": jnp.ones((0, 3))}]),
        BatchError,
        E("The batch has 0 examples (batch['x'] has batch axis 0)"),
        id="fit-batch-zero-size",
    ),
    P(
        lambda p: fit(train_data=[{"x": X, "mask": None}]),
        BatchError,
        E("batch['mask'] is None; give it an array or drop the key"),
        id="fit-batch-None-leaf",
    ),
    P(
        lambda p: fit(train_data=[X]),
        BatchError,
        E("A batch must be a dict of arrays") + ".*got ArrayImpl",
        id="fit-batch-an-array",
    ),
    P(
        lambda p: fit(
            train_step=STEP_XY,
            train_data=[{"x": X, "y": jnp.ones(4)}, {"x": X}],
            num_steps=2,
        ),
        BatchError,
        E("Batch is missing key(s) ['y']; it has ['x']."),
        id="fit-batch-missing-key",
    ),
    P(
        lambda p: fit(train_data=[{"x": X}, {"x": X, "z": X}], num_steps=2),
        BatchError,
        E("Batch has unexpected key(s) ['z']; the first batch had ['x']."),
        id="fit-batch-unexpected-key",
    ),
    # -------------------------------------------------------------- ArrayLoader
    P(
        lambda p: ArrayLoader([np.ones(4)], 2),
        BatchError,
        E("ArrayLoader takes a dict name -> array") + ".*got list",
        id="loader-a-list",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones((0, 3))}, 2, drop_remainder=False),
        BatchError,
        E("ArrayLoader got 0 examples (column 'x' has shape [0, 3])"),
        id="loader-zero-examples",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones((0, 3)), "y": np.ones(0)}, 2),
        BatchError,
        E("ArrayLoader got 0 examples (column 'x'"),
        id="loader-zero-examples-drop-remainder",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones(4), "name": list("abcd")}, 2),
        BatchError,
        E("Column 'name' has dtype <U1, not numbers or bools; encode it as numbers"),
        id="loader-string-column",
    ),
    P(
        lambda p: ArrayLoader(
            {"x": np.ones(4), "meta": np.array([{}, 1, 2, 3], object)}, 2
        ),
        BatchError,
        E("Column 'meta' has dtype object, not numbers or bools"),
        id="loader-object-column",
    ),
    P(
        lambda p: ArrayLoader({"x": [1.0, None, 2.0, 3.0]}, 2),
        BatchError,
        E("Column 'x' has dtype object"),
        id="loader-None-among-values",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones(4), "w": None}, 2),
        BatchError,
        E("Column 'w' is None; ArrayLoader takes one array per name"),
        id="loader-None-column",
    ),
    P(
        lambda p: ArrayLoader({"x": {"a": np.ones(4)}}, 2),
        BatchError,
        E(
            "Column 'x' is a dict; ArrayLoader takes one array per name (a flat dict "
            "of arrays)."
        ),
        id="loader-nested-dict",
    ),
    P(
        lambda p: ArrayLoader({"x": [[1.0, 2.0], [3.0]]}, 1),
        BatchError,
        E("Column 'x' is not a rectangular array"),
        id="loader-ragged-column",
    ),
    P(
        lambda p: ArrayLoader({0: np.ones(4)}, 2),
        BatchError,
        E("ArrayLoader's column names must be strings") + ".*got 0",
        id="loader-int-column-name",
    ),
    P(
        lambda p: ArrayLoader({}, 2),
        BatchError,
        E("ArrayLoader needs at least one column; got an empty dict."),
        id="loader-no-columns",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones(4), "y": np.ones(5)}, 2),
        BatchError,
        E("Batch leaves must share their leading (batch) axis; got x: 4, y: 5."),
        id="loader-uneven-columns",
    ),
    P(
        lambda p: ArrayLoader({"s": 1.0}, 1),
        BatchError,
        E("batch['s'] is a scalar; batch leaves need a leading batch axis."),
        id="loader-scalar-column",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones(4)}, 0),
        BatchError,
        E("batch_size must be an int >= 1; got 0."),
        id="loader-batch_size-zero",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones(4)}, True),
        BatchError,
        E("batch_size must be an int >= 1; got True."),
        id="loader-batch_size-bool",
    ),
    P(
        lambda p: ArrayLoader({"x": np.ones(4)}, 5),
        BatchError,
        E("batch_size=5 exceeds the 4 examples"),
        id="loader-batch_size-too-big",
    ),
    P(
        lambda p: ArrayLoader(
            {"x": np.ones(4)}, 3, drop_remainder=False, on_device=True
        ),
        BatchError,
        E("on_device=True stacks an epoch's batches") + ".*drop_remainder=True",
        id="loader-on_device-with-remainder",
    ),
    P(
        lambda p: ArrayLoader(
            {"x": np.ones(4)}, 3, drop_remainder=False
        ).iter_from_step(0, 2),
        BatchError,
        E("steps_per_call > 1 stacks batches") + ".*drop_remainder=True",
        id="loader-stacking-with-remainder",
    ),
    P(
        lambda p: check_batch({"x": np.ones(3)}, expected_keys=["x", "y"]),
        BatchError,
        E("Batch is missing key(s) ['y']"),
        id="check_batch-missing-key",
    ),
    # --------------------------------------------------------- train step calls
    P(
        lambda p: STEP_XY(STATE, x=X),
        TypeError,
        E("missing 1 required keyword-only argument: 'y'"),
        id="step-missing-key",
    ),
    P(
        lambda p: STEP(STATE, x=X, z=X),
        TypeError,
        E("got an unexpected keyword argument 'z'"),
        id="step-unexpected-key",
    ),
    P(
        lambda p: STEP_XY(STATE, x=X, y=jnp.ones(5)),
        BatchError,
        E("Batch leaves must share their leading (batch) axis; got x: 4, y: 5."),
        id="step-shape-mismatch",
    ),
    P(
        lambda p: STEP(STATE, x=X, mask=None),
        BatchError,
        E("batch['mask'] is None; give it an array or drop the key"),
        id="step-None-leaf",
    ),
    P(
        lambda p: STEP(STATE, x=X, extra={"m": None}),
        BatchError,
        E("batch['extra/m'] is None"),
        id="step-nested-None-leaf",
    ),
    P(
        lambda p: STEP(STATE, x=jnp.ones((0, 3))),
        BatchError,
        E("The batch has 0 examples (batch['x'] has batch axis 0)"),
        id="step-zero-size",
    ),
    P(
        lambda p: STEP_K2(STATE, x=jnp.ones((2, 0, 3))),
        BatchError,
        E("The batch has 0 examples (batch['x']"),
        id="step-k2-zero-size",
    ),
    P(
        lambda p: STEP_K2(STATE, x=X),
        BatchError,
        E("With steps_per_call=2 every batch leaf needs a leading axis of 2")
        + ".*"
        + E("batch['x'] has shape [4, 3]"),
        id="step-k2-without-leading-axis",
    ),
    P(
        lambda p: STEP(STATE, {"x": X}, x=X),
        TypeError,
        E("or as one positional batch") + ".*" + E("not both; got dict and keys ['x']"),
        id="step-two-batches",
    ),
    P(
        lambda p: build_train_step(lambda *, model, state, rng, x: jnp.sum(x))(
            STATE, x=X
        ),
        TypeError,
        E(
            "The loss function must return a 3-tuple (loss, new_state, aux); got a "
            "float32[] array."
        ),
        id="step-loss-not-a-tuple",
    ),
    P(
        lambda p: build_train_step(
            lambda *, model, state, rng, x: (x @ model["w"], state, {})
        )(STATE, x=X),
        ValueError,
        E("The loss must be a scalar; got shape [4]."),
        id="step-loss-not-a-scalar",
    ),
    P(
        lambda p: build_train_step(loss_x, jit=False).lower(STATE, x=X),
        ValueError,
        E("lower() needs a jitted step: build it with jit=True."),
        id="step-lower-without-jit",
    ),
    # --------------------------------------------------------- building a step
    P(
        lambda p: build_train_step("loss"),
        TypeError,
        E("loss_fn must be callable; got str."),
        id="build-loss_fn-not-callable",
    ),
    P(
        lambda p: build_train_step(loss_x, steps_per_call=0),
        ValueError,
        E("steps_per_call must be an int >= 1; got 0."),
        id="build-steps_per_call-zero",
    ),
    P(
        lambda p: build_train_step(loss_x, jit=False, donate=True),
        ValueError,
        E("donate=True needs jit=True"),
        id="build-donate-without-jit",
    ),
    P(
        lambda p: build_eval_step(None),
        TypeError,
        E("eval_fn must be callable; got NoneType."),
        id="build-eval_fn-not-callable",
    ),
    # ----------------------------------------------------------------- evaluate
    P(
        lambda p: evaluate(STATE, EVAL, []),
        BatchError,
        E("evaluate got no batches: the eval data is empty."),
        id="evaluate-no-batches",
    ),
    P(
        lambda p: evaluate(STATE, EVAL, [{"x": jnp.ones((0, 3))}]),
        BatchError,
        E("The batch has 0 examples (batch['x'] has batch axis 0)"),
        id="evaluate-zero-size",
    ),
    P(
        lambda p: evaluate(STATE, EVAL, [{"x": X, "w": None}]),
        BatchError,
        E("batch['w'] is None"),
        id="evaluate-None-leaf",
    ),
    P(
        lambda p: evaluate(STATE, EVAL, [X]),
        BatchError,
        E("A batch must be a dict of arrays"),
        id="evaluate-batch-an-array",
    ),
    P(
        lambda p: evaluate(STATE, EVAL, [{"x": np.float32(1)}]),
        BatchError,
        E("batch['x'] is a scalar; batch leaves need a leading batch axis."),
        id="evaluate-scalar-leaf",
    ),
    # --------------------------------------------------------------- TrainState
    P(
        lambda p: TrainState.initial_state({"w": X}, "sgd", KEY),
        TypeError,
        E("optimizer_def must be an optax GradientTransformation") + ".*got str",
        id="state-optimizer-a-str",
    ),
    P(
        lambda p: TrainState.initial_state({"w": X}, optax.sgd(0.1), 0),
        TypeError,
        E("root_rng must be a single PRNG key") + ".*got int",
        id="state-root_rng-an-int",
    ),
    P(
        lambda p: TrainState.initial_state({"w": X}, optax.sgd(0.1), KEY, epoch=1),
        TypeError,
        E("TrainState has no field(s) ['epoch']") + ".*Subclass TrainState",
        id="state-unknown-field",
    ),
    P(
        lambda p: TrainState.initial_state({"n": jnp.arange(3)}, optax.sgd(0.1), KEY),
        PartitionError,
        E("has no trainable parameters left after trainable=None"),
        id="state-no-float-arrays",
    ),
    P(
        lambda p: TrainState.initial_state(
            {"w": X}, optax.sgd(0.1), KEY, trainable="zzz"
        ),
        PartitionError,
        E("no trainable parameters left after trainable='zzz'"),
        id="state-trainable-matches-nothing",
    ),
    P(
        lambda p: TrainState.create(
            apply_fn=apply_fn, params={"w": X}, tx=optax.sgd(0.1), root_rng=0
        ),
        TypeError,
        E("root_rng must be a single PRNG key"),
        id="create-root_rng-an-int",
    ),
    P(
        lambda p: STATE.replace(stepp=1),
        TypeError,
        E("TrainState has no field(s) ['stepp']"),
        id="state-replace-unknown-field",
    ),
    P(
        lambda p: STATE.apply_gradients({"v": jnp.ones(3)}),
        ValueError,
        E(
            "grads must have the structure of state.params: missing names ['w'], "
            "unexpected names ['v']."
        ),
        id="state-grads-other-names",
    ),
    P(
        lambda p: STATE.hyperparams,
        ValueError,
        E("The optimizer state holds no injected hyperparameters")
        + ".*inject_hyperparams",
        id="state-no-hyperparams",
    ),
    P(
        lambda p: STATE.apply_fn,
        AttributeError,
        E("apply_fn exists only on states built with TrainState.create"),
        id="state-apply_fn-without-create",
    ),
    # ------------------------------------------------ callbacks and checkpoints
    P(
        lambda p: EarlyStopping(mode="avg"),
        ValueError,
        E("mode must be 'min' or 'max'; got 'avg'."),
        id="early-stopping-mode",
    ),
    P(
        lambda p: EarlyStopping(patience=0),
        ValueError,
        E("patience must be >= 1; got 0."),
        id="early-stopping-patience",
    ),
    P(
        lambda p: NanPolicy("ignore"),
        ValueError,
        E("mode must be 'stop' or 'skip'; got 'ignore'."),
        id="nan-policy-mode",
    ),
    P(
        lambda p: Checkpoints(p.tmp, mode="best"),
        ValueError,
        E("mode must be 'min' or 'max'; got 'best'."),
        id="checkpoints-mode",
    ),
    P(
        lambda p: Checkpoints(p.tmp, keep_last=0),
        ValueError,
        E("keep_last must be an int >= 1; got 0."),
        id="checkpoints-keep_last-zero",
    ),
    P(
        lambda p: Checkpoints(p.tmp, keep_last="2"),
        ValueError,
        E("keep_last must be an int >= 1; got '2'."),
        id="checkpoints-keep_last-str",
    ),
    P(
        lambda p: Checkpoints(p.tmp, keep_best=-1),
        ValueError,
        E("keep_best must be an int >= 0; got -1."),
        id="checkpoints-keep_best-negative",
    ),
    P(
        lambda p: Checkpoints(p.tmp, every_steps=0),
        ValueError,
        E("every_steps must be an int >= 1; got 0."),
        id="checkpoints-every_steps-zero",
    ),
    P(
        lambda p: Checkpoints(p.params / "meta" / "metadata").prepare(
            STATE, resume=False
        ),
        CheckpointError,
        E("Cannot write checkpoints to ") + ".*metadata" + E(": it is a file."),
        id="checkpoints-directory-is-a-file",
    ),
    P(
        lambda p: pztrain.load_params(p.tmp / "nope", STATE),
        CheckpointError,
        E("No checkpoint at ") + ".*nope" + E(": the directory does not exist."),
        id="load_params-missing-directory",
    ),
    P(
        lambda p: pztrain.load_params(p.params, {"v": X}),
        CheckpointError,
        E("does not match the target: missing names ['v'], unexpected names ['w']")
        + ".*partial=True",
        id="load_params-other-names",
    ),
    P(
        lambda p: pztrain.load_params(p.params, {"w": jnp.ones(4)}),
        CheckpointError,
        E("Parameter 'w' in ")
        + ".*"
        + E("is float32[3], but the target expects float32[4]"),
        id="load_params-other-shape",
    ),
    P(
        lambda p: pztrain.load_state(p.params, STATE),
        CheckpointError,
        E("holds params only (save_params); use load_params"),
        id="load_state-of-params",
    ),
    P(
        lambda p: pztrain.load_state(
            p.state, TrainState.initial_state({"w": jnp.ones(3)}, optax.adam(0.1), KEY)
        ),
        CheckpointError,
        E("does not match the target state: missing ['.opt_state[0].count'"),
        id="load_state-other-optimizer",
    ),
    P(
        lambda p: pztrain.save_params(p.params, STATE),
        CheckpointError,
        E("exists; pass overwrite=True to replace it"),
        id="save_params-over-a-checkpoint",
    ),
    P(
        lambda p: pztrain.save_params(p.tmp / "m", STATE, metadata={"f": object()}),
        CheckpointError,
        E("metadata['f'] is a object, which JSON cannot hold"),
        id="save_params-metadata-not-json",
    ),
    P(
        lambda p: pztrain.read_metadata(p.tmp),
        CheckpointError,
        E("is not a pztrain checkpoint: it has no 'meta' item"),
        id="read_metadata-not-a-checkpoint",
    ),
]


@pytest.mark.parametrize("call, error, message", CASES)
def test_a_bad_input_is_refused_by_name(tmp_path, saved, call, error, message):
    with pytest.raises(error, match=message):
        call(Paths(tmp_path, *saved))


def test_the_table_is_large_and_its_names_distinct():
    ids = [case.id for case in CASES]
    assert len(ids) >= 60
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    "host_int", [int, np.int64, np.array], ids=["int", "np.int64", "np.array"]
)
def test_a_hook_that_sets_a_host_integer_step_checkpoints_readably(tmp_path, host_int):
    """A state returned with its step as a Python or NumPy integer reaches the
    next hook (the checkpoints) and the loop as a JAX int32 scalar; before, the
    checkpoint saved had no step array and could not be loaded."""

    class HostStep(Callback):
        def on_log(self, state, record):
            return state.replace(step=host_int(int(state.step)))

    state, _ = fit(
        num_steps=2,
        log_every=1,
        callbacks=[HostStep()],
        checkpoints=Checkpoints(tmp_path, every_steps=1),
    )
    assert isinstance(state.step, jax.Array) and state.step.dtype == jnp.int32
    for step in (1, 2):
        back = pztrain.load_state(tmp_path / str(step), STATE)
        assert back.step.dtype == jnp.int32 and int(back.step) == step
