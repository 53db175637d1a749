"""pztrain's orbax settings: the (quiet) import and a checkpoint's item handlers.

A checkpoint directory holds three orbax items: ``params`` and ``state`` (arrays,
uncompressed, one zarr array per array: save + load then run at about the speed of
``np.save`` / ``np.load``, see ``benchmarks/checkpoint_bench.py``) and ``meta``
(JSON). pztrain never reads orbax's files itself: `restore` goes through orbax's
public API, and `pztrain.checkpoint._integrity` checks what it returns.

`write` saves one checkpoint synchronously and atomically, from one process or
from every process of a multi-process run (each writes its shards; process 0
renames the finished directory).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain.checkpoint._metadata import CheckpointError

__all__ = [
    "all_agree",
    "all_agree_each",
    "barrier",
    "checkpointer",
    "handlers",
    "ocp",
    "restore",
    "write",
]


# Notices orbax logs as warnings about what pztrain does on purpose, which a user
# can do nothing about: a non-OCDBT save had no OCDBT parts to merge; a
# synchronous save waited for its own background signals (orbax 0.11's notice
# that "blocking the main thread will slow down blocking save times").
_NOTICES = (
    "Skipping merge of OCDBT checkpoints",
    "_SignalingThread.join() waiting for signals",
)


class _QuietNotices(logging.Filter):
    """Drops orbax's `_NOTICES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(notice in message for notice in _NOTICES)


def ocp() -> Any:
    """The ``orbax.checkpoint`` module (imported on first use: ~0.3 s)."""
    import orbax.checkpoint

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietNotices) for f in absl.filters):
        absl.addFilter(_QuietNotices())
    return orbax.checkpoint


def handlers() -> dict[str, Any]:
    """The handlers of the ``params``, ``state`` and ``meta`` items."""
    orbax = ocp()

    def arrays():
        return orbax.PyTreeCheckpointHandler(
            use_compression=False, use_ocdbt=False, use_zarr3=False
        )

    return {
        "params": arrays(),
        "state": arrays(),
        "meta": orbax.JsonCheckpointHandler(),
    }


def checkpointer() -> Any:
    """A synchronous checkpointer of the three items (a context manager)."""
    orbax = ocp()
    return orbax.Checkpointer(orbax.CompositeCheckpointHandler(**handlers()))


def write(path: Path, args: Any, overwrite: bool) -> Path:
    """Saves ``args`` (a checkpoint's items) as ``path``, atomically.

    The checkpoint is written beside ``path`` and renamed once complete, so an
    existing checkpoint is replaced only then and a failed save loses nothing.
    In a multi-process run every process calls it (each writes its shards);
    process 0 alone tidies and renames, between barriers.

    Raises:
      CheckpointError: if ``path`` exists and not ``overwrite``.
    """
    if path.exists() and not overwrite:
        raise CheckpointError(
            f"{path} exists; pass overwrite=True to replace it, or choose another "
            "directory."
        )
    new = path.with_name(f".{path.name}.saving")
    primary = jax.process_index() == 0
    if primary:
        _remove_partial(new)
    barrier(f"pztrain.write start {path}")
    try:
        with checkpointer() as saver:
            saver.save(new.absolute(), args=args)
    except BaseException:
        if primary:
            _remove_partial(new)
        raise
    if primary:
        _replace(path, new)
    barrier(f"pztrain.write done {path}")
    return path


def _replace(path: Path, new: Path) -> None:
    """Renames ``new`` to ``path`` (an existing ``path`` removed after)."""
    if not path.exists():
        new.rename(path)
        return
    old = path.with_name(f".{path.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    path.rename(old)
    new.rename(path)
    shutil.rmtree(old)


def _remove_partial(new: Path) -> None:
    """Removes a save's directory and orbax's temporaries for it."""
    for leftover in [new, *new.parent.glob(f"{new.name}.orbax-checkpoint-tmp*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def restore(
    path: Path, items: dict[str, dict[str, Any]], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """Restores array items: ``{item: {key: jax.ShapeDtypeStruct}}``, each array
    onto its target's sharding (a target without one: a NumPy array).

    Args:
      path: The checkpoint.
      items: The targets, by item and key.
      labels: How errors name an array, by ``"<item>/<key>"``.

    Raises:
      CheckpointError: naming the checkpoint, and the array that orbax could not
        read (found by reading each alone once the whole read failed).
    """
    try:
        return _restore(path, items)
    except Exception as e:  # orbax raises many kinds; name the checkpoint
        cause = _first_cause(e)
    where = _culprit(path, items, labels or {})
    raise CheckpointError(
        f"Checkpoint {path} is incomplete or corrupt: {where} could not be read "
        f"({cause}). Load another checkpoint (resuming skips this one)."
    )


def _restore(path: Path, items: dict[str, dict[str, Any]]) -> dict[str, Any]:
    orbax = ocp()
    args = {
        item: orbax.args.PyTreeRestore(
            item=targets,
            restore_args={k: _restore_args(orbax, t) for k, t in targets.items()},
            partial_restore=True,  # the keys the target asks for
        )
        for item, targets in items.items()
    }
    with checkpointer() as reader:
        restored = reader.restore(path, args=orbax.args.Composite(**args))
    return {item: dict(restored[item]) for item in items}


def _culprit(path: Path, items: dict[str, dict[str, Any]], labels: dict) -> str:
    """``"<label> (<directory>)"`` of the first array that fails to read alone
    (``"an array"`` if each reads alone)."""
    for item, targets in items.items():
        for key, target in targets.items():
            try:
                _restore(path, {item: {key: target}})
            except Exception:  # noqa: BLE001 - this is the one
                name = f"{item}/{key}"
                return f"{labels.get(name, name)} ({path / item / key})"
    return "an array"


def _restore_args(orbax: Any, target: Any) -> Any:
    if target.sharding is None:
        return orbax.RestoreArgs(restore_type=np.ndarray, dtype=target.dtype)
    return orbax.ArrayRestoreArgs(
        sharding=target.sharding, global_shape=target.shape, dtype=target.dtype
    )


def _first_cause(e: BaseException) -> str:
    """The innermost cause of an orbax error in one line, without TensorStore's
    spec, naming the array's directory where the error has it."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e)
    line = (text.splitlines() or [""])[0].split(" See full TensorStore")[0]
    where = re.search(r"'path': '([^']*)'", text)
    found = f" (in {where.group(1).rstrip('/')})" if where else ""
    return f"{type(e).__name__}: {line[:300]}{found}"


def barrier(name: str) -> None:
    """Waits for every process of a multi-process run (nothing in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def all_agree(flag: bool) -> bool:
    """Whether ``flag`` holds in every process (``flag`` itself in one process)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(flag))))


def all_agree_each(flags: list[bool]) -> list[bool]:
    """Each of ``flags`` and-ed over every process (``flags`` in one process);
    every process must pass as many."""
    if jax.process_count() == 1:
        return list(flags)
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(flags, dtype=bool))
    return [bool(v) for v in np.all(np.asarray(gathered), axis=0)]
