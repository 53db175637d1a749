"""Grad norms as metrics (``build_train_step(grad_norms=...)``): their values,
summed and logged by fit, plotted, nothing when off, bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import XOR_X, XOR_Y, logits_of, penzai_v2_mlp

from pztrain import ArrayLoader, History, TrainState, build_train_step, fit

_rng = np.random.default_rng(0)
X = _rng.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
OPT = optax.sgd(0.05)


def loss_fn(*, model, state, rng, x, y):
    err = x @ model["w"] + model["b"] - y
    return jnp.mean(err**2), state, {"mae": jnp.mean(jnp.abs(err))}


def _state():
    model = {"w": jnp.ones(3), "b": jnp.zeros(())}
    return TrainState.initial_state(model, OPT, jax.random.key(0))


def _norms(grads):
    per = {k: float(np.linalg.norm(np.asarray(g))) for k, g in grads.items()}
    return float(np.sqrt(sum(v**2 for v in per.values()))), per


@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_norms_are_those_of_the_grads_the_step_applies(microbatches):
    batch = {"x": X[:8], "y": Y[:8]}
    step = build_train_step(loss_fn, grad_norms="per_param", microbatches=microbatches)
    grads = step.compute_grads(_state(), **batch).grads  # micro-batches averaged
    total, per = _norms(grads)
    _, aux = step(_state(), **batch)
    assert sorted(aux) == ["grad_norm", "grad_norm/b", "grad_norm/w", "mae"]
    assert float(aux["grad_norm"]) == pytest.approx(total, rel=1e-6)
    for name, value in per.items():
        assert float(aux[f"grad_norm/{name}"]) == pytest.approx(value, rel=1e-6)
    _, aux = build_train_step(loss_fn, grad_norms="global")(_state(), **batch)
    assert sorted(aux) == ["grad_norm", "mae"]
    assert float(aux["grad_norm"]) == pytest.approx(total, rel=1e-6)


def test_fit_sums_and_logs_them_like_any_metric():
    step = build_train_step(loss_fn, grad_norms="per_param")
    loader = ArrayLoader({"x": X, "y": Y}, batch_size=4, shuffle=False)
    _, history = fit(
        _state(), step, loader, num_steps=4, log_every=4, progress=False, loggers=[]
    )
    state, seen = _state(), []
    for i in range(4):
        state, aux = step(state, x=X[4 * i : 4 * i + 4], y=Y[4 * i : 4 * i + 4])
        seen.append({k: float(v) for k, v in aux.items()})
    record = history.last("train")["metrics"]
    for name in ("grad_norm", "grad_norm/w", "grad_norm/b"):
        want = np.mean([s[name] for s in seen])
        assert record[name] == pytest.approx(want, rel=1e-6)


def test_off_adds_nothing():
    batch = {"x": X[:8], "y": Y[:8]}
    off, on = build_train_step(loss_fn), build_train_step(loss_fn, grad_norms="global")
    assert off.metric_sums(_state(), **batch).names == ("loss", "mae")
    assert on.metric_sums(_state(), **batch).names == ("loss", "grad_norm", "mae")
    _, aux = off(_state(), **batch)
    assert sorted(aux) == ["mae"]
    hlo_off = off.lower(_state(), **batch).as_text()
    assert "sqrt" not in hlo_off
    assert "sqrt" in on.lower(_state(), **batch).as_text()


def test_per_param_names_a_penzai_models_params():
    def xent(*, model, state, rng, x, y):
        logits = logits_of(model, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, state, None

    state = TrainState.initial_state(penzai_v2_mlp(), OPT, jax.random.key(0))
    step = build_train_step(xent, grad_norms="per_param")
    _, aux = step(state, x=XOR_X, y=XOR_Y)
    assert sorted(aux) == ["grad_norm", *sorted(f"grad_norm/{n}" for n in state.params)]


def test_history_plot_puts_per_param_norms_and_ema_metrics_on_shared_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [
        {
            "step": s,
            "split": "train",
            "metrics": {
                "loss": 1.0 / s,
                "grad_norm": 2.0,
                "grad_norm/w": 1.5,
                "grad_norm/b": 0.5,
            },
        }
        for s in (1, 2)
    ] + [{"step": 2, "split": "eval", "metrics": {"loss": 0.6, "ema/loss": 0.5}}]
    fig = History(records).plot()
    titles = {ax.get_title(): ax for ax in fig.axes}
    assert sorted(titles) == ["grad_norm", "grad_norm per param", "loss"]
    labels = lambda ax: sorted(line.get_label() for line in ax.get_lines())  # noqa: E731
    assert labels(titles["grad_norm per param"]) == ["b", "w"]
    assert labels(titles["loss"]) == ["eval", "eval EMA", "train"]
    plt.close(fig)


def test_bad_grad_norms_options_are_named():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "grad_norms must be None (off), 'global' (the norm of all grads) or "
            "'per_param' (that and one per parameter); got 'all'."
        ),
    ):
        build_train_step(loss_fn, grad_norms="all")

    def tuple_aux(*, model, state, rng, x, y):
        return jnp.mean(x @ model["w"] - y), state, (1.0,)

    with pytest.raises(
        TypeError, match=re.escape("must then be a dict (or None); got tuple")
    ):
        build_train_step(tuple_aux, grad_norms="global")(_state(), x=X, y=Y)

    def clashing(*, model, state, rng, x, y):
        return jnp.mean(x @ model["w"] - y), state, {"grad_norm": 1.0}

    with pytest.raises(
        ValueError, match=re.escape("The loss function's aux has ['grad_norm']")
    ):
        build_train_step(clashing, grad_norms="global")(_state(), x=X, y=Y)
