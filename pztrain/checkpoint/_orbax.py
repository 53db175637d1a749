"""pztrain's orbax settings: the (quiet) import and a checkpoint's item handlers.

A checkpoint directory holds three orbax items: ``params`` and ``state`` (arrays,
uncompressed, one file per array: save + load then run at about the speed of
``np.save`` / ``np.load``, see ``benchmarks/checkpoint_bench.py``) and ``meta``
(JSON). The arrays are zarr version 2 whatever orbax's default, because a load
checks their files (`pztrain._integrity`).

`write` saves one checkpoint synchronously and atomically, from one process or
from every process of a multi-process run (each writes its shards; process 0
renames the finished directory).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pztrain.checkpoint._metadata import CheckpointError

__all__ = ["all_agree", "barrier", "checkpointer", "handlers", "ocp", "write"]


class _QuietNonOcdbtMerge(logging.Filter):
    """Drops orbax's notice that a non-OCDBT save had no OCDBT parts to merge."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def ocp() -> Any:
    """The ``orbax.checkpoint`` module (imported on first use: ~0.3 s)."""
    import orbax.checkpoint

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietNonOcdbtMerge) for f in absl.filters):
        absl.addFilter(_QuietNonOcdbtMerge())
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
