"""Warm starts (issue 32): `load_params(..., rename=...)` loads stored params
under other names, and ``return_report=True`` says what was loaded, left and
ignored; bad renames are errors naming the rule, the names and the shapes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai.models import simple_mlp

import pztrain
from pztrain import CheckpointMismatchError, TrainState
from pztrain.checkpoint import LoadReport


def _layer(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out)), "b": jnp.zeros(n_out)}


def _encoder_checkpoint(path):
    """A trained encoder-decoder's params, saved as ``encoder/...``, ``decoder/...``."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "encoder": {"layer_0": _layer(k[0], 4, 8), "layer_1": _layer(k[1], 8, 8)},
        "decoder": _layer(k[2], 8, 4),
    }
    pztrain.save_params(path, params)
    return params


def _classifier(seed=1):
    """A bigger model: the encoder as ``backbone/...``, a new 3-class head."""
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "backbone": {"layer_0": _layer(k[0], 4, 8), "layer_1": _layer(k[1], 8, 8)},
        "head": {"hidden": _layer(k[2], 8, 16), "out": _layer(k[2], 16, 3)},
    }


def test_a_backbone_loads_under_another_prefix_with_a_report(tmp_path):
    saved = _encoder_checkpoint(tmp_path / "enc")
    like = _classifier()
    loaded, report = pztrain.load_params(
        tmp_path / "enc",
        like,
        rename={"encoder": "backbone"},
        partial=True,
        return_report=True,
    )
    for layer in ("layer_0", "layer_1"):
        for name in ("w", "b"):
            np.testing.assert_array_equal(
                loaded["backbone"][layer][name], saved["encoder"][layer][name]
            )
    jax.tree.map(np.testing.assert_array_equal, loaded["head"], like["head"])
    assert isinstance(report, LoadReport)
    assert report.loaded == {
        "backbone/layer_0/b": "encoder/layer_0/b",
        "backbone/layer_0/w": "encoder/layer_0/w",
        "backbone/layer_1/b": "encoder/layer_1/b",
        "backbone/layer_1/w": "encoder/layer_1/w",
    }
    assert list(report.loaded) == sorted(report.loaded)  # the target's order
    assert report.left == (
        "head/hidden/b",
        "head/hidden/w",
        "head/out/b",
        "head/out/w",
    )
    assert report.ignored == ("decoder/b", "decoder/w")
    assert report.directory == tmp_path / "enc"
    assert str(report).replace(str(tmp_path), "<tmp>") == "\n".join(
        [
            "From <tmp>/enc: 4 params loaded, 4 left as they were, 2 stored "
            "params ignored.",
            "         target              stored             shape",
            "-------  ------------------  -----------------  --------------",
            "loaded   backbone/layer_0/b  encoder/layer_0/b  float32[8]",
            "loaded   backbone/layer_0/w  encoder/layer_0/w  float32[4, 8]",
            "loaded   backbone/layer_1/b  encoder/layer_1/b  float32[8]",
            "loaded   backbone/layer_1/w  encoder/layer_1/w  float32[8, 8]",
            "left     head/hidden/b       -                  float32[16]",
            "left     head/hidden/w       -                  float32[8, 16]",
            "left     head/out/b          -                  float32[3]",
            "left     head/out/w          -                  float32[16, 3]",
            "ignored  -                   decoder/b          float32[4]",
            "ignored  -                   decoder/w          float32[8, 4]",
        ]
    )


def test_patterns_rename_by_the_first_that_matches_a_whole_name(tmp_path):
    saved = _encoder_checkpoint(tmp_path / "enc")
    like = _classifier()
    rules = [
        (r"encoder/layer_1/(.*)", r"head/hidden/\1"),  # first: wins over the next
        (r"encoder/(.*)", r"backbone/\1"),
        ("coder/b", "never/used"),  # matches no whole name ...
    ]
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            f"rename: 'coder/b' renames no param of {tmp_path / 'enc'} (its names: "
            "'decoder/b', 'decoder/w', 'encoder/layer_0/b', 'encoder/layer_0/w', "
            "'encoder/layer_1/b' and 1 more). Fix it or leave it out"
        ),
    ):
        pztrain.load_params(tmp_path / "enc", like, rename=rules, partial=True)
    rules[1:] = [(re.compile(r"encoder/(.*)"), r"backbone/\1")]  # compiled works
    like["head"]["hidden"] = _layer(jax.random.key(5), 8, 8)  # fits layer_1 now
    loaded, report = pztrain.load_params(
        tmp_path / "enc", like, rename=rules, partial=True, return_report=True
    )
    assert report.loaded == {
        "backbone/layer_0/b": "encoder/layer_0/b",
        "backbone/layer_0/w": "encoder/layer_0/w",
        "head/hidden/b": "encoder/layer_1/b",
        "head/hidden/w": "encoder/layer_1/w",
    }
    assert report.left == ("backbone/layer_1/b", "backbone/layer_1/w", *_out())
    assert report.ignored == ("decoder/b", "decoder/w")
    np.testing.assert_array_equal(
        loaded["head"]["hidden"]["w"], saved["encoder"]["layer_1"]["w"]
    )


def _out():
    return ("head/out/b", "head/out/w")


def test_without_rename_the_report_and_the_return_types_are_as_before(tmp_path):
    saved = _encoder_checkpoint(tmp_path / "enc")
    like = {"encoder": _classifier()["backbone"], "new": jnp.zeros(2)}
    loaded = pztrain.load_params(tmp_path / "enc", like, partial=True)
    assert isinstance(loaded, dict) and set(loaded) == {"encoder", "new"}
    _, report = pztrain.load_params(
        tmp_path / "enc", like, partial=True, return_report=True
    )
    assert report.loaded == {n: n for n in report.loaded}
    assert len(report.loaded) == 4 and report.left == ("new",)
    assert report.ignored == ("decoder/b", "decoder/w")
    # Everything loaded: nothing left, nothing ignored; a TrainState stays one.
    state = TrainState.initial_state(saved, optax.sgd(0.1), jax.random.key(0))
    got, report = pztrain.load_params(tmp_path / "enc", state, return_report=True)
    assert isinstance(got, TrainState)
    assert (report.left, report.ignored, len(report.loaded)) == ((), (), 6)


def test_a_penzai_model_takes_another_models_first_layer(tmp_path):
    def mlp(name, sizes, seed):
        return simple_mlp.MLP.from_config(
            name=name, init_base_rng=jax.random.key(seed), feature_sizes=sizes
        )

    trained = TrainState.initial_state(
        mlp("mlp", [4, 8, 10], 0), optax.adam(1e-3), jax.random.key(0)
    )
    pztrain.save_params(tmp_path / "p", trained)
    new, report = pztrain.load_params(
        tmp_path / "p",
        mlp("clf", [4, 8, 5], 3),
        rename={"mlp/Affine_0": "clf/Affine_0"},
        partial=True,
        return_report=True,
    )
    assert report.loaded == {
        "clf/Affine_0/AddBias.bias": "mlp/Affine_0/AddBias.bias",
        "clf/Affine_0/Linear.weights": "mlp/Affine_0/Linear.weights",
    }
    assert report.left == ("clf/Affine_1/AddBias.bias", "clf/Affine_1/Linear.weights")
    assert report.ignored == (
        "mlp/Affine_1/AddBias.bias",
        "mlp/Affine_1/Linear.weights",
    )
    params, _ = pztrain.partition.split(new, frozen=True)
    np.testing.assert_array_equal(
        params["clf/Affine_0/Linear.weights"],
        trained.params["mlp/Affine_0/Linear.weights"],
    )


# ----------------------------------------------------------------- errors


def test_two_stored_names_onto_one_target_name_is_an_error(tmp_path):
    _encoder_checkpoint(tmp_path / "enc")
    rules = [(r"(en|de)coder/(?:layer_0/)?(.*)", r"backbone/layer_0/\2")]
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            "rename: the params ['decoder/b', 'encoder/layer_0/b'] of "
            f"{tmp_path / 'enc'} are all loaded as 'backbone/layer_0/b'; a target "
            "param takes one stored param."
        ),
    ):
        pztrain.load_params(tmp_path / "enc", _classifier(), rename=rules, partial=True)
    # Onto a name the target lacks, they are all ignored: nothing is ambiguous.
    rules = [
        (r"(?:de|en)coder/(?:layer_1/)?(.)", r"old/\1"),  # 4 names onto 2
        (r"en(coder/.*)", r"back\1"),
    ]
    _, report = pztrain.load_params(
        tmp_path / "enc",
        {"backcoder": {"layer_0": _layer(jax.random.key(2), 4, 8)}},
        rename=rules,
        partial=True,
        return_report=True,
    )
    assert report.loaded == {
        "backcoder/layer_0/b": "encoder/layer_0/b",
        "backcoder/layer_0/w": "encoder/layer_0/w",
    }
    assert report.left == ()
    assert report.ignored == (
        "decoder/b",
        "decoder/w",
        "encoder/layer_1/b",
        "encoder/layer_1/w",
    )


def test_a_renamed_param_of_another_shape_names_both_names_and_shapes(tmp_path):
    _encoder_checkpoint(tmp_path / "enc")
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            f"Parameter 'decoder/b' in {tmp_path / 'enc'}, loaded as "
            "'head/out/b', is float32[4], but the target's 'head/out/b' is "
            "float32[3]. Rename it to a param of that shape"
        ),
    ):
        pztrain.load_params(
            tmp_path / "enc",
            _classifier(),
            rename={"encoder": "backbone", "decoder": "head/out"},
            partial=True,
        )


def test_a_mapping_key_that_fits_no_name_is_an_error(tmp_path):
    _encoder_checkpoint(tmp_path / "enc")
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(f"rename: 'encoders' renames no param of {tmp_path / 'enc'}"),
    ):
        pztrain.load_params(
            tmp_path / "enc", _classifier(), rename={"encoders": "backbone"}
        )
    # "enc" is no prefix of "encoder/..." up to a "/": it fits nothing either.
    with pytest.raises(CheckpointMismatchError, match="rename: 'enc' renames no"):
        pztrain.load_params(tmp_path / "enc", _classifier(), rename={"enc": "back"})


def test_names_left_over_after_a_rename_need_partial(tmp_path):
    _encoder_checkpoint(tmp_path / "enc")
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            f"Checkpoint {tmp_path / 'enc'} does not match the target after rename: "
            "target names it does not fill ['head/hidden/b', 'head/hidden/w', "
            "'head/out/b', 'head/out/w'], stored names not used ['decoder/b', "
            "'decoder/w']. Pass partial=True"
        ),
    ):
        pztrain.load_params(
            tmp_path / "enc", _classifier(), rename={"encoder": "backbone"}
        )


@pytest.mark.parametrize(
    ("rename", "error", "message"),
    [
        ({"encoder": 3}, TypeError, "rename maps stored names to new ones"),
        ({"": "x"}, TypeError, "rename maps stored names to new ones"),
        ("encoder", TypeError, "rename is a mapping of stored names"),
        ([("a", "b", "c")], TypeError, "rename[0] is ('a', 'b', 'c'); each rule"),
        ([("(", "b")], ValueError, "rename[0]: '(' is not a regular expression"),
        (
            [(r"encoder/(.*)", r"backbone/\2")],
            ValueError,
            r"rename: the replacement 'backbone/\\2' of 'encoder/(.*)' does not "
            "apply to 'encoder/layer_0/b'",
        ),
    ],
)
def test_malformed_renames_are_named(tmp_path, rename, error, message):
    _encoder_checkpoint(tmp_path / "enc")
    with pytest.raises(error, match=re.escape(message)):
        pztrain.load_params(tmp_path / "enc", _classifier(), rename=rename)


def test_rename_with_ema_says_what_to_do_instead(tmp_path):
    _encoder_checkpoint(tmp_path / "enc")
    with pytest.raises(
        ValueError,
        match=re.escape("load_params(..., ema=True) cannot rename: save the EMA"),
    ):
        pztrain.load_params(
            tmp_path / "enc", _classifier(), rename={"encoder": "backbone"}, ema=True
        )
