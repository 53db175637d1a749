"""A population's programs: a step's pure function mapped over the members.

One ``jax.vmap`` inside the jit: the params, optimizer and loss-function states,
metric sums, root keys and the rest's arrays carry the member axis; the step
counter is shared (members step together), and the batch is shared by every
member or, with ``member_batches``, one per member (a leading axis ``K``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pztrain._tree import named_leaves
from pztrain.data._batch import BatchError
from pztrain.metrics import MetricSums
from pztrain.step._types import Carry, Inputs

__all__ = [
    "PinnedMembers",
    "check_counter",
    "counted_after",
    "one_member",
    "over_members",
    "placed_as_members",
]

_CARRY_AXES = Carry(None, 0, 0, 0, 0)  # the step counter is shared


def over_members(
    run: Callable[[Carry, Inputs], Any],
    members: int,
    member_batches: bool,
    train: bool = False,
    spread: bool = False,
) -> Callable[[Carry, Inputs], Any]:
    """``run`` (``(carry, inputs) -> out``) for ``members`` members at once.

    A train function's outputs (``(carry, new_rest, aux)``) keep the shared
    step counter, counted after the members' update unless they are
    ``spread`` over devices (`counted_after`); any other function's outputs
    all get the member axis.
    """
    batch_axis = 0 if member_batches else None
    out_axes = (_CARRY_AXES, 0, 0) if train else 0

    def population_run(carry: Carry, inputs: Inputs) -> Any:
        if member_batches:
            check_member_batch(inputs.batch, members)
        # An array of the rest with a member axis of 1 is shared by every
        # member (`pztrain.population.stack_members`): read once, not mapped.
        shared = [members > 1 and np.shape(x)[:1] == (1,) for x in inputs.rest]
        rest = [x[0] if s else x for x, s in zip(inputs.rest, shared, strict=True)]
        rest_axes = [None if s else 0 for s in shared]
        in_axes = (_CARRY_AXES, Inputs(0, rest_axes, batch_axis))
        mapped = jax.vmap(run, in_axes=in_axes, out_axes=out_axes)
        out = mapped(carry, inputs._replace(rest=rest))
        if not train or spread:
            return out
        return (counted_after(out[0]), *out[1:])

    return population_run


def counted_after(carry: Carry) -> Carry:
    """``carry`` whose step counter is computed after its params' update.

    XLA:CPU runs a program's thunks as a graph and, whenever more than 8 are
    ready at once, hands half of them to another thread (a wake-up that costs
    more than a small program's work). A population's step has, besides the
    user's loss, a ready thunk per parameter copy and optimizer count; the
    shared counter's ``step + 1`` made one too many with a loss in the aux
    (W0, K=16: 10 ready at the start against 9 for a hand-written
    ``jit(vmap(step))``; the call took 1.45x its time, in worker threads).
    Adding a zero read from the first updated param (``min(isnan(x), 0)``,
    which XLA cannot fold) makes the increment wait for the update. Not
    done when the members are spread over devices: that read would cross
    them.
    """
    leaves = jax.tree.leaves(carry.params)
    if not leaves or not jnp.issubdtype(leaves[0].dtype, jnp.inexact):
        return carry
    late = jnp.isnan(leaves[0].ravel()[0]).astype(carry.step.dtype)
    return dataclasses.replace(carry, step=carry.step + jnp.minimum(late, 0))


def check_member_batch(batch: Any, members: int) -> None:
    """Refuses a per-member batch whose leaves' leading axis is not ``members``
    (checked while tracing: no cost per call)."""
    if not isinstance(batch, Mapping):
        raise BatchError(
            "member_batches=True takes one batch per member as a dict of arrays "
            f"with a leading member axis; got {type(batch).__name__}. Give a "
            "dict, or build the step without member_batches to share the batch."
        )
    for name, leaf in named_leaves(batch):
        shape = np.shape(leaf)
        if not shape or shape[0] != members:
            raise BatchError(
                f"With member_batches=True every batch leaf has a leading member "
                f"axis of {members} (the population's size); got {name!r} of "
                f"shape {tuple(shape)}. Stack one batch per member on axis 0, or "
                "build the step without member_batches to share one batch."
            )


def check_counter(members: int | None, step: Any) -> None:
    """Refuses a population whose step counter is not one scalar (e.g. made by
    ``jax.vmap`` of ``TrainState.initial_state``: one counter per member)."""
    if members is not None and np.ndim(step) != 0:
        raise ValueError(
            f"A population's step is one scalar (its {members} members step "
            f"together); got a step counter of shape {np.shape(step)}, as "
            "jax.vmap of TrainState.initial_state makes. Set it with "
            "state.replace(step=state.step[0]), or build the population with "
            "pztrain.make_population or pztrain.stack_members."
        )


def placed_as_members(sums: MetricSums, root_rng: Any) -> MetricSums:
    """Sums placed as the state whose root key is ``root_rng`` is, so that
    every call of the step sees its inputs placed alike (a new placement is a
    new compilation): a population's rows split over the devices as its
    members are (`pztrain.population.shard_members`); on the state's device
    if the state is committed to one (restored, or put there); else as made."""
    sharding = getattr(root_rng, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.spec:
        rows = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0]))
    elif getattr(root_rng, "committed", False) and sharding.is_fully_addressable:
        rows = sharding  # (across processes, the step places them itself)
    else:
        return sums
    states = jax.device_put(sums.states, rows)  # metric states: a row per member
    return MetricSums(sums.names, jax.device_put(sums.packed, rows), states)


def one_member(shapes: Any, members: int | None) -> Any:
    """A population's shapes (``jax.ShapeDtypeStruct`` s) without the member
    axis: one member's (as they are for one run)."""
    if members is None:
        return shapes
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), shapes)


class PinnedMembers:
    """A population's jitted train program whose outputs stay split over the
    devices as its inputs' members are (`pztrain.population.shard_members`).

    Left to itself, jit may place an output that it computes anew (a dropout
    stream's counter of an NNX model) on one device while the other member
    arrays stay split: the next program that maps over the members (an
    evaluation) then finds its inputs split unlike each other. Here each
    output of the carry and of the model's state variables is constrained to
    its input's `NamedSharding`; one program per placement of the members
    (the root key's), found by one dict lookup a call.
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        self._fn, self._options = fn, options
        self._plain = jax.jit(fn, **options)  # inside a trace: no placement
        self._jitted: dict[Any, Any] = {}

    def __call__(self, carry: Carry, key_data: Any, rest: Any, batch: Any) -> Any:
        jitted = self._jitted.get(getattr(key_data, "sharding", None))
        if jitted is None:
            jitted = self._for((carry, key_data, rest, batch))
        return jitted(carry, key_data, rest, batch)

    def lower(self, *args: Any) -> Any:
        return self._for(args).lower(*args)

    def _for(self, args: tuple[Any, ...]) -> Any:
        """The program for the placement of ``args`` (made at its first call)."""
        if isinstance(args[1], jax.core.Tracer):
            return self._plain
        key = args[1].sharding
        if key not in self._jitted:
            carry, rest = args[0], args[2]
            pins = (_shardings(carry), _shardings(rest))
            self._jitted[key] = jax.jit(_pinned(self._fn, *pins), **self._options)
        return self._jitted[key]


def _shardings(tree: Any) -> list[Any]:
    """Each leaf's ``(NamedSharding, shape)`` (``None`` for any other placement)."""
    named = [(getattr(x, "sharding", None), np.shape(x)) for x in jax.tree.leaves(tree)]
    return [pin if isinstance(pin[0], NamedSharding) else None for pin in named]


def _pinned(fn: Callable[..., Any], carry_pins: list, rest_pins: list):
    """``fn`` whose new carry and state variables are constrained to ``pins``."""

    def pin(tree: Any, pins: list) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        if len(leaves) != len(pins):  # another structure (sums made in the call)
            return tree
        kept = [
            x
            if p is None or x.shape != p[1]
            else jax.lax.with_sharding_constraint(x, p[0])
            for x, p in zip(leaves, pins, strict=True)
        ]
        return jax.tree.unflatten(treedef, kept)

    def pinned_run(carry: Carry, key_data: Any, rest: Any, batch: Any) -> Any:
        new_carry, new_rest, aux = fn(carry, key_data, rest, batch)
        new_rest = None if new_rest is None else pin(new_rest, rest_pins)
        return pin(new_carry, carry_pins), new_rest, aux

    return pinned_run
