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
        found = Found(self._built[key], static, arrays, data)
        self.last = (rest, optimizer_def, root_rng, found)
        return found

    def rebuild(self, found: Found, arrays: list[Any], optimizer_def, root_rng):
        """The rest built from new arrays (state variables), remembered."""
        rest = found.static.rest.build(arrays)
        self.last = (rest, optimizer_def, root_rng, found._replace(rest=arrays))
        return rest


class Found(NamedTuple):
    """What a call needs besides the state: the program, its static structure,
    the rest's arrays and the key's raw data."""

    program: Any
    static: Static
    rest: list[Any]
    key_data: jax.Array


class TrainPrograms:
    """The programs of a train step for one model structure and optimizer."""

    def __init__(self, step: Any, grads: Callable[[], Any], aux: Any):
        self.step = step  # (Carry, Inputs) -> (Carry, new rest arrays, aux)
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


class KeepShardings:
    """A train step on a mesh whose state keeps the shardings it came with.

    Compiled at the first call, with the ``Carry``'s shardings of that call as
    its output shardings (an uncommitted array, such as fresh metric sums, is
    replicated): params, optimizer state and counters stay where they are, step
    after step, and donation reuses their buffers. The per-call cost is one
    ``is None`` check.
    """

    def __init__(self, fn: Callable[..., Any], mesh: Any, options: dict[str, Any]):
        self._fn, self._mesh, self._options = fn, mesh, options
        self._jitted: Any = None

    def __call__(self, carry: Carry, inputs: Inputs) -> Any:
        jitted = self._jitted
        if jitted is None:
            jitted = self._jitted = self._compile(carry)
        return jitted(carry, inputs)

    def lower(self, carry: Carry, inputs: Inputs) -> jax.stages.Lowered:
        if self._jitted is None:
            self._jitted = self._compile(carry)
        return self._jitted.lower(carry, inputs)

    def _compile(self, carry: Carry) -> Any:
        mesh = self._mesh
        devices = set(mesh.devices.flat)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def sharding_of(path: Any, x: Any) -> Any:
            if not isinstance(x, jax.Array) or not x.committed:
                return replicated
            if x.sharding.device_set != devices:
                where = jax.tree_util.keystr(tuple(path))
                raise ValueError(
                    f"carry{where} of the state is on {sorted(map(str, x.devices()))}"
                    f", not on the step's mesh of {len(devices)} devices. Put the "
                    "state on the mesh first: pztrain.shard_state(state, mesh, "
                    "rules) or pztrain.sharded_initial_state(make_state, mesh, "
                    "rules)."
                )
            return x.sharding

        shardings = jax.tree_util.tree_map_with_path(sharding_of, carry)
        # The metric sums (replicated scalars) come and go between calls (fit's
        # accumulate, then a plain call): ``None`` lets jit place them.
        shardings = shardings._replace(sums=None)
        return jax.jit(self._fn, out_shardings=(shardings, None, None), **self._options)
