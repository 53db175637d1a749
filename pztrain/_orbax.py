"""pztrain's orbax settings: the (quiet) import and a checkpoint's item handlers.

A checkpoint directory holds three orbax items: ``params`` and ``state`` (arrays,
uncompressed, one file per array: save + load then run at about the speed of
``np.save`` / ``np.load``, see ``benchmarks/checkpoint_bench.py``) and ``meta``
(JSON). The arrays are zarr version 2 whatever orbax's default, because a load
checks their files (`pztrain._integrity`).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["checkpointer", "handlers", "ocp"]


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
