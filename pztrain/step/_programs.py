"""A step's compiled programs: built per (model structure, optimizer), looked
up by identity on every call; a train step's (`train_programs`): one step or a
fused scan, plain ``jax.jit`` or `OnMesh`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from pztrain._members import member_count
from pztrain.partition import split_rest
from pztrain.state import TrainState
from pztrain.step import _fns
from pztrain.step._members import PinnedMembers, over_members
from pztrain.step._mesh import Layout, MeshLayout
from pztrain.step._on_mesh import OnMesh
from pztrain.step._types import Carry, Inputs, Static, key_data

__all__ = [
    "FLAT_NAMES",
    "Found",
    "Programs",
    "TrainPrograms",
    "args_of",
    "flat_args",
    "jit_options",
    "train_programs",
]

# The arguments of a train step's program (`pztrain.step._fns.flat`), as an
# error names them.
FLAT_NAMES = ("state", "state.root_rng", "state.model_without_params", "batch")


class Programs:
    """A step's compiled functions, one per (model structure, optimizer).

    The structure is the `Static` of a state: its rest's `RestSpec` and its root
    key's implementation. The last lookup is remembered by identity: a run
    passes the same ``model_without_params``, optimizer and key objects call
    after call, so the per-call cost is three ``is`` checks.
    """

    def __init__(self, build: Callable[[Static, Any], Any]):
        self._build = build
        self._built: dict[tuple[Static, Any], Any] = {}
        # The objects of the last lookup, and what it found.
        self.last: tuple[Any, Any, Any, Found | None] = (None, None, None, None)

    def lookup(self, rest: Any, optimizer_def: Any, root_rng: Any) -> Found:
        """The program for a state's rest, optimizer and key, and its inputs."""
        last = self.last
        if last[0] is rest and last[1] is optimizer_def and last[2] is root_rng:
            return last[3]
        spec, arrays = split_rest(rest)
        data, impl = key_data(root_rng)
        static = Static(spec, impl, member_count(root_rng), _spread(root_rng))
        key = (static, optimizer_def)
        if key not in self._built:
            self._built[key] = self._build(static, optimizer_def)
        program = self._built[key]
        found = Found(getattr(program, "step", None), static, arrays, data, program)
        self.last = (rest, optimizer_def, root_rng, found)
        return found

    def rebuild(self, found: Found, arrays: list[Any], optimizer_def, root_rng):
        """The rest built from new arrays (state variables), remembered."""
        rest = found.static.rest.build(arrays)
        self.last = (rest, optimizer_def, root_rng, found._replace(rest=arrays))
        return rest


class Found(NamedTuple):
    """What a call needs besides the state: the step program (a train step's,
    first: the hot path unpacks the tuple), the rest's arrays, the key's raw
    data, the programs and their static structure."""

    step: Any
    static: Static
    rest: list[Any]
    key_data: jax.Array
    program: Any


class TrainPrograms:
    """The programs of a train step for one model structure and optimizer."""

    def __init__(self, step: Any, grads: Callable[[], Any], aux: Any):
        self.step = step  # flat arguments -> flat outputs: see _fns.flat
        self._make_grads = grads
        self._grads = None
        self.aux = aux  # forward-only aux, for metric names
        self.metric_names: dict[Any, tuple[tuple[str, ...], dict]] = {}
        self.costs: dict[Any, Any] = {}  # StepCost by batch shapes

    @property
    def grads(self) -> Any:
        if self._grads is None:
            self._grads = self._make_grads()
        return self._grads

    def aux_shape(self, *args: Any) -> Any:
        """The shapes of the loss function's aux for these arguments."""
        if isinstance(self.aux, OnMesh):
            return self.aux.eval_shape(*args)
        return jax.eval_shape(self.aux, *args)


def args_of(state: TrainState, found: Found, batch: Any, opt_state: bool = True):
    """The ``(Carry, Inputs)`` of ``state`` (optimizer state left out if not
    needed, so that it is not passed in)."""
    carry = Carry(
        state.step,
        state.params,
        state.opt_state if opt_state else None,
        state.loss_fn_state,
    )
    return carry, Inputs(found.key_data, found.rest, batch)


def flat_args(state: TrainState, found: Found, batch: Any) -> tuple[Any, ...]:
    """The arguments of a train step's program (see `pztrain.step._fns.flat`)."""
    carry, inputs = args_of(state, found, batch)
    return (carry, *inputs)


def train_programs(
    loss_fn: Any,
    static: Static,
    optimizer_def: Any,
    *,
    steps_per_call: int,
    microbatches: int,
    mode: str | None,
    layout: Layout,
    grad_norms: str | None,
    jit: bool,
    options: dict[str, Any],
    member_batches: bool = False,
) -> TrainPrograms:
    """A train step's programs for one model structure and optimizer: the step
    (on flat arguments), the grads (built on first use) and the forward-only aux,
    jitted with ``options`` (`jit_options`) unless ``jit`` is false, each on the
    mesh with a `MeshLayout`."""
    k, m, norms = steps_per_call, microbatches, grad_norms
    train = _fns.train_fn(loss_fn, static, optimizer_def, k, m, mode, layout, norms)
    grads = _fns.grads_fn(loss_fn, static, m, mode, layout)
    aux = _fns.aux_fn(loss_fn, static, m, mode, layout, norms)
    if static.members is not None and isinstance(layout, MeshLayout):
        raise ValueError(
            f"A population ({static.members} members) on a step built with mesh=: "
            "split the members over a mesh axis with "
            "pztrain.population.shard_members(state, mesh) and build the step "
            "without mesh=; the program follows the members' placement."
        )
    if static.members is not None:  # a population: one program for all
        train = over_members(
            train, static.members, member_batches, train=True, spread=static.spread
        )
        grads = over_members(grads, static.members, member_batches)
        aux = over_members(aux, static.members, member_batches)
    step = _fns.flat(train)
    if not jit:
        return TrainPrograms(step, lambda: grads, aux)
    if isinstance(layout, MeshLayout):
        return TrainPrograms(
            OnMesh(step, layout, options, FLAT_NAMES, keep=_carry_outputs),
            lambda: OnMesh(grads, layout, {}, ("state", "inputs")),
            OnMesh(aux, layout, {}, ("state", "inputs")),
        )
    if static.members is not None and "out_shardings" not in options:
        step = PinnedMembers(step, options)  # outputs split as the members are
        return TrainPrograms(step, lambda: jax.jit(grads), aux)
    return TrainPrograms(jax.jit(step, **options), lambda: jax.jit(grads), aux)


def _spread(root_rng: Any) -> bool:
    """Whether a state's arrays (its root key's) lie on several devices."""
    sharding = getattr(root_rng, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def jit_options(
    donate: bool, state_shardings: Any, batch_shardings: Any
) -> dict[str, Any]:
    """``jax.jit`` options of a train step's program: donation of its `Carry`
    (step, params, optimizer and loss-function states, sums), and the
    shardings given at build."""
    options: dict[str, Any] = {}
    if donate:
        options["donate_argnums"] = (0,)
    if state_shardings is None and batch_shardings is None:
        return options
    sh = state_shardings
    carry = Carry(
        None,
        *(getattr(sh, name, None) for name in ("params", "opt_state", "loss_fn_state")),
    )
    options["in_shardings"] = (carry, None, None, batch_shardings)
    options["out_shardings"] = (carry, None, None)
    return options


def _carry_outputs(args: tuple[Any, ...], sharding_of: Callable[[Any], Any]):
    """A train step's ``out_shardings`` on a mesh: its carry's arrays stay
    where its first call's were (the metric sums, state variables and aux come
    and go between calls, fit's accumulate then a plain call: jit places them)."""
    carry = args[0]
    kept = Carry(
        *(
            jax.tree.map(sharding_of, x)
            for x in (carry.step, carry.params, carry.opt_state, carry.loss_fn_state)
        )
    )
    return (kept, None, None)
