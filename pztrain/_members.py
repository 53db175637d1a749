"""The vocabulary of populations (many runs in one program) that every room
shares: how many members a state's root key says it has, and how a value with a
member axis becomes record entries.

A population is a `pztrain.TrainState` whose root key has a leading member axis
``K`` (one key per member), as have its params, optimizer and loss-function
states and the arrays of ``model_without_params``; its ``step`` stays one scalar,
since members step together. See `pztrain.population`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pztrain._tree import is_array, is_float_array

__all__ = [
    "finite_members",
    "member_count",
    "member_key",
    "member_shape_note",
    "spread",
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
