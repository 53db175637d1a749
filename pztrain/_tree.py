"""The shared vocabulary of pytrees: names of leaves, array tests, descriptions.

A leaf has a name (`path_name`: ``"layers/0/weight"``, what params, metrics and
batch entries are called) and a location (`path_repr`: ``"['layers'][0]"``,
where an error points to).

Every module that names a leaf (parameters, metrics, batch entries, checkpoint
entries) or describes one in an error uses these, so a name or a ``float32[3]``
reads the same everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def path_name(path: Sequence[Any]) -> str:
    """A key path as a ``/``-separated name: ``"layers/0/weight"``.

    Example:
      >>> import jax
      >>> [path_name(p) for p, _ in
      ...  jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
      ['a/0', 'a/1']
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def path_repr(path: Sequence[Any]) -> str:
    """A key path as Python indexing, for errors and stored paths: ``"['a'][0]"``."""
    return jax.tree_util.keystr(tuple(path))


def named_leaves(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> list[tuple[str, Any]]:
    """The leaves of ``tree`` with their names (see `path_name`), in order."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [(path_name(path), leaf) for path, leaf in flat]


def is_array(x: Any) -> bool:
    """A JAX or NumPy array (tracers included)."""
    return isinstance(x, jax.Array | np.ndarray)


def is_array_like(x: Any) -> bool:
    """An array, or a ``jax.ShapeDtypeStruct`` standing for one (an abstract
    model or state, from ``jax.eval_shape``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> is_array_like(jax.ShapeDtypeStruct((2,), jnp.float32)), is_array_like(2.0)
      (True, False)
    """
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_float_array(x: Any) -> bool:
    """An array (or `is_array_like`) of a floating-point or complex dtype, by
    JAX's dtype rules.

    JAX's rules count ``bfloat16`` and the float8 types as floating point (NumPy's
    ``np.issubdtype`` does not). A ``ShapeDtypeStruct`` counts, so an abstract
    model splits into abstract params.

    Example:
      >>> import jax.numpy as jnp
      >>> is_float_array(jnp.zeros(2, jnp.bfloat16)), is_float_array(jnp.arange(2))
      (True, False)
    """
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def all_finite(tree: Any) -> bool:
    """Whether every floating-point array in ``tree`` is finite.

    One fused sum per array (a non-finite value makes its sum NaN or inf), read
    back once; only a sum that overflowed is checked element by element. That is
    about four times faster than ``isfinite(x).all()`` on the host's CPUs, which
    matters before a checkpoint save that the training loop waits for.

    Example:
      >>> import jax.numpy as jnp
      >>> all_finite({"w": jnp.ones(2), "n": 3}), all_finite([jnp.array(jnp.nan)])
      (True, False)
      >>> all_finite([jnp.array([3e38, 3e38])])  # the sum overflows; the values do not
      True
      >>> all_finite([jnp.array([1 + 1j, complex(1, float("nan"))])])
      False
    """
    floats = [x for x in jax.tree.leaves(tree) if is_float_array(x) and is_array(x)]
    if not floats:
        return True
    sums = np.asarray(_sums(floats))
    return all(
        bool(np.isfinite(s)) or bool(_finite(x))
        for s, x in zip(sums, floats, strict=True)
    )


@jax.jit
def _sums(arrays: list[Any]) -> jax.Array:
    return jnp.stack([_sum(x) for x in arrays])


def _sum(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        total = jnp.sum(x)
        return (total.real + total.imag).astype(jnp.float32)
    return jnp.sum(x, dtype=jnp.float32)


@jax.jit
def _finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def describe_shape(shape: Sequence[int], dtype: Any) -> str:
    """``dtype[shape]``, the way errors show an array: ``float32[128, 3]``."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", str(dtype))
    return f"{name}{list(shape)}"


def describe(x: Any) -> str:
    """`describe_shape` of an array-like, or the type name of anything else.

    Example:
      >>> import numpy as np
      >>> describe(np.zeros((2, 3), np.float32)), describe("text")
      ('float32[2, 3]', 'str')
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return type(x).__name__
    return describe_shape(np.shape(x), x.dtype)


def structure_difference(a: Any, b: Any) -> str:
    """Where the structure of pytree ``b`` first differs from ``a``'s, for
    errors: the path, and the nodes there (the fields that differ, for two
    dataclasses of one type: an equinox module's configuration).

    Example:
      >>> structure_difference({"a": [1, 2]}, {"a": [1, 2, 3]})
      "['a']: PyTreeDef([*, *, *]) against PyTreeDef([*, *])"
    """
    return _difference(a, b, ())


def _difference(a: Any, b: Any, path: tuple) -> str:
    where = jax.tree_util.keystr(path) or "the root"
    if _node(a) != _node(b):
        return f"{where}: {_unlike(a, b)}"
    for (key, x), (_, y) in zip(_children(a), _children(b), strict=True):
        if jax.tree_util.tree_structure(x) != jax.tree_util.tree_structure(y):
            return _difference(x, y, (*path, *key))
    return where


def _node(x: Any) -> Any:
    """``x`` 's node alone: its type, static data and number of children."""
    return jax.tree_util.tree_structure(x, is_leaf=lambda y: y is not x)


def _children(x: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]


def _unlike(a: Any, b: Any) -> str:
    """Node ``b`` against node ``a``: the static fields that differ if both
    are dataclasses of one type, else their node structures (shortened)."""
    if type(a) is type(b) and dataclasses.is_dataclass(a):
        children = {getattr(key[0], "name", None) for key, _ in _children(a)}
        fields = [f.name for f in dataclasses.fields(a) if f.name not in children]
        differ = [n for n in fields if not _equal(getattr(a, n), getattr(b, n))]
        if differ:
            mine = ", ".join(f"{n}={getattr(b, n)!r}" for n in differ)
            first = ", ".join(f"{n}={getattr(a, n)!r}" for n in differ)
            return f"{type(b).__name__} with {mine} against {first}"[:400]
    return f"{str(_node(b))[:180]} against {str(_node(a))[:180]}"


def _equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an == that is not a truth value
        return False
