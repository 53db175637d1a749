"""`OnMesh`: a step's program on a mesh, compiled at its first call for that
call's layouts, and the check that every array it takes is on the step's mesh."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pztrain.sharding import ShardingError
from pztrain.step._mesh import MeshLayout, spec_of
from pztrain.step._types import Carry

__all__ = ["OnMesh", "describe_mesh", "same_mesh"]


class OnMesh:
    """A program on a mesh, compiled at its first call for that call's layouts.

    The body runs in explicit mode (`pztrain.step._mesh.MeshLayout.entered`),
    each argument in the layout it arrives in (an uncommitted array, such as
    fresh metric sums, replicated). With ``keep``, outputs keep the shardings
    their arguments arrived in (a train step's step, params, optimizer and
    loss-function states): they stay where they are, step after step, and
    donation reuses their buffers. The per-call cost is one ``is None`` check.

    Args:
      fn: The program's function, on positional arguments.
      layout: The step's `pztrain.step._mesh.MeshLayout`.
      options: For ``jax.jit`` (donation).
      names: The arguments' names, for errors (``"state.params"``: an array
        of it is named ``state.params['w1']``).
      keep: ``(args, sharding_of) -> out_shardings``: the outputs' shardings
        from the first call's arguments (``sharding_of`` maps an array to
        its sharding), or ``None``: jit places the outputs.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        layout: MeshLayout,
        options: dict[str, Any],
        names: tuple[str, ...],
        keep: Callable[[tuple[Any, ...], Callable], Any] | None = None,
    ):
        self._fn, self._layout, self._options = fn, layout, options
        self._names, self._keep = names, keep
        self._jitted: Any = None
        self._others: dict[Any, Any] = {}  # programs for other layouts

    def __call__(self, *args: Any) -> Any:
        jitted = self._jitted
        if jitted is None:
            jitted = self._jitted = self._compile(args)
        try:  # free unless it raises (Python 3.11's exception tables)
            return jitted(*args)
        except ValueError as err:  # JAX's, for a state moved since the first call?
            self._refuse_misplaced(args, err)
            if self._keep is not None:  # a train step: its first call's layouts stay
                raise
            return self._own_layout(args)(*args)  # e.g. an evaluation's last rows

    def _own_layout(self, args: tuple[Any, ...]) -> Any:
        """A program for these arguments' own layouts, when the first call's
        do not fit them (an eval step given an evaluation's few last rows
        replicated, `pztrain.data.eval_batches`: no data split divides them);
        one per layout."""
        leaves, tree = jax.tree.flatten(tuple(map(_specs, args)))
        key = (tuple(leaves), tree)
        found = self._others.get(key)
        if found is None:
            found = self._others[key] = self._compile(args)
        return found

    def lower(self, *args: Any) -> jax.stages.Lowered:
        if self._jitted is None:
            self._jitted = self._compile(args)
        return self._jitted.lower(*args)

    def eval_shape(self, *args: Any) -> Any:
        """``jax.eval_shape`` of the program for these arguments (nothing runs)."""
        specs = tuple(map(_specs, args))
        return jax.eval_shape(self._layout.entered(self._fn, specs), *args)

    def _compile(self, args: tuple[Any, ...]) -> Any:
        self._check_all_placed(args)
        specs = tuple(map(_specs, args))
        options = dict(self._options)
        if self._keep is not None:
            options["out_shardings"] = self._keep(args, self._sharding_of)
        return jax.jit(self._layout.entered(self._fn, specs), **options)

    def _sharding_of(self, x: Any) -> Any:
        if isinstance(x, jax.Array) and x.committed:
            return x.sharding
        return jax.sharding.NamedSharding(
            self._layout.mesh, jax.sharding.PartitionSpec()
        )

    def _check_all_placed(self, args: tuple[Any, ...]) -> None:
        """Refuses any argument's array that is not on the step's mesh (at the
        first call, and after a call failed: never on the hot path)."""
        for name, arg in zip(self._names, args, strict=True):
            check = functools.partial(self._check_placed, name)
            jax.tree_util.tree_map_with_path(check, arg)

    def _refuse_misplaced(self, args: tuple[Any, ...], err: ValueError) -> None:
        """After JAX refused a call: says so if an array is off the mesh."""
        try:
            self._check_all_placed(args)
        except ShardingError as named:
            raise named from err

    def _check_placed(self, name: str, path: Any, x: Any) -> None:
        """Refuses an array committed to other devices than the mesh's, or to
        another mesh over them (another shape, axis names or device order).

        Raises:
          ShardingError: naming the array, its mesh and the fix.
        """
        if not (isinstance(x, jax.Array) and x.committed):
            return
        mesh, sharding = self._layout.mesh, x.sharding
        if isinstance(sharding, NamedSharding):
            if same_mesh(sharding.mesh, mesh):
                return
            there = f"a mesh {describe_mesh(sharding.mesh)}"
        elif sharding.device_set == set(mesh.devices.flat):
            return
        else:
            there = f"devices {sorted(d.id for d in sharding.device_set)}"
        where = name + jax.tree_util.keystr(tuple(path))
        raise ShardingError(
            f"{where} is on {there}, not on the step's mesh "
            f"{describe_mesh(mesh)}. Put the state on the "
            "step's mesh first: pztrain.shard_state(state, train_step.mesh, "
            "rules), or pztrain.sharded_initial_state(make_state, "
            "train_step.mesh, rules)."
        )


def same_mesh(a: Any, b: Mesh) -> bool:
    """Whether ``a`` is ``b`` for a step: the same devices in the same
    arrangement under the same axis names (the axis types may differ: the
    step's body makes every axis Explicit)."""
    if a is b:
        return True
    return (
        isinstance(a, Mesh)
        and a.axis_names == b.axis_names
        and a.devices.shape == b.devices.shape
        and bool(np.all(a.device_ids == b.device_ids))
    )


def describe_mesh(mesh: Any) -> str:
    """``{'data': 4, 'model': 2} over device ids [0, 1, …]``, for errors."""
    ids = [int(i) for i in np.ravel(mesh.device_ids)]
    shown = ", ".join(map(str, ids[:8])) + (", …" if len(ids) > 8 else "")
    return f"{dict(mesh.shape)} over device ids [{shown}]"


def _specs(arg: Any) -> Any:
    """The specs of one argument's arrays, or one replicated spec for all of
    them (which then also fits the argument given another structure, as the
    metric sums are: ``None`` in a plain call); a train step's `Carry` field by
    field."""
    if isinstance(arg, Carry):
        fields = (arg.step, arg.params, arg.opt_state, arg.loss_fn_state, arg.sums)
        return Carry(*map(_specs, fields))
    specs = jax.tree.map(spec_of, arg)
    if all(s == PartitionSpec() for s in jax.tree.leaves(specs)):
        return PartitionSpec()
    return specs
