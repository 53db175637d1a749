"""Property tests of `pztrain.partition.split` / `merge` on random pytrees.

Trees are nested dicts / lists / tuples whose leaves are float32, float16 and
int32 arrays (numpy or JAX) of small random shapes, ``None`` and Python ints,
floats and strings. The expected parameter names are computed here by walking
the tree, independently of JAX's key paths.
"""

from __future__ import annotations

import re
import zlib

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from penzai import pz

import pztrain
from pztrain.partition import ParamSlot, PartitionError, merge, split

# 50 random trees a test, their arrays in new shapes and dtypes each: seconds
# apiece. The fast subset checks split and merge through the doctests and the
# models of the other tests.
pytestmark = pytest.mark.slow

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32)]
KEYS = st.text(alphabet="abcx01_", min_size=1, max_size=3)


@st.composite
def array_leaves(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    value = draw(hnp.arrays(dtype, shape))
    return jnp.asarray(value) if draw(st.booleans()) else value


python_leaves = st.one_of(
    st.none(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
)


@st.composite
def leaves(draw):
    """An array three times in four, else a Python leaf."""
    if draw(st.integers(0, 3)):
        return draw(array_leaves())
    return draw(python_leaves)


def trees(keys=KEYS):
    return st.recursive(
        leaves(),
        lambda children: (
            st.lists(children, max_size=3)
            | st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(keys, children, max_size=3)
        ),
        max_leaves=10,
    )


def _walk(tree, path=()):
    """(name, leaf) in JAX's flattening order; names joined by '/' here."""
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _walk(tree[k], (*path, str(k)))
    elif isinstance(tree, list | tuple):
        for i, child in enumerate(tree):
            yield from _walk(child, (*path, str(i)))
    elif tree is not None:
        yield "/".join(path) or "root", tree


def _is_array(x):
    return isinstance(x, np.ndarray | jax.Array)


def _is_float_array(x):
    return _is_array(x) and np.issubdtype(x.dtype, np.floating)


def _float_leaves(tree):
    return [(n, v) for n, v in _walk(tree) if _is_float_array(v)]


def _has_subnormals(x):
    x = np.asarray(x)
    return bool(np.any((x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny)))


def _assert_same_array(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()  # bit-exact, NaN payloads and -0.0 included


def _assert_reproduces(got, want, *, identical_arrays):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if _is_array(w):
            if identical_arrays:
                assert g is w
            _assert_same_array(g, w)
        else:
            assert g is w  # static leaves come back as the very same objects


def _assert_rest(rest, tree, selected: set[str]):
    """Selected arrays became named slots; everything else stayed, unchanged."""
    rest_leaves = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, ParamSlot))
    walked = list(_walk(tree))
    assert len(rest_leaves) == len(walked)
    for r, (name, leaf) in zip(rest_leaves, walked, strict=True):
        if name in selected and _is_float_array(leaf):
            assert r == ParamSlot(name)
        else:
            assert r is leaf
    # A slot has no children: the arrays left in rest are the unselected ones.
    n_slots = sum(isinstance(r, ParamSlot) for r in rest_leaves)
    assert n_slots == len(selected)
    assert len(jax.tree.leaves(rest)) == len(walked) - len(selected)


def _check_split(tree, trainable, selected: dict[str, object]):
    if not selected:
        with pytest.raises(PartitionError, match="no trainable parameters"):
            split(tree, trainable)
        return
    params, rest = split(tree, trainable)
    assert sorted(params) == sorted(selected)
    for name, value in selected.items():
        assert params[name] is value
    _assert_rest(rest, tree, set(selected))
    _assert_reproduces(merge(params, rest), tree, identical_arrays=True)


@SETTINGS
@given(trees())
def test_split_takes_exactly_the_float_arrays_by_key_path(tree):
    selected = dict(_float_leaves(tree))
    assert len(selected) == len(_float_leaves(tree))  # KEYS cannot make collisions
    _check_split(tree, None, selected)


PATTERNS = ["a", "^b", "0$", "x|1", "/", "c.*0", "^root$", "_", "[ab]/[01]"]


@SETTINGS
@given(trees(), st.sampled_from(PATTERNS))
def test_regex_filter_leaves_unselected_arrays_in_rest(tree, pattern):
    selected = {n: v for n, v in _float_leaves(tree) if re.search(pattern, n)}
    _check_split(tree, pattern, selected)


@SETTINGS
@given(trees(), st.integers(0, 2**31 - 1))
def test_predicate_filter_sees_each_float_array_once(tree, seed):
    calls = []

    def keep(name, value):
        calls.append((name, value))
        return (zlib.crc32(name.encode()) ^ seed) % 3 != 0

    floats = _float_leaves(tree)
    selected = {n: v for n, v in floats if keep(n, v)}
    calls.clear()
    _check_split(tree, keep, selected)
    # Called with (name, the array itself), only for float arrays, once each.
    assert sorted(n for n, _ in calls) == sorted(n for n, _ in floats)
    leaf_of = dict(floats)
    assert all(value is leaf_of[name] for name, value in calls)


@SETTINGS
@given(trees(), st.sampled_from([None, "a", "^b", "0$", "_"]))
def test_train_state_model_round_trip(tree, trainable):
    selected = {
        n: v
        for n, v in _float_leaves(tree)
        if trainable is None or re.search(trainable, n)
    }
    args = (tree, optax.sgd(0.1), jax.random.key(0))
    if not selected:
        with pytest.raises(PartitionError):
            pztrain.TrainState.initial_state(*args, trainable=trainable)
        return
    state = pztrain.TrainState.initial_state(*args, trainable=trainable)
    assert sorted(state.params) == sorted(selected)
    for name, value in selected.items():
        assert isinstance(state.params[name], jax.Array)
        _assert_same_array(state.params[name], value)
    _assert_reproduces(state.model, tree, identical_arrays=False)
    # The params are the state's own copies; the rest keeps the other arrays.
    model_leaves = jax.tree.leaves(state.model)
    for (name, leaf), got in zip(_walk(tree), model_leaves, strict=True):
        if name in selected:
            assert got is not leaf
        elif _is_array(leaf):
            assert got is leaf


ODD_KEYS = st.sampled_from(["a", "0", "a/0", "a/a", "a/", "", "/a", "root"])


@SETTINGS
@given(trees(keys=ODD_KEYS))
def test_keys_with_slashes_or_empty_are_named_by_joined_path(tree):
    names = [n for n, _ in _float_leaves(tree)]
    if len(set(names)) < len(names):
        with pytest.raises(PartitionError, match="Duplicate parameter name"):
            split(tree)
        return
    _check_split(tree, None, dict(_float_leaves(tree)))


@st.composite
def colliding_trees(draw):
    """Two float arrays whose key paths join to one name: {"a/b": {"c": x}} and
    {"a": {"b": {"c": y}}}, inside a random tree."""
    segments = draw(st.lists(KEYS, min_size=2, max_size=4))
    cut = draw(st.integers(2, len(segments)))
    joined = ["/".join(segments[:cut]), *segments[cut:]]
    tree = {"zz": draw(trees())}
    for path in (joined, segments):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        dtype = draw(st.sampled_from(DTYPES[:2]))
        node[path[-1]] = draw(hnp.arrays(dtype, draw(hnp.array_shapes(min_dims=0))))
    return tree, "/".join(segments)


@SETTINGS
@given(colliding_trees())
def test_colliding_key_paths_raise_instead_of_overwriting(tree_and_name):
    tree, name = tree_and_name
    with pytest.raises(PartitionError, match="Duplicate parameter name") as err:
        split(tree)
    assert repr(name) in str(err.value)


# ----------------------------------------------------------------------------
# penzai v2: parameters named by label, or label/<path> for multi-array values


@st.composite
def float_arrays(draw):
    dtype = draw(st.sampled_from(DTYPES[:2]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    return jnp.asarray(draw(hnp.arrays(dtype, shape)))


@st.composite
def penzai_v2_models(draw):
    labels = draw(st.lists(KEYS, min_size=1, max_size=4, unique=True))
    values = [
        draw(
            st.recursive(
                float_arrays(),
                lambda c: (
                    st.lists(c, min_size=1, max_size=2)
                    | st.dictionaries(KEYS, c, min_size=1, max_size=2)
                ),
                max_leaves=3,
            )
        )
        for _ in labels
    ]
    by_label = dict(zip(labels, values, strict=True))
    params = [pz.Parameter(value=v, label=lb) for lb, v in by_label.items()]
    return {"layers": params, "extra": draw(trees())}, by_label


def _v2_names(label, value):
    walked = list(_walk(value))
    if len(walked) == 1:
        return [(label, walked[0][1])]
    return [(f"{label}/{n}", v) for n, v in walked]


@SETTINGS
@given(penzai_v2_models(), st.sampled_from([None, "a", "^b", "0$", "_"]))
def test_penzai_v2_params_by_label_and_round_trip(model_and_values, pattern):
    model, values = model_and_values
    selected = {}
    for label, value in values.items():
        for n, v in _v2_names(label, value):
            if _is_float_array(v) and (pattern is None or re.search(pattern, n)):
                selected[n] = v  # selection is per array, even within a parameter
    args = (model, optax.adam(1e-3), jax.random.key(0))
    if not selected:
        with pytest.raises(PartitionError, match="no trainable parameters"):
            pztrain.TrainState.initial_state(*args, trainable=pattern)
        return
    state = pztrain.TrainState.initial_state(*args, trainable=pattern)
    assert sorted(state.params) == sorted(selected)
    for name, value in selected.items():
        _assert_same_array(state.params[name], value)
    # state.model gives back pz.Parameter variables with every value, trained or
    # frozen, and the rest of the tree unchanged.
    _, params = pz.unbind_params(state.model)
    assert sorted(str(p.label) for p in params) == sorted(values)
    for p in params:
        assert isinstance(p, pz.Parameter)
        _assert_reproduces(p.value, values[p.label], identical_arrays=False)
    _assert_reproduces(state.model["extra"], model["extra"], identical_arrays=False)


def _sum_loss(*, model, state, rng, scale):
    """Sums every float array of any pytree model (static leaves ignored)."""
    del rng
    floats = [x for x in jax.tree.leaves(model) if _is_float_array(x)]
    loss = sum(jnp.sum(x.astype(jnp.float32)) for x in floats) * scale
    return loss, state, {}


@settings(SETTINGS, max_examples=25)
@given(trees(), st.sampled_from([None, "a", "0$"]))
def test_train_step_keeps_the_rest_and_moves_only_params(tree, trainable):
    selected = {
        n: v
        for n, v in _float_leaves(tree)
        if trainable is None or re.search(trainable, n)
    }
    if not selected:
        return
    # XLA's CPU runtime computes with subnormals flushed to zero, so x - 0 is 0
    # for a subnormal x: such values cannot come back unchanged from a step.
    assume(not any(_has_subnormals(v) for v in selected.values()))
    state = pztrain.TrainState.initial_state(
        tree, optax.sgd(1.0), jax.random.key(0), trainable=trainable
    )
    train_step = pztrain.build_train_step(_sum_loss)
    state, _ = train_step(state, scale=jnp.float32(0.0))
    # A zero loss gradient leaves every value as it was (a signaling NaN may come
    # back quieted), and every untrained leaf bit for bit ...
    model = state.model
    assert jax.tree.structure(model) == jax.tree.structure(tree)
    for (name, leaf), got in zip(_walk(tree), jax.tree.leaves(model), strict=True):
        if name in selected:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))
            assert np.asarray(got).dtype == leaf.dtype
        elif _is_array(leaf):
            _assert_same_array(got, leaf)
        else:
            assert got is leaf
    state, _ = train_step(state, scale=jnp.float32(1.0))
    # ... and sgd(1.0) on sum(x) subtracts exactly 1 from each trained element.
    assert int(state.step) == 2
    model = state.model
    assert jax.tree.structure(model) == jax.tree.structure(tree)
    for (name, leaf), got in zip(_walk(tree), jax.tree.leaves(model), strict=True):
        if name in selected:
            want = (np.asarray(leaf) - np.asarray(1, leaf.dtype)).astype(leaf.dtype)
            np.testing.assert_array_equal(np.asarray(got), want)
            assert np.asarray(got).dtype == leaf.dtype
        elif _is_array(leaf):
            _assert_same_array(got, leaf)
        else:
            assert got is leaf
