"""Loads that do not trust the files (issue 11).

Numbers stored in the JSON come back only as the types the target has; leaves a
checkpoint cannot hold are refused at save. A checkpoint that is readable but
saved from another structure is a `CheckpointMismatchError`; one that cannot be
trusted a plain `CheckpointError`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import CheckpointError, CheckpointMismatchError, TrainState

W = jnp.arange(4.0)  # params are stored in name order: "b" is 0, "w" is 1
PARAMS = {"b": jnp.arange(3, dtype=jnp.int32), "w": W}


def _like() -> dict[str, jax.Array]:
    return {"b": jnp.zeros(3, jnp.int32), "w": jnp.zeros(4)}


def _state(**fields: Any) -> TrainState:
    cls = ExtraState if fields else TrainState
    return cls.initial_state({"w": W}, optax.adam(0.1), jax.random.key(0), **fields)


class ExtraState(TrainState):
    note: Any
    rate: Any


def _edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _not_a_mismatch(excinfo: pytest.ExceptionInfo) -> None:
    assert not isinstance(excinfo.value, CheckpointMismatchError), excinfo.value


# ------------------------------------------------- numbers in the JSON


def test_numbers_come_back_exactly_as_the_types_they_were(tmp_path):
    fields = {"note": (2**70, np.int64(-5), True), "rate": (0.1, np.float32(0.3))}
    ckpt = pztrain.save_state(tmp_path / "s", _state(**fields))
    like = _state(note=(0, np.int64(0), False), rate=(0.0, np.float32(0)))
    back = pztrain.load_state(ckpt, like)
    for got, want in zip(
        [*back.note, *back.rate], [*fields["note"], *fields["rate"]], strict=True
    ):
        assert type(got) is type(want) and got == want, (got, want)


@pytest.mark.parametrize(
    "stored, error, said",
    [
        ('"fast"', CheckpointError, "metadata's [\"state.scalars['.rate']\"]"),
        ("[1, 2]", CheckpointError, "metadata's [\"state.scalars['.rate']\"]"),
        ("1", CheckpointMismatchError, "State leaf .rate in "),
        ("true", CheckpointMismatchError, "State leaf .rate in "),
    ],
    ids=["a-string", "a-list", "an-int-for-a-float", "a-bool-for-a-float"],
)
def test_a_stored_number_never_changes_type(tmp_path, stored, error, said):
    ckpt = pztrain.save_state(tmp_path / "s", _state(note=3, rate=0.5))
    meta = ckpt / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('".rate": 0.5', f'".rate": {stored}'))
    with pytest.raises(error, match=re.escape(said)) as e:
        pztrain.load_state(ckpt, _state(note=0, rate=0.0))
    if error is CheckpointError:
        _not_a_mismatch(e)
    else:
        assert "but the target has a float there (float)" in str(e.value)


def test_a_number_only_one_side_has_is_a_mismatch(tmp_path):
    ckpt = pztrain.save_state(tmp_path / "s", _state(note=3, rate=0.5))
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape("its numbers differ (missing [], unexpected ['.note'])"),
    ):
        pztrain.load_state(ckpt, _state(note="a label", rate=0.0))


# ---------------------------------------------- what a save refuses


@pytest.mark.parametrize(
    "params, said",
    [
        ({"w": W, "n": 3}, "Parameter 'n' is a Python int (3), not an array"),
        ({"w": W, "z": 1 + 2j}, "Parameter 'z' is a Python complex ((1+2j))"),
        ({"w": W, "e": jnp.zeros((0, 3))}, "Parameter 'e' is float32[0, 3], an empty"),
        ({"w": W, "k": jax.random.key(0)}, "Parameter 'k' is key<fry>[], which a"),
    ],
    ids=["int", "complex", "empty", "prng-key"],
)
def test_params_that_are_not_arrays_are_refused_at_save(tmp_path, params, said):
    with pytest.raises(CheckpointError, match=re.escape(said)):
        pztrain.save_params(tmp_path / "p", params)
    assert not (tmp_path / "p").exists()


def test_a_complex_number_in_the_state_is_refused_at_save(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=re.escape("State leaf .note is a complex ((1+2j)), which a checkpoint"),
    ):
        pztrain.save_state(tmp_path / "s", _state(note=1 + 2j, rate=0.5))
    with pytest.raises(CheckpointError, match=re.escape("State leaf .rate is a")):
        pztrain.Checkpoints(tmp_path / "c").save(
            _state(note=1, rate=np.complex64(2)), 1
        )
    assert not (tmp_path / "s").exists()


# ------------------------------------------- mismatch, not corruption


def test_a_readable_checkpoint_of_another_structure_is_a_mismatch(tmp_path):
    ckpt = pztrain.save_state(tmp_path / "s", _state())
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape("missing names ['v'], unexpected names ['w']"),
    ):
        pztrain.load_params(ckpt, {"v": W})
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            "Parameter 'w' in " + str(ckpt) + " is float32[4], but the "
            "target expects float32[5]"
        ),
    ):
        pztrain.load_state(
            ckpt,
            TrainState.initial_state(
                {"w": jnp.zeros(5)}, optax.adam(0.1), jax.random.key(0)
            ),
        )
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape("is float32[4], but the target expects bfloat16[4]"),
    ):
        pztrain.load_params(ckpt, {"w": jnp.zeros(4, jnp.bfloat16)})
    other = TrainState.initial_state({"w": W}, optax.sgd(0.1), jax.random.key(0))
    with pytest.raises(
        CheckpointMismatchError,
        match=re.escape(
            "does not match the target state: missing [], unexpected "
            "['.opt_state[0].count'"
        ),
    ):
        pztrain.load_state(ckpt, other)
    params_only = pztrain.save_params(tmp_path / "p", PARAMS)
    with pytest.raises(CheckpointMismatchError, match="holds params only"):
        pztrain.load_state(params_only, _state())
