"""state.summary(): a row per array, totals per part, step and key; treescope."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import treescope
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    dict_mlp_apply,
    dict_mlp_params,
    equinox_mlp,
    penzai_v1_mlp,
    penzai_v2_mlp,
)
from penzai import pz

import pztrain
from pztrain.state import DonatedStateError, TrainState
from pztrain.step import build_train_step
from pztrain.summary import Summary, optimizer_state_types, summarize

ROOT = Path(__file__).resolve().parents[1]


def _row(summary: Summary, name: str):
    (row,) = [r for r in summary.rows if r.name == name]
    return row


def _total(summary: Summary, part: str):
    (total,) = [t for t in summary.totals if t[0] == part]
    return total


def test_penzai_v2_rows_and_totals_are_exact():
    state = TrainState.initial_state(
        penzai_v2_mlp(hidden=16), optax.adam(1e-3), jax.random.key(0)
    )
    summary = state.summary()
    assert isinstance(summary, str) and isinstance(summary, Summary)
    weights = _row(summary, "mlp/Affine_0/Linear.weights")
    assert (weights.shape, weights.dtype, weights.count, weights.nbytes) == (
        (2, 16),
        "float32",
        32,
        128,
    )
    assert weights.kind == "trainable" and weights.sharding is None
    assert {r.name for r in summary.rows} == set(state.params)
    # 2*16 + 16 + 16*2 + 2 = 82 values, 328 bytes in float32
    assert _total(summary, "params") == ("params", "4", "82", "328 B", "328 B", "")
    # adam: count (int32) + mu + nu = 1 + 2 * 82 values, 4 + 2 * 328 bytes
    assert _total(summary, "opt_state") == (
        "opt_state",
        "9",
        "165",
        "660 B",
        "660 B",  # one device holds it all
        "(ScaleByAdamState, EmptyState)",
    )
    assert _total(summary, "loss_fn_state")[1:] == ("0", "0", "0 B", "0 B", "None")
    assert summary.splitlines()[0] == (
        "TrainState at step 0: 4 trainable arrays, 82 values (328 B); 0 frozen"
    )
    assert summary.step == 0 and "step: 0" in summary
    assert summary.key == "threefry2x32 key, shape ()"
    assert "optimizer tuple" not in summary


def test_the_text_table_has_one_line_per_row_with_its_columns():
    state = TrainState.initial_state(
        penzai_v2_mlp(), optax.adam(1e-3), jax.random.key(0)
    )
    lines = str(state.summary()).splitlines()
    assert lines[2].split() == ["name", "shape", "dtype", "count", "bytes", "kind"]
    line = next(x for x in lines if x.startswith("mlp/Affine_0/Linear.weights"))
    assert line.split() == [
        "mlp/Affine_0/Linear.weights",
        "(2,",
        "16)",
        "float32",
        "32",
        "128",
        "trainable",
    ]
    opt = next(x for x in lines if x.startswith("opt_state"))
    assert opt.split()[:5] == ["opt_state", "9", "165", "660", "B"]
    # repr is the table itself (a notebook cell without HTML shows it unquoted)
    assert repr(state.summary()) == str(state.summary())


def test_step_and_key_after_training():
    state = TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.PRNGKey(3)
    )
    state = state.apply_gradients({"w": jnp.ones(3)})
    state = state.apply_gradients({"w": jnp.ones(3)})
    summary = state.summary()
    assert summary.step == 2 and summary.title.startswith("TrainState at step 2:")
    assert summary.key == "legacy raw key uint32[2] (jax.random.PRNGKey)"


def test_equinox_with_a_trainable_filter_lists_the_frozen_layer():
    state = TrainState.initial_state(
        equinox_mlp(hidden=16),
        optax.adam(0.1),
        jax.random.key(0),
        trainable=r"^layers/1/",
    )
    summary = state.summary()
    kinds = {r.name: r.kind for r in summary.rows}
    assert kinds == {
        "layers/1/weight": "trainable",
        "layers/1/bias": "trainable",
        "layers/0/weight": "frozen",
        "layers/0/bias": "frozen",
    }
    assert _row(summary, "layers/0/weight").shape == (16, 2)
    # frozen: 16*2 + 16 = 48 values; trained: 2*16 + 2 = 34
    assert summary.title.endswith(
        "2 trainable arrays, 34 values (136 B); 2 frozen (48 values)"
    )
    assert _total(summary, "model_without_params")[1:4] == ("2", "48", "192 B")


def test_dict_params_with_a_frozen_part_and_subclass_fields():
    class WithStats(TrainState):
        batch_stats: dict
        epoch: jax.Array

    state = WithStats.initial_state(
        dict_mlp_params(hidden=8),
        optax.sgd(0.1, momentum=0.9),
        jax.random.key(1),
        loss_fn_state={"seen": jnp.zeros(3)},
        trainable="dense1",
        batch_stats={"mean": jnp.zeros(4), "var": jnp.ones(4)},
        epoch=jnp.array(3, jnp.int32),
    )
    summary = state.summary()
    kinds = {r.name: r.kind for r in summary.rows}
    assert kinds == {
        "dense1/kernel": "trainable",
        "dense1/bias": "trainable",
        "dense0/kernel": "frozen",
        "dense0/bias": "frozen",
    }
    assert _total(summary, "batch_stats") == (
        "batch_stats", "2", "8", "32 B", "32 B", "dict"
    )  # fmt: skip
    assert _total(summary, "epoch") == (
        "epoch", "1", "1", "4 B", "4 B", "int32[] = 3"
    )  # fmt: skip
    assert _total(summary, "loss_fn_state") == (
        "loss_fn_state",
        "1",
        "3",
        "12 B",
        "12 B",
        "dict",
    )
    # momentum: one trace per trained array (8*2 + 2 values)
    assert _total(summary, "opt_state")[2:] == (
        "18",
        "72 B",
        "72 B",
        "(TraceState, EmptyState)",
    )
    assert summary.title.startswith("WithStats at step 0:")


@pz.pytree_dataclass
class _CountCalls(pz.nn.Layer):
    count: pz.StateVariable

    def __call__(self, x, **side_inputs):
        del side_inputs
        self.count.value = self.count.value + 1
        return x


@pytest.mark.slow  # a second or more (compiles, imports)
def test_penzai_frozen_params_and_state_variables():
    model = pz.nn.Sequential(
        [
            penzai_v2_mlp(hidden=4),
            _CountCalls(count=pz.StateVariable(jnp.int32(0), label="calls")),
        ]
    )
    state = TrainState.initial_state(
        model, optax.adam(0.1), jax.random.key(0), trainable="Affine_1"
    )
    summary = state.summary()
    kinds = {r.name: r.kind for r in summary.rows}
    assert kinds == {
        "mlp/Affine_1/AddBias.bias": "trainable",
        "mlp/Affine_1/Linear.weights": "trainable",
        "mlp/Affine_0/AddBias.bias": "frozen",
        "mlp/Affine_0/Linear.weights": "frozen",
        "calls": "state",
    }
    assert (_row(summary, "calls").dtype, _row(summary, "calls").nbytes) == ("int32", 4)


def test_a_sharded_state_shows_each_arrays_partition_spec():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    state = TrainState.initial_state(
        {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(0)
    )
    specs = {"w": P("data", None), "b": P()}
    params = {
        k: jax.device_put(v, NamedSharding(mesh, specs[k]))
        for k, v in state.params.items()
    }
    summary = state.replace(params=params).summary()
    assert _row(summary, "w").sharding == "P('data', None)"
    assert _row(summary, "b").sharding == "P()"
    header = summary.splitlines()[2].split()
    assert header[-1] == "sharding"
    assert "P('data', None)" in next(
        x for x in summary.splitlines() if x.startswith("w ")
    )
    # a state on one device has no sharding column
    assert "sharding" not in state.summary()


def test_html_has_tables_and_escapes():
    state = TrainState.initial_state(
        {"a<b>": jnp.zeros(2)}, optax.adam(0.1), jax.random.key(0)
    )
    page = state.summary()._repr_html_()
    assert page.count("<table>") == 2
    assert ">a&lt;b&gt;</td>" in page and "<td>opt_state</td>" in page
    assert "ScaleByAdamState" in page


def test_html_breaks_lines_as_the_text_does_and_wraps_its_long_columns():
    """A population's title is two lines in HTML too; the contents and name
    columns may break after a separator and wrap instead of being cut, inside
    a word when they must: ``overflow-wrap: anywhere``, since ``break-word``
    leaves a table cell at least as wide as its longest word
    (``InjectStatefulHyperparamsState(``): the table could not narrow to the
    page."""

    def init(seed):
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
        model = {"encoder/block_0/attention.weights": jnp.zeros(2)}
        return TrainState.initial_state(model, tx, jax.random.key(seed))

    summary = pztrain.make_population(init, seeds=range(2)).summary()
    first, second = summary.title.splitlines()
    page = summary._repr_html_()
    assert f"<p>{first}<br>{second}</p>" in page
    wrapping = re.findall(r'<td style="([^"]*)">([^<]*(?:<wbr>[^<]*)*)</td>', page)
    assert len(wrapping) == 1 + 4  # the one array's name, each part's contents
    assert all("overflow-wrap: anywhere" in style for style, _ in wrapping)
    cells = {text.replace("<wbr>", "") for _, text in wrapping}
    assert "encoder/block_0/attention.weights" in cells
    assert "encoder/<wbr>block_0/<wbr>attention.<wbr>weights" in page
    contents = next(t for _, t in wrapping if "InjectStatefulHyperparamsState" in t)
    assert ",<wbr> " in contents  # breaks where the text table's contents break


def test_optimizer_state_types_nest():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.1),
    )
    names = optimizer_state_types(tx.init({"w": jnp.zeros(2)}))
    assert names == (
        "(EmptyState, InjectStatefulHyperparamsState("
        "(ScaleByAdamState, EmptyState, EmptyState)))"
    )
    masked = optax.masked(optax.adam(0.1), {"w": True, "b": False})
    assert optimizer_state_types(
        masked.init({"w": jnp.zeros(2), "b": jnp.zeros(1)})
    ) == ("MaskedState((ScaleByAdamState, EmptyState))")


def test_a_donated_state_is_refused():
    def loss_fn(*, model, state, rng, x):
        return jnp.sum(model["w"] * x), state, {}

    state0 = TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.key(0)
    )
    build_train_step(loss_fn)(state0, x=jnp.ones(3))
    with pytest.raises(DonatedStateError, match=re.escape("state.summary(): ")):
        state0.summary()
    with pytest.raises(DonatedStateError, match=re.escape("state.summary(): ")):
        summarize(state0)


def test_treescope_text_stays_readable_at_depth():
    state = TrainState.initial_state(
        penzai_v2_mlp(), optax.adam(1e-3), jax.random.key(0)
    )
    text = treescope.render_to_text(state)
    assert max(map(len, text.splitlines())) < 200
    for field in (
        "params=",
        "opt_state=",
        "step=",
        "root_rng=",
        "model_without_params=",
    ):
        assert field in text
    # deep parts are written out, not folded into one line
    assert "label='mlp/Affine_1/Linear.weights'" in text
    assert "ScaleByAdamState(" in text
    # the HTML view is unchanged in kind (treescope's foldable HTML), and
    # rendering text leaves the layout as it was
    assert "<" in treescope.render_to_html(state)
    assert treescope.render_to_text(state) == text


def test_treescope_text_of_a_deep_model_has_short_lines():
    model = pz.nn.Sequential(
        [
            pz.nn.Affine.from_config(
                name=f"layer{i}",
                init_base_rng=jax.random.key(i),
                input_axes={"features": 4},
                output_axes={"features_out": 4},
            )
            for i in range(12)
        ]
    )
    state = TrainState.initial_state(model, optax.adam(1e-3), jax.random.key(0))
    text = treescope.render_to_text(state)
    assert max(map(len, text.splitlines())) < 200
    assert "layer11" in text


_EIGHT_DEVICES = """
import json, sys
import jax, optax
sys.path.insert(0, "tests")
from models import dict_mlp_params
from pztrain.sharding import ShardingRules, shard_state
from pztrain.state import TrainState

state = TrainState.initial_state(dict_mlp_params(hidden=16), optax.adam(0.1),
                                 jax.random.key(0))
mesh = jax.make_mesh((8,), ("data",))
sharded = shard_state(state, mesh, ShardingRules(fsdp="data"))
summary = sharded.summary()
device0 = sum(
    s.data.nbytes for x in sharded.params.values() for s in x.addressable_shards
    if s.device == jax.devices()[0]
)
params = [t for t in summary.totals if t[0] == "params"][0]
print(json.dumps({"rows": {r.name: r.sharding for r in summary.rows},
                  "header": summary.splitlines()[2].split(),
                  "html": summary._repr_html_(),
                  "params": params, "device0": device0}))
"""


@pytest.mark.slow
def test_a_state_on_eight_devices_shows_its_shardings():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _EIGHT_DEVICES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["rows"] == {
        "dense0/kernel": "P(None, 'data')",
        "dense0/bias": "P('data',)",
        "dense1/kernel": "P('data',)",
        "dense1/bias": "P()",
    }
    assert out["header"][-1] == "sharding"
    assert "<th>sharding</th>" in out["html"]
    # per device: the bytes of device 0's shards, less than the whole
    assert out["params"][4] == f"{out['device0']} B" != out["params"][3]


def test_penzai_v1_frozen_params_are_named_by_parameter_name():
    state = TrainState.initial_state(
        penzai_v1_mlp(hidden=16),
        optax.adam(0.1),
        jax.random.key(0),
        trainable="Affine_1",
    )
    kinds = {r.name: r.kind for r in state.summary().rows}
    assert kinds == {
        "Affine_1.AddBias.bias": "trainable",
        "Affine_1.Linear.weights": "trainable",
        "Affine_0.AddBias.bias": "frozen",
        "Affine_0.Linear.weights": "frozen",
    }


@pytest.mark.slow  # a second or more (compiles, imports)
def test_flax_style_state_lists_its_params_pytree():
    state = TrainState.create(
        apply_fn=dict_mlp_apply, params=dict_mlp_params(hidden=4), tx=optax.sgd(0.1)
    )
    summary = state.summary()
    assert [(r.name, r.shape) for r in summary.rows] == [
        ("dense0/bias", (4,)),
        ("dense0/kernel", (2, 4)),
        ("dense1/bias", (2,)),
        ("dense1/kernel", (4, 2)),
    ]
    assert _total(summary, "params")[1:4] == ("4", "22", "88 B")
    assert _total(summary, "model_without_params")[1:4] == ("0", "0", "0 B")


def test_treescope_shows_a_summary_as_its_table():
    summary = TrainState.initial_state(
        {"w": jnp.zeros(2)}, optax.adam(0.1), jax.random.key(0)
    ).summary()
    page = treescope.render_to_html(summary, compressed=False)
    assert "<table>" in page and "ScaleByAdamState" in page
    text = treescope.render_to_text(summary)
    assert text.startswith(summary.title)
    words = str(summary).split()
    assert text.split()[: len(words)] == words
