"""Checkpoints: params alone or the whole state, as arrays + JSON (orbax).

A checkpoint directory holds orbax items, written atomically (a temporary
directory renamed on success):

* ``params``: the trainable arrays, keyed ``"0"``, ``"1"``, … in name order;
* ``state`` (full-state checkpoints only): every other array of the
  `TrainState` (optimizer and loss-function state, step, key, arrays left in
  ``model_without_params``, extra subclass fields);
* ``meta``: JSON: format version, pztrain version, parameter names, shapes and
  dtypes, the key paths of the state arrays, Python scalars, and free-form
  metadata (hyperparameters, metrics, callback counters).

Nothing is pickled, and loading runs no code: the structure always comes from the
``like`` argument built in code, and names, shapes and dtypes are checked against
the JSON before any array is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain import partition
from pztrain.callbacks import Callback
from pztrain.state import DonatedStateError, TrainState

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "export_safetensors",
    "import_safetensors",
    "load_params",
    "load_state",
    "read_metadata",
    "save_params",
    "save_state",
]

FORMAT = "pztrain.checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the target."""


class _QuietNonOcdbtMerge(logging.Filter):
    """Drops orbax's notice that a non-OCDBT save had no OCDBT parts to merge."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def _ocp():
    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietNonOcdbtMerge) for f in absl.filters):
        absl.addFilter(_QuietNonOcdbtMerge())
    return ocp


def _handlers() -> dict[str, Any]:
    ocp = _ocp()
    # Uncompressed, one file per array: params-only save+load then runs at about
    # the speed of np.save/np.load (benchmarks/checkpoint_bench.py).
    arrays = lambda: ocp.PyTreeCheckpointHandler(  # noqa: E731
        use_compression=False, use_ocdbt=False
    )
    return {"params": arrays(), "state": arrays(), "meta": ocp.JsonCheckpointHandler()}


def _version() -> str:
    from pztrain import __version__

    return __version__


# ----------------------------------------------------------------------------
# flattening a state into named arrays


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _dtype_name(x: Any) -> str:
    return str(x.dtype)


def _describe(shape: Sequence[int], dtype: str) -> str:
    return f"{dtype}{list(shape)}"


def _params_of(state_or_params: Any) -> Any:
    return (
        state_or_params.params
        if isinstance(state_or_params, TrainState)
        else state_or_params
    )


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    return [
        (jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _state_leaves(state: TrainState) -> list[tuple[str, Any]]:
    """Every leaf of the state but the params, named by key path."""
    rest = state.replace(params=None)
    return [(jax.tree_util.keystr(p), x) for p, x in _flatten_with_path(rest)]


def _flatten_with_path(tree: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _param_meta(params: Any) -> dict[str, Any]:
    named = _named_leaves(params)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise CheckpointError("Parameter names must be unique to be saved.")
    return {
        "names": names,
        "shapes": [list(np.shape(x)) for _, x in named],
        "dtypes": [_dtype_name(x) for _, x in named],
    }


def _as_items(params: Any, state: TrainState | None, extra: dict[str, Any] | None):
    ocp = _ocp()
    named = _named_leaves(params)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "pztrain_version": _version(),
        "params": _param_meta(params),
        "metadata": extra or {},
    }
    items = {
        "params": ocp.args.PyTreeSave({str(i): x for i, (_, x) in enumerate(named)})
    }
    if state is not None:
        arrays, scalars, paths = {}, {}, []
        for path, leaf in _state_leaves(state):
            if _is_array(leaf):
                arrays[str(len(paths))] = leaf
                paths.append((path, list(np.shape(leaf)), _dtype_name(leaf)))
            elif isinstance(leaf, bool | int | float) or leaf is None:
                scalars[path] = leaf
        meta["state"] = {
            "paths": [p for p, _, _ in paths],
            "shapes": [s for _, s, _ in paths],
            "dtypes": [d for _, _, d in paths],
            "scalars": scalars,
        }
        items["state"] = ocp.args.PyTreeSave(arrays)
    items["meta"] = ocp.args.JsonSave(meta)
    return ocp.args.Composite(**items)


# ----------------------------------------------------------------------------
# reading


def _checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Resolves a checkpoint directory (a `Checkpoints` root means its latest)."""
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}: the directory does not exist.")
    if (path / "meta").is_dir():
        return path
    steps = sorted(
        (
            int(p.name)
            for p in path.iterdir()
            if p.name.isdigit() and (p / "meta").is_dir()
        ),
        reverse=True,
    )
    if steps:
        return path / str(steps[0])
    raise CheckpointError(
        f"{path} is not a pztrain checkpoint: it has no 'meta' item and no numbered "
        "step directories. Pass the directory that save_params/save_state wrote."
    )


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads a checkpoint's JSON metadata (names, shapes, dtypes, metadata).

    Raises:
      CheckpointError: if ``directory`` is not a complete pztrain checkpoint.
    """
    path = _checkpoint_dir(directory)
    meta_file = path / "meta" / "metadata"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"Checkpoint {path} is incomplete or corrupt: cannot read {meta_file} "
            f"({e})."
        ) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a pztrain checkpoint (format {meta.get('format')!r})."
        )
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer pztrain (format version "
            f"{meta['format_version']}); upgrade pztrain to read it."
        )
    return meta


def _restore(path: Path, items: dict[str, Any]) -> dict[str, Any]:
    ocp = _ocp()
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers()))
    try:
        return checkpointer.restore(path, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax raises many kinds; name the checkpoint
        raise CheckpointError(
            f"Checkpoint {path} is incomplete or corrupt and could not be read: "
            f"{type(e).__name__}: {str(e)[:500]}"
        ) from e


def _restore_args(target: Any):
    return _ocp().checkpoint_utils.construct_restore_args(target)


def _abstract(shape: Sequence[int], dtype: str) -> jax.ShapeDtypeStruct:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)


def _read_params(path: Path, meta: dict[str, Any], like_named: dict[str, Any]):
    """Restores the stored params that ``like_named`` asks for (name → leaf)."""
    p = meta["params"]
    target = {}
    for i, (name, shape, dtype) in enumerate(
        zip(p["names"], p["shapes"], p["dtypes"], strict=True)
    ):
        if name in like_named:
            target[str(i)] = _abstract(shape, dtype)
    ocp = _ocp()
    if len(target) < len(p["names"]):  # read a subset: transforms pick by key
        restored = _restore(
            path,
            {
                "params": ocp.args.PyTreeRestore(
                    item=target,
                    restore_args=_restore_args(target),
                    partial_restore=True,
                )
            },
        )
    else:
        restored = _restore(
            path,
            {
                "params": ocp.args.PyTreeRestore(
                    item=target, restore_args=_restore_args(target)
                )
            },
        )
    arrays = restored["params"]
    return {p["names"][int(i)]: arrays[i] for i in target}


def _check_params(
    path: Path, meta: dict[str, Any], like_named: dict[str, Any], partial: bool
) -> dict[str, Any]:
    """Checks names, shapes and dtypes; returns the names to load."""
    p = meta["params"]
    stored = {
        n: (tuple(s), d)
        for n, s, d in zip(p["names"], p["shapes"], p["dtypes"], strict=True)
    }
    missing = sorted(set(like_named) - set(stored))
    unexpected = sorted(set(stored) - set(like_named))
    if (missing or unexpected) and not partial:
        raise CheckpointError(
            f"Checkpoint {path} does not match the target: missing names {missing}, "
            f"unexpected names {unexpected}. Pass partial=True to load only the "
            "names both have (e.g. for fine-tuning)."
        )
    for name in sorted(set(like_named) & set(stored)):
        leaf = like_named[name]
        want = (tuple(np.shape(leaf)), _dtype_name(leaf))
        if stored[name] != want:
            raise CheckpointError(
                f"Parameter {name!r} in {path} is {_describe(*stored[name])}, but the "
                f"target expects {_describe(*want)}. Build the model with the "
                "configuration it was trained with."
            )
    return {n: like_named[n] for n in like_named if n in stored}


def save_params(
    directory: str | os.PathLike,
    state_or_params: TrainState | Any,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Saves the params alone (arrays + JSON), named as in ``state.params``.

    Args:
      directory: Where to write; must not exist unless ``overwrite``.
      state_or_params: A `TrainState` or a params pytree.
      metadata: JSON-able extra information to store.
      overwrite: Replace an existing checkpoint.

    Returns:
      The directory.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> d = tempfile.mkdtemp() + "/ckpt"
      >>> _ = save_params(d, {"w": jnp.ones(2)})
      >>> load_params(d, {"w": jnp.zeros(2)})["w"]
      Array([1., 1.], dtype=float32)
    """
    path = Path(directory)
    if path.exists() and not overwrite:
        raise CheckpointError(
            f"{path} exists; pass overwrite=True to replace it, or choose another "
            "directory."
        )
    ocp = _ocp()
    params = _params_of(state_or_params)
    args = _as_items(params, None, metadata)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers())) as ck:
        ck.save(path.absolute(), args=args, force=overwrite)
    return path


def load_params(
    directory: str | os.PathLike, like: Any, *, partial: bool = False
) -> Any:
    """Loads params into ``like``: a `TrainState`, a model, or a params pytree.

    The structure comes from ``like`` (built in code); the checkpoint supplies
    values by name. A full-state checkpoint (or a `Checkpoints` directory, whose
    latest step is used) works too.

    Args:
      directory: A checkpoint from `save_params`, `save_state` or `Checkpoints`.
      like: A `TrainState` (returned with its params replaced), a model (penzai
        v2/v1, equinox or any pytree; returned with its params) or a params
        pytree (returned filled).
      partial: Load only the names both sides have; others keep ``like`` 's
        values (e.g. fine-tuning a model with a new head).

    Returns:
      ``like`` with the stored params.

    Raises:
      CheckpointError: naming missing or unexpected names, a shape or dtype that
        differs (stored vs expected), or a directory that is not a complete
        checkpoint.
    """
    path = _checkpoint_dir(directory)
    meta = read_metadata(path)
    params, rebuild = _target(like)
    wanted = _check_params(path, meta, dict(_named_leaves(params)), partial)
    return rebuild(_filled(params, _read_params(path, meta, wanted)))


def _target(like: Any) -> tuple[Any, Any]:
    """The params of ``like`` and a function that puts new ones back into it."""
    if isinstance(like, TrainState):
        return like.params, lambda p: like.replace(params=p)
    if _is_params_tree(like):
        return like, lambda p: p
    params, rest = partition.split(like)
    return params, lambda p: partition.to_user_model(partition.merge(p, rest))


def _filled(params: Any, loaded: dict[str, Any]) -> Any:
    """``params`` with the leaves named in ``loaded`` replaced."""
    named = _named_leaves(params)
    treedef = jax.tree.structure(params)
    return treedef.unflatten([loaded.get(n, leaf) for n, leaf in named])


def _is_params_tree(like: Any) -> bool:
    """A dict (or nested dicts/lists) of arrays only: a params pytree."""
    if not isinstance(like, dict):
        return False
    return partition.family_of(like) == "pytree" and all(
        _is_array(x) for x in jax.tree.leaves(like)
    )


def save_state(
    directory: str | os.PathLike,
    state: TrainState,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Saves the whole `TrainState` (synchronously) with JSON metadata.

    Restore it with `load_state` into a state built from code. For periodic,
    asynchronous saves during `pztrain.fit`, use `Checkpoints`.
    """
    path = Path(directory)
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} exists; pass overwrite=True to replace it.")
    ocp = _ocp()
    args = _as_items(state.params, state, _with_hparams(state, metadata))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers())) as ck:
        ck.save(path.absolute(), args=args, force=overwrite)
    return path


def _with_hparams(state: TrainState, metadata: dict[str, Any] | None) -> dict:
    out = dict(metadata or {})
    with contextlib.suppress(ValueError), jax.transfer_guard_device_to_host("allow"):
        out.setdefault(
            "hyperparams",
            {k: np.asarray(v).tolist() for k, v in state.hyperparams.items()},
        )
    return out


def load_state(directory: str | os.PathLike, like: TrainState) -> TrainState:
    """Restores a full-state checkpoint into ``like`` (a state built from code).

    Every array comes back with ``like`` 's exact types (optax state classes,
    penzai structures, PRNG keys), so the run continues bit for bit.

    Raises:
      CheckpointError: if the checkpoint holds params only, or its names,
        paths, shapes or dtypes differ from ``like`` (each named).
    """
    path = _checkpoint_dir(directory)
    meta = read_metadata(path)
    if "state" not in meta:
        raise CheckpointError(
            f"{path} holds params only (save_params); use load_params, or save with "
            "save_state / Checkpoints to resume training."
        )
    _check_params(path, meta, dict(_named_leaves(like.params)), partial=False)
    stored = meta["state"]
    like_leaves = _state_leaves(like)
    like_arrays = [(p, x) for p, x in like_leaves if _is_array(x)]
    have = [p for p, _ in like_arrays]
    if have != stored["paths"]:
        missing = sorted(set(have) - set(stored["paths"]))
        unexpected = sorted(set(stored["paths"]) - set(have))
        raise CheckpointError(
            f"The state in {path} does not match the target state: missing "
            f"{missing}, unexpected {unexpected}. Build the state with the same "
            "model, optimizer and loss_fn_state as the run that saved it."
        )
    for (p, x), shape, dtype in zip(
        like_arrays, stored["shapes"], stored["dtypes"], strict=True
    ):
        if (list(np.shape(x)), _dtype_name(x)) != (shape, dtype):
            raise CheckpointError(
                f"State array {p} in {path} is {_describe(shape, dtype)}, but the "
                f"target expects {_describe(np.shape(x), _dtype_name(x))}."
            )
    ocp = _ocp()
    p_target = {
        str(i): _abstract(s, d)
        for i, (s, d) in enumerate(
            zip(meta["params"]["shapes"], meta["params"]["dtypes"], strict=True)
        )
    }
    s_target = {
        str(i): ocp.utils.to_shape_dtype_struct(x)
        for i, (_, x) in enumerate(like_arrays)
    }
    restored = _restore(
        path,
        {
            "params": ocp.args.PyTreeRestore(
                item=p_target, restore_args=_restore_args(p_target)
            ),
            "state": ocp.args.PyTreeRestore(
                item=s_target, restore_args=_restore_args(s_target)
            ),
        },
    )
    by_name = {
        meta["params"]["names"][int(i)]: v for i, v in restored["params"].items()
    }
    new_params = _filled(like.params, by_name)
    # the rest of the state: arrays by position, Python scalars from JSON
    rest = like.replace(params=None)
    flat, rest_def = jax.tree_util.tree_flatten_with_path(rest)
    arrays = iter(restored["state"][str(i)] for i in range(len(like_arrays)))
    new_leaves = []
    for p, x in flat:
        if _is_array(x):
            new_leaves.append(next(arrays))
        else:
            new_leaves.append(stored["scalars"].get(jax.tree_util.keystr(p), x))
    return rest_def.unflatten(new_leaves).replace(params=new_params)


# ----------------------------------------------------------------------------
# safetensors (optional extra)


def export_safetensors(path: str | os.PathLike, state_or_params: Any) -> Path:
    """Writes the params to one ``.safetensors`` file, keyed by parameter name.

    For use outside JAX (PyTorch, NumPy, Rust …). Needs ``pztrain[safetensors]``.
    """
    save_file = _safetensors().save_file
    named = _named_leaves(_params_of(state_or_params))
    with jax.transfer_guard_device_to_host("allow"):
        tensors = {n: np.ascontiguousarray(jax.device_get(x)) for n, x in named}
    save_file(tensors, str(path), metadata={"format": "pztrain.params"})
    return Path(path)


def import_safetensors(
    path: str | os.PathLike, like: Any, *, partial: bool = False
) -> Any:
    """Reads params from a ``.safetensors`` file into ``like`` (see `load_params`)."""
    tensors = _safetensors().load_file(str(path))
    params, rebuild = _target(like)
    meta = {
        "params": {
            "names": list(tensors),
            "shapes": [list(t.shape) for t in tensors.values()],
            "dtypes": [str(t.dtype) for t in tensors.values()],
        }
    }
    wanted = _check_params(Path(path), meta, dict(_named_leaves(params)), partial)
    loaded = {n: jax.numpy.asarray(tensors[n]) for n in wanted}
    return rebuild(_filled(params, loaded))


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "safetensors export/import needs the extra: pip install "
            "'pztrain[safetensors]'."
        ) from None
    return safetensors.numpy


# ----------------------------------------------------------------------------
# periodic checkpoints during fit


class Checkpoints(Callback):
    """Periodic full-state checkpoints during `pztrain.fit`, and resume.

    Keeps the last ``keep_last`` checkpoints and the best ``keep_best`` by
    ``monitor``; the newest checkpoint is always kept, so best-k never deletes
    what resume needs. Saves are asynchronous by default and always finished at
    the end of `fit`, on exceptions and KeyboardInterrupt included.

    Pass it to ``fit(..., checkpoints=Checkpoints(dir), resume=True)`` to continue
    a run from its newest complete checkpoint.

    Args:
      directory: The root directory; each checkpoint is ``<directory>/<step>``.
      every_steps: Save at the first log, eval or epoch point at least this many
        steps after the last save (``None``: no periodic saves).
      at_epoch_end: Save at the end of every epoch.
      on_eval: Save after every evaluation (default: when ``keep_best > 0``).
      keep_last: How many of the newest checkpoints to keep.
      keep_best: How many of the best checkpoints to keep (by ``monitor``).
      monitor: ``"eval/<name>"`` or a train metric name, for best-k.
      mode: ``"min"`` or ``"max"``.
      async_save: Write in the background while training continues.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_steps: int | None = None,
        at_epoch_end: bool = False,
        on_eval: bool | None = None,
        keep_last: int = 2,
        keep_best: int = 0,
        monitor: str = "eval/loss",
        mode: str = "min",
        async_save: bool = True,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}.")
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (resume needs the newest); got {keep_last}."
            )
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be >= 1; got {every_steps}.")
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self.at_epoch_end = at_epoch_end
        self.on_eval = keep_best > 0 if on_eval is None else on_eval
        self.keep_last, self.keep_best = keep_last, keep_best
        self.monitor, self.mode = monitor, mode
        self.async_save = async_save
        self.peers: list[Callback] = []
        self._manager = None
        self._last_saved: int | None = None
        self._latest_metrics: dict[str, float] = {}
        self._hparams: dict[str, Any] = {}

    # -- orbax manager

    @property
    def manager(self):
        """The orbax ``CheckpointManager`` (made on first use)."""
        if self._manager is None:
            ocp = _ocp()
            policies = [ocp.checkpoint_managers.LatestN(self.keep_last)]
            if self.keep_best:
                policies.append(
                    ocp.checkpoint_managers.BestN(
                        get_metric_fn=lambda m: m[self.monitor],
                        reverse=self.mode == "min",
                        n=self.keep_best,
                        keep_checkpoints_without_metrics=False,
                    )
                )
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.async_save,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(
                    policies
                ),
                create=True,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, item_handlers=_handlers(), options=options
            )
            # Saves made outside fit are finished too when the interpreter exits:
            # registered with threading (not atexit), so that it runs before the
            # thread pools that orbax writes with are shut down.
            threading._register_atexit(self._close_at_exit)
        return self._manager

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk."""
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        """The step of the best checkpoint by ``monitor`` (``None`` if unknown)."""
        return self.manager.best_step() if self.keep_best else None

    def save(self, state: TrainState, step: int, metrics: dict | None = None) -> None:
        """Saves ``state`` as checkpoint ``step`` (asynchronously if configured)."""
        if step in self.manager.all_steps():
            return
        callbacks = {
            f"{i}:{type(cb).__name__}": cb.state_dict()
            for i, cb in enumerate(self.peers)
            if hasattr(cb, "state_dict")
        }
        meta = _with_hparams(state, {"callbacks": callbacks, "hparams": self._hparams})
        best = {self.monitor: metrics[self.monitor]} if metrics else None
        if metrics:
            meta["metrics"] = metrics
        self.manager.save(step, args=_as_items(state.params, state, meta), metrics=best)
        self._last_saved = step

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases the manager."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def _close_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- resume

    def restore_latest(self, like: TrainState) -> TrainState | None:
        """The newest complete, readable checkpoint restored into ``like``.

        Incomplete checkpoints (a save killed midway) and unreadable ones are
        skipped with a warning that names them. Callback counters saved with the
        checkpoint are given back to the ``peers`` callbacks.

        Returns:
          The restored state, or ``None`` if there is no checkpoint.
        """
        if not self.directory.exists():
            return None
        for tmp in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
            warnings.warn(
                f"Skipping incomplete checkpoint {tmp} (a save that did not finish).",
                stacklevel=2,
            )
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self.directory / str(step)
            try:
                state = load_state(path, like)
                meta = read_metadata(path)
            except CheckpointError as e:
                warnings.warn(
                    f"Skipping unreadable checkpoint {path}: {e}", stacklevel=2
                )
                continue
            saved = meta.get("metadata", {}).get("callbacks", {})
            for i, cb in enumerate(self.peers):
                key = f"{i}:{type(cb).__name__}"
                if key in saved and hasattr(cb, "load_state_dict"):
                    cb.load_state_dict(saved[key])
            self._last_saved = step
            return state
        return None

    # -- callback hooks

    def on_train_start(self, state, info):
        self._hparams = dict(info.hparams)
        if self._last_saved is None:
            self._last_saved = info.start_step

    def _maybe_save(self, state, step: int, metrics=None) -> None:
        if (
            self.every_steps is not None
            and self._last_saved is not None
            and step - self._last_saved >= self.every_steps
        ):
            self.save(state, step, metrics)

    def on_log(self, state, record):
        self._latest_metrics.update(record["metrics"])
        self._maybe_save(state, record["step"])

    def on_eval_end(self, state, record):
        metrics = {f"eval/{k}": v for k, v in record["metrics"].items()}
        metrics.update(self._latest_metrics)
        if self.on_eval:
            if self.keep_best and self.monitor not in metrics:
                raise KeyError(
                    f"Checkpoints monitors {self.monitor!r}, which is not among the "
                    f"metrics {sorted(metrics)}."
                )
            self.save(state, record["step"], metrics)
        else:
            self._maybe_save(state, record["step"])

    def on_epoch_end(self, state, epoch):
        step = int(state.step)
        if self.at_epoch_end:
            self.save(state, step)
        else:
            self._maybe_save(state, step)

    def on_train_end(self, state, history):
        """Saves the final state (also after an exception) and finishes saves."""
        try:
            step = int(state.step)
            if self._last_saved != step:
                state.check_not_donated("Checkpoints.on_train_end")
                self.save(state, step)
        except DonatedStateError:
            pass  # a step failed after taking the state: nothing valid to save
        finally:
            self.close()
