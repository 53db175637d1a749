"""ArrayLoader, check_batch, stack_batches and prefetch_to_device."""

from __future__ import annotations

import itertools
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pztrain
from pztrain.data import (
    ArrayLoader,
    BatchError,
    check_batch,
    prefetch_to_device,
    stack_batches,
)

N = 10


def _arrays(n: int = N) -> dict[str, np.ndarray]:
    return {
        "x": np.arange(2 * n, dtype=np.float32).reshape(n, 2),
        "idx": np.arange(n),
    }


def _idx(batches) -> list[list[int]]:
    return [np.asarray(b["idx"]).tolist() for b in batches]


def _assert_batches_equal(got, want) -> None:
    got, want = list(got), list(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def _run_with_timeout(fn, timeout: float = 60.0):
    """Runs ``fn`` in a thread; fails (instead of hanging the suite) if it hangs."""
    out: dict[str, object] = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # pragma: no cover - reported below
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# ----------------------------------------------------------------- order


def test_order_depends_only_on_seed_and_epoch():
    a = ArrayLoader(_arrays(), 3, seed=7)
    b = ArrayLoader(_arrays(), 3, seed=7)
    # Ask b for the epochs in another order first: no hidden iterator state.
    later_first = {e: b.order(e) for e in (3, 0, 2, 1)}
    for e in range(4):
        np.testing.assert_array_equal(a.order(e), later_first[e])
        np.testing.assert_array_equal(a.order(e), b.order(e))
        assert sorted(a.order(e).tolist()) == list(range(N))  # a permutation
        _assert_batches_equal(a.epoch(e), b.epoch(e))
    for s in range(12):
        _assert_batches_equal([a.batch_at(s)], [b.batch_at(s)])
    orders = [tuple(a.order(e).tolist()) for e in range(4)]
    assert len(set(orders)) == 4  # every epoch is shuffled anew
    other = ArrayLoader(_arrays(), 3, seed=8)
    assert [tuple(other.order(e).tolist()) for e in range(4)] != orders
    assert not np.array_equal(other.order(0), a.order(0))


def test_orders_made_ahead_match_single_orders_and_are_read_only():
    from pztrain.data import _loader as data_mod

    a = ArrayLoader(_arrays(), 3, seed=7)
    got = [a.order(e) for e in range(20)]  # crosses several blocks made ahead
    for e in (19, 5, 0, 12):  # a fresh loader per epoch: nothing made ahead
        np.testing.assert_array_equal(
            ArrayLoader(_arrays(), 3, seed=7).order(e), got[e]
        )
    with pytest.raises(ValueError, match="read-only"):
        a.order(3)[0] = 1  # a caller cannot corrupt the epoch's order
    assert len(a._orders) <= 8
    big = ArrayLoader({"x": np.zeros((300_000, 1), np.float32)}, 10, seed=0)
    big.order(0)
    held = sum(o.nbytes for o in big._orders.values())
    assert len(big._orders) == 1 and held <= data_mod._ORDER_BYTES * 3


def test_shuffle_false_is_in_order_every_epoch():
    loader = ArrayLoader(_arrays(), 4, shuffle=False)
    for e in range(3):
        assert _idx(loader.epoch(e)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _idx(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _idx([loader.batch_at(s) for s in range(5)]) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]
    np.testing.assert_array_equal(loader.batch_at(1)["x"], _arrays()["x"][4:8])


def test_drop_remainder_and_steps_per_epoch():
    dropping = ArrayLoader(_arrays(), 4, seed=3)
    assert dropping.steps_per_epoch == len(dropping) == 2
    seen = _idx(dropping.epoch(0))
    assert [len(b) for b in seen] == [4, 4]
    flat = sum(seen, [])
    assert len(set(flat)) == 8 and set(flat) <= set(range(N))
    # The dropped examples are the tail of that epoch's order.
    assert flat == dropping.order(0)[:8].tolist()

    keeping = ArrayLoader(_arrays(), 4, seed=3, drop_remainder=False)
    assert keeping.steps_per_epoch == len(keeping) == 3
    seen = _idx(keeping.epoch(1))
    assert [len(b) for b in seen] == [4, 4, 2]
    assert sum(seen, []) == keeping.order(1).tolist()  # every example once
    assert len(keeping.batch_at(5)["idx"]) == 2  # epoch 1, last batch

    exact = ArrayLoader(_arrays(), 5, drop_remainder=False)
    assert exact.steps_per_epoch == 2  # no empty batch when it divides evenly
    # drop_remainder=False accepts a batch larger than the data: one batch.
    whole = ArrayLoader(_arrays(), 11, shuffle=False, drop_remainder=False)
    assert whole.steps_per_epoch == 1
    assert _idx(whole) == [list(range(N))]


# ------------------------------------------------------- iter_from_step


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_iter_from_step_matches_uninterrupted_iteration(drop_remainder):
    loader = ArrayLoader(_arrays(), 3, seed=5, drop_remainder=drop_remainder)
    per_epoch = loader.steps_per_epoch
    assert per_epoch == (3 if drop_remainder else 4)
    total = 4 * per_epoch
    reference = list(itertools.islice(loader.iter_from_step(0), total))
    # The uninterrupted stream is the epochs one after another.
    _assert_batches_equal(
        reference, itertools.chain.from_iterable(loader.epoch(e) for e in range(4))
    )
    starts = [0, 1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch, 11]
    for s in starts:
        resumed = itertools.islice(loader.iter_from_step(s), total - s)
        _assert_batches_equal(resumed, reference[s:])
        _assert_batches_equal([loader.batch_at(s)], [reference[s]])


@pytest.mark.parametrize("k", [2, 3])
def test_iter_from_step_stacks_steps_per_call(k):
    loader = ArrayLoader(_arrays(), 3, seed=2)  # 3 steps per epoch
    total = 12
    reference = list(itertools.islice(loader.iter_from_step(0), total + k))
    for s in [0, 1, 2, 3, 4, 6]:
        stacked = list(itertools.islice(loader.iter_from_step(s, k), 3))
        want = [stack_batches(reference[s + i * k : s + (i + 1) * k]) for i in range(3)]
        _assert_batches_equal(stacked, want)
        assert stacked[0]["x"].shape == (k, 3, 2)
        assert stacked[0]["idx"].shape == (k, 3)


def test_stack_batches():
    a = {"x": np.zeros((2, 3)), "y": np.ones(2)}
    b = {"x": np.ones((2, 3)), "y": np.zeros(2)}
    out = stack_batches([a, b])
    assert out["x"].shape == (2, 2, 3) and out["y"].shape == (2, 2)
    np.testing.assert_array_equal(out["y"], [[1, 1], [0, 0]])


# ----------------------------------------------------------------- errors


def test_check_batch_returns_the_size():
    assert check_batch({"x": np.zeros((5, 2)), "y": np.zeros(5)}) == 5
    assert check_batch({"x": jax.numpy.zeros((3, 2))}, expected_keys=["x"]) == 3
    assert check_batch({"nested": {"a": np.zeros(2), "b": np.zeros((2, 4))}}) == 2


def test_error_unequal_lengths():
    with pytest.raises(
        BatchError,
        match=re.escape("Batch leaves must share their leading (batch) axis; got "),
    ) as info:
        ArrayLoader({"x": np.zeros((4, 2)), "y": np.zeros(3)}, 2)
    assert "x: 4, y: 3." in str(info.value)
    with pytest.raises(BatchError, match=re.escape("got x: 4, y: 3.")):
        check_batch({"x": np.zeros(4), "y": np.zeros(3)})
    assert issubclass(BatchError, ValueError)


def test_error_non_array_leaf():
    with pytest.raises(
        BatchError,
        match=re.escape(
            "batch['name'] is a str, not an array; convert it with np.asarray"
        ),
    ):
        check_batch({"x": np.zeros(3), "name": "abc"})
    with pytest.raises(
        BatchError, match=re.escape("A batch must be a dict of arrays")
    ) as info:
        check_batch([np.zeros(3)])
    assert "got list." in str(info.value)
    with pytest.raises(
        BatchError, match=re.escape("A batch needs at least one array.")
    ):
        check_batch({})


def test_error_missing_key():
    with pytest.raises(
        BatchError,
        match=re.escape(
            "Batch is missing key(s) ['y']; it has ['x']. Every batch needs the "
            "same keys."
        ),
    ):
        check_batch({"x": np.zeros(3)}, expected_keys=["x", "y"])


def test_error_scalar_leaf():
    msg = "batch['s'] is a scalar; batch leaves need a leading batch axis."
    with pytest.raises(BatchError, match=re.escape(msg)):
        check_batch({"x": np.zeros(3), "s": np.float32(1.0)})
    with pytest.raises(BatchError, match=re.escape(msg)):
        check_batch({"x": np.zeros(3), "s": np.array(2)})
    with pytest.raises(BatchError, match=re.escape(msg)):
        ArrayLoader({"s": 1.0}, 1)


def test_error_batch_size():
    with pytest.raises(
        BatchError,
        match=re.escape(
            "batch_size=11 exceeds the 10 examples; with drop_remainder=True no "
            "batch would be made."
        ),
    ):
        ArrayLoader(_arrays(), 11)
    for bad in (0, -1, 2.0):
        with pytest.raises(
            BatchError, match=re.escape(f"batch_size must be an int >= 1; got {bad!r}")
        ):
            ArrayLoader(_arrays(), bad)


def test_error_steps_per_call_without_drop_remainder():
    loader = ArrayLoader(_arrays(), 3, drop_remainder=False)
    with pytest.raises(
        BatchError,
        match=re.escape(
            "steps_per_call > 1 stacks batches, so all must have one shape: use "
            "drop_remainder=True."
        ),
    ):
        next(loader.iter_from_step(0, steps_per_call=2))
    next(loader.iter_from_step(0, steps_per_call=1))  # fine


# ------------------------------------------------------------- prefetch


def test_prefetch_keeps_order_and_moves_to_device():
    items = [{"i": np.array([i, -i])} for i in range(25)]
    out = list(prefetch_to_device(items, size=2))
    assert len(out) == 25
    assert all(isinstance(b["i"], jax.Array) for b in out)
    assert [b["i"].tolist() for b in out] == [[i, -i] for i in range(25)]

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = list(prefetch_to_device(iter(items[:3]), size=1, sharding=sharding))
    assert [b["i"].sharding for b in out] == [sharding] * 3

    put = lambda item: ("put", item)  # noqa: E731
    assert list(prefetch_to_device(range(4), put=put)) == [("put", i) for i in range(4)]


def test_prefetch_reraises_the_source_exception_in_order():
    class Boom(Exception):
        pass

    def source():
        for i in range(3):
            yield {"i": np.array([i])}
        raise Boom("the source failed")

    got = []

    def consume():
        with pytest.raises(Boom, match=re.escape("the source failed")):
            for b in prefetch_to_device(source(), size=2):
                got.append(int(b["i"][0]))

    _run_with_timeout(consume)
    assert got == [0, 1, 2]  # everything before the error, then the error

    def bad_put():
        with pytest.raises(ZeroDivisionError):
            list(prefetch_to_device(range(3), put=lambda i: 1 / (i - 1)))

    _run_with_timeout(bad_put)


def test_prefetch_early_close_does_not_hang():
    pulled = []

    def endless():
        for i in itertools.count():
            pulled.append(i)
            yield {"i": np.array([i])}

    def consume():
        before = set(threading.enumerate())
        it = prefetch_to_device(endless(), size=2)
        first = [int(next(it)["i"][0]) for _ in range(3)]
        it.close()  # the producer may be blocked on a full queue
        workers = [
            t
            for t in set(threading.enumerate()) - before
            if t.name == "pztrain-prefetch"
        ]
        return first, workers

    first, workers = _run_with_timeout(consume)
    assert first == [0, 1, 2]
    assert workers == []  # the producer thread has ended
    assert len(pulled) <= 3 + 2 + 2  # it pulled only a bounded number ahead

    # Breaking out of a for loop closes the generator the same way.
    def consume_break():
        for b in prefetch_to_device(endless(), size=1):
            if int(b["i"][0]) >= 0:
                break

    _run_with_timeout(consume_break)


def test_a_loader_sharding_must_split_the_examples():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",))
    data = {"x": np.ones((16, 3), np.float32)}
    with pytest.raises(pztrain.BatchError, match=r"must split the first axis"):
        pztrain.ArrayLoader(data, 4, sharding=NamedSharding(mesh, P(None, "data")))


def test_a_mesh_step_refuses_an_on_device_loader_without_a_sharding():
    mesh = jax.make_mesh((1,), ("data",))

    def loss_fn(*, model, state, rng, x):
        loss = jnp.mean(x * model["w"])
        return loss, state, {"loss": loss}

    state = pztrain.TrainState.initial_state(
        {"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0)
    )
    loader = pztrain.ArrayLoader({"x": np.ones((16, 3), np.float32)}, 4, on_device=True)
    step = pztrain.build_train_step(loss_fn, mesh=mesh)
    with pytest.raises(
        ValueError, match=r"on a mesh but ArrayLoader\(on_device=True\)"
    ):
        pztrain.fit(state, step, loader, num_steps=2, progress=False)
