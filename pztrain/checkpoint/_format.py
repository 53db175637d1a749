"""The checkpoint format: params alone or the whole state, as arrays + JSON.

A checkpoint directory holds orbax items, written atomically (a temporary directory
renamed on success): ``params``, the trainable arrays keyed ``"0"``, ``"1"``, … in name
order, then the model's own state by name (an NNX model's batch statistics and rng
state: `pztrain.partition.model_state`); ``state`` (full-state checkpoints only), every
other array of the `TrainState` (optimizer and loss-function state, step, key, arrays
left in ``model_without_params``, subclass fields); ``meta``, JSON: the format and
pztrain versions, each array's name or key path, shape, dtype and checksum, the state's
numbers, the number of members of a population (``null`` for one run, see
`pztrain.population`), and free-form metadata (hyperparameters, metrics, callback
counters). A state loads only into a state with as many members.

Nothing is pickled, and loading runs no code: the structure always comes from the
``like`` argument built in code, checked against the JSON and the files before any array
is read (`load_params` says how), each array then against its checksum.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain._members import member_count
from pztrain._tree import is_array_like, named_leaves, path_repr
from pztrain._version import __version__
from pztrain.checkpoint import _integrity, _orbax
from pztrain.checkpoint._ema import stored_ema, weights_to_save
from pztrain.checkpoint._integrity import StoredArray
from pztrain.checkpoint._metadata import (
    CHECKSUM,
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointMismatchError,
    check_json,
    check_params,
    check_state,
    checkpoint_dir,
    describe_params,
    describe_state,
    read_metadata,
    restored_scalars,
    stored_params,
)
from pztrain.checkpoint._targets import (
    concrete,
    filled,
    param_target,
    params_of,
    params_target,
    state_skeleton,
    state_with_params,
)
from pztrain.checkpoint._warm import LoadReport, Rename, plan_load
from pztrain.state import TrainState
from pztrain.state._donation import check_alive

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "LoadReport",
    "load_params",
    "load_state",
    "read_metadata",
    "save_params",
    "save_state",
]


# ----------------------------------------------------------------------------
# writing


def save_params(
    directory: str | os.PathLike,
    state_or_params: TrainState | Any,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    ema: bool = False,
) -> Path:
    """Saves the params alone (arrays + JSON), named as in ``state.params``.

    A Flax NNX model's other variables (batch statistics, rng keys and counts)
    are saved beside them, by name (``"bn/mean"``), so that `load_params`
    into a fresh model restores them too.

    Args:
      directory: Where to write; must not exist unless ``overwrite``.
      state_or_params: A `TrainState` or a params pytree.
      metadata: JSON-able extra information to store.
      overwrite: Replace an existing checkpoint.
      ema: Save a state's EMA params (`pztrain.with_ema`) as its params.

    Returns:
      The directory.

    Example:
      >>> import tempfile, jax.numpy as jnp, pztrain
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = pztrain.save_params(d + "/ckpt", {"w": jnp.ones(2)})
      ...     print(pztrain.load_params(path, {"w": jnp.zeros(2)})["w"])
      [1. 1.]
    """
    source = weights_to_save(state_or_params, ema, "save_params")
    params = params_of(source)
    check_alive(params, "save_params", "the params to save")
    of = source if isinstance(source, TrainState) else None
    args = save_args(params, None, metadata, of=of)
    return _orbax.write(Path(directory), args, overwrite)


def save_state(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Saves the whole `TrainState` (synchronously) with JSON metadata.

    Restore it with `load_state` into a state built from code. For periodic,
    asynchronous saves during `pztrain.fit`, use `pztrain.Checkpoints`.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from pztrain import TrainState, load_state, save_state
      >>> like = TrainState.initial_state({"w": jnp.ones(2)}, optax.adam(0.1),
      ...                                 jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d:  # after one update: step 1
      ...     path = save_state(d + "/ckpt", like.apply_gradients({"w": jnp.ones(2)}))
      ...     print(int(load_state(path, like).step))
      1
    """
    check_alive(state, "save_state", "the arrays of this TrainState")
    args = save_args(params_of(state), state, state_metadata(state, metadata))
    return _orbax.write(Path(directory), args, overwrite)


def save_args(
    params: Any,
    state: TrainState | None,
    metadata: dict[str, Any] | None,
    *,
    of: TrainState | None = None,
) -> Any:
    """The orbax save arguments (``ocp.args.Composite``) of a checkpoint of ``params``
    (`params_of` a state), the arrays of ``state`` (full-state checkpoint, or ``None``)
    and free-form ``metadata``, with the member count of ``state`` (or of ``of``, the
    state ``params`` come from; params saved without a state have none).

    Raises:
      CheckpointError: naming a leaf a checkpoint cannot hold (a Python number
        among the params, a complex number in the state, an empty array) or
        metadata JSON cannot hold. Nothing has been written then.
    """
    ocp = _orbax.ocp()
    check_json(metadata or {}, "metadata")
    named = named_leaves(params)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "pztrain_version": __version__,
        "params": describe_params(named),
        "metadata": metadata or {},
    }
    source = state if state is not None else of
    if source is not None:
        meta["members"] = member_count(source.root_rng)
    arrays = {str(i): x for i, (_, x) in enumerate(named)}
    meta["params"][CHECKSUM] = _integrity.checksums(list(arrays.values()))
    items = {"params": ocp.args.PyTreeSave(arrays)}
    if state is not None:
        state_arrays, meta["state"] = describe_state(_state_leaves(state))
        meta["state"][CHECKSUM] = _integrity.checksums(list(state_arrays.values()))
        items["state"] = ocp.args.PyTreeSave(state_arrays)
    items["meta"] = ocp.args.JsonSave(meta)
    return ocp.args.Composite(**items)


def state_metadata(state: TrainState, metadata: dict[str, Any] | None) -> dict:
    """``metadata`` plus the state's injected hyperparameters (if any)."""
    out = dict(metadata or {})
    with contextlib.suppress(ValueError), jax.transfer_guard_device_to_host("allow"):
        out.setdefault(
            "hyperparams",
            {k: np.asarray(v).tolist() for k, v in state.hyperparams.items()},
        )
    return out


def _state_leaves(state: TrainState) -> list[tuple[str, Any]]:
    """Every leaf of the state but what the params item holds, by key path."""
    flat = jax.tree_util.tree_flatten_with_path(state_skeleton(state))[0]
    return [(path_repr(path), leaf) for path, leaf in flat]


# ----------------------------------------------------------------------------
# reading


def load_params(
    directory: str | os.PathLike,
    like: Any,
    *,
    partial: bool = False,
    ema: bool = False,
    rename: Rename | None = None,
    return_report: bool = False,
) -> Any:
    """Loads params into ``like``: a `TrainState`, a model, or a params pytree.

    The structure comes from ``like`` (built in code), the values by name from the
    checkpoint: nothing is read before the JSON, the target and the files agree on
    names, shapes and dtypes; each array is then checked against its checksum.

    Args:
      directory: From `save_params`, `save_state` or `pztrain.Checkpoints`.
      like: A `TrainState` (returned with its params replaced), a model (penzai
        v2/v1, equinox or any pytree; returned with its params) or a params pytree
        (returned filled), maybe abstract (``jax.ShapeDtypeStruct`` leaves, from
        ``jax.eval_shape``; a penzai v2 model frozen first). Each param goes onto
        its target's sharding (a ``ShapeDtypeStruct`` without one: the first device).
      partial: Load only the names both sides have; others keep ``like`` 's
        values (e.g. fine-tuning a model with a new head).
      ema: Load a full-state checkpoint's EMA params (`pztrain.with_ema`) as
        the params (a model's own state, batch statistics, from its params).
      rename: Stored names to load under others: ``{"encoder": "backbone"}``
        (a name and the names under it) or ``[(pattern, replacement), ...]``
        (the first pattern that matches a whole name; `LoadReport` has more).
      return_report: Also return a `LoadReport` (loaded, left, ignored).

    Returns:
      ``like`` with the stored params; ``(loaded, report)`` with ``return_report``.

    Raises:
      CheckpointMismatchError: the checkpoint is readable but holds other params
        (names, shapes or dtypes: each named, stored vs expected, a renamed one by
        both names), no EMA weights (with ``ema``), or a state of another member
        count than ``like``; a ``rename`` rule fits no name or joins two.
      TypeError, ValueError: a malformed ``rename`` (or one with ``ema``).
      CheckpointError: a file, or a checkpoint that cannot be trusted:
        incomplete, or array files missing, truncated, outside it, described
        otherwise than its JSON, or failing their checksum (each named).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from pztrain import load_params, save_params
      >>> with tempfile.TemporaryDirectory() as d:  # a new head: partial
      ...     p = save_params(d + "/c", {"body": jnp.ones(2), "head": jnp.ones(3)})
      ...     load_params(p, {"body": jnp.zeros(2), "new": jnp.zeros(1)}, partial=True)
      {'body': Array([1., 1.], dtype=float32), 'new': Array([0.], dtype=float32)}
    """
    path = _checkpoint_dir(directory, "load_params")
    meta = read_metadata(path)
    check_members(path, meta, like)
    params, rebuild = params_target(like)
    report = plan_load(path, meta, params, rename=rename, partial=partial, ema=ema)
    values = _loaded_values(path, meta, params, report, ema)
    loaded = concrete(rebuild(filled(params, values)))
    return (loaded, report) if return_report else loaded


def _loaded_values(
    path: Path, meta: dict[str, Any], params: Any, report: LoadReport, ema: bool
) -> dict[str, Any]:
    """The arrays of ``report.loaded``, by target name: from the params item,
    or with ``ema`` the EMA from the state item (a model's own state, which
    has none, from the params item)."""
    targets = dict(named_leaves(params))
    averaged = stored_ema(path, meta, params, set(report.loaded)) if ema else {}
    plain = {s: targets[t] for t, s in report.loaded.items() if t not in averaged}
    items = {"params": _stored_params(meta, plain), "state": [*averaged.values()]}
    restored = _read(path, meta, **{k: v for k, v in items.items() if v})
    by_stored = _by_name(meta["params"]["names"], restored.get("params", {}))
    values = {t: by_stored[s] for t, s in report.loaded.items() if s in by_stored}
    for name, stored_array in averaged.items():
        values[name] = jax.numpy.asarray(restored["state"][stored_array.key])
    return values


def load_state(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Restores a full-state checkpoint into ``like`` (a state built from code).

    Every array comes back with ``like`` 's exact types (optax state classes, penzai
    structures, PRNG keys) and shardings (``like`` may be abstract and sharded:
    ``jax.ShapeDtypeStruct(..., sharding=)`` leaves) and stored numbers as ``like`` 's
    types: the run goes on bit for bit, on any mesh (files checked as in `load_params`).

    Raises:
      CheckpointMismatchError: the checkpoint is readable but was saved from another
        structure: it holds params only, its number of members differs from
        ``like`` 's (a population against one run: both counts named), or its names,
        paths, shapes, dtypes or stored numbers differ (each named). Resuming
        refuses it.
      CheckpointError: ``directory`` is a file, or the checkpoint cannot be
        trusted (see `load_params`). Resuming skips it.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> from pztrain import TrainState, load_state, save_state
      >>> state = TrainState.initial_state({"w": jnp.ones(2)}, optax.adam(0.1),
      ...                                  jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d:  # into shapes: nothing made first
      ...     path = save_state(d + "/ckpt", state)
      ...     print(load_state(path, jax.eval_shape(lambda: state)).params["w"])
      [1. 1.]
    """
    path = _checkpoint_dir(directory, "load_state")
    meta = read_metadata(path)
    if "state" not in meta:
        raise CheckpointMismatchError(
            f"{path} holds params only (save_params); use load_params, or save with "
            "save_state / Checkpoints to resume training."
        )
    check_members(path, meta, like)
    stored = stored_params(meta)
    like_params = params_of(like)
    targets = dict(named_leaves(like_params))
    check_params(path, stored, targets, False, meta.get("members"))
    leaves = _state_leaves(like)
    like_arrays = [(p, x) for p, x in leaves if is_array_like(x)]
    check_state(path, meta["state"], like_arrays)
    scalars = restored_scalars(path, meta["state"]["scalars"], leaves)
    state_arrays = _stored_state(meta, like_arrays)
    params = _stored_params(meta, targets)
    restored = _read(path, meta, params=params, state=state_arrays)
    by_name = _by_name(list(stored), restored["params"])
    arrays = [restored["state"][str(i)] for i in range(len(like_arrays))]
    rest = _filled_state(like, arrays, scalars)
    return state_with_params(like, rest, filled(like_params, by_name))


def _checkpoint_dir(directory: str | os.PathLike, call: str) -> Path:
    """`checkpoint_dir`, refusing a file (naming ``call`` and the file)."""
    if (path := Path(directory)).exists() and not path.is_dir():
        fix = "pass the directory that save_params, save_state or Checkpoints wrote"
        if path.suffix == ".safetensors":
            fix = "read a .safetensors file with pztrain.import_safetensors(path, like)"
        raise CheckpointError(
            f"{call}({str(directory)!r}, ...): {path} is a file, not a checkpoint "
            f"directory; {fix}."
        )
    return checkpoint_dir(path)


def check_members(path: Path, meta: dict[str, Any], like: Any) -> None:
    """Checks the member count of checkpoint ``path`` (its JSON ``meta``)
    against a `TrainState` ``like`` 's (``None``: one run, as
    `pztrain.population_size` says). A full-state checkpoint without one is one
    run's (written before populations); params saved alone have none to check.

    Raises:
      CheckpointMismatchError: naming both counts and the state to load into.
    """
    if not isinstance(like, TrainState) or not ("members" in meta or "state" in meta):
        return
    stored, target = meta.get("members"), member_count(like.root_rng)
    if stored == target:
        return

    def what(n: int | None) -> str:
        return "one run's state" if n is None else f"a population of {n} members"

    if stored is None:
        fix = (
            "Load it into one run's state (pztrain.member(target, 0) is one); "
            "pztrain.stack_members makes a population of such states."
        )
    else:
        fix = (
            f"Load it into a population of {stored} members (pztrain."
            f"make_population with {stored} seeds), then take a run out with "
            "pztrain.member(population, i) if you want one."
        )
    raise CheckpointMismatchError(
        f"Checkpoint {path} holds {what(stored)}, but the target is {what(target)}: "
        f"a checkpoint loads into a state with as many members. {fix}"
    )


def _by_name(names: list[str], restored: dict[str, Any]) -> dict[str, Any]:
    """Restored params by name, as JAX arrays (a 64-bit one read on the host
    is narrowed by JAX's rules here, after its checksum was verified)."""
    return {names[int(k)]: jax.numpy.asarray(v) for k, v in restored.items()}


def _filled_state(like: TrainState, arrays: list[Any], scalars: dict) -> TrainState:
    """``like`` (params aside) with its arrays and stored numbers replaced."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state_skeleton(like))
    new_arrays = iter(arrays)
    leaves = [
        next(new_arrays) if is_array_like(x) else scalars.get(path_repr(p), x)
        for p, x in flat
    ]
    return treedef.unflatten(leaves)


def _stored_params(meta: dict[str, Any], targets: dict[str, Any]) -> list[StoredArray]:
    """The stored params the target has, by name (the others are not read)."""
    p = meta["params"]
    sums = p.get(CHECKSUM) or [None] * len(p["names"])
    return [
        StoredArray(
            f"parameter {name!r}", str(i), param_target(dtype, targets[name]), checksum
        )
        for i, (name, dtype, checksum) in enumerate(
            zip(p["names"], p["dtypes"], sums, strict=True)
        )
        if name in targets
    ]


def _stored_state(
    meta: dict[str, Any], like_arrays: list[tuple[str, Any]]
) -> list[StoredArray]:
    sums = meta["state"].get(CHECKSUM) or [None] * len(like_arrays)
    return [
        StoredArray.like(f"state array {p}", str(i), x, checksum)
        for i, ((p, x), checksum) in enumerate(zip(like_arrays, sums, strict=True))
    ]


def _read(
    path: Path, meta: dict[str, Any], **items: list[StoredArray]
) -> dict[str, dict[str, Any]]:
    """Reads the arrays of ``items`` through orbax, each onto its target, and
    verifies them (`pztrain.checkpoint._integrity.verify`)."""
    targets = {
        item: {a.key: _integrity.as_written(a.target) for a in arrays}
        for item, arrays in items.items()
    }
    labels = {
        f"{item}/{a.key}": a.label for item, arrays in items.items() for a in arrays
    }
    restored = _orbax.restore(path, targets, labels)
    out = {}
    for item, arrays in items.items():
        found = {
            a.key: _integrity.from_written(a, restored[item][a.key]) for a in arrays
        }
        _integrity.verify(path, item, arrays, found)
        out[item] = found
    return out
