"""A step's compiled programs: built per (model structure, optimizer), looked
up by identity on every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from pztrain.partition import split_rest
from pztrain.state import TrainState
from pztrain.step._fns import Carry, Inputs, Static, key_data

__all__ = ["Found", "KeepShardings", "Programs", "TrainPrograms", "args_of"]


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
        static = Static(spec, impl)
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
        self.metric_names: dict[Any, tuple[str, ...]] = {}

    @property
    def grads(self) -> Any:
        if self._grads is None:
            self._grads = self._make_grads()
        return self._grads


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
    """The flat arguments of a train step's program (see `pztrain.step._fns.flat`)."""
    carry, inputs = args_of(state, found, batch)
    return (*carry, *inputs)


class KeepShardings:
    """A train step on a mesh whose state keeps the shardings it came with.

    Compiled at the first call, with the shardings of that call's step, params,
    optimizer and loss-function states as its output shardings (an uncommitted
    array is replicated): they stay where they are, step after step, and
    donation reuses their buffers. The per-call cost is one ``is None`` check.
    """

    def __init__(self, fn: Callable[..., Any], mesh: Any, options: dict[str, Any]):
        self._fn, self._mesh, self._options = fn, mesh, options
        self._jitted: Any = None

    def __call__(self, *args: Any) -> Any:
        jitted = self._jitted
        if jitted is None:
            jitted = self._jitted = self._compile(args)
        return jitted(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        if self._jitted is None:
            self._jitted = self._compile(args)
        return self._jitted.lower(*args)

    def _compile(self, args: tuple[Any, ...]) -> Any:
        mesh = self._mesh
        devices = set(mesh.devices.flat)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def sharding_of(path: Any, x: Any) -> Any:
            if not isinstance(x, jax.Array) or not x.committed:
                return replicated
            if x.sharding.device_set != devices:
                where = jax.tree_util.keystr(tuple(path))
                raise ValueError(
                    f"state{where} is on {sorted(map(str, x.devices()))}, not on "
                    f"the step's mesh of {len(devices)} devices. Put the state on "
                    "the mesh first: pztrain.shard_state(state, mesh, rules) or "
                    "pztrain.sharded_initial_state(make_state, mesh, rules)."
                )
            return x.sharding

        names = ("step", "params", "opt_state", "loss_fn_state")
        fields = jax.tree_util.tree_map_with_path(
            sharding_of, dict(zip(names, args[:4], strict=True))
        )
        kept = tuple(fields[name] for name in names)
        # The metric sums (replicated scalars) come and go between calls (fit's
        # accumulate, then a plain call): ``None`` lets jit place them.
        out = (*kept, None, None, None)
        return jax.jit(self._fn, out_shardings=out, **self._options)
