"""Populations: many runs of one model trained as one program.

A population of ``K`` members is an ordinary `pztrain.TrainState` whose array
leaves carry a leading member axis ``K``: params, optimizer state (so injected
hyperparameters such as the learning rate are one value per member),
loss-function state, the arrays of ``model_without_params`` and the root key
(one key per member). Its ``step`` stays one scalar: members step together.
An array of ``model_without_params`` that every member shares (``K`` adapter
sets over one frozen base: ``make_population(..., shared="model_without_params")``)
is held once, with a member axis of 1: one copy in memory, read by every member.

Why a `TrainState` and not a type around one: every pytree tool already takes
it (orbax saves it, treescope shows it, ``jax.vmap`` of
`pztrain.TrainState.initial_state` makes its arrays: then set its step, a
vector there, to one scalar with ``state.replace(step=state.step[0])``), the
step, `pztrain.fit`, `pztrain.evaluate` and the checkpoints need no second
code path, and a member is a plain slice. What
makes a state a population is its root key's member axis (`population_size`).

A train step (`pztrain.build_train_step`) called on a population maps the step
over the members inside its one jitted program (``jax.vmap`` inside the jit);
the batch is shared by every member, or one per member with
``build_train_step(..., member_batches=True)``. Metrics come back per member,
and `pztrain.fit` logs each metric's mean, min, max and per-member values
(``"loss"``, ``"loss/min"``, ``"loss/max"``, ``"loss/member_3"``).

Example:
  >>> import jax, jax.numpy as jnp, optax, pztrain
  >>> from pztrain.population import make_population, member, population_size
  >>> def init(seed):
  ...     w = jax.random.normal(jax.random.key(seed), (3,))
  ...     tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  ...     return pztrain.TrainState.initial_state({"w": w}, tx, jax.random.key(seed))
  ...
  >>> pop = make_population(init, seeds=range(4),
  ...                       learning_rate=[0.01, 0.03, 0.1, 0.3])
  >>> population_size(pop), pop.params["w"].shape, pop.step.shape
  (4, (4, 3), ())
  >>> def loss_fn(*, model, state, rng, x):
  ...     loss = jnp.mean((x @ model["w"] - 1.0) ** 2)
  ...     return loss, state, {"loss": loss}
  ...
  >>> train_step = pztrain.build_train_step(loss_fn)
  >>> for _ in range(20):
  ...     pop, aux = train_step(pop, x=jnp.ones((8, 3)))
  ...
  >>> aux["loss"].shape  # one loss per member
  (4,)
  >>> best = member(pop, int(jnp.argmin(aux["loss"])))  # an ordinary TrainState
  >>> best.params["w"].shape, int(best.step)
  ((3,), 20)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pztrain._members import equal_arrays, member_count, same, unlike
from pztrain._tree import is_array
from pztrain.state import TrainState

__all__ = [
    "PopulationError",
    "make_population",
    "member",
    "members",
    "population_size",
    "set_member_hyperparams",
    "shard_members",
    "stack_members",
]

_STEP = jax.tree_util.GetAttrKey("step")
_REST = jax.tree_util.GetAttrKey("model_without_params")
_SHAREABLE = "model_without_params"


class PopulationError(ValueError):
    """Members that cannot form a population, or a member that is not there.

    Example:
      >>> from pztrain import PopulationError, stack_members
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> a = pztrain.TrainState.initial_state({"w": jnp.zeros(2)}, optax.sgd(0.1),
      ...                                      jax.random.key(0))
      >>> b = pztrain.TrainState.initial_state({"w": jnp.zeros(3)}, optax.sgd(0.1),
      ...                                      jax.random.key(1))
      >>> try:
      ...     stack_members([a, b])
      ... except PopulationError as e:
      ...     print(e)  # doctest: +ELLIPSIS
      Member 1 differs from member 0 at .params['w']: float32[3] against float32[2]...
    """


def population_size(state: TrainState) -> int | None:
    """The number of members of ``state``, or ``None`` for a single run.

    Read from the root key: one key per member (a leading axis on a typed key
    array, or on the ``uint32`` rows of legacy keys).

    Example:
      >>> from pztrain import make_population, population_size
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def init(seed):
      ...     return pztrain.TrainState.initial_state(
      ...         {"w": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(seed))
      ...
      >>> population_size(init(0)), population_size(make_population(init, seeds=[1, 2]))
      (None, 2)
    """
    return member_count(state.root_rng)


def stack_members(
    states: Sequence[TrainState], *, shared: str | None = None
) -> TrainState:
    """One population from ``K`` single states: every array stacked on a new
    leading member axis, the step kept (all members must be at the same step).

    With ``shared="model_without_params"``, each array of
    ``model_without_params`` that is the same in every member (the same object,
    or bitwise equal: a frozen base under ``K`` adapter sets) is held once,
    with a member axis of 1 instead of ``K`` copies (one copy in memory and
    in checkpoints); the step reads it once for every member (``jax.vmap``
    with ``in_axes=None``) and `member` gives it to every member.
    Arrays of it that differ are stacked as usual.

    The population runs member 0's optimizer definition (each call of an optax
    constructor makes a new, equal object): what differs between members
    must be injected hyperparameters (``optax.inject_hyperparams``), which live
    in the optimizer state. Optimizers whose states differ are refused.

    Raises:
      PopulationError: for no states, a population among them, members whose
        structure (model, optimizer, fields), leaf shapes or dtypes or step
        differ from member 0's (the message names the member and the leaf), or
        a ``shared`` that is not ``None`` or ``"model_without_params"``.

    Example:
      >>> from pztrain import stack_members
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> states = [pztrain.TrainState.initial_state(
      ...     {"w": jnp.full(2, float(i))}, optax.sgd(0.1), jax.random.key(i))
      ...     for i in range(3)]
      >>> pop = stack_members(states)
      >>> pop.params["w"].tolist(), pop.step.shape
      ([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]], ())
    """
    states = _members_of(states, shared)
    # One optimizer for all: each init call makes its own (equal) transformation.
    optimizer_def = states[0].optimizer_def
    states = [s.replace(optimizer_def=optimizer_def) for s in states]
    problem = unlike(states)
    if problem:
        raise PopulationError(problem)
    share = shared is not None and len(states) > 1
    return jax.tree_util.tree_map_with_path(
        lambda path, *xs: _stack(path, *xs, share=share), *states
    )


def _members_of(states: Sequence[TrainState], shared: str | None) -> list:
    """``states`` as a list, refused if not single runs' states, or if
    ``shared`` names what cannot be shared."""
    states = list(states)
    if shared not in (None, _SHAREABLE):
        raise PopulationError(
            f"stack_members(shared={shared!r}): only {_SHAREABLE!r} can be "
            "shared (the arrays of the model that no step changes); give "
            f"shared={_SHAREABLE!r} or None."
        )
    if not states:
        raise PopulationError("stack_members needs at least one state; got none.")
    for i, state in enumerate(states):
        if not isinstance(state, TrainState):
            raise PopulationError(
                f"Member {i} is a {type(state).__name__}, not a TrainState."
            )
        if population_size(state) is not None:
            raise PopulationError(
                f"Member {i} is already a population of {population_size(state)}; "
                "take it apart with members(state) first."
            )
        state.check_not_donated("stack_members")
    return states


def _stack(path: Any, *xs: Any, share: bool = False) -> Any:
    """One leaf of the population: the arrays stacked; the step, and a leaf
    that is not an array (a function, a name: the model's structure, static
    in the step as for one run) kept when equal in every member; numbers that
    differ stacked, one per member; with ``share``, an array of the model
    without params equal in every member held once (member axis 1)."""
    if path[0] == _STEP or (not is_array(xs[0]) and same(xs)):
        return xs[0]
    if share and path[0] == _REST and equal_arrays(xs):
        return jnp.expand_dims(xs[0], 0)
    return jnp.stack(xs)


def member(state: TrainState, i: int) -> TrainState:
    """Member ``i`` of a population: an ordinary `TrainState` (every array's
    slice ``i``, the step shared) that every other API takes (`pztrain.fit`,
    `pztrain.evaluate`, `pztrain.save_params`, ``state.summary()``, …).

    Raises:
      PopulationError: if ``state`` is not a population or ``i`` is not one of
        its members.

    Example:
      >>> from pztrain import make_population, member
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def init(seed):
      ...     return pztrain.TrainState.initial_state(
      ...         {"w": jnp.full(2, float(seed))}, optax.sgd(0.1), jax.random.key(seed))
      ...
      >>> pop = make_population(init, seeds=[5, 6, 7])
      >>> one = member(pop, 1)
      >>> one.params["w"].tolist(), pztrain.population_size(one)
      ([6.0, 6.0], None)
    """
    size = _size_of(state, "member(state, i)")
    integer = isinstance(i, int | np.integer) and not isinstance(i, bool)
    if not integer or not -size <= i < size:
        raise PopulationError(
            f"member(state, {i!r}): the population has {size} members "
            f"(0 to {size - 1})."
        )
    state.check_not_donated("member(state, i)")
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _row(x, i) if path[0] != _STEP and is_array(x) else x,
        state,
    )


def _row(x: Any, i: int) -> Any:
    """Member ``i``'s slice of ``x``; the one row of an array shared by every
    member (a member axis of 1, see `stack_members`)."""
    return x[0] if np.shape(x)[0] == 1 else x[i]


def members(state: TrainState) -> list[TrainState]:
    """Every member of a population, in order (see `member`).

    Example:
      >>> from pztrain import make_population, members
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def init(seed):
      ...     return pztrain.TrainState.initial_state(
      ...         {"w": jnp.full(2, float(seed))}, optax.sgd(0.1), jax.random.key(seed))
      ...
      >>> pop = make_population(init, seeds=[3, 4])
      >>> [float(m.params["w"][0]) for m in members(pop)]
      [3.0, 4.0]
    """
    return [member(state, i) for i in range(_size_of(state, "members(state)"))]


def _size_of(state: TrainState, where: str) -> int:
    size = population_size(state)
    if size is None:
        raise PopulationError(
            f"{where} takes a population (a TrainState with one root key per "
            "member, e.g. from make_population); got a single run's state."
        )
    return size


def make_population(
    init: Callable[[int], TrainState],
    *,
    seeds: Iterable[int],
    shared: str | None = None,
    **hyperparams: Any,
) -> TrainState:
    """A population: member ``i`` is ``init(seeds[i])``, with per-member values
    of injected hyperparameters (``learning_rate=[...]``, one per member).

    ``init`` builds one run's state from a seed (its model, optimizer and root
    key), as for a single run: every family of model works. Hyperparameters set
    here must be injected by the optimizer (``optax.inject_hyperparams``);
    anything else that differs between members (dropout rate, weight decay,
    EMA decay) can be too, or can live in the loss-function state.

    Args:
      init: ``seed -> TrainState``.
      seeds: One seed (a Python int) per member.
      shared: ``"model_without_params"`` to hold each of its arrays that is
        the same in every member once (e.g. ``K`` adapter sets over one frozen
        base: one copy of the base), as `stack_members` does; ``None`` (the
        default) stacks every array.
      **hyperparams: Name → one value per member (a list or a 1-D array).

    Returns:
      A `TrainState` with a leading member axis (see the module's docstring).

    Raises:
      PopulationError: for members that differ in structure or shape, and for
        a hyperparameter with the wrong number of values.
      ValueError: for a hyperparameter the optimizer does not inject.

    Example:
      >>> from pztrain import make_population
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def init(seed):
      ...     tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
      ...     w = jax.random.normal(jax.random.key(seed), (4,))
      ...     key = jax.random.key(seed)
      ...     return pztrain.TrainState.initial_state({"w": w}, tx, key)
      ...
      >>> pop = make_population(init, seeds=range(3), learning_rate=[0.5, 0.25, 0.125])
      >>> pop.hyperparams["learning_rate"].tolist()
      [0.5, 0.25, 0.125]
    """
    seeds = [int(s) for s in seeds]
    for name, values in hyperparams.items():
        if np.ndim(values) != 1 or len(values) != len(seeds):
            raise PopulationError(
                f"Hyperparameter {name!r} needs one value per member ({len(seeds)} "
                f"seeds); got {np.shape(values)} values."
            )
    population = stack_members([init(seed) for seed in seeds], shared=shared)
    if not hyperparams:
        return population
    return set_member_hyperparams(population, **hyperparams)


def set_member_hyperparams(state: TrainState, **values: Any) -> TrainState:
    """A population with injected hyperparameters set, one value per member
    (as `pztrain.TrainState.with_hyperparams` does for one run: the new state
    owns its arrays).

    Example:
      >>> from pztrain import make_population
      >>> from pztrain.population import set_member_hyperparams
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def init(seed):
      ...     tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      ...     return pztrain.TrainState.initial_state(
      ...         {"w": jnp.zeros(2)}, tx, jax.random.key(seed))
      ...
      >>> pop = make_population(init, seeds=range(2))
      >>> pop = set_member_hyperparams(pop, learning_rate=[0.5, 0.25])
      >>> pop.hyperparams["learning_rate"].tolist()
      [0.5, 0.25]
    """
    size = _size_of(state, "set_member_hyperparams(state, ...)")
    stored = state.hyperparams
    arrays = {}
    for name, value in values.items():
        array = np.asarray(value)
        if array.shape != (size,):
            raise PopulationError(
                f"Hyperparameter {name!r} needs one value per member, shape "
                f"({size},); got shape {array.shape}."
            )
        # an unknown name is refused by with_hyperparams, naming the known ones
        arrays[name] = (
            jnp.asarray(array, stored[name].dtype) if name in stored else array
        )
    return state.with_hyperparams(**arrays)


def shard_members(state: TrainState, mesh: Mesh, axis: str = "members") -> TrainState:
    """The population placed on ``mesh`` with its members split over ``axis``
    (every array's leading axis; the step replicated): a train step built
    without ``mesh=`` then runs each device's members where they are.

    The arrays are placed on the mesh's devices with Auto axes, whatever the
    mesh's axis types: members need no layout in their types, and the program
    (fit, micro-batches, per-member batches given as NumPy arrays) follows the
    placement as a sharded program does without a mesh context.

    Raises:
      PopulationError: if ``state`` is not a population, or its size is not a
        multiple of the axis's size.

    Example:
      >>> from pztrain import make_population
      >>> from pztrain.population import shard_members
      >>> import jax, jax.numpy as jnp, optax, pztrain
      >>> def init(seed):
      ...     return pztrain.TrainState.initial_state(
      ...         {"w": jnp.zeros(2)}, optax.sgd(0.1), jax.random.key(seed))
      ...
      >>> mesh = jax.make_mesh((1,), ("members",))
      >>> pop = shard_members(make_population(init, seeds=range(2)), mesh)
      >>> pop.params["w"].sharding.spec == jax.P("members")
      True
    """
    size = _size_of(state, "shard_members(state, mesh)")
    devices = mesh.shape[axis]
    if size % devices:
        raise PopulationError(
            f"shard_members: {size} members do not split evenly over mesh axis "
            f"{axis!r} of {devices} devices."
        )
    auto = Mesh(
        mesh.devices,
        mesh.axis_names,
        axis_types=(AxisType.Auto,) * len(mesh.axis_names),
    )
    split = NamedSharding(auto, PartitionSpec(axis))
    whole = NamedSharding(auto, PartitionSpec())

    def place(path, x):
        if not is_array(x):  # the model's structure (a function, a name)
            return x
        if path[0] == _STEP or np.ndim(x) == 0 or (size > 1 and x.shape[0] == 1):
            return jax.device_put(x, whole)  # shared by every member: replicated
        return jax.device_put(x, split)

    return jax.tree_util.tree_map_with_path(place, state)
