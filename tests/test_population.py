"""Populations: K runs trained as one program equal K separate runs (within the
float rounding of batched matmuls), through the step, fit and evaluation; bad
members and bad per-member input are refused by name."""

import itertools
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain.population import set_member_hyperparams

LRS = [0.003, 0.01, 0.03, 0.1]


def loss_fn(*, model, state, rng, x, y):
    drop = jax.random.bernoulli(rng, 0.9, (x.shape[0],))  # the member's key matters
    pred = jnp.tanh(x @ model["w1"]) @ model["w2"]
    loss = jnp.sum(drop * (pred - y) ** 2) / x.shape[0]
    return loss, state + 1, {"loss": loss, "acc": jnp.mean(jnp.abs(pred - y) < 0.3)}


def eval_fn(*, model, state, rng, x, y):
    pred = jnp.tanh(x @ model["w1"]) @ model["w2"]
    return {"mse": jnp.mean((pred - y) ** 2)}


def init(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (3, 8)) * 0.5,
        "w2": jax.random.normal(k2, (8,)) * 0.5,
    }
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    return pztrain.TrainState.initial_state(
        params, tx, jax.random.key(seed + 50), loss_fn_state=jnp.zeros((), jnp.int32)
    )


def solo(seed, lr):
    return init(seed).with_hyperparams(learning_rate=lr)


RNG = np.random.RandomState(0)
X = RNG.randn(64, 3).astype(np.float32)
Y = np.sin(X[:, 0]).astype(np.float32)


def population():
    return pztrain.make_population(init, seeds=range(4), learning_rate=LRS)


def assert_member_equals(pop, i, state, rtol=2e-4):
    one = pztrain.member(pop, i)
    assert int(one.step) == int(state.step)
    assert int(one.loss_fn_state) == int(state.loss_fn_state)
    for name in state.params:
        np.testing.assert_allclose(
            one.params[name], state.params[name], rtol=rtol, atol=1e-5
        )


def test_make_population_stacks_members_and_sets_their_rates():
    pop = population()
    assert pztrain.population_size(pop) == 4
    assert pop.step.shape == ()
    assert pop.params["w1"].shape == (4, 3, 8)
    np.testing.assert_allclose(pop.hyperparams["learning_rate"], LRS, rtol=1e-6)
    for i in range(4):
        one = pztrain.member(pop, i)
        np.testing.assert_array_equal(one.params["w1"], init(i).params["w1"])
        assert jax.random.key_data(one.root_rng).tolist() == (
            jax.random.key_data(init(i).root_rng).tolist()
        )


def test_population_step_equals_separate_runs():
    step = pztrain.build_train_step(loss_fn)
    pop = population()
    for _ in range(5):
        pop, aux = step(pop, x=X, y=Y)
    assert aux["loss"].shape == (4,)
    single = pztrain.build_train_step(loss_fn)
    for i, lr in enumerate(LRS):
        state = solo(i, lr)
        for _ in range(5):
            state, solo_aux = single(state, x=X, y=Y)
        assert_member_equals(pop, i, state)
        np.testing.assert_allclose(aux["loss"][i], solo_aux["loss"], rtol=2e-4)


def test_members_differ_by_key_and_rate():
    """The check above could fail: members with each other's key or rate differ."""
    step = pztrain.build_train_step(loss_fn)
    pop, _ = step(population(), x=X, y=Y)
    a, b = pztrain.member(pop, 0), pztrain.member(pop, 1)
    assert not np.allclose(a.params["w1"], b.params["w1"])


def test_fused_microbatched_and_accumulated_population_steps():
    two = {"x": np.stack([X, X]), "y": np.stack([Y, Y])}
    fused = pztrain.build_train_step(loss_fn, steps_per_call=2, microbatches=2)
    plain = pztrain.build_train_step(loss_fn, microbatches=2)
    pop, aux = fused(population(), **two)
    assert aux["loss"].shape == (4, 2)
    ref = population()
    for _ in range(2):
        ref, _ = plain(ref, x=X, y=Y)
    for i in range(4):
        assert_member_equals(pop, i, pztrain.member(ref, i), rtol=1e-5)
    sums = plain.metric_sums(population(), x=X, y=Y)
    assert sums.packed.shape[0] == 4
    acc_pop, sums = plain.accumulate(population(), sums, x=X, y=Y, calls=2)
    summary = sums.read()
    assert summary.count == 2
    assert set(summary.means) >= {"loss", "loss/min", "loss/max", "loss/member_3"}
    for i in range(4):
        assert_member_equals(acc_pop, i, pztrain.member(ref, i), rtol=1e-5)


def test_one_batch_per_member():
    step = pztrain.build_train_step(loss_fn, member_batches=True)
    xs = np.stack([X * (i + 1) for i in range(4)])
    ys = np.stack([Y] * 4)
    pop, _ = step(population(), x=xs, y=ys)
    single = pztrain.build_train_step(loss_fn)
    for i, lr in enumerate(LRS):
        state, _ = single(solo(i, lr), x=xs[i], y=ys[i])
        assert_member_equals(pop, i, state)


def test_eval_step_per_member_and_member_batches():
    pop = population()
    mse = pztrain.build_eval_step(eval_fn)(pop, x=X, y=Y)["mse"]
    each = pztrain.build_eval_step(eval_fn)
    for i in range(4):
        np.testing.assert_allclose(mse[i], each(init(i), x=X, y=Y)["mse"], rtol=1e-5)
    per = pztrain.build_eval_step(eval_fn, member_batches=True)
    xs = np.stack([X[:8]] * 4)
    assert per(pop, x=xs, y=np.stack([Y[:8]] * 4))["mse"].shape == (4,)


def test_population_compiles_once_and_donates():
    traces = []

    def counted(**kw):
        traces.append(1)
        return loss_fn(**kw)

    step = pztrain.build_train_step(counted)
    pop = population()
    old = pop
    for _ in range(3):
        pop, _ = step(pop, x=X, y=Y)
    assert len(traces) == 1
    with pytest.raises(pztrain.DonatedStateError):
        step(old, x=X, y=Y)


def test_fit_logs_every_member_and_their_mean(tmp_path):
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=16, seed=0)
    step = pztrain.build_train_step(loss_fn)
    pop, history = pztrain.fit(
        population(),
        step,
        data,
        num_epochs=2,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=data,
        log_every=4,
        progress=False,
        run_dir=tmp_path / "run",
    )
    train = [r for r in history.to_dicts() if r["split"] == "train"][-1]["metrics"]
    losses = [train[f"loss/member_{i}"] for i in range(4)]
    assert train["loss"] == pytest.approx(np.mean(losses))
    assert train["loss/min"] == pytest.approx(min(losses))
    assert train["learning_rate/member_2"] == pytest.approx(LRS[2])
    evals = [r for r in history.to_dicts() if r["split"] == "eval"][-1]["metrics"]
    for i, lr in enumerate(LRS):  # each member's fit equals a fit of that run
        state, solo_history = pztrain.fit(
            solo(i, lr),
            step,
            data,
            num_epochs=2,
            eval_step=pztrain.build_eval_step(eval_fn),
            eval_data=data,
            log_every=4,
            progress=False,
        )
        assert_member_equals(pop, i, state)
        solo_eval = [r for r in solo_history.to_dicts() if r["split"] == "eval"][-1]
        assert evals[f"mse/member_{i}"] == pytest.approx(
            solo_eval["metrics"]["mse"], rel=1e-4
        )


def test_members_that_differ_are_refused_by_name():
    other = pztrain.TrainState.initial_state(
        {"w1": jnp.zeros((3, 9)), "w2": jnp.zeros(9)},
        optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
        jax.random.key(0),
        loss_fn_state=jnp.zeros((), jnp.int32),
    )
    with pytest.raises(
        pztrain.PopulationError,
        match=re.escape(
            "Member 1 differs from member 0 at .params['w1']: float32[3, 9] against "
            "float32[3, 8]"
        ),
    ):
        pztrain.stack_members([init(0), other])
    sgd = pztrain.TrainState.initial_state(
        init(0).params,
        optax.sgd(0.1),
        jax.random.key(0),
        loss_fn_state=jnp.zeros((), jnp.int32),
    )
    with pytest.raises(pztrain.PopulationError, match="Member 1's structure differs"):
        pztrain.stack_members([init(0), sgd])
    later = init(1).replace(step=jnp.asarray(3, jnp.int32))
    with pytest.raises(
        pztrain.PopulationError, match=re.escape("different steps [0, 3]")
    ):
        pztrain.stack_members([init(0), later])
    with pytest.raises(pztrain.PopulationError, match="already a population"):
        pztrain.stack_members([population()])


def test_bad_member_and_hyperparameter_input():
    pop = population()
    with pytest.raises(
        pztrain.PopulationError,
        match=re.escape("member(state, 4): the population has 4 members (0 to 3)."),
    ):
        pztrain.member(pop, 4)
    with pytest.raises(pztrain.PopulationError, match="got a single run's state"):
        pztrain.member(init(0), 0)
    with pytest.raises(
        pztrain.PopulationError,
        match=re.escape(
            "Hyperparameter 'learning_rate' needs one value per member (4 seeds); "
            "got (3,)"
        ),
    ):
        pztrain.make_population(init, seeds=range(4), learning_rate=[0.1] * 3)
    with pytest.raises(
        ValueError, match=re.escape("Unknown hyperparameter(s) ['momentum']")
    ):
        pztrain.make_population(init, seeds=range(2), momentum=[0.9, 0.8])
    with pytest.raises(
        pztrain.PopulationError, match=re.escape("shape (4,); got shape (2,)")
    ):
        set_member_hyperparams(pop, learning_rate=[0.1, 0.2])


def test_a_per_member_batch_of_the_wrong_size_is_refused():
    step = pztrain.build_train_step(loss_fn, member_batches=True)
    with pytest.raises(
        pztrain.BatchError,
        match=re.escape(
            "every batch leaf has a leading member axis of 4 (the population's size); "
            "got 'x' of shape (3, 64, 3)"
        ),
    ):
        step(population(), x=np.stack([X] * 3), y=np.stack([Y] * 4))


def test_metric_sums_of_per_member_batches_of_several_steps_a_call():
    """member_batches with steps_per_call=2 (the member axis, then the steps):
    `fit`'s metric sums come from one step's slice of every member's batch,
    not from member 0's steps (a combination-matrix row failed in `fit`)."""
    per = pztrain.build_train_step(loss_fn, member_batches=True, steps_per_call=2)
    xs = np.stack([X[i : i + 32].reshape(2, 16, 3) for i in range(4)])
    ys = np.stack([Y[i : i + 32].reshape(2, 16) for i in range(4)])
    sums = per.metric_sums(population(), {"x": xs, "y": ys})
    _, aux = per(population(), x=xs, y=ys)
    assert sorted(sums.names) == sorted(aux) == ["acc", "loss"]


class _MemberLoader(pztrain.data.StepLoader):
    """One ArrayLoader per member, their batches stacked on a leading member
    axis (then the steps, with ``steps_per_call``)."""

    steps_per_epoch = 4

    def __init__(self):
        arrays = {"x": X, "y": Y}
        self.loaders = [pztrain.ArrayLoader(arrays, 16, seed=i) for i in range(4)]

    def batch_at(self, step):
        return _stacked([loader.batch_at(step) for loader in self.loaders])

    def epoch(self, epoch=0):
        return map(self.batch_at, range(4 * epoch, 4 * epoch + 4))

    def iter_from_step(self, step, steps_per_call=1):
        its = [loader.iter_from_step(step, steps_per_call) for loader in self.loaders]
        return (_stacked(batches) for batches in zip(*its, strict=True))


def _stacked(batches):
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def test_fit_reads_per_member_loaders_of_several_steps_a_call():
    """A loader of per-member batches with steps_per_call=2 (the member axis,
    then the steps) trains under fit as the step alone: fit's look at the
    first batch before the run stacks the steps after the members (a
    combination-matrix row)."""
    per = pztrain.build_train_step(loss_fn, member_batches=True, steps_per_call=2)
    pop, _ = pztrain.fit(
        population(), per, _MemberLoader(), num_steps=4, log_every=2, progress=False
    )
    ref = population()
    for batch in itertools.islice(_MemberLoader().iter_from_step(0, 2), 2):
        ref, _ = per(ref, **batch)
    for i in range(4):
        assert_member_equals(pop, i, pztrain.member(ref, i), rtol=1e-6)


def test_population_inside_the_users_own_scan():
    step = pztrain.build_train_step(loss_fn)
    pop, aux = jax.lax.scan(
        lambda s, _: step(s, x=X, y=Y), population(), None, length=3
    )
    assert aux["loss"].shape == (3, 4)
    ref = population()
    for _ in range(3):
        ref, _ = step(ref, x=X, y=Y)
    for i in range(4):
        assert_member_equals(pop, i, pztrain.member(ref, i), rtol=1e-5)


MESH_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from tests.test_population import population, loss_fn, eval_fn, X, Y
    import pztrain
    from pztrain.population import shard_members
    mesh = jax.make_mesh((4,), ("members",))
    step = pztrain.build_train_step(loss_fn)
    pop = shard_members(population(), mesh)
    ref = population()
    for _ in range(3):
        pop, aux = step(pop, x=X, y=Y)
        ref, _ = step(ref, x=X, y=Y)
    w = pop.params["w1"]
    assert len(w.sharding.device_set) == 4, w.sharding
    assert w.addressable_shards[0].data.shape == (1, 3, 8)
    np.testing.assert_allclose(w, ref.params["w1"], rtol=1e-5, atol=1e-6)
    # fit and evaluation on the split population, on Explicit and Auto axes
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=16, seed=0)
    ev = pztrain.build_eval_step(eval_fn)
    kw = dict(num_steps=8, eval_step=ev, eval_data=data, log_every=4, progress=False)
    _, plain = pztrain.fit(population(), step, data, **kw)
    auto = jax.sharding.AxisType.Auto
    for mesh in (mesh, jax.make_mesh((4,), ("members",), axis_types=(auto,))):
        spread = shard_members(population(), mesh)
        split, history = pztrain.fit(spread, step, data, **kw)
        assert len(split.params["w2"].sharding.device_set) == 4
        got, want = history.last("eval")["metrics"], plain.last("eval")["metrics"]
        np.testing.assert_allclose(got["mse/member_3"], want["mse/member_3"], rtol=1e-5)
    # micro-batches, and one NumPy batch per member, on the split population
    micro = pztrain.build_train_step(loss_fn, microbatches=2)
    got = micro(shard_members(population(), mesh), x=X, y=Y)[1]["loss"]
    np.testing.assert_allclose(got, micro(population(), x=X, y=Y)[1]["loss"], rtol=1e-5)
    per = pztrain.build_train_step(loss_fn, member_batches=True)
    xs, ys = np.stack([X] * 4), np.stack([Y] * 4)
    got = per(shard_members(population(), mesh), x=xs, y=ys)[1]["loss"]
    np.testing.assert_allclose(got, step(population(), x=X, y=Y)[1]["loss"], rtol=1e-5)
    try:
        data_mesh = jax.make_mesh((4,), ("data",))
        pztrain.build_train_step(loss_fn, mesh=data_mesh)(population(), x=X, y=Y)
    except ValueError as e:
        assert "shard_members(state, mesh)" in str(e), e
    else:
        raise AssertionError("a population on a step built with mesh= ran")
    print("ok", aux["loss"].shape)
    """
)


def _on_four_devices(script: str) -> str:
    """``script``'s output, run in a process of 4 CPU devices (it must succeed)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_members_split_over_a_mesh_axis():
    assert "ok (4,)" in _on_four_devices(MESH_SCRIPT)


NNX_MESH_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, optax
    import pztrain
    from pztrain.population import shard_members
    from tests.nnx_models import mlp, loss_fn, batch, xent
    def init(seed):
        return pztrain.TrainState.initial_state(
            mlp(seed), optax.adam(0.05), jax.random.key(seed))
    def eval_fn(*, model, state, rng, x, y):
        return {"loss": xent(model(x), y)}
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4,), ("members",), axis_types=(auto,))
    pop = shard_members(pztrain.make_population(init, seeds=range(4)), mesh)
    step, b = pztrain.build_train_step(loss_fn), batch()
    pop, sums = step.accumulate(pop, step.metric_sums(pop, b), b)
    leaves = jax.tree.leaves(pop.model_without_params)  # the dropout's counter too
    unsplit = [x.shape for x in leaves if len(x.sharding.device_set) != 4]
    assert not unsplit, unsplit
    out = pztrain.build_eval_step(eval_fn)(pop, **b)  # maps over split members
    print("ok", np.shape(out["loss"]))
    """
)


@pytest.mark.slow
def test_an_nnx_populations_state_variables_stay_split_after_a_step():
    assert "ok (4,)" in _on_four_devices(NNX_MESH_SCRIPT)


def test_progress_bar_shows_the_mean_and_the_members_range():
    class Bar:
        def __init__(self, **kw):
            self.postfix = None

        def set_postfix(self, postfix, refresh):
            self.postfix = postfix

    bar = pztrain.ProgressBar(make_bar=Bar)
    info = pztrain.LoopInfo(
        start_step=0,
        end_step=10,
        steps_per_epoch=None,
        steps_per_call=1,
        log_every=5,
        evaluates=True,
        run_dir=None,
    )
    bar.on_train_start(None, info)
    metrics = {"loss": 0.31, "loss/min": 0.12, "loss/max": 0.55}
    metrics.update({"loss/member_0": 0.12, "loss/member_1": 0.55, "lr": 0.1})
    bar.on_log(None, {"step": 5, "metrics": metrics})
    bar.on_eval_end(
        None, {"step": 5, "metrics": {"acc": 0.9, "acc/min": 0.8, "acc/max": 1.0}}
    )
    assert bar.bar.postfix == {
        "loss": "0.31 [0.12, 0.55]",
        "lr": "0.1",
        "eval/acc": "0.9 [0.8, 1]",
    }


def test_history_plot_draws_members_under_their_mean(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=16, seed=0)
    _, history = pztrain.fit(
        population(),
        pztrain.build_train_step(loss_fn),
        data,
        num_steps=8,
        log_every=4,
        progress=False,
    )
    fig = history.plot(["loss", "learning_rate"])
    loss_panel = fig.axes[0]
    widths = [line.get_linewidth() for line in loss_panel.lines]
    assert len(widths) == 5 and max(widths[:4]) < widths[4]  # 4 members, the mean
    assert [ax.get_title() for ax in history.plot().axes] == [
        "acc",
        "learning_rate",
        "loss",
    ]
    plt.close("all")


def test_summary_names_the_member_axis():
    text = str(population().summary())
    assert "a population of 4 members: every shape starts with the member axis " in text
    assert "(32 values per member)" in text
    assert "key:  threefry2x32 key, shape (4,)" in text
    assert "population" not in str(init(0).summary())


def test_per_member_ema_decay_and_dropout_rate():
    """Hyperparameters outside the optimizer's rate: an injected EMA decay, and
    a dropout rate kept in the loss-function state (one value per member)."""

    def dropout_loss(*, model, state, rng, x, y):
        keep = jax.random.bernoulli(rng, 1.0 - state["rate"], x.shape)
        pred = jnp.tanh((x * keep) @ model["w1"]) @ model["w2"]
        loss = jnp.mean((pred - y) ** 2)
        return loss, state, {"loss": loss}

    def member_init(seed, decay=0.9, rate=0.1):
        ema = optax.inject_hyperparams(
            pztrain.with_ema, static_args=("optimizer", "warmup")
        )(optimizer=optax.adam(0.01), decay=decay)
        return pztrain.TrainState.initial_state(
            init(seed).params,
            ema,
            jax.random.key(seed),
            loss_fn_state={"rate": jnp.float32(rate)},
        )

    decays, rates = [0.5, 0.9, 0.99], [0.0, 0.2, 0.5]
    pop = pztrain.make_population(member_init, seeds=range(3), decay=decays)
    pop = pop.replace(loss_fn_state={"rate": jnp.asarray(rates, jnp.float32)})
    step = pztrain.build_train_step(dropout_loss)
    for _ in range(4):
        pop, _ = step(pop, x=X, y=Y)
    for i in range(3):
        state = member_init(i, decays[i], rates[i])
        for _ in range(4):
            state, _ = step(state, x=X, y=Y)
        np.testing.assert_allclose(
            pztrain.member(pop, i).ema_params["w1"],
            state.ema_params["w1"],
            rtol=2e-4,
            atol=1e-5,
        )
    assert not np.allclose(pop.ema_params["w1"][0], pop.ema_params["w1"][2])


def test_a_vmapped_initial_state_needs_one_step_counter():
    pop = jax.vmap(init)(jnp.arange(3))
    step = pztrain.build_train_step(loss_fn)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "got a step counter of shape (3,), as jax.vmap of TrainState.initial_state "
            "makes. Set it with state.replace(step=state.step[0])"
        ),
    ):
        step(pop, x=X, y=Y)
    pop, aux = step(pop.replace(step=pop.step[0]), x=X, y=Y)
    assert aux["loss"].shape == (3,)


def test_monitors_rank_members(tmp_path):
    """EarlyStopping and Checkpoints' best-k take a population's entries: the
    best member (``eval/mse/min``) or one member (``eval/mse/member_2``)."""
    data = pztrain.ArrayLoader({"x": X, "y": Y}, batch_size=16, seed=0)
    early = pztrain.EarlyStopping(monitor="eval/mse/min", patience=100)
    ckpts = pztrain.Checkpoints(
        tmp_path / "ckpt", keep_best=1, keep_last=1, monitor="eval/mse/member_2"
    )
    _, history = pztrain.fit(
        population(),
        pztrain.build_train_step(loss_fn),
        data,
        num_steps=12,
        eval_step=pztrain.build_eval_step(eval_fn),
        eval_data=data,
        eval_every=4,
        log_every=4,
        progress=False,
        callbacks=[early],
        checkpoints=ckpts,
    )
    evals = [r for r in history.to_dicts() if r["split"] == "eval"]
    best = min(evals, key=lambda r: r["metrics"]["mse/min"])
    assert early.best == pytest.approx(best["metrics"]["mse/min"])
    by_member_2 = min(evals, key=lambda r: r["metrics"]["mse/member_2"])["step"]
    assert ckpts.best_step() == by_member_2


def test_treescope_names_the_member_axis():
    import treescope

    text = treescope.render_to_text(population())
    assert text.startswith("# a population of 4 members: axis 0 of every array\n")
    assert "float32(4, 3, 8)" in text
    assert "population" not in treescope.render_to_text(init(0))
