"""Splitting a model into named trainable arrays: one adapter per model family."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
from penzai.core import variables as pz_vars

from pztrain._tree import is_array, is_float_array, named_leaves, path_name, path_repr
from pztrain.partition._model import (
    ApplyFnModel,
    ParamSlot,
    PartitionError,
    Trainable,
    merge,
)
from pztrain.partition._nnx import (
    check_no_loose_variables,
    is_linen_module,
    is_nnx_module,
    split_nnx,
)

__all__ = ["family_of", "param_values", "split"]


def _leaf_names(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """Names every leaf of a parameter value: the prefix alone for one array.

    A penzai ``NamedArray`` holds one array, so its parameter keeps its label.
    """
    leaves = named_leaves(value)
    if len(leaves) == 1:
        return [(prefix, leaves[0][1])]
    return [(f"{prefix}/{name}", leaf) for name, leaf in leaves]


def _make_filter(trainable: Trainable) -> Callable[[str, Any], bool]:
    if trainable is None:
        return lambda name, value: True
    if isinstance(trainable, str):
        try:
            pattern = re.compile(trainable)
        except re.error as e:
            raise PartitionError(
                f"trainable={trainable!r} is not a valid regular expression: {e}"
            ) from None
        return lambda name, value: pattern.search(name) is not None
    if callable(trainable):
        return trainable
    raise PartitionError(
        "trainable must be None, a regex string searched in parameter names, or a "
        f"predicate (name, value) -> bool; got {type(trainable).__name__}."
    )


def _check_hashable(path: tuple[Any, ...], leaf: Any) -> None:
    if is_array(leaf):
        return
    try:
        hash(leaf)
    except TypeError:
        raise PartitionError(
            f"Unsupported leaf at model{path_repr(path)}: a "
            f"{type(leaf).__name__} is neither an array nor hashable, so it can be "
            "neither trained nor treated as static structure. Convert it to an "
            "array, or mark the field static (penzai: "
            "dataclasses.field(metadata={'pytree_node': False}); equinox: "
            "eqx.field(static=True))."
        ) from None


def _check_unique(names: list[tuple[str, str]]) -> None:
    """Raises on duplicate names; ``names`` holds (name, where) pairs."""
    seen: dict[str, str] = {}
    for name, where in names:
        if name in seen:
            raise PartitionError(
                f"Duplicate parameter name {name!r} (at {seen[name]} and at "
                f"{where}). Names key the params dict, checkpoints and optimizer "
                "masks, so they must be unique: give the parameters distinct "
                "names or labels."
            )
        seen[name] = where


def _v1_module():
    """The penzai v1 parameter module, if it was imported (else no v1 model)."""
    return sys.modules.get("penzai.deprecated.v1.nn.parameters")


def family_of(model: Any) -> str:
    """Names the model family that `split` will use for ``model``.

    Returns:
      ``"flax"`` for an `ApplyFnModel`, ``"nnx"`` for a Flax ``nnx.Module``,
      ``"linen"`` for a Flax linen module (which `split` refuses),
      ``"penzai_v2"`` when the model holds penzai variables, ``"penzai_v1"``
      when it holds penzai v1 parameters, and ``"pytree"`` otherwise (equinox
      modules included).

    Example:
      >>> import jax.numpy as jnp; from pztrain.partition import family_of
      >>> family_of({"w": jnp.zeros(3)})
      'pytree'
    """
    if isinstance(model, ApplyFnModel):
        return "flax"
    if is_nnx_module(model):
        return "nnx"
    if is_linen_module(model):
        return "linen"
    v1 = _v1_module()
    v1_types = () if v1 is None else (v1.Parameter, v1.UninitializedParameter)
    var_types = (pz_vars.AbstractVariable, pz_vars.AbstractVariableValue)
    found = "pytree"
    for leaf in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, var_types)):
        if isinstance(leaf, var_types):
            return "penzai_v2"
    if v1_types:
        nodes = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, v1_types))
        if any(isinstance(x, v1_types) for x in nodes):
            found = "penzai_v1"
    return found


def param_values(state: Any) -> dict[str, Any]:
    """A state's trainable params as penzai's own ``TrainState.params`` holds
    them: keyed by parameter name (penzai v1) or label (penzai v2), each value
    as the model holds it: a ``NamedArray`` where the parameter had one.

    ``state.params`` itself stays a flat dict of plain arrays (what checkpoints,
    optimizer masks and sharding rules name); this is a view. For other
    families it is ``state.params``.

    Args:
      state: A `pztrain.TrainState` (anything with ``params`` and
        ``model_without_params``).

    Returns:
      A dict name → value.

    Example:
      >>> from pztrain.partition import param_values, split
      >>> import types, jax.numpy as jnp
      >>> from penzai import pz
      >>> w = pz.nx.wrap(jnp.ones(2)).tag("features")
      >>> params, rest = split({"w": pz.Parameter(value=w, label="w")})
      >>> type(params["w"]).__name__
      'ArrayImpl'
      >>> state = types.SimpleNamespace(params=params, model_without_params=rest)
      >>> dict(param_values(state)["w"].named_axes)
      {'features': 2}
    """
    params, rest = state.params, state.model_without_params
    v1 = _v1_module()
    kinds = (pz_vars.ParameterValue, *(() if v1 is None else (v1.Parameter,)))
    is_param = lambda x: isinstance(x, kinds)  # noqa: E731
    out: dict[str, Any] = {}
    for node in jax.tree.leaves(rest, is_leaf=is_param):
        if is_param(node) and _holds_slot(node.value):
            name = str(node.label) if hasattr(node, "label") else node.name
            out.setdefault(name, merge(params, node.value))
    return out or dict(params)


def _holds_slot(value: Any) -> bool:
    is_slot = lambda x: isinstance(x, ParamSlot)  # noqa: E731
    return any(is_slot(x) for x in jax.tree.leaves(value, is_leaf=is_slot))


# ----------------------------------------------------------------------------
# split


def split(
    model: Any, trainable: Trainable = None, *, frozen: bool = False
) -> tuple[dict[str, Any], Any]:
    """Splits ``model`` into named trainable arrays and the model without them.

    Args:
      model: A penzai v2 or v1 model, a Flax ``nnx.Module`` (its float
        ``nnx.Param`` arrays are the parameters; every other variable stays in
        the rest), an equinox module, or any pytree.
      trainable: Which parameters to train: ``None`` for all (penzai v2
        parameters with ``metadata["trainable"] == False`` excepted), a regex
        searched in each name, or a predicate ``(name, value) -> bool``. Arrays
        left out stay in the rest and get no optimizer state.
      frozen: Also take the frozen penzai v2 parameter values
        (``pz.ParameterValue``) the model holds itself, once per label: a model
        from ``pz.freeze_params``, or an abstract one from ``jax.eval_shape``
        (whose ``pz.Parameter`` s cannot hold a ``ShapeDtypeStruct``).

    Returns:
      ``(params, rest)``: a flat ``dict`` name → array, and the model with a
      `ParamSlot` at each trainable array.

    Raises:
      PartitionError: on duplicate names, an unsupported leaf, an uninitialized
        penzai v1 parameter, a Flax linen module or an NNX model without
        ``nnx.Param``, or when no trainable parameter is left.

    Example:
      >>> import jax.numpy as jnp; from pztrain.partition import split
      >>> from pztrain.partition import merge
      >>> params, rest = split({"w": jnp.ones(2), "n": jnp.arange(3)})
      >>> list(params), rest["w"]
      (['w'], ParamSlot(name='w'))
      >>> merge(params, rest)["w"]
      Array([1., 1.], dtype=float32)
    """
    keep = _make_filter(trainable)
    family = family_of(model)
    if family == "flax":
        return model.params, dataclasses.replace(model, params=None)
    if family == "linen":
        raise _linen_error(model)
    if family == "nnx":
        params, rest = split_nnx(model, keep)
    elif family == "penzai_v2":
        params, rest = _split_penzai_v2(model, keep, frozen)
    elif family == "penzai_v1":
        params, rest = _split_penzai_v1(model, keep)
    else:
        check_no_loose_variables(model)
        params, rest = _split_pytree(model, keep)
    if not params:
        raise PartitionError(
            f"The model ({type(model).__name__}, read as {family}) has no trainable "
            f"parameters left after trainable={trainable!r}. Parameters are "
            "floating-point arrays; check the filter or the model."
        )
    return params, rest


def _linen_error(model: Any) -> PartitionError:
    return PartitionError(
        f"The model ({type(model).__name__}) is a Flax linen module, which holds "
        "no arrays: initialise it (variables = model.init(key, x)) and build the "
        "state from its apply function, TrainState.create(apply_fn=model.apply, "
        "params=variables['params'], tx=...). Or write the model as a "
        "flax.nnx.Module and give it to TrainState.initial_state."
    )


def _split_pytree(model: Any, keep) -> tuple[dict[str, Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    params: dict[str, Any] = {}
    names: list[tuple[str, str]] = []
    new_leaves = []
    for path, leaf in leaves:
        _check_hashable(path, leaf)
        name = path_name(path) or "root"
        if is_float_array(leaf) and keep(name, leaf):
            names.append((name, f"model{path_repr(path)}"))
            params[name] = leaf
            new_leaves.append(ParamSlot(name))
        else:
            new_leaves.append(leaf)
    _check_unique(names)
    return params, treedef.unflatten(new_leaves)


def _take_params(
    prefix: str, value: Any, keep, params: dict[str, Any], where: str
) -> tuple[Any, list[tuple[str, str]]]:
    """Moves the selected float arrays of one parameter value into ``params``.

    Selection is per array: a parameter whose value holds several arrays may
    train some and freeze the rest. Returns the value with slots, and the names.
    """
    leaves, treedef = jax.tree.flatten(value)
    named = _leaf_names(prefix, value)
    taken = []
    new_leaves = []
    for leaf, (name, _) in zip(leaves, named, strict=True):
        if is_float_array(leaf) and keep(name, leaf):
            params[name] = leaf
            taken.append((name, where))
            new_leaves.append(ParamSlot(name))
        else:
            new_leaves.append(leaf)
    return treedef.unflatten(new_leaves), taken


def _split_penzai_v2(model: Any, keep, frozen: bool) -> tuple[dict[str, Any], Any]:
    try:
        unbound, variables = pz_vars.unbind_variables(model, freeze=True)
    except pz_vars.VariableConflictError as e:
        raise PartitionError(
            f"Duplicate parameter label in a penzai model: {e} Each pz.Parameter "
            "needs a unique label (or the same Parameter object must be reused)."
        ) from None
    params: dict[str, Any] = {}
    names: list[tuple[str, str]] = []
    rebound = []
    for var in variables:
        trainable = var.metadata.get("trainable", True)
        if not isinstance(var, pz_vars.ParameterValue) or not trainable:
            rebound.append(var)  # state variables and frozen params stay in rest
            continue
        label = str(var.label)
        value, taken = _take_params(
            label, var.value, keep, params, f"parameter {label!r}"
        )
        names += taken
        rebound.append(dataclasses.replace(var, value=value))
    if frozen:
        unbound = _take_frozen(unbound, keep, params, names)
    _check_unique(names)
    rest = pz_vars.bind_variables(unbound, rebound)
    for path, leaf in jax.tree_util.tree_flatten_with_path(rest)[0]:
        _check_hashable(path, leaf)
    return params, rest


def _take_frozen(
    unbound: Any, keep, params: dict[str, Any], names: list[tuple[str, str]]
) -> Any:
    """Takes the trainable frozen parameter values in ``unbound``, once per label."""
    is_value = lambda x: isinstance(x, pz_vars.ParameterValue)  # noqa: E731
    seen: dict[str, Any] = {}

    def take(x):
        if not is_value(x) or not x.metadata.get("trainable", True):
            return x
        label = str(x.label)
        if label not in seen:
            where = f"frozen parameter {label!r}"
            value, taken = _take_params(label, x.value, keep, params, where)
            names.extend(taken)
            seen[label] = dataclasses.replace(x, value=value)
        return seen[label]

    return jax.tree.map(take, unbound, is_leaf=is_value)


def _split_penzai_v1(model: Any, keep) -> tuple[dict[str, Any], Any]:
    v1 = _v1_module()
    is_param = lambda x: isinstance(x, v1.Parameter | v1.UninitializedParameter)  # noqa: E731
    params: dict[str, Any] = {}
    names: list[tuple[str, str]] = []

    def replace(path, node):
        if not is_param(node):
            _check_hashable(path, node)
            return node
        where = f"model{path_repr(path)}"
        if isinstance(node, v1.UninitializedParameter):
            raise PartitionError(
                f"Parameter {node.name!r} at {where} is uninitialized: call "
                "pz.nn.initialize_parameters(model, key) first."
            )
        value, taken = _take_params(node.name, node.value, keep, params, where)
        names.extend(taken)
        return dataclasses.replace(node, value=value)

    rest = jax.tree_util.tree_map_with_path(replace, model, is_leaf=is_param)
    _check_unique(names)
    return params, rest
