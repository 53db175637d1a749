"""A checkpoint's JSON: where it is, and checking it before anything relies on it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointMismatchError",
    "checkpoint_dir",
    "read_metadata",
    "stored_params",
]

FORMAT = "pztrain.checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the target."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint whose structure differs from the target's.

    Another model or optimizer, not corruption: resuming refuses it (and touches
    nothing) instead of skipping it.
    """


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads a checkpoint's JSON metadata (names, shapes, dtypes, metadata).

    A `pztrain.Checkpoints` directory means its newest checkpoint.

    Raises:
      CheckpointError: if ``directory`` is not a complete pztrain checkpoint.
    """
    path = checkpoint_dir(directory)
    meta_file = path / "meta" / "metadata"
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise CheckpointError(
            f"Checkpoint {path} is incomplete or corrupt: cannot read {meta_file} "
            f"({e})."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path} is not a pztrain checkpoint (format {got!r}).")
    _check_meta(path, meta)
    return meta


_META_LISTS = {
    "params": ("names", "shapes", "dtypes"),
    "state": ("paths", "shapes", "dtypes"),
}


def _check_meta(path: Path, meta: dict[str, Any]) -> None:
    """Checks the JSON's own structure (before anything relies on it)."""
    version = meta.get("format_version", 0)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer pztrain (format version {version}); "
            "upgrade pztrain to read it."
        )
    bad = [] if isinstance(version, int) else ["format_version"]
    for item, keys in _META_LISTS.items():
        if item == "state" and item not in meta:
            continue  # a params-only checkpoint
        part = meta.get(item)
        lists = [part.get(k) for k in keys] if isinstance(part, dict) else [None]
        if not all(isinstance(x, list) for x in lists) or len(set(map(len, lists))) > 1:
            bad.append(item)
    extra = meta.get("metadata", {})
    if not isinstance(extra, dict) or not isinstance(extra.get("callbacks", {}), dict):
        bad.append("metadata")
    state = meta.get("state", {})
    if not isinstance(state, dict) or not isinstance(state.get("scalars", {}), dict):
        bad.append("state")
    if bad:
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: its metadata's {sorted(set(bad))} "
            "entries are not what pztrain writes (lists of one length per item, "
            "dicts of metadata)."
        )


def checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Resolves a checkpoint directory (a `Checkpoints` root means its newest)."""
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}: the directory does not exist.")
    if (path / "meta").is_dir():
        return path
    steps = [
        int(p.name)
        for p in path.iterdir()
        if p.name.isdigit() and (p / "meta").is_dir()
    ]
    if steps:
        return path / str(max(steps))
    raise CheckpointError(
        f"{path} is not a pztrain checkpoint: it has no 'meta' item and no numbered "
        "step directories. Pass the directory that save_params/save_state wrote."
    )


def stored_params(meta: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name → (shape, dtype) of the stored params, in stored order."""
    p = meta["params"]
    return {
        n: (tuple(s), d)
        for n, s, d in zip(p["names"], p["shapes"], p["dtypes"], strict=True)
    }
