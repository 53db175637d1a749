"""The pieces of a split model: slots, the Flax-style wrapper, the rest of a
Flax NNX model, and merging back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
from penzai.core import variables as pz_vars

from pztrain._tree import is_array, is_array_like

__all__ = [
    "ApplyFnModel",
    "NnxModel",
    "ParamSlot",
    "PartitionError",
    "Trainable",
    "annotated_specs",
    "flax_nnx",
    "freeze_state_vars",
    "has_state_vars",
    "merge",
    "model_state",
    "thaw_state_vars",
    "to_user_model",
    "with_model_state",
]

Trainable = Callable[[str, Any], bool] | str | None
"""A trainable filter: ``None`` (every float array), a regex searched in each
parameter name, or a predicate ``(name, value) -> bool``."""


class PartitionError(ValueError):
    """A model cannot be split into named parameters as asked.

    Example:
      >>> from pztrain import PartitionError
      >>> from pztrain.partition import merge
      >>> import jax.numpy as jnp
      >>> from pztrain.partition import split
      >>> params, rest = split({"w": jnp.ones(2)})
      >>> try:
      ...     merge({}, rest)
      ... except PartitionError as e:
      ...     print(e)  # doctest: +ELLIPSIS
      Parameter 'w' is missing from params (it has 0 entries). ...
    """


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Marks where a trainable array was taken out of a model.

    A slot is a pytree node with no children, so flattening a model without its
    params yields only the arrays that stay behind.

    Attributes:
      name: The parameter name; the key of the array in ``TrainState.params``.

    Example:
      >>> import jax.numpy as jnp, jax
      >>> from pztrain.partition import split
      >>> params, rest = split({"w": jnp.ones(2), "n": jnp.arange(3)})
      >>> rest["w"], jax.tree.leaves(rest)  # a slot has no leaves
      (ParamSlot(name='w'), [Array([0, 1, 2], dtype=int32)])
    """

    name: str


jax.tree_util.register_static(ParamSlot)


@dataclasses.dataclass(frozen=True)
class ApplyFnModel:
    """A Flax-style model: an ``apply_fn`` and its params, callable like a model.

    ``ApplyFnModel(apply_fn, params)(*args, **kwargs)`` calls
    ``apply_fn({"params": params}, *args, **kwargs)``, so a loss function written
    as ``model(x)`` works for Flax-style states too. ``apply_fn`` is static;
    ``params`` is the pytree child.

    Attributes:
      apply_fn: The function that applies the model, e.g. ``module.apply``.
      params: The parameter pytree (``None`` in ``model_without_params``).

    Example:
      >>> import jax.numpy as jnp; from pztrain import ApplyFnModel
      >>> m = ApplyFnModel(lambda v, x: v["params"]["w"] * x, {"w": jnp.array(2.0)})
      >>> m(3.0)
      Array(6., dtype=float32, weak_type=True)
    """

    apply_fn: Callable[..., Any]
    params: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.apply_fn({"params": self.params}, *args, **kwargs)


jax.tree_util.register_dataclass(
    ApplyFnModel, data_fields=["params"], meta_fields=["apply_fn"]
)


def flax_nnx() -> Any:
    """``flax.nnx``, imported when first needed (the optional extra ``nnx``)."""
    try:
        from flax import nnx
    except ImportError:
        raise ImportError(
            "Flax NNX models need flax: pip install 'pztrain[nnx]'."
        ) from None
    return nnx


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """A Flax NNX model without its params: its ``model_without_params``.

    ``nnx.split(model)`` gives a graph definition and one ``nnx.State``; this
    keeps both, with a `ParamSlot` in place of each trained ``nnx.Param`` array.
    Its pytree children are the values that are not slots, keyed by name
    (``"bn/mean"``), so summaries, checkpoints and shardings see batch
    statistics and rng state by name; the slots are static.
    ``to_user_model(merge(params, rest))`` gives the ``nnx.Module``.

    Attributes:
      graphdef: The graph definition from ``nnx.split`` (static).
      treedef: The structure of the model's ``nnx.State`` (static).
      names: Each value's name: its variable's path, without ``/value``.
      types: Each value's variable type (``"Param"``, ``"BatchStat"``,
        ``"RngKey"``, ``"RngCount"``, a subclass's name …).
      params: Whether each value is an ``nnx.Param``'s (trained, or left out
        by the trainable filter).
      shardings: ``(name, PartitionSpec)`` of each param with a sharding
        annotation (``nnx.with_partitioning``, ``out_sharding`` metadata).
      values: One per leaf of the state: a `ParamSlot` for each trained param,
        the array (or other leaf) otherwise.

    Example:
      >>> from flax import nnx
      >>> from pztrain.partition import split
      >>> rngs = nnx.Rngs(0)
      >>> params, rest = split(nnx.Sequential(nnx.Linear(2, 3, rngs=rngs),
      ...                                     nnx.BatchNorm(3, rngs=rngs)))
      >>> type(rest).__name__, rest.stateful
      ('NnxModel', True)
      >>> sorted(params)
      ['layers/0/bias', 'layers/0/kernel', 'layers/1/bias', 'layers/1/scale']
      >>> [(n, t) for n, t in zip(rest.names, rest.types) if t != "Param"]
      [('layers/1/mean', 'BatchStat'), ('layers/1/var', 'BatchStat')]
    """

    graphdef: Any
    treedef: Any
    names: tuple[str, ...]
    types: tuple[str, ...]
    params: tuple[bool, ...]
    shardings: tuple[tuple[str, Any], ...]
    values: tuple[Any, ...]

    @property
    def stateful(self) -> bool:
        """Whether the model holds arrays besides its params (its state)."""
        return any(
            not p and is_array(v) for p, v in zip(self.params, self.values, strict=True)
        )

    def module(self) -> Any:
        """The ``nnx.Module``, with these values (slots must be filled)."""
        for value in self.values:
            if isinstance(value, ParamSlot):
                raise PartitionError(
                    f"Parameter {value.name!r} is still a slot: merge(params, rest) "
                    "first."
                )
        return flax_nnx().merge(self.graphdef, self.treedef.unflatten(self.values))

    def merged(self, params: Mapping[str, Any]) -> NnxModel:
        """This rest with each slot filled from ``params`` (see `merge`)."""
        return _nnx_model(self.aux(), tuple(_filled(params, v) for v in self.values))

    def aux(self) -> tuple[Any, ...]:
        """The static fields, in order."""
        return (
            self.graphdef,
            self.treedef,
            self.names,
            self.types,
            self.params,
            self.shardings,
        )


def _nnx_model(aux: tuple[Any, ...], values: tuple[Any, ...]) -> NnxModel:
    """An `NnxModel` without the dataclass ``__init__`` (the step rebuilds one
    per call from new arrays)."""
    m = object.__new__(NnxModel)
    m.__dict__.update(zip(_NNX_FIELDS, (*aux, values), strict=True))
    return m


_NNX_FIELDS = tuple(f.name for f in dataclasses.fields(NnxModel))


def _nnx_flatten(m: NnxModel, keys: bool) -> tuple[list[Any], tuple[Any, ...]]:
    """Children: the values that are not slots (slots are static, in the aux)."""
    children, slots = [], []
    for i, (name, value) in enumerate(zip(m.names, m.values, strict=True)):
        if isinstance(value, ParamSlot):
            slots.append((i, value))
        else:
            children.append((jax.tree_util.DictKey(name), value) if keys else value)
    return children, (m.aux(), tuple(slots))


def _nnx_unflatten(aux: tuple[Any, ...], children: Any) -> NnxModel:
    static, slots = aux
    values = list(children)
    for i, slot in slots:
        values.insert(i, slot)
    return _nnx_model(static, tuple(values))


jax.tree_util.register_pytree_with_keys(
    NnxModel,
    lambda m: _nnx_flatten(m, keys=True),
    _nnx_unflatten,
    lambda m: _nnx_flatten(m, keys=False),
)


def annotated_specs(rest: Any) -> dict[str, Any]:
    """The ``PartitionSpec`` s a model's own annotations give its params, by name.

    For a Flax NNX model: the trained params with an ``out_sharding``
    annotation (``nnx.with_partitioning``, ``kernel_metadata``), resolved by
    flax's logical axis rules if any were set when the state was built. Empty
    for other families.

    Example:
      >>> import jax
      >>> from pztrain.partition import annotated_specs
      >>> from flax import nnx
      >>> from pztrain.partition import split
      >>> init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
      >>> with jax.set_mesh(jax.make_mesh((1,), ("model",))):
      ...     linear = nnx.Linear(2, 4, kernel_init=init, rngs=nnx.Rngs(0))
      ...
      >>> annotated_specs(split(linear)[1])
      {'kernel': P(None, 'model')}
    """
    return dict(rest.shardings) if isinstance(rest, NnxModel) else {}


def model_state(rest: Any) -> dict[str, Any]:
    """The model's own state in ``model_without_params``, by name.

    For a Flax NNX model: the arrays of its variables that are not
    ``nnx.Param`` s (batch statistics, rng keys and counts, caches, a user's
    variable types), which params checkpoints keep beside the params. Empty for
    other families (penzai v2 state variables are kept by full-state
    checkpoints).

    Example:
      >>> from pztrain.partition import model_state
      >>> from flax import nnx
      >>> from pztrain.partition import split
      >>> _, rest = split(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> model_state(rest)  # doctest: +NORMALIZE_WHITESPACE
      {'mean': Array([0., 0., 0.], dtype=float32),
       'var': Array([1., 1., 1.], dtype=float32)}
    """
    if not isinstance(rest, NnxModel):
        return {}
    return {
        n: v
        for n, p, v in zip(rest.names, rest.params, rest.values, strict=True)
        if not p and is_array_like(v)
    }


def with_model_state(rest: Any, values: Mapping[str, Any]) -> Any:
    """``rest`` with the `model_state` arrays named in ``values`` replaced.

    Example:
      >>> from pztrain.partition import model_state, with_model_state
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from pztrain.partition import split
      >>> _, rest = split(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> model_state(with_model_state(rest, {"mean": jnp.ones(3)}))["mean"]
      Array([1., 1., 1.], dtype=float32)
    """
    if not values:
        return rest
    new = tuple(values.get(n, v) for n, v in zip(rest.names, rest.values, strict=True))
    return dataclasses.replace(rest, values=new)


# ----------------------------------------------------------------------------
# merge


def _is_slot(x: Any) -> bool:
    return isinstance(x, ParamSlot)


def merge(params: Mapping[str, Any] | Any, rest: Any) -> Any:
    """Puts ``params`` back into the slots of ``rest``.

    For penzai v2 the result holds frozen ``pz.ParameterValue`` s, as penzai's own
    trainer passes to a loss function; `to_user_model` turns them back into
    ``pz.Parameter`` variables.

    Args:
      params: The dict from `split` (or, for an `ApplyFnModel`, its params).
      rest: The model without params from `split`.

    Returns:
      The model with every slot filled.

    Raises:
      PartitionError: if a slot's name is missing from ``params``.

    Example:
      >>> import jax.numpy as jnp; from pztrain.partition import merge
      >>> from pztrain.partition import split
      >>> params, rest = split({"w": jnp.ones(2), "n": jnp.arange(3)})
      >>> merge({"w": jnp.zeros(2)}, rest)
      {'n': Array([0, 1, 2], dtype=int32), 'w': Array([0., 0.], dtype=float32)}
    """
    if isinstance(rest, ApplyFnModel):
        return dataclasses.replace(rest, params=params)
    if isinstance(rest, NnxModel):
        return rest.merged(params)
    return jax.tree.map(lambda x: _filled(params, x), rest, is_leaf=_is_slot)


def _filled(params: Mapping[str, Any], x: Any) -> Any:
    """The param of slot ``x`` (``x`` itself if it is not a slot)."""
    if not _is_slot(x):
        return x
    try:
        return params[x.name]
    except KeyError:
        raise PartitionError(
            f"Parameter {x.name!r} is missing from params (it has "
            f"{len(params)} entries). Keep every name that split() made."
        ) from None


def _is_var_value(x: Any) -> bool:
    return isinstance(x, pz_vars.AbstractVariableValue)


def _thaw(tree: Any, is_value: Callable[[Any], bool]) -> Any:
    """Unfreezes matching variable values; one new variable object per label."""
    made: dict[Hashable, Any] = {}

    def thaw(x):
        if not is_value(x):
            return x
        slot = x.get_slot()
        if slot not in made:
            made[slot] = x.unfreeze_as_copy()
        return made[slot]

    return jax.tree.map(thaw, tree, is_leaf=is_value)


def to_user_model(model: Any) -> Any:
    """Turns frozen penzai v2 variable values back into mutable variables.

    Each label becomes one new variable object, so shared parameters stay shared.
    A Flax NNX model (`NnxModel`) becomes its ``nnx.Module``. Models of other
    families are returned unchanged.

    Example:
      >>> import jax
      >>> from pztrain.partition import merge, to_user_model
      >>> from penzai import pz
      >>> from pztrain.partition import split
      >>> linear = pz.nn.Linear.from_config(name="lin", init_base_rng=jax.random.key(0),
      ...                                   input_axes={"i": 2}, output_axes={"o": 3})
      >>> params, rest = split(linear)
      >>> model = merge(params, rest)  # as a loss function gets it
      >>> type(model.weights).__name__, type(to_user_model(model).weights).__name__
      ('ParameterValue', 'Parameter')
    """
    if isinstance(model, NnxModel):
        return model.module()
    return _thaw(model, _is_var_value)


def _is_state_value(x: Any) -> bool:
    return isinstance(x, pz_vars.StateVariableValue)


def has_state_vars(rest: Any) -> bool:
    """Whether ``rest`` holds penzai v2 state variables (their updates persist)."""
    return any(
        _is_state_value(x) for x in jax.tree.leaves(rest, is_leaf=_is_state_value)
    )


def thaw_state_vars(rest: Any) -> Any:
    """Replaces frozen state-variable values by mutable ``pz.StateVariable`` s."""
    return _thaw(rest, _is_state_value)


def freeze_state_vars(rest: Any) -> Any:
    """The inverse of `thaw_state_vars`: freezes the (possibly updated) variables."""
    is_var = lambda x: isinstance(x, pz_vars.StateVariable)  # noqa: E731
    return jax.tree.map(lambda x: x.freeze() if is_var(x) else x, rest, is_leaf=is_var)
