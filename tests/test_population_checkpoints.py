"""Populations on disk: checkpoints save and resume the whole population bitwise,
stops (Ctrl-C, SIGTERM) lose nothing as for one run, a member is an ordinary
state for every other API, and a checkpoint loads only into a state with as many
members (a population against one run is refused, naming both counts, before
anything is written).
"""

from __future__ import annotations

import json
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import (
    ArrayLoader,
    Callback,
    CheckpointError,
    CheckpointMismatchError,
    Checkpoints,
    member,
    population_size,
)
from pztrain.loggers import read_jsonl
from pztrain.records import TIMING_KEYS

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
RATES = [0.01, 0.05, 0.2]
K = len(RATES)


def loss_fn(*, model, state, rng, x, y):
    noise = 0.01 * jax.random.normal(rng, y.shape)  # each member's own key
    loss = jnp.mean((x @ model["w"] + model["b"] + noise - y) ** 2)
    return loss, state + 1, {"loss": loss}


def eval_fn(*, model, state, rng, x, y):
    return {"mse": jnp.mean((x @ model["w"] + model["b"] - y) ** 2)}


STEP = pztrain.build_train_step(loss_fn)
EVAL = pztrain.build_eval_step(eval_fn)
EVAL_DATA = [{"x": X[:8], "y": Y[:8]}, {"x": X[8:16], "y": Y[8:16]}]


def init(seed):
    model = {
        "w": 0.1 * jax.random.normal(jax.random.key(seed), (3,)),
        "b": jnp.zeros((), jnp.float32),
    }
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.05)
    return pztrain.TrainState.initial_state(
        model, tx, jax.random.key(seed), jnp.zeros((), jnp.int32)
    )


def new_population(seeds=range(K), rates=RATES):
    return pztrain.make_population(init, seeds=seeds, learning_rate=rates)


def trained_population(steps=3):
    pop = new_population()
    for i in range(steps):
        pop, _ = STEP(pop, x=X[4 * i : 4 * i + 4], y=Y[4 * i : 4 * i + 4])
    return pop


def loader():
    return ArrayLoader({"x": X, "y": Y}, 4, seed=1)  # 8 steps per epoch


def run(state, **kw):
    kw.setdefault("progress", False)
    return pztrain.fit(state, STEP, loader(), **kw)


def assert_bitwise(a, b):
    """Same structure, and every leaf the same bits (keys by their key data).

    Each ``init`` call makes its own (equal) optimizer, part of the treedef:
    states compare with ``b`` 's.
    """
    if isinstance(a, pztrain.TrainState):
        a = a.replace(optimizer_def=b.optimizer_def)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def without_time(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def snapshot(*directories):
    """Every file under ``directories``: its bytes, by path."""
    return {
        str(f): f.read_bytes()
        for d in directories
        if d.exists()
        for f in sorted(d.rglob("*"))
        if f.is_file()
    }


# ------------------------------------------------------------ save and load


def test_save_state_load_state_round_trips_a_population_bitwise(tmp_path):
    pop = trained_population()
    pztrain.save_state(tmp_path / "s", pop)
    meta = pztrain.read_metadata(tmp_path / "s")
    assert meta["members"] == K
    assert meta["metadata"]["hyperparams"]["learning_rate"] == pytest.approx(RATES)
    # Into a population of other seeds and rates, and into its shapes alone.
    like = new_population(seeds=range(10, 10 + K), rates=[0.5] * K)
    for target in (like, jax.eval_shape(lambda: like)):
        back = pztrain.load_state(tmp_path / "s", target)
        assert_bitwise(back, pop)
        assert population_size(back) == K and int(back.step) == 3
        np.testing.assert_array_equal(
            back.opt_state.hyperparams["learning_rate"], np.float32(RATES)
        )
        keys = jax.random.key_data(back.root_rng)
        assert len({tuple(k) for k in np.asarray(keys).tolist()}) == K
    # The params alone, into a population.
    pztrain.save_params(tmp_path / "p", pop)
    assert pztrain.read_metadata(tmp_path / "p")["members"] == K
    back = pztrain.load_params(tmp_path / "p", like)
    assert_bitwise(back.params, pop.params)


def test_params_saved_without_a_state_load_into_a_population(tmp_path):
    pop = trained_population()
    pztrain.save_params(tmp_path / "p", pop.params)  # a pytree: no member count
    assert "members" not in pztrain.read_metadata(tmp_path / "p")
    back = pztrain.load_params(tmp_path / "p", new_population(seeds=range(5, 5 + K)))
    assert_bitwise(back.params, pop.params)


def test_a_checkpoint_without_a_member_count_is_one_run(tmp_path):
    state = member(trained_population(), 0)
    pztrain.save_state(tmp_path / "s", state)
    meta_file = tmp_path / "s" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta.pop("members") is None
    meta_file.write_text(json.dumps(meta))  # as pztrain 0.2.0 wrote it
    assert_bitwise(pztrain.load_state(tmp_path / "s", init(9)), state)
    with pytest.raises(CheckpointMismatchError, match="holds one run's state"):
        pztrain.load_state(tmp_path / "s", new_population())
    for bad in ("three", 0, -1, True, [K]):
        meta_file.write_text(json.dumps({**meta, "members": bad}))
        with pytest.raises(CheckpointError, match=re.escape("metadata's ['members']")):
            pztrain.load_state(tmp_path / "s", init(9))


# ------------------------------------------------------------ stops and resume


class SignalAt(Callback):
    """Sends ``sig`` to this process at the log point of ``step``."""

    def __init__(self, step, sig):
        self.step, self.sig = step, sig

    def on_log(self, state, record):
        if record["step"] == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.mark.slow  # three population runs
@pytest.mark.parametrize(
    "sig, reason",
    [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "preempted")],
    ids=["sigint", "sigterm"],
)
def test_a_stopped_population_resumes_bitwise_and_logs_each_step_once(
    tmp_path, sig, reason
):
    opts = dict(num_steps=16, log_every=2)
    whole, _ = run(new_population(), run_dir=tmp_path / "whole", **opts)
    ckpt = Checkpoints(tmp_path / "c", every_steps=4)
    state, history = run(
        new_population(),
        checkpoints=ckpt,
        callbacks=[SignalAt(6, sig)],
        run_dir=tmp_path / "run",
        **opts,
    )
    assert history.stop_reason == reason and int(state.step) == 6
    assert ckpt.steps()[-1] == 6  # the stop's save
    assert pztrain.read_metadata(tmp_path / "c" / "6")["members"] == K
    # fit(state, ...) goes on from the returned population.
    assert_bitwise(run(state, **opts)[0], whole)
    resumed, _ = run(
        new_population(seeds=range(7, 7 + K), rates=[1.0] * K),  # all restored
        checkpoints=ckpt,
        resume=True,
        run_dir=tmp_path / "run",
        **opts,
    )
    assert_bitwise(resumed, whole)
    records = without_time(read_jsonl(tmp_path / "run"))
    assert [r["step"] for r in records] == list(range(2, 17, 2))
    assert records == without_time(read_jsonl(tmp_path / "whole"))
    assert {f"loss/member_{i}" for i in range(K)} <= set(records[-1]["metrics"])


@pytest.mark.slow  # three population runs
def test_an_interrupted_population_resumes_from_its_newest_checkpoint(tmp_path):
    class Interrupt(Callback):
        def on_log(self, state, record):
            if record["step"] == 12:
                raise KeyboardInterrupt

    opts = dict(num_steps=16, log_every=4)
    whole, _ = run(new_population(), run_dir=tmp_path / "whole", **opts)
    ckpt = Checkpoints(tmp_path / "c", every_steps=4, keep_last=10)
    with pytest.raises(KeyboardInterrupt):
        run(
            new_population(),
            checkpoints=ckpt,
            callbacks=[Interrupt()],
            run_dir=tmp_path / "run",
            **opts,
        )
    assert ckpt.steps() == [4, 8]  # 12's record was not logged: no checkpoint
    resumed, _ = run(
        new_population(),
        checkpoints=ckpt,
        resume=True,
        run_dir=tmp_path / "run",
        **opts,
    )
    assert_bitwise(resumed, whole)
    records = without_time(read_jsonl(tmp_path / "run"))
    assert [r["step"] for r in records] == [4, 8, 12, 16]
    assert records == without_time(read_jsonl(tmp_path / "whole"))


# ------------------------------------------------------------ a member


def test_a_member_is_an_ordinary_state_for_every_api(tmp_path):
    pop = trained_population()
    one = member(pop, 1)
    assert population_size(one) is None and int(one.step) == 3
    assert float(one.opt_state.hyperparams["learning_rate"]) == np.float32(RATES[1])
    pztrain.save_params(tmp_path / "p", one)
    assert pztrain.read_metadata(tmp_path / "p")["members"] is None
    assert_bitwise(pztrain.load_params(tmp_path / "p", init(7)).params, one.params)
    pztrain.save_state(tmp_path / "s", one)
    assert_bitwise(pztrain.load_state(tmp_path / "s", init(7)), one)
    # A member of a restored population is the member of the saved one.
    pztrain.save_state(tmp_path / "pop", pop)
    back = pztrain.load_state(tmp_path / "pop", new_population(seeds=range(4, 4 + K)))
    assert_bitwise(member(back, 1), one)
    # Evaluated alone, it scores what the population's evaluation says of it
    # (up to the rounding of batched matmuls).
    alone = pztrain.evaluate(one, EVAL, EVAL_DATA)
    together = pztrain.evaluate(pop, EVAL, EVAL_DATA)
    assert set(alone) == {"mse"}
    np.testing.assert_allclose(alone["mse"], together["mse/member_1"], rtol=1e-5)
    text = str(one.summary())
    assert "TrainState at step 3" in text and "threefry2x32 key, shape ()" in text
    # And it trains on as one run.
    state, history = run(one, num_steps=5, log_every=1)
    assert int(state.step) == 5 and set(history.records[-1]["metrics"]) >= {"loss"}
    assert not any("/member_" in k for k in history.records[-1]["metrics"])


def test_a_member_exports_to_safetensors(tmp_path):
    import safetensors.numpy as safetensors_numpy  # the dev extra brings it

    one = member(trained_population(), 2)
    path = pztrain.export_safetensors(tmp_path / "w.safetensors", one)
    tensors = safetensors_numpy.load_file(str(path))
    assert {n: t.shape for n, t in tensors.items()} == {"b": (), "w": (3,)}
    back = pztrain.import_safetensors(path, init(7))
    assert_bitwise(back.params, one.params)


# ------------------------------------------------------------ bad input


def _counts(n):
    return "one run's state" if n is None else f"a population of {n} members"


@pytest.mark.parametrize("saved, target", [(K, None), (None, K), (K, 2)])
@pytest.mark.parametrize("load", ["load_state", "load_params"])
def test_another_member_count_is_refused_naming_both(tmp_path, saved, target, load):
    pop = trained_population()
    pztrain.save_state(tmp_path / "s", pop if saved else member(pop, 0))
    like = init(5) if target is None else new_population(range(target), [0.1] * target)
    fix = (
        "Load it into one run's state (pztrain.member(target, 0) is one)"
        if saved is None
        else f"Load it into a population of {saved} members"
    )
    with pytest.raises(CheckpointMismatchError) as caught:
        getattr(pztrain, load)(tmp_path / "s", like)
    message = str(caught.value)
    assert message.startswith(
        f"Checkpoint {tmp_path / 's'} holds {_counts(saved)}, but the target is "
        f"{_counts(target)}: a checkpoint loads into a state with as many members."
    )
    assert fix in message


@pytest.mark.parametrize("saved_members", [K, None], ids=["population", "one_run"])
def test_resume_into_another_member_count_is_refused_and_writes_nothing(
    tmp_path, saved_members
):
    pop = new_population()
    saved = pop if saved_members else member(pop, 0)
    other = member(new_population(), 0) if saved_members else new_population()
    run(
        saved,
        num_steps=2,
        log_every=2,
        checkpoints=Checkpoints(tmp_path / "c"),
        run_dir=tmp_path / "run",
    )
    before = snapshot(tmp_path / "c", tmp_path / "run")
    assert any("metrics.jsonl" in f for f in before)
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(f"holds {_counts(saved_members)}, but the target is "),
    ):
        run(
            other,
            num_steps=4,
            log_every=2,
            checkpoints=Checkpoints(tmp_path / "c"),
            resume=True,
            run_dir=tmp_path / "run",
        )
    assert snapshot(tmp_path / "c", tmp_path / "run") == before
    other.check_not_donated("the refused resume")  # the target is left whole


def test_a_population_loaded_into_one_model_names_the_param_and_the_members(
    tmp_path,
):
    """Into a model or params (not a state): the message names the param,
    both shapes, the checkpoint's members and how to take one out; short."""
    saved = pztrain.save_params(tmp_path / "pop", new_population())
    with pytest.raises(CheckpointMismatchError) as raised:
        pztrain.load_params(saved, init(0).params)  # a params dict, one run's
    message = str(raised.value)
    assert message.startswith(
        f"Parameter 'b' in {saved} is float32[{K}], but the target expects float32[]."
    )
    assert f"holds a population of {K} members" in message
    assert "pztrain.member(population, i)" in message and len(message) < 400
    one = pztrain.save_params(tmp_path / "one", init(0))
    with pytest.raises(CheckpointMismatchError, match=f"leading axis of {K}, as a"):
        pztrain.load_params(one, new_population().params)  # one run's, into K


def test_members_of_another_configuration_are_refused_naming_the_field():
    import equinox as eqx

    def wide(seed, width):
        model = eqx.nn.MLP(3, 1, width, 1, key=jax.random.key(seed))
        return pztrain.TrainState.initial_state(
            model, optax.sgd(0.1), jax.random.key(0)
        )

    with pytest.raises(pztrain.PopulationError) as raised:
        pztrain.stack_members([wide(0, 8), wide(1, 16)])
    message = str(raised.value)
    assert message.startswith(
        "Member 1's structure differs from member 0's at .model_without_params: "
        "MLP with width_size=16 against width_size=8."
    )
    assert len(message) < 400
