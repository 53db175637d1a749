"""The loop's schedule: pure arithmetic on steps, tested without JAX."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pztrain.loop._schedule import Schedule, run_end


def test_next_point_is_the_nearest_log_eval_epoch_end_or_wish():
    s = Schedule(
        start=0, end=20, steps_per_call=1, log_every=5, eval_every=7, steps_per_epoch=6
    )
    assert [s.next_point(step) for step in (0, 5, 6, 7, 12, 18, 19)] == [
        5,
        6,
        7,
        10,
        14,
        20,
        20,
    ]
    assert s.next_point(0, wish=3) == 3  # a hook asked for step 3
    assert s.next_point(4, wish=4) == 5  # a wish already reached is no point
    assert s.next_point(0, wish=None) == 5


def test_what_is_due_at_a_point():
    s = Schedule(
        start=0,
        end=10,
        steps_per_call=1,
        log_every=4,
        steps_per_epoch=3,
        evaluates=True,
    )
    assert [x for x in range(1, 11) if s.logs_at(x)] == [4, 8, 10]  # end logs
    assert s.ends_epoch(3, 0, ended_pass=False) and not s.ends_epoch(5, 1, False)
    assert s.evaluates_at(3, ended_epoch=True)  # no eval_every: at epoch ends
    assert not s.evaluates_at(4, ended_epoch=False)
    every = Schedule(0, 10, 1, 4, eval_every=5, evaluates=True)
    assert every.evaluates_at(5, False) and not every.evaluates_at(3, True)
    assert not Schedule(0, 10, 1, 4, eval_every=5).evaluates_at(5, False)


def test_epochs_from_passes_when_the_data_does_not_say():
    s = Schedule(start=0, end=math.inf, steps_per_call=1, log_every=2, num_epochs=2)
    assert s.end_step is None and s.epoch_at(17) == 0
    assert s.ends_epoch(3, 0, ended_pass=True) and not s.ends_epoch(3, 0, False)
    assert s.next_epoch(3, 0) == 1
    assert not s.done(100, 1) and s.done(100, 2)


def test_epochs_and_the_end_from_the_step():
    s = Schedule(start=9, end=12, steps_per_call=1, log_every=4, steps_per_epoch=4)
    assert s.epoch_at(9) == 2 and s.next_epoch(12, 2) == 3 and s.end_step == 12
    assert not s.done(11, 2) and s.done(12, 3)


def test_run_end_and_its_check():
    assert run_end(0, 1, 4, num_steps=None, num_epochs=3) == 12
    assert run_end(0, 1, None, num_steps=None, num_epochs=3) == math.inf
    assert run_end(5, 2, None, num_steps=9, num_epochs=None) == 9
    assert run_end(20, 2, None, num_steps=9, num_epochs=None) == 9  # nothing to run
    with pytest.raises(
        ValueError,
        match=re.escape(
            "The run covers 7 steps (from step 0 to 7), not a multiple of "
            "steps_per_call=2; choose num_steps accordingly."
        ),
    ):
        run_end(0, 2, None, num_steps=7, num_epochs=None)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 4),
    log=st.integers(1, 6),
    ev=st.one_of(st.none(), st.integers(1, 6)),
    epoch=st.one_of(st.none(), st.integers(1, 6)),
    calls=st.integers(1, 40),
    wish_every=st.one_of(st.none(), st.integers(1, 9)),
)
def test_walking_the_points_stops_at_every_due_step(
    k, log, ev, epoch, calls, wish_every
):
    """From start to end, the points land on every log, eval and epoch step, on
    the end, and on multiples of steps_per_call only; none is skipped."""
    log, ev = log * k, None if ev is None else ev * k
    epoch = None if epoch is None else epoch * k
    s = Schedule(0, calls * k, k, log, ev, epoch, evaluates=True)
    seen, step = [], 0
    while step < s.end:
        wish = None if wish_every is None else (step // k + wish_every) * k
        step = s.next_point(step, wish)
        seen.append(step)
    assert seen == sorted(set(seen)) and seen[-1] == s.end
    assert all(p % k == 0 for p in seen)
    for every in (log, ev, epoch):
        if every:
            assert set(range(every, calls * k + 1, every)) <= set(seen)
