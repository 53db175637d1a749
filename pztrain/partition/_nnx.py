"""Flax NNX models: ``nnx.Param`` trained, every other variable carried as state.

- `split_nnx` runs ``nnx.split`` once. The floating-point ``nnx.Param`` arrays
  the trainable filter keeps are the params, named by their variable's path
  (``"l1/kernel"``); everything else (frozen params, ``nnx.BatchStat``, the rng
  streams' keys and counts, ``nnx.Cache``, a user's variable types) stays in the
  `NnxModel`.
- `bind_nnx` runs inside the step. It rebuilds the module from fresh variables,
  made at the loss's trace level (NNX refuses to update a variable made outside
  it), sets the mode (``model.train()`` / ``model.eval()``), reseeds every rng
  stream from the step key (`reseed_streams`), and returns a reader. Called
  after the loss, the reader gives the rest with the new values of its non-param
  variables, which the step keeps.

flax is imported only for a model that is an NNX one (``flax.nnx`` already in
``sys.modules``).
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from collections.abc import Callable
from typing import Any

import jax

from pztrain._tree import describe, is_array, is_float_array, path_name, path_repr
from pztrain.partition._model import (
    NnxModel,
    ParamSlot,
    PartitionError,
    flax_nnx,
    merge,
)

__all__ = [
    "MODES",
    "bind_nnx",
    "check_no_loose_variables",
    "is_linen_module",
    "is_nnx_module",
    "nnx_variables",
    "reseed_streams",
    "split_nnx",
]

MODES = ("train", "eval", None)
"""The modes a step can run a model in; ``None`` leaves the modes as built."""

_VALUE = jax.tree_util.GetAttrKey("value")


def is_nnx_module(model: Any) -> bool:
    """Whether ``model`` is an ``nnx.Module`` (without importing flax)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def is_linen_module(model: Any) -> bool:
    """Whether ``model`` is a Flax linen module (without importing flax)."""
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(model, linen.Module)


def check_no_loose_variables(model: Any) -> None:
    """Refuses NNX variables in a pytree that is not an ``nnx.Module``."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    is_var = lambda x: isinstance(x, nnx.Variable | nnx.Module)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_var)[0]:
        if is_var(leaf):
            raise PartitionError(
                f"The model ({type(model).__name__}) holds a Flax NNX "
                f"{type(leaf).__name__} at model{path_repr(path)} outside a "
                "top-level nnx.Module. pztrain splits an NNX model as a whole: "
                "make the model one nnx.Module (put the parts in its attributes)."
            )


def nnx_variables(model: Any) -> tuple[list[Any], list[Any]]:
    """``(params, others)``: the ``nnx.Param`` variables of an NNX module and
    its other variables (``([], [])`` for other models), each once.

    Example:
      >>> import jax
      >>> from pztrain.partition import nnx_variables
      >>> from flax import nnx
      >>> params, others = nnx_variables(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> [type(v).__name__ for v in params], [type(v).__name__ for v in others]
      (['Param', 'Param'], ['BatchStat', 'BatchStat'])
      >>> nnx_variables({"w": jax.numpy.ones(2)})
      ([], [])
    """
    if not is_nnx_module(model):
        return [], []
    nnx = flax_nnx()
    params, others = [], []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            (params if isinstance(node, nnx.Param) else others).append(node)
    return params, others


# ----------------------------------------------------------------------------
# split


def _entries(nnx: Any, state: Any) -> list[tuple[str, Any, Any]]:
    """``(name, variable, leaf)`` for each leaf of an ``nnx.State``, in order."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    out = []
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]:
        for sub, leaf in jax.tree_util.tree_flatten_with_path(var)[0]:
            out.append(
                (path_name(path + tuple(k for k in sub if k != _VALUE)), var, leaf)
            )
    return out


def _annotation(nnx: Any, var: Any) -> Any:
    """The ``PartitionSpec`` a param's sharding annotation gives, or ``None``."""
    metadata = var.get_metadata()  # flax 0.12.2 names it "sharding_names"
    if not (metadata.get("out_sharding") or metadata.get("sharding_names")):
        return None
    return nnx.spmd.get_var_pspec(var)


def split_nnx(
    model: Any, keep: Callable[[str, Any], bool]
) -> tuple[dict[str, Any], NnxModel]:
    """``(params, rest)`` of an NNX model: the kept float ``nnx.Param`` arrays by
    name, and the `NnxModel` with a `ParamSlot` at each."""
    nnx = flax_nnx()
    graphdef, state = nnx.split(model)
    entries = _entries(nnx, state)
    if not any(isinstance(var, nnx.Param) for _, var, _ in entries):
        found = sorted({type(var).__name__ for _, var, _ in entries})
        raise PartitionError(
            f"The NNX model ({type(model).__name__}) has no nnx.Param (its "
            f"variables: {found or 'none'}). pztrain trains nnx.Param variables "
            "only: hold the weights to train in nnx.Param(...)."
        )
    params: dict[str, Any] = {}
    values, shardings = [], []
    for name, var, leaf in entries:
        if isinstance(var, nnx.Param) and is_float_array(leaf) and keep(name, leaf):
            params[name] = leaf
            leaf = ParamSlot(name)
            spec = _annotation(nnx, var)
            if spec is not None:
                shardings.append((name, spec))
        values.append(leaf)
    rest = NnxModel(
        graphdef,
        jax.tree.structure(state),
        tuple(name for name, _, _ in entries),
        tuple(type(var).__name__ for _, var, _ in entries),
        tuple(isinstance(var, nnx.Param) for _, var, _ in entries),
        tuple(shardings),
        tuple(values),
    )
    _check_hashable(model, rest)
    return params, rest


def _check_hashable(model: Any, rest: NnxModel) -> None:
    try:
        hash((rest.graphdef, rest.treedef))
    except TypeError as e:
        raise PartitionError(
            f"The structure of the NNX model ({type(model).__name__}) is not "
            f"hashable ({e}); a step compiles once per structure, so static "
            "attributes and variable metadata must be hashable (tuples, not "
            "lists or dicts)."
        ) from None


# ----------------------------------------------------------------------------
# bind


def reseed_streams(module: Any, rng: jax.Array) -> None:
    """Reseeds every rng stream of an NNX module from one key, as a step does.

    Stream ``tag`` (``"dropout"``, ``"default"`` …) is reseeded with
    ``jax.random.fold_in(rng, zlib.crc32(tag.encode()))`` through
    ``nnx.reseed``, which gives each stream of one tag its own key (in the
    module's graph order) and sets its count to 0. In a train step ``rng`` is
    the loss function's own ``rng`` argument, ``fold_in(root_rng, step)``.

    Example:
      >>> import jax, jax.numpy as jnp; from pztrain.partition import reseed_streams
      >>> from flax import nnx
      >>> drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
      >>> reseed_streams(drop, jax.random.key(1))
      >>> a = drop(jnp.ones(8))
      >>> reseed_streams(drop, jax.random.key(1))
      >>> bool((drop(jnp.ones(8)) == a).all())
      True
    """
    nnx = flax_nnx()
    tags = sorted(
        {
            node.tag
            for _, node in nnx.iter_graph(module)
            if isinstance(node, nnx.RngStream)
        }
    )
    keys = {tag: jax.random.fold_in(rng, zlib.crc32(tag.encode())) for tag in tags}
    if keys:
        nnx.reseed(module, policy="match_shape", **keys)


def bind_nnx(
    rest: NnxModel, params: Any, rng: jax.Array | None, mode: str | None
) -> tuple[Any, Callable[[], NnxModel]]:
    """The module a loss function gets, and a reader of the rest after it ran.

    Args:
      rest: The model without params (slots in place).
      params: The params to merge in.
      rng: The step key the streams are reseeded from (``None``: not reseeded).
      mode: ``"train"`` (``module.train()``), ``"eval"`` (``module.eval()``) or
        ``None`` (the modes the model was built with).

    Returns:
      ``(module, new_rest)``; ``new_rest()`` is ``rest`` with the new values of
      the variables that are not params.
    """
    module = merge(params, rest).module()  # fresh variables, at this trace level
    if mode == "train":
        module.train()
    elif mode == "eval":
        module.eval()
    if rng is not None:
        reseed_streams(module, rng)
    return module, lambda: _after(module, rest)


def _after(module: Any, rest: NnxModel) -> NnxModel:
    """``rest`` with the non-param values ``module`` holds now."""
    nnx = flax_nnx()
    entries = _entries(nnx, nnx.split(module)[1])
    names = tuple(name for name, _, _ in entries)
    if names != rest.names:
        raise _changed_variables(type(module).__name__, rest.names, entries)
    values = []
    for (name, _, new), old, is_param in zip(
        entries, rest.values, rest.params, strict=True
    ):
        if is_param or not is_array(old):
            values.append(old)
            continue
        if new.shape != old.shape or new.dtype != old.dtype:
            raise PartitionError(
                f"The loss function changed NNX variable {name!r} from "
                f"{describe(old)} to {describe(new)}. A variable keeps its shape "
                "and dtype from step to step: cast the new value (.astype)."
            )
        values.append(new)
    return dataclasses.replace(rest, values=tuple(values))


def _changed_variables(
    model: str, before: tuple[str, ...], entries: list[tuple[str, Any, Any]]
) -> PartitionError:
    types = {name: type(var).__name__ for name, var, _ in entries}
    added = [f"{n} ({types[n]})" for n in types if n not in before]
    removed = [n for n in before if n not in types]
    what = []
    if added:
        what.append(f"created {added}")
    if removed:
        what.append(f"removed {removed}")
    return PartitionError(
        f"The loss function {' and '.join(what) or 'restructured'} NNX variables "
        f"of the {model} model during the step. pztrain carries a model's "
        "variables from step to step, so they are fixed when the state is built: "
        "create variables in the model's __init__, and collect intermediates "
        "with nnx.capture (or nnx.pop them before the loss returns)."
    )
