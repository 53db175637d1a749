"""The pieces `Checkpoints` is wired from, each alone: which checkpoints to keep
(`Retention`), which host points to save at (`SavePoints`), and the background
writer (`Writer`); and the store they make up (`CheckpointStore`)."""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pztrain.checkpoint import CheckpointError, _format
from pztrain.checkpoint._due import SavePoints
from pztrain.checkpoint._retention import Retention
from pztrain.checkpoint._writer import Writer

# ------------------------------------------------------------------ Retention


def test_retention_keeps_the_newest_and_the_best():
    saved = {1: {"eval/loss": 0.3}, 2: {"eval/loss": 0.1}, 3: {"eval/loss": 0.2}}
    saved |= {4: {"eval/loss": 0.5}, 5: None}
    assert Retention(keep_last=1).keep(saved) == [5]
    assert Retention(keep_last=2, keep_best=2).keep(saved) == [2, 3, 4, 5]
    assert Retention(keep_last=1, keep_best=1, mode="max").keep(saved) == [4, 5]
    assert Retention(keep_last=1, keep_best=2).delete(saved) == [1, 4]
    assert Retention(keep_best=3).best(saved) == [2, 3, 1, 4]


def test_retention_ranks_only_finite_values_of_its_metric_and_ties_go_newer():
    saved = {
        1: {"loss": 0.1},
        2: {"loss": math.nan},
        3: {"other": 0.0},
        4: {"loss": 0.1},
        5: {"loss": math.inf},
    }
    assert Retention(monitor="loss").best(saved) == [4, 1]


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"keep_last": 0}, "keep_last must be an int >= 1; got 0."),
        ({"keep_best": -1}, "keep_best must be an int >= 0; got -1."),
        ({"keep_last": True}, "keep_last must be an int >= 1; got True."),
        ({"mode": "best"}, "mode must be 'min' or 'max'; got 'best'."),
    ],
)
def test_retention_refuses_bad_settings_by_name(kwargs, said):
    with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
        Retention(**kwargs)


saved_checkpoints = st.dictionaries(
    st.integers(0, 10_000),
    st.one_of(
        st.none(),
        st.fixed_dictionaries({"m": st.floats(allow_nan=True, allow_infinity=True)}),
    ),
    min_size=1,
)


@given(
    saved_checkpoints,
    st.integers(1, 4),
    st.integers(0, 4),
    st.sampled_from(["min", "max"]),
)
def test_retention_never_deletes_the_newest_and_keeps_at_most_what_it_says(
    saved, keep_last, keep_best, mode
):
    policy = Retention(keep_last, keep_best, "m", mode)
    keep, delete = policy.keep(saved), policy.delete(saved)
    assert max(saved) in keep
    assert set(keep) | set(delete) == set(saved) and not set(keep) & set(delete)
    assert len(keep) <= keep_last + keep_best
    assert sorted(saved)[-keep_last:] == [
        s for s in keep if s in sorted(saved)[-keep_last:]
    ]
    ranked = policy.best(saved)
    values = [saved[s]["m"] for s in ranked]
    assert values == sorted(values, reverse=mode == "max")


# ----------------------------------------------------------------- SavePoints


def test_periodic_saves_come_at_the_first_point_every_steps_after_the_last():
    points = SavePoints(every_steps=100)
    points.start(0)
    due = []
    for step in (40, 80, 120, 160, 200, 240):
        points.logged(step)
        if points.point_ended(step):
            points.saved(step)
            due.append(step)
    assert due == [120, 240]


def test_eval_and_epoch_points_save_when_asked():
    points = SavePoints(on_eval=True, at_epoch_end=False)
    points.start(0)
    points.epoch_ended(10)
    assert not points.point_ended(10)
    points.evaluated(20)
    assert points.point_ended(20)
    points.saved(20)
    points.evaluated(20)  # the same step again: already saved
    assert not points.point_ended(20)
    epochs = SavePoints(at_epoch_end=True)
    epochs.start(0)
    epochs.epoch_ended(10)
    assert epochs.point_ended(10)


def test_the_final_step_is_saved_only_if_logged_and_its_point_is_over():
    points = SavePoints()
    points.start(0)
    points.logged(50)
    points.point_ended(50)
    assert points.final(50)  # logged, point over, not saved yet
    assert not points.final(60)  # an interruption between log points
    points.logged(70)  # an interruption inside the point of step 70
    assert not points.final(70)
    points.saved(70)
    assert not points.final(70)


def test_a_resumed_run_counts_its_period_from_the_checkpoint():
    points = SavePoints(every_steps=10)
    points.saved(30)  # resumed from checkpoint 30
    points.start(30)
    points.logged(35)
    assert not points.point_ended(35)
    points.logged(40)
    assert points.point_ended(40)


# --------------------------------------------------------------------- Writer


def _args(value: float):
    return _format.save_args({"w": jnp.full(3, value)}, None, {})


@pytest.mark.parametrize("async_save", [True, False])
def test_writer_saves_lists_and_deletes(tmp_path, async_save):
    writer = Writer(tmp_path, async_save)
    writer.save(1, _args(1.0), wait=False)
    writer.save(2, _args(2.0), wait=False)
    writer.wait()
    assert writer.steps() == [1, 2]
    writer.delete([1])
    assert writer.steps() == [2]
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


def test_a_failed_save_is_named_and_raised_by_every_later_call(tmp_path, monkeypatch):
    writer = Writer(tmp_path, async_save=False)
    writer.save(1, _args(1.0), wait=True)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.manager, "save", full_disk)
    with pytest.raises(CheckpointError, match="Saving checkpoint 2 in .* failed"):
        writer.save(2, _args(2.0), wait=True)
    for call in (writer.wait, lambda: writer.save(3, _args(3.0), wait=True)):
        with pytest.raises(CheckpointError, match="Saving checkpoint 2"):
            call()
    monkeypatch.undo()
    writer.failed = None
    assert writer.steps() == [1]
    writer.close()


# ------------------------------------------------------------- CheckpointStore


def _state(value: float):
    import jax
    import optax

    from pztrain import TrainState

    state = TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.key(0)
    )
    return state.replace(params={"w": jnp.full(3, float(value))})


def _store(directory, keep_last=1, keep_best=1, overwrite=False):
    from pztrain.checkpoint._store import CheckpointStore

    retention = Retention(keep_last=keep_last, keep_best=keep_best, monitor="loss")
    return CheckpointStore(directory, retention, async_save=True, overwrite=overwrite)


def test_store_writes_keeps_by_its_retention_and_reads_back(tmp_path):
    store = _store(tmp_path / "run")
    store.open()
    for step, loss in [(1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3)]:
        store.write(step, _state(step), {}, {"loss": loss}, wait=False)
    store.wait()  # the background saves finished, then the policy applied
    assert store.steps() == [2, 4]  # the best (loss 0.1) and the newest
    assert store.best_step() == 2
    assert float(store.read(2, _state(0.0)).params["w"][0]) == 2.0
    with pytest.raises(ValueError, match=r"holds no checkpoint of step 3; .* \[2, 4\]"):
        store.read(3, _state(0.0))
    store.close()


def test_store_refuses_to_replace_a_step_unless_overwrite(tmp_path):
    store = _store(tmp_path, keep_last=3, keep_best=0)
    store.write(1, _state(1.0), {}, None, wait=True)
    with pytest.raises(CheckpointError, match="1"):
        store.write(1, _state(2.0), {}, None, wait=True)
    store.close()
    store = _store(tmp_path, keep_last=3, keep_best=0, overwrite=True)
    store.write(1, _state(2.0), {}, None, wait=True)
    assert float(store.read(1, _state(0.0)).params["w"][0]) == 2.0
    store.close()


def test_store_finds_the_newest_readable_and_its_metrics(tmp_path):
    assert _store(tmp_path / "none").newest(_state(0.0)) is None  # no directory
    store = _store(tmp_path, keep_last=3, keep_best=0)
    store.write(1, _state(1.0), {"metrics": {"loss": 0.5}}, {"loss": 0.5}, wait=True)
    store.write(2, _state(2.0), {"metrics": {"loss": 0.2}}, {"loss": 0.2}, wait=True)
    store.close()
    again = _store(tmp_path, keep_last=3, keep_best=0)
    found = again.newest(_state(0.0))
    assert found.step == 2 and float(found.state.params["w"][0]) == 2.0
    assert again.metrics == {1: {"loss": 0.5}, 2: {"loss": 0.2}}
    again.close()


def test_store_holds_its_directory_from_open_to_close(tmp_path):
    from pztrain import DirectoryInUseError

    first, second = _store(tmp_path), _store(tmp_path)
    first.open()
    with pytest.raises(DirectoryInUseError):
        second.open()
    first.close()
    second.open()  # free again
    second.close()


def test_checkpoints_overwrite_set_after_construction_reaches_its_store(tmp_path):
    from pztrain import Checkpoints

    ckpts = Checkpoints(tmp_path, keep_last=3)
    ckpts.save(_state(1.0), 1)
    with pytest.raises(CheckpointError, match="1"):
        ckpts.save(_state(2.0), 1)
    ckpts.overwrite = True
    ckpts.save(_state(2.0), 1)
    assert float(ckpts.restore(1, _state(0.0)).params["w"][0]) == 2.0
    ckpts.close()


# ---------------------------------------------------------------- orbax notices


def test_orbax_notices_about_pztrains_own_choices_are_dropped_others_kept(caplog):
    import logging

    from pztrain.checkpoint import _orbax

    _orbax.ocp()  # installs the filter
    absl = logging.getLogger("absl")
    with caplog.at_level(logging.WARNING, logger="absl"):
        absl.warning(
            "[process=0][thread=MainThread] _SignalingThread.join() waiting for "
            "signals ([]) blocking the main thread will slow down blocking save times."
        )
        absl.warning("Skipping merge of OCDBT checkpoints: no OCDBT parts.")
        absl.warning("A real problem that a user must see.")
    assert [r.getMessage() for r in caplog.records] == [
        "A real problem that a user must see."
    ]
