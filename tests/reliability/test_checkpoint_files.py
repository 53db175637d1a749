"""Loads that do not trust the files (issue 11).

Array files whose description, size, place or bytes are not what the save wrote
are refused before (or, for bytes, right after) they are read, naming the
parameter and the file; numbers stored in the JSON come back only as the types
the target has; leaves a checkpoint cannot hold are refused at save. A
checkpoint that is readable but saved from another structure is a
`CheckpointMismatchError`; one that cannot be trusted a plain `CheckpointError`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain import CheckpointError, CheckpointMismatchError, TrainState

ROOT = Path(__file__).resolve().parents[2]
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


def _chunk(directory: Path) -> Path:
    """The one data file of an array's directory."""
    (file,) = [f for f in directory.iterdir() if not f.name.startswith(".")]
    return file


def _edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _flip_a_bit(file: Path, at: int = 5) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def _corrupt(ckpt: Path, *details: str) -> str:
    """The regex of a corruption error: its checkpoint, then ``details``."""
    parts = [f"Checkpoint {ckpt} is incomplete or corrupt: ", *details]
    return ".*".join(map(re.escape, parts))


def _not_a_mismatch(excinfo: pytest.ExceptionInfo) -> None:
    assert not isinstance(excinfo.value, CheckpointMismatchError), excinfo.value


# ------------------------------------------------ damaged array files
#
# pztrain reads arrays through orbax's API and checks what comes back against
# the JSON (shape, dtype, xxh3-64 checksum): whatever changed on disk, the load
# is refused naming the array, and never returns other values.


def _zarray(edit):
    return lambda ckpt: _edit_json(ckpt / "params" / "1" / ".zarray", edit)


def _truncate(ckpt):
    chunk = _chunk(ckpt / "params" / "1")
    chunk.write_bytes(chunk.read_bytes()[:7])


def _link_out(ckpt):
    chunk = _chunk(ckpt / "params" / "1")
    outside = ckpt.parent / "outside"
    outside.write_bytes(np.full(4, 5.0, np.float32).tobytes())
    chunk.unlink()
    chunk.symlink_to(outside)


DAMAGE = {
    "dtype-same-size": _zarray(lambda z: z.update(dtype="<i4")),  # read as a cast
    "dtype-other-size": _zarray(lambda z: z.update(dtype="<f2")),
    "shape": _zarray(lambda z: z.update(shape=[2], chunks=[2])),
    "compressed": _zarray(lambda z: z.update(compressor={"id": "zstd"})),
    "chunks": _zarray(lambda z: z.update(chunks=[1])),
    "truncated": _truncate,
    "missing": lambda ckpt: _chunk(ckpt / "params" / "1").unlink(),
    "flipped": lambda ckpt: _flip_a_bit(_chunk(ckpt / "params" / "1"), at=1),
    "linked-out": _link_out,
    "array-gone": lambda ckpt: shutil.rmtree(ckpt / "params" / "1"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_array_files_are_refused_naming_the_parameter(tmp_path, damage):
    ckpt = pztrain.save_params(tmp_path / "p", PARAMS)
    DAMAGE[damage](ckpt)
    with pytest.raises(CheckpointError, match=_corrupt(ckpt)) as e:
        pztrain.load_params(ckpt, _like())
    _not_a_mismatch(e)
    message = str(e.value)
    assert f"parameter 'w' ({ckpt / 'params' / '1'})" in message, message
    assert "TensorStore" not in message and "\n" not in message


@pytest.mark.slow  # a fit, a save and a damaged read
def test_a_damaged_state_array_is_named_by_its_path(tmp_path):
    trained = _state().apply_gradients({"w": jnp.ones(4)})  # mu is not zero
    ckpt = pztrain.save_state(tmp_path / "s", trained)
    paths = pztrain.read_metadata(ckpt)["state"]["paths"]
    i = paths.index(".opt_state[0].mu['w']")
    for edit in (lambda z: z.update(dtype="<i4"), lambda z: z.update(dtype="<f2")):
        _edit_json(ckpt / "state" / str(i) / ".zarray", edit)
        with pytest.raises(CheckpointError, match=_corrupt(ckpt)) as e:
            pztrain.load_state(ckpt, _state())
        assert f"state array .opt_state[0].mu['w'] ({ckpt / 'state' / str(i)})" in (
            str(e.value)
        )


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["tree_metadata"].popitem(),
        lambda m: m["tree_metadata"]["('1',)"]["value_metadata"].update(
            value_type="scalar"
        ),
        lambda m: m["tree_metadata"]["('1',)"]["value_metadata"].update(
            skip_deserialize=True
        ),
        lambda m: m["tree_metadata"]["('1',)"]["key_metadata"][0].update(key=1),
    ],
    ids=["an-array-left-out", "not-an-array", "value-from-elsewhere", "int-key"],
)
def test_an_edited_orbax_listing_never_changes_a_value(tmp_path, edit):
    ckpt = pztrain.save_params(tmp_path / "p", PARAMS)
    _edit_json(ckpt / "params" / "_METADATA", edit)
    try:
        back = pztrain.load_params(ckpt, _like())
    except CheckpointError as e:
        assert not isinstance(e, CheckpointMismatchError), e
    else:  # orbax did not need the entry: the values are the saved ones
        np.testing.assert_array_equal(back["w"], W)
        np.testing.assert_array_equal(back["b"], PARAMS["b"])


def test_an_aggregate_file_never_supplies_a_param(tmp_path):
    from orbax.checkpoint import msgpack_utils

    ckpt = pztrain.save_params(tmp_path / "p", PARAMS)
    values = {"0": np.full(3, 7, np.int32), "1": np.full(4, 9.0, np.float32)}
    (ckpt / "params" / "checkpoint").write_bytes(
        msgpack_utils.msgpack_serialize(values)
    )
    try:
        back = pztrain.load_params(ckpt, _like())
    except CheckpointError as e:
        assert "parameter '" in str(e)
    else:
        np.testing.assert_array_equal(back["w"], W)
        np.testing.assert_array_equal(back["b"], PARAMS["b"])


def test_other_extra_files_are_ignored(tmp_path):
    ckpt = pztrain.save_state(tmp_path / "s", _state())
    (ckpt / "params" / "extra.msgpack").write_bytes(b"\x81\xa1w\x93\x01\x02\x03")
    (ckpt / "params" / "7").mkdir()
    (ckpt / "params" / "7" / "0").write_bytes(np.ones(4, np.float32).tobytes())
    (ckpt / "state" / "notes.txt").write_text("hello")
    back = pztrain.load_state(ckpt, _state())
    np.testing.assert_array_equal(back.params["w"], W)
    assert sorted(back.params) == ["w"]


def test_a_link_to_the_same_bytes_is_read(tmp_path):
    ckpt = pztrain.save_params(tmp_path / "p", PARAMS)
    chunk = _chunk(ckpt / "params" / "1")
    copy = tmp_path / "copy"
    chunk.rename(copy)
    chunk.symlink_to(copy)
    np.testing.assert_array_equal(pztrain.load_params(ckpt, _like())["w"], W)


@pytest.mark.slow
def test_a_damaged_checkpoint_fails_in_one_line_in_a_fresh_process(tmp_path):
    ckpt = pztrain.save_state(tmp_path / "s", _state())
    paths = pztrain.read_metadata(ckpt)["state"]["paths"]
    chunk = _chunk(ckpt / "state" / str(paths.index(".opt_state[0].mu['w']")))
    chunk.write_bytes(chunk.read_bytes()[:3])
    code = (
        "import jax, optax, pztrain\n"
        "like = pztrain.TrainState.initial_state({'w': jax.numpy.zeros(4)}, "
        "optax.adam(0.1), jax.random.key(0))\n"
        "try:\n"
        f"    pztrain.load_state({str(ckpt)!r}, like)\n"
        "except pztrain.CheckpointError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    (line,) = out.stdout.splitlines()
    assert f"state array .opt_state[0].mu['w'] ({chunk.parent})" in line, line
    assert "TensorStore" not in line


SHARDED = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax, pztrain
import pztrain.checkpoint._orbax as orbax_settings
from jax.sharding import NamedSharding, PartitionSpec as P

root = sys.argv[1]
mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
def state(scale):
    params = {
        "a": jax.device_put(scale * jnp.arange(8.0), NamedSharding(mesh, P("d"))),
        "b": jax.device_put(
            scale * jnp.arange(12.0).reshape(3, 4), NamedSharding(mesh, P(None, "d"))
        ),
    }
    return pztrain.TrainState.initial_state(params, optax.adam(0.1), jax.random.key(1))
def loss(*, model, state, rng):
    return jnp.sum(model["a"]) + jnp.sum(model["b"] ** 2), state, {}
saved, _ = pztrain.build_train_step(loss)(state(1.0))
ckpt = pztrain.save_state(root + "/s", saved)
back = pztrain.load_state(ckpt, state(0.0))
out = {"equal": all(
    np.array_equal(x, y) for x, y in
    zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(saved.opt_state))
) and all(np.array_equal(back.params[k], saved.params[k]) for k in "ab")}
out["mu_sharding"] = str(back.opt_state[0].mu["b"].sharding.spec)
paths = pztrain.read_metadata(ckpt)["state"]["paths"]
mu = ckpt / "state" / str(paths.index(".opt_state[0].mu['b']"))
chunk = mu / "0.1"
data = bytearray(chunk.read_bytes()); data[2] ^= 1; chunk.write_bytes(bytes(data))
for name in ("flip", "orbax"):
    if name == "orbax":
        class Failing:
            def __enter__(self): return self
            def __exit__(self, *exc): return False
            def restore(self, directory, args):
                cause = 'FAILED_PRECONDITION: Error reading local file "f"'
                try:
                    raise ValueError(cause)
                except ValueError as e:
                    raise Exception(
                        "Encountered error while reading array index. See full "
                        "TensorStore details: <bound method spec of TensorStore({\\n"
                        "'driver': 'zarr'})>"
                    ) from e
        orbax_settings.checkpointer = Failing
    try:
        pztrain.load_state(ckpt, state(0.0))
    except pztrain.CheckpointError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


# jaxlib 0.9 (the floor) logs this line for each program it loads from the
# persistent compilation cache the tests keep (tests/conftest.py): JAX's, not
# pztrain's, and absent from later jaxlibs.
_CACHE_NOTICE = re.compile(
    r"^W\d{4} [\d:.]+ +\d+ pjrt_executable\.cc:\d+\] Assume version "
    r"compatibility\..*\n?",
    re.MULTILINE,
)


@pytest.mark.slow
def test_arrays_sharded_over_devices_are_read_by_orbax_and_verified(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    run = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    stderr = _CACHE_NOTICE.sub("", run.stderr)
    assert run.returncode == 0 and stderr == "", run.stderr
    out = json.loads(run.stdout)
    assert out["equal"] and out["mu_sharding"] == "P(None, 'd')"
    ckpt = tmp_path / "s"
    assert re.fullmatch(
        _corrupt(
            ckpt, "state array .opt_state[0].mu['b'] (", ") does not match the checksum"
        )
        + ".*",
        out["flip"],
    ), out["flip"]
    assert out["orbax"] == (
        f"Checkpoint {ckpt} is incomplete or corrupt: parameter 'a' "
        f"({ckpt / 'params' / '0'}) could not be read (ValueError: "
        'FAILED_PRECONDITION: Error reading local file "f"). Load another '
        "checkpoint (resuming skips this one)."
    ), out["orbax"]


# --------------------------------------------------------------- checksums


def test_checksums_are_stored_per_param_and_per_state_array(tmp_path):
    ckpt = pztrain.save_state(tmp_path / "s", _state())
    meta = pztrain.read_metadata(ckpt)
    for item, names in (("params", "names"), ("state", "paths")):
        sums = meta[item]["xxh3_64"]
        assert len(sums) == len(meta[item][names])
        assert all(re.fullmatch("[0-9a-f]{16}", s) for s in sums), sums


@pytest.mark.parametrize("item", ["params", "state"])
def test_a_flipped_bit_is_an_error_naming_the_array(tmp_path, item):
    ckpt = pztrain.save_state(tmp_path / "s", _state())
    paths = pztrain.read_metadata(ckpt)["state"]["paths"]
    key = "0" if item == "params" else str(paths.index(".opt_state[0].mu['w']"))
    _flip_a_bit(_chunk(ckpt / item / key))
    label = "parameter 'w'" if item == "params" else "state array .opt_state[0].mu['w']"
    with pytest.raises(
        CheckpointError,
        match=_corrupt(
            ckpt,
            f"{label} ({ckpt / item / key}) does not match the checksum stored when "
            "it was saved (xxh3_64 ",
        ),
    ) as e:
        pztrain.load_state(ckpt, _state())
    _not_a_mismatch(e)
    if item == "params":
        with pytest.raises(CheckpointError, match="does not match the checksum"):
            pztrain.load_params(ckpt, {"w": W})


def test_resume_skips_a_checkpoint_whose_bytes_changed(tmp_path):
    state = _state()
    later = state.replace(params={"w": W + 1}, step=jnp.asarray(2, jnp.int32))
    pztrain.Checkpoints(tmp_path / "c").save(state, 1)
    pztrain.Checkpoints(tmp_path / "c").save(later, 2)
    _flip_a_bit(_chunk(tmp_path / "c" / "2" / "params" / "0"))
    with pytest.warns(UserWarning, match=re.escape(str(tmp_path / "c" / "2"))):
        back = pztrain.Checkpoints(tmp_path / "c").restore_latest(_state())
    np.testing.assert_array_equal(back.params["w"], W)


def test_checksums_on_several_threads_match_and_catch_a_flip(tmp_path, monkeypatch):
    import pztrain.checkpoint._integrity as integrity

    params = {f"p{i}": jnp.full(5, float(i)) for i in range(6)}
    serial = pztrain.save_params(tmp_path / "serial", params)
    monkeypatch.setattr(integrity, "_PARALLEL_BYTES", 0)  # hash on threads
    threaded = pztrain.save_params(tmp_path / "threaded", params)
    sums = [pztrain.read_metadata(c)["params"]["xxh3_64"] for c in (serial, threaded)]
    assert sums[0] == sums[1] and len(set(sums[0])) == 6
    _flip_a_bit(_chunk(threaded / "params" / "4"))
    with pytest.raises(CheckpointError, match=re.escape("parameter 'p4' (")):
        pztrain.load_params(threaded, params)


@pytest.mark.slow  # trains twice around a save
def test_a_large_array_read_from_its_file_trains_like_the_saved_one(tmp_path):
    import gc

    big = {"w": jnp.linspace(-1.0, 1.0, 3 * 2**18)}  # 3 MiB: on mapped pages
    state = TrainState.initial_state(big, optax.adam(0.1), jax.random.key(0))
    ckpt = pztrain.save_state(tmp_path / "s", state)
    back = pztrain.load_state(ckpt, state)
    gc.collect()
    step = pztrain.build_train_step(
        lambda *, model, state, rng: (jnp.sum(model["w"] ** 2), state, {})
    )
    want, _ = step(state)
    got, _ = step(back)  # donates the arrays read from the file
    np.testing.assert_array_equal(got.params["w"], want.params["w"])
    np.testing.assert_array_equal(got.opt_state[0].mu["w"], want.opt_state[0].mu["w"])
    _flip_a_bit(_chunk(ckpt / "params" / "0"), at=2**20 + 3)
    with pytest.raises(CheckpointError, match=re.escape("parameter 'w' (")):
        pztrain.load_params(ckpt, big)


def test_a_checkpoint_saved_before_checksums_still_loads(tmp_path):
    ckpt = pztrain.save_state(tmp_path / "s", _state())

    def drop(meta):
        del meta["params"]["xxh3_64"], meta["state"]["xxh3_64"]

    _edit_json(ckpt / "meta" / "metadata", drop)
    back = pztrain.load_state(ckpt, _state())
    np.testing.assert_array_equal(back.params["w"], W)


def test_a_damaged_checksum_list_is_corruption(tmp_path):
    ckpt = pztrain.save_params(tmp_path / "p", PARAMS)
    _edit_json(
        ckpt / "meta" / "metadata", lambda m: m["params"]["xxh3_64"].append("00")
    )
    with pytest.raises(
        CheckpointError, match=re.escape("metadata's ['params.xxh3_64'] entries")
    ) as e:
        pztrain.load_params(ckpt, _like())
    _not_a_mismatch(e)


def test_checksums_cover_bfloat16_keys_and_numpy_arrays(tmp_path):
    params = {"h": jnp.ones(3, jnp.bfloat16), "n": np.arange(6.0).reshape(2, 3).T}
    state = TrainState.initial_state(params, optax.sgd(0.1), jax.random.key(3))
    ckpt = pztrain.save_state(tmp_path / "s", state)
    like = TrainState.initial_state(
        {"h": jnp.zeros(3, jnp.bfloat16), "n": np.zeros((3, 2))},
        optax.sgd(0.1),
        jax.random.key(0),
    )
    back = pztrain.load_state(ckpt, like)
    np.testing.assert_array_equal(back.params["n"], params["n"])  # non-contiguous
    np.testing.assert_array_equal(
        jax.random.key_data(back.root_rng), jax.random.key_data(state.root_rng)
    )
    paths = pztrain.read_metadata(ckpt)["state"]["paths"]
    _flip_a_bit(_chunk(ckpt / "state" / str(paths.index(".root_rng"))), at=0)
    with pytest.raises(CheckpointError, match=re.escape("state array .root_rng (")):
        pztrain.load_state(ckpt, like)


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


def test_64_bit_numpy_params_are_verified_at_their_stored_width(tmp_path):
    assert not jax.config.jax_enable_x64
    values = np.linspace(0, 1, 7)  # float64, not exact in float32
    ckpt = pztrain.save_params(tmp_path / "p", {"w": values})
    assert pztrain.read_metadata(ckpt)["params"]["dtypes"] == ["float64"]
    back = pztrain.load_params(ckpt, {"w": np.zeros(7)})
    np.testing.assert_array_equal(back["w"], jnp.asarray(values))
