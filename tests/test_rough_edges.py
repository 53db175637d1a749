"""Rough edges a reader hits while following the docs (issue 25, item 9).

`evaluate` given a model, a penzai transformer's summary (constants, width),
treescope's text lines, the progress bar's width and first rate,
`EarlyStopping(restore_best=True)`, and the ``notebooks`` extra.
"""

from __future__ import annotations

import functools
import io
import re
import time
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import treescope
from packaging.requirements import Requirement
from penzai.models import simple_mlp
from penzai.models.transformer.variants import llamalike_common

import pztrain

ROOT = Path(__file__).resolve().parents[1]
MAKE_STATE = (
    "state = pztrain.TrainState.initial_state(model, optax.identity(), "
    "jax.random.key(0))"
)


def _eval_fn(*, model, state, rng, x):
    return {"mean": jnp.mean(x @ model["w"])}


def _loss_fn(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"]) ** 2)
    return loss, state, {"loss": loss}


@pytest.mark.parametrize(
    "call, where, optimizer",
    [
        ("evaluate", "evaluate(state, ...)", "optax.identity()"),
        ("eval_step", "eval_step(state, ...)", "optax.identity()"),
        ("train_step", "train_step(state, ...)", "optax.adam(1e-3)"),
    ],
)
def test_a_model_instead_of_a_state_gets_the_line_that_makes_one(
    call, where, optimizer
):
    model = {"w": jnp.ones((3, 1))}
    x = np.ones((4, 3), np.float32)
    calls = {
        "evaluate": lambda: pztrain.evaluate(
            model, pztrain.build_eval_step(_eval_fn), [{"x": x}]
        ),
        "eval_step": lambda: pztrain.build_eval_step(_eval_fn)(model, x=x),
        "train_step": lambda: pztrain.build_train_step(_loss_fn)(model, x=x),
    }
    expected = (
        f"{where} takes a pztrain.TrainState, not a dict. Make one from the model"
    )
    made = MAKE_STATE.replace("optax.identity()", optimizer)
    with pytest.raises(TypeError, match=re.escape(expected) + ".*" + re.escape(made)):
        calls[call]()


def test_the_line_in_the_error_makes_a_state_that_evaluate_takes():
    model = {"w": jnp.ones((3, 1))}
    namespace = {"pztrain": pztrain, "optax": optax, "jax": jax, "model": model}
    exec(MAKE_STATE, namespace)
    data = [{"x": np.ones((4, 3), np.float32)}]
    result = pztrain.evaluate(
        namespace["state"], pztrain.build_eval_step(_eval_fn), data
    )
    assert result == {"mean": pytest.approx(3.0)}


# ------------------------------------------------------------------ summary


@pytest.fixture(scope="module")
def transformer_state():
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=16,
        projection_dim=8,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=20,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=False,
    )
    model = llamalike_common.build_llamalike_transformer(
        config, init_base_rng=jax.random.key(0), name="transformer"
    )
    return pztrain.TrainState.initial_state(model, optax.adam(1e-3), jax.random.key(0))


@pytest.mark.slow  # builds a penzai transformer (the module's fixture)
def test_a_penzai_transformers_summary_names_its_constants(transformer_state):
    summary = transformer_state.summary()
    kinds = {row.name.rsplit("/", 1)[-1]: row.kind for row in summary.rows}
    assert kinds["by"] == "constant"  # ConstantRescale(by=...)
    assert kinds["masked_out_value"] == "constant"  # the causal mask's
    assert kinds["epsilon"] == "constant"  # RMSNorm's
    assert {row.kind for row in summary.rows} == {"trainable", "constant"}
    assert summary.title.endswith("; 0 frozen")
    assert "frozen" not in str(summary).split("\n", 1)[1]


@pytest.mark.slow  # builds a penzai transformer (the module's fixture)
def test_a_penzai_transformers_summary_fits_100_columns(transformer_state):
    text = str(transformer_state.summary())
    widths = [len(line) for line in text.splitlines()]
    assert max(widths) <= 100, max(widths)
    assert "  query_key_to_attn/" in text  # a name wrapped onto a second line


def test_long_names_wrap_within_100_columns_and_read_back_whole():
    names = [
        "encoder/" + "/".join(f"block_{i}_with_a_rather_long_name" for i in range(3)),
        "x" * 117,  # no separator: cut
        "short",
    ]
    model = {name: jnp.zeros((2, 3)) for name in names}
    state = pztrain.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
    lines = str(state.summary()).splitlines()
    assert max(map(len, lines)) <= 100
    table = lines[lines.index("") + 3 : lines.index("", lines.index("") + 1)]
    read, current = [], ""
    for line in table:  # a name's first line holds the row; the rest: indented
        if line.startswith("  "):
            current += line.split()[0]
        else:
            if current:
                read.append(current)
            current = line.split()[0]
    read.append(current)
    assert read == sorted(names)


def test_a_pytree_models_filtered_out_floats_stay_frozen_params():
    model = {"w": jnp.zeros(3), "b": jnp.zeros(2), "idx": jnp.arange(3)}
    state = pztrain.TrainState.initial_state(
        model, optax.sgd(0.1), jax.random.key(0), trainable="w"
    )
    kinds = {row.name: row.kind for row in state.summary().rows}
    assert kinds == {"w": "trainable", "b": "frozen", "idx": "buffer"}


# ------------------------------------------------------------------ treescope

# What a line of treescope's text may hold past 80 characters: one item that
# treescope does not break, a name with an array's summary or a function's name.
_ONE_ITEM = re.compile(
    r"^ *('[^']*'|\w+)(: |=)(<jax\.Array[^<>]*>|<function [\w.<>]*>),?$"
)


def _mlp_state(optimizer):
    model = simple_mlp.MLP.from_config(
        name="mlp", init_base_rng=jax.random.key(0), feature_sizes=[64, 128, 10]
    )
    return pztrain.TrainState.initial_state(model, optimizer, jax.random.key(0))


@pytest.mark.slow  # renders three states (test_summary's treescope tests stay fast)
@pytest.mark.parametrize(
    "optimizer",
    [
        optax.adam(3e-3),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ],
    ids=["adam", "inject_hyperparams", "chain"],
)
def test_treescope_text_runs_past_80_columns_only_for_a_name_and_its_array(
    optimizer,
):
    text = treescope.render_to_text(_mlp_state(optimizer))
    long = [line for line in text.splitlines() if len(line) > 80]
    assert all(_ONE_ITEM.match(line) for line in long), long
    assert max(map(len, text.splitlines())) <= 115
    assert "optimizer_def=GradientTransformationExtraArgs(" in text
    assert "init=<function chain.<locals>.init_fn>," in text or (
        "init=<function inject_hyperparams.<locals>" in text
    )
    assert "# Defined at" not in text  # the optimizer's functions, by name


# ------------------------------------------------------------------ progress bar


def _metrics_loss_fn(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"]) ** 2)
    names = ("loss", "a_long_metric_name", "another_metric", "learning_rate")
    return loss, state, {name: loss for name in names}


def _bar_lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


@pytest.mark.parametrize("columns", [60, 100])
def test_the_progress_bar_stays_within_the_width_when_writing_to_a_file(
    columns, monkeypatch
):
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()  # not a terminal: tqdm cannot read a width
    bar = pztrain.ProgressBar(make_bar=functools.partial(tqdm.tqdm, file=out))
    state = pztrain.TrainState.initial_state(
        {"w": jnp.ones((3, 1))}, optax.sgd(0.1), jax.random.key(0)
    )
    data = pztrain.ArrayLoader({"x": np.ones((64, 3), np.float32)}, 4, seed=0)
    pztrain.fit(
        state,
        pztrain.build_train_step(_metrics_loss_fn),
        data,
        num_steps=200,
        log_every=20,
        progress=bar,
    )
    lines = _bar_lines(out.getvalue())
    assert lines and "200/200" in lines[-1]
    assert max(map(len, lines)) <= columns - 1, lines
    untrimmed = len(lines[-1].split(", loss=")[0]) + 70  # the metrics alone: 70+
    assert untrimmed > columns - 1  # so the width was what kept it short


@pytest.mark.slow  # sleeps 1 s
def test_the_progress_bars_rate_starts_after_the_compile():
    tqdm = pytest.importorskip("tqdm")
    out = io.StringIO()
    bar = pztrain.ProgressBar(make_bar=functools.partial(tqdm.tqdm, file=out))
    info = pztrain.LoopInfo(
        start_step=0,
        end_step=1000,
        steps_per_epoch=None,
        steps_per_call=1,
        log_every=100,
        evaluates=False,
        run_dir=None,
    )
    bar.on_train_start(None, info)
    bar.on_advance(0, t=time.perf_counter())
    time.sleep(1.0)  # the first call: its compile
    first = bar.on_advance(10, t=time.perf_counter())
    assert bar.bar.initial == 10 and bar.bar.n == 10
    bar.on_advance(first, t=time.perf_counter())
    meter = tqdm.tqdm.format_meter(**bar.bar.format_dict)
    rate = float(re.search(r"([\d.]+)step/s", meter).group(1))
    assert rate > 50, meter  # with the compile counted: under 20 step/s
    bar.on_train_end(None, None)


# ------------------------------------------------------------------ EarlyStopping


def _drift_loss(*, model, state, rng, x):
    loss = jnp.sum(model["w"]) + 0 * jnp.sum(x)  # w falls by lr at each step
    return loss, state, {"loss": loss}


def _distance_to_best(*, model, state, rng, x):
    return {"gap": jnp.sum((model["w"] + 0.3) ** 2)}  # 0 at step 3


def test_restore_best_gives_back_the_params_and_keeps_the_step_as_documented():
    stopper = pztrain.EarlyStopping("eval/gap", patience=2, restore_best=True)
    state = pztrain.TrainState.initial_state(
        {"w": jnp.zeros(())}, optax.sgd(0.1), jax.random.key(0)
    )
    data = [{"x": np.ones(2, np.float32)}] * 20
    state, history = pztrain.fit(
        state,
        pztrain.build_train_step(_drift_loss),
        data,
        num_steps=20,
        log_every=1,
        eval_step=pztrain.build_eval_step(_distance_to_best),
        eval_data=data[:1],
        eval_every=1,
        callbacks=[stopper],
        progress=False,
    )
    assert stopper.best_step == 3
    assert float(state.params["w"]) == pytest.approx(-0.3)  # the best params
    assert int(state.step) == 5  # the stopping point, as the docstring says
    assert history.last("eval")["step"] == 5
    best = [r for r in history.records if r["split"] == "eval" and r["step"] == 3]
    assert best[0]["metrics"]["gap"] == pytest.approx(stopper.best, abs=1e-6)
    doc = " ".join(pztrain.EarlyStopping.__doc__.split())
    assert "so ``state.step`` is not `best_step`" in doc


# ------------------------------------------------------------------ extras


def test_the_notebooks_extra_installs_jupyter_and_nbconvert():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["notebooks"]
    names = {Requirement(r).name for r in extra}  # each a valid requirement
    assert names & {"notebook", "jupyterlab"}, names  # opens the notebooks
    assert {"nbconvert", "ipykernel", "nbclient"} <= names, names
