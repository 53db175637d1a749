"""A step on a mesh: storage and compute layouts, in explicit mode.

Params live in their **storage** layout (what `pztrain.ShardingRules` gave them:
FSDP axes split). Inside a step on a mesh, whatever the mesh's axis types (Auto,
Explicit or mixed), the program runs with every mesh axis Explicit, so that the
layouts are part of the types and pztrain, not the compiler, decides them
(`MeshLayout.entered`):

* each param is resharded to its **compute** layout (`compute_spec`): its data
  (FSDP) axes gathered, its other (tensor-parallel) axes kept;
* batch leaves are split along the data axes in their types;
* the user's function (loss, eval) runs in auto mode
  (``jax.sharding.auto_axes``), as on an Auto mesh: it needs not know the mesh.
  Its outputs (loss, new state, aux) come back replicated;
* the grads go back to the storage layout (`MeshLayout.store`) before the
  optimizer: under FSDP each device keeps its slice of the reduced gradient.

With micro-batches (`MeshLayout.per_device`), each device accumulates the grads
of its share of every micro-batch over the data axes (``jax.shard_map``), and
the mean over devices is taken once per step: one gradient reduction, where a
step whose loss sees the whole batch would reduce once per micro-batch.

Without a mesh every method of `NO_MESH` is the identity.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pztrain.metric_states import is_metric_state, merge_stacked
from pztrain.sharding import ShardingError

__all__ = ["NO_MESH", "Layout", "MeshLayout", "compute_spec", "mesh_of"]


def compute_spec(spec: PartitionSpec, data_axes: tuple[str, ...]) -> PartitionSpec:
    """The compute layout of an array stored as ``spec``: the data axes taken out
    of every dimension (gathered), the others kept.

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> compute_spec(P("data", "model"), ("data",))
      P(None, 'model')
    """
    dims = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        kept = tuple(a for a in names if a not in data_axes)
        dims.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*dims)


class Layout:
    """No mesh: params, grads and the user's function as they are."""

    @property
    def data_shards(self) -> int:
        """The devices a batch's examples are split over."""
        return 1

    def compute(self, params: Any) -> Any:
        """``params`` in their compute layout."""
        return params

    def store(self, grads: Any, like: Any) -> Any:
        """``grads`` (in the compute layout) in the storage layout of ``like``."""
        del like
        return grads

    def user(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as the step runs the user's function."""
        return fn

    def per_device(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(layout, params, loss_fn_state, rest, rng, batch) -> (loss,
        loss_fn_state, aux, new_rest, grads)``, run on each device's share of
        the batch and combined once (here: run once, with this layout)."""
        return functools.partial(fn, self)

    def zeros(self, like: Any) -> Any:
        """Zeros to add gradients like ``like`` to, in at least float32."""
        return jnp.zeros(like.shape, jnp.promote_types(like.dtype, jnp.float32))


NO_MESH = Layout()


@dataclasses.dataclass(frozen=True)
class MeshLayout(Layout):
    """The layouts of a step on ``mesh`` whose examples split over ``data_axes``.

    Attributes:
      mesh: The device mesh.
      data_axes: The mesh axes a batch's examples are split over.
      explicit_loss: Run the user's function in explicit mode too (it then
        sees the compute layout in its arrays' types, and decides the layout
        of its activations itself); by default it runs in auto mode.
      manual: Inside `per_device`: the data axes are manual there.
    """

    mesh: Mesh
    data_axes: tuple[str, ...]
    explicit_loss: bool = False
    manual: bool = False

    @property
    def data_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def abstract(self) -> Any:
        """The mesh with every axis Explicit, as the step's body sees it."""
        explicit = {name: AxisType.Explicit for name in self.mesh.axis_names}
        return self.mesh.abstract_mesh.update_axis_types(explicit)

    def compute(self, params: Any) -> Any:
        if self.manual:  # per_device's arguments are in the compute layout
            return params
        return jax.tree.map(
            lambda p: jax.sharding.reshard(p, compute_spec(_spec(p), self.data_axes)),
            params,
        )

    def store(self, grads: Any, like: Any) -> Any:
        return jax.tree.map(lambda g, p: jax.sharding.reshard(g, _spec(p)), grads, like)

    def user(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        skip = self.data_axes if self.manual else ()
        axes = tuple(a for a in self.mesh.axis_names if a not in skip)
        if not self.explicit_loss and axes:
            fn = jax.sharding.auto_axes(fn, axes=axes, out_sharding=PartitionSpec())
        return functools.partial(self._named_errors, fn)

    def _named_errors(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs (traces) the user's function; a sharding error inside it
        becomes a `pztrain.sharding.ShardingError` that says what the step
        gave it and what to do."""
        try:
            return fn(*args)
        except Exception as e:  # JAX's sharding errors have no public type
            if not _is_sharding_error(e):
                raise
            mode = (
                "explicit_loss=True: its arrays carry the compute layout in their "
                "types (params with the data axes gathered, batches split over "
                f"{list(self.data_axes)})"
                if self.explicit_loss
                else "in auto mode"
            )
            raise ShardingError(
                f"The step's function failed on the mesh {dict(self.mesh.shape)} "
                f"with a sharding error ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:300]}). It ran {mode}. In explicit "
                "mode a sharding constraint is an assert: move arrays with "
                "jax.sharding.reshard(x, spec), or build the step without "
                "explicit_loss so that the compiler chooses the activations' "
                "layouts."
            ) from e

    def per_device(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = dataclasses.replace(self, manual=True)
        axes = self.data_axes

        def local(params, lfs, rest, rng, batch):
            # Varying params: each device's grads stay its own partial ones
            # (an invariant param's would be summed at every micro-batch); the
            # states threaded through the micro-batches vary by device too.
            params, lfs, rest = jax.lax.pcast((params, lfs, rest), axes, to="varying")
            index = jax.lax.axis_index(axes)  # each device its own keys
            out = fn(inner, params, lfs, rest, jax.random.fold_in(rng, index), batch)
            return _across_devices(out, axes)

        def run(params, lfs, rest, rng, batch):
            examples = jax.tree.map(
                lambda x: PartitionSpec(axes) if np.ndim(x) else PartitionSpec(),
                batch,
            )
            mapped = jax.shard_map(
                local,
                mesh=self.abstract,
                in_specs=(PartitionSpec(),) * 4 + (examples,),
                out_specs=PartitionSpec(),
                axis_names=set(axes),
            )
            return mapped(params, lfs, rest, rng, batch)

        return run

    def zeros(self, like: Any) -> Any:
        # In the grad's own layout: a tensor-parallel grad's zeros split over
        # its model axes too, or the scan's carry would change type.
        dtype = jnp.promote_types(like.dtype, jnp.float32)
        sharding = getattr(like, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else None
        zeros = jnp.zeros(like.shape, dtype, out_sharding=spec)
        if self.manual:  # added to each device's own partial grads
            return jax.lax.pcast(zeros, self.data_axes, to="varying")
        return zeros

    def entered(
        self, fn: Callable[..., Any], specs: tuple[Any, ...]
    ) -> Callable[..., Any]:
        """``fn`` with its body in explicit mode: each argument resharded to its
        spec in ``specs`` (a prefix tree per argument), outputs as ``fn`` gives
        them (the jitted program's output shardings place them)."""

        def run(*args: Any) -> Any:
            with jax.sharding.use_abstract_mesh(self.abstract):
                args = jax.sharding.reshard(args, specs)
                return fn(*args)

        return run


def _across_devices(out: tuple[Any, ...], axes: tuple[str, ...]) -> tuple[Any, ...]:
    """One step's ``(loss, loss_fn_state, aux, new_rest, grads)`` from each
    device's, as the micro-batches' are combined: loss and grads the mean, in
    one reduction; aux scalars the mean (floats), sum (integers) or any
    (booleans), per-example aux arrays gathered in batch order; the loss
    function's state and the state variables the mean (floats) or the
    largest (integers, such as counters every device advanced alike)."""
    loss, lfs, aux, new_rest, grads = out
    loss, grads = jax.lax.pmean((loss, grads), axes)
    combine = functools.partial(_combine_aux_leaf, axes=axes)
    aux = jax.tree.map(combine, aux, is_leaf=is_metric_state)
    lfs, new_rest = jax.tree.map(lambda x: _combine_state(x, axes), (lfs, new_rest))
    return loss, lfs, aux, new_rest, grads


def _combine_aux_leaf(x: Any, axes: tuple[str, ...]) -> Any:
    if is_metric_state(x):  # every device's state, merged
        return merge_stacked(jax.tree.map(lambda a: _stacked(a, axes), x))
    if x.ndim:
        return jax.lax.all_gather(x, axes, axis=0, tiled=True)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    if x.dtype == jnp.bool_:
        return jax.lax.pmax(x, axes)
    return jax.lax.psum(x, axes)


def _stacked(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Every device's ``x`` stacked on a new leading axis, the same on every
    device (a sum of one-hot rows: exact, and typed as replicated)."""
    rows = jnp.zeros((jax.lax.axis_size(axes), *x.shape), x.dtype)
    return jax.lax.psum(rows.at[jax.lax.axis_index(axes)].set(x), axes)


def _combine_state(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    return jax.lax.pmax(x, axes)


def _is_sharding_error(e: Exception) -> bool:
    """Whether JAX raised ``e`` for a layout (it has no public error types)."""
    if type(e).__name__ in ("ShardingTypeError", "DuplicateSpecError"):
        return True
    return isinstance(e, AssertionError) and "sharding" in str(e).lower()


def _spec(x: Any) -> PartitionSpec:
    """The storage spec of an array in explicit mode (from its type)."""
    return jax.typeof(x).sharding.spec


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh of the first array of ``tree`` placed with a `NamedSharding`."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def spec_of(x: Any) -> PartitionSpec:
    """The spec of an argument as the body sees it: its own for an array
    committed with a `NamedSharding`, else replicated."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and getattr(x, "committed", True):
        return sharding.spec
    return PartitionSpec()
