"""The vocabulary of populations (many runs in one program) that every room
shares: how many members a state's root key says it has, and how a value with a
member axis becomes record entries.

A population is a `pztrain.TrainState` whose root key has a leading member axis
``K`` (one key per member), as have its params, optimizer and loss-function
states and the arrays of ``model_without_params``; its ``step`` stays one scalar,
since members step together. See `pztrain.population`. Also: whether states
can be the members of one population (`unlike`: the first difference, as a
message) and which of their leaves are equal in every member.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pztrain._tree import describe, is_array, is_float_array, structure_difference

__all__ = [
    "equal_arrays",
    "finite_members",
    "member_count",
    "member_key",
    "member_shape_note",
    "same",
    "shared_batch_sharding",
    "shared_shape_note",
    "spread",
    "unlike",
]


def member_count(root_rng: Any) -> int | None:
    """Members of a state whose root key is ``root_rng``: ``None`` for one run
    (a scalar typed key, or a legacy ``uint32[2]`` key; or anything that is not
    an array), else its leading axis.

    Example:
      >>> import jax
      >>> keys = jax.random.split(jax.random.key(0), 3)
      >>> member_count(jax.random.key(0)), member_count(keys)
      (None, 3)
    """
    dtype = getattr(root_rng, "dtype", None)
    if dtype is None:  # not a key (e.g. a tree of shardings shaped as a state)
        return None
    shape = np.shape(root_rng)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return shape[0] if len(shape) == 1 else None
    return shape[0] if len(shape) == 2 else None


def member_shape_note(
    stored: tuple[int, ...], wanted: tuple[int, ...], members: int | None
) -> str | None:
    """What to do when a stored array of shape ``stored`` (of a population of
    ``members``, or of one run: ``None``) does not fit a target's ``wanted``
    because one of them has a member axis and the other has not; else ``None``.

    Example:
      >>> member_shape_note((3, 8), (8,), 3)[:44]
      'The checkpoint holds a population of 3 membe'
      >>> print(member_shape_note((4,), (8,), None))
      None
    """
    stored, wanted = tuple(stored), tuple(wanted)
    if members is not None and stored[1:] == wanted:
        return (
            f"The checkpoint holds a population of {members} members (axis 0 of "
            "every array): load it into a population (pztrain.make_population "
            f"with {members} seeds), then take one out with "
            "pztrain.member(population, i)."
        )
    if members is None and wanted[1:] == stored:
        return (
            f"The checkpoint holds one run's params; the target's have a leading "
            f"axis of {wanted[0]}, as a population's: load it into one run (e.g. "
            "pztrain.member(population, 0)); pztrain.stack_members stacks runs."
        )
    return None


def shared_shape_note(stored: Any, wanted: Any) -> str:
    """What to do when a stored state array and a target's differ only in
    their member axis being 1 on one side (held once for every member, see
    `pztrain.population.stack_members`) and ``K`` on the other, after a
    space; else ``""``.

    Example:
      >>> shared_shape_note((1, 4, 3), (4, 4, 3))[:53]
      ' The checkpoint holds this array once for every membe'
      >>> shared_shape_note((2, 3), (4, 3))
      ''
    """
    stored, wanted = tuple(stored), tuple(wanted)
    if not stored or len(stored) != len(wanted) or stored[1:] != wanted[1:]:
        return ""
    if stored[0] == 1 < wanted[0]:
        held = "once for every member, the target once per member"
    elif wanted[0] == 1 < stored[0]:
        held = "once per member, the target once for every member"
    else:
        return ""
    return (
        f" The checkpoint holds this array {held}: build the target population "
        "as the saved one was, with or without make_population(..., "
        "shared='model_without_params')."
    )


def member_key(name: str, i: int) -> str:
    """The record entry of member ``i``'s value of ``name``: ``"loss/member_3"``."""
    return f"{name}/member_{i}"


def spread(name: str, value: Any) -> dict[str, float]:
    """Record entries of one metric: itself if a scalar; for a value per member
    (a 1-D array), the mean under ``name``, then ``name/min``, ``name/max`` and
    one entry per member (`member_key`).

    A member whose value is not finite (NaN or inf: it diverged) is left out
    of ``/min`` and ``/max`` (NaN when no member is finite), so that a monitor
    of the best member (``"loss/min"``) follows the members that still train;
    ``name/diverged`` then counts those members. The mean stays the mean of
    every member: NaN as soon as one diverged, as the population's own mean is.

    Example:
      >>> import numpy as np
      >>> spread("loss", np.array([1.0, 3.0]))  # doctest: +NORMALIZE_WHITESPACE
      {'loss': 2.0, 'loss/min': 1.0, 'loss/max': 3.0,
       'loss/member_0': 1.0, 'loss/member_1': 3.0}
      >>> spread("loss", np.array([1.0, np.nan, 3.0]))  # doctest: +NORMALIZE_WHITESPACE
      {'loss': nan, 'loss/min': 1.0, 'loss/max': 3.0, 'loss/diverged': 1.0,
       'loss/member_0': 1.0, 'loss/member_1': nan, 'loss/member_2': 3.0}
    """
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        return {name: float(array)}
    finite = array[np.isfinite(array)]
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as it is
        out = {name: float(array.mean())}
    out[f"{name}/min"] = float(finite.min()) if finite.size else float("nan")
    out[f"{name}/max"] = float(finite.max()) if finite.size else float("nan")
    if finite.size < array.size:
        out[f"{name}/diverged"] = float(array.size - finite.size)
    out.update({member_key(name, i): float(v) for i, v in enumerate(array)})
    return out  # every entry but the mean matches pztrain._plot.SPREAD


def finite_members(tree: Any, members: int) -> np.ndarray:
    """Per member of a population, whether every float array of ``tree``
    (its arrays with the member axis first, e.g. its params) is finite.

    Example:
      >>> import numpy as np
      >>> finite_members({"w": np.array([[1.0, 2.0], [np.nan, 0.0]])}, 2).tolist()
      [True, False]
    """
    leaves = jax.tree.leaves(tree)
    floats = [jnp.asarray(x) for x in leaves if is_float_array(x) and is_array(x)]
    if not floats:
        return np.ones(members, bool)
    return np.asarray(_finite_rows(floats))


@jax.jit
def _finite_rows(arrays: list[jax.Array]) -> jax.Array:
    rows = [jnp.isfinite(x.reshape(x.shape[0], -1)).all(axis=1) for x in arrays]
    return jnp.stack(rows).all(axis=0)


def shared_batch_sharding(state: Any, member_batches: bool) -> Any:
    """Where ``fit`` puts a population's shared host batches: replicated on
    the mesh its members are split over (`pztrain.population.shard_members`),
    so that the step gets them there rather than moving them from the default
    device each call; ``None`` otherwise (one run, one device, or a batch per
    member)."""
    sharding = getattr(state.root_rng, "sharding", None)
    if member_batches or not isinstance(sharding, NamedSharding):
        return None
    if not sharding.spec or member_count(state.root_rng) is None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec())


def equal_arrays(xs: Sequence[Any]) -> bool:
    """Whether every array of ``xs`` is ``xs[0]`` or bitwise equal to it.

    Example:
      >>> import numpy as np
      >>> a = np.ones(2)
      >>> equal_arrays([a, np.ones(2)]), equal_arrays([a, np.zeros(2)])
      (True, False)
    """
    first = np.asarray(xs[0])
    return all(x is xs[0] or np.array_equal(np.asarray(x), first) for x in xs[1:])


def same(xs: Sequence[Any]) -> bool:
    """Whether every ``x`` is ``xs[0]`` or equal to it (not arrays)."""
    try:
        return all(x is xs[0] or bool(x == xs[0]) for x in xs)
    except Exception:  # an == that is not a truth value
        return False


def unlike(states: Sequence[Any]) -> str | None:
    """How a member differs from member 0 (naming the member and the leaf),
    or ``None`` if they can form a population."""
    first, first_def = jax.tree_util.tree_flatten_with_path(states[0])
    for i, state in enumerate(states[1:], start=1):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        if treedef != first_def:
            where = structure_difference(states[0], state)
            return (
                f"Member {i}'s structure differs from member 0's at {where}. "
                "Members of a population share everything but their arrays' "
                "values (model structure, optimizer, loss-function state, "
                "TrainState type)."
            )
        for (path, a), (_, b) in zip(first, leaves, strict=True):
            problem = _leaf_unlike(i, path, a, b)
            if problem:
                return problem
    steps = {int(s.step) for s in states}
    if len(steps) > 1:
        return (
            f"Members are at different steps {sorted(steps)}: a population steps "
            "together. Start them at one step (e.g. state.replace(step=...))."
        )
    return None


def _leaf_unlike(i: int, path: Any, a: Any, b: Any) -> str | None:
    """How member ``i``'s leaf ``b`` is unlike member 0's ``a``: arrays of
    another shape or dtype, or a leaf that is not an array (a function, a
    name) and differs, unless both are numbers (stacked, one per member)."""
    where = f"Member {i} differs from member 0 at {jax.tree_util.keystr(path)}"
    if is_array(a) and is_array(b):
        if np.shape(a) != np.shape(b) or a.dtype != b.dtype:
            return (
                f"{where}: {describe(b)} against {describe(a)}. Members need "
                "equal shapes and dtypes."
            )
        return None
    if is_array(a) or is_array(b):
        return (
            f"{where}: {describe(b)} against {describe(a)}. Members need an array "
            "where member 0 has one, and the same non-array leaves."
        )
    if not (same([a, b]) or (_number(a) and _number(b))):
        return (
            f"{where}: {b!r} against {a!r}. A leaf that is not an array (a "
            "function, a name, a setting) is shared by every member; to vary it "
            "per member, make it an array or an injected hyperparameter."
        )
    return None


def _number(x: Any) -> bool:
    return isinstance(x, int | float | complex | np.number) and not isinstance(x, bool)
