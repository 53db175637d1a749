"""A checkpoint's JSON: writing it, finding it, and checking it before anything
relies on it, then against the target.

Two kinds of failure, two errors. `CheckpointError`: the checkpoint cannot be
trusted (missing, incomplete, its JSON or files damaged or changed). Its
subclass `CheckpointMismatchError`: the checkpoint is readable but was saved from
another structure than the target (another model, optimizer or state class).
Resuming skips the first kind and refuses the second.

Format version 1 throughout: the per-array checksums (``"xxh3_64"`` lists) were
added to it without a new version, because they are optional. A checkpoint
without them (saved before they existed) loads unverified; one with them loads
in an older pztrain, which ignores them. So was ``"members"``: a population's
member count (``null`` for one run), written when a `TrainState` is saved; a
full-state checkpoint without it is one run's.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from pztrain._members import member_shape_note, shared_shape_note
from pztrain._tree import describe, describe_shape, is_array

__all__ = [
    "CHECKSUM",
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointMismatchError",
    "check_json",
    "checkpoint_steps",
    "check_params",
    "check_state",
    "checkpoint_dir",
    "describe_params",
    "describe_state",
    "read_metadata",
    "restored_scalars",
    "stored_params",
]

FORMAT = "pztrain.checkpoint"
FORMAT_VERSION = 1
CHECKSUM = "xxh3_64"  # the JSON key of an item's checksums (see _integrity)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the target.

    Example:
      >>> import tempfile, jax.numpy as jnp; from pztrain import CheckpointError
      >>> from pztrain.checkpoint import load_params, save_params
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = save_params(d + "/ckpt", {"w": jnp.ones(2)})
      ...     _ = (path / "meta" / "metadata").write_text("{")  # damaged
      ...     try:
      ...         load_params(path, {"w": jnp.zeros(2)})
      ...     except CheckpointError as e:
      ...         print(e)  # doctest: +ELLIPSIS
      Checkpoint ... is incomplete or corrupt: cannot read .../meta/metadata (...).
    """


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint whose structure differs from the target's.

    Another model or optimizer, not corruption: resuming refuses it (and touches
    nothing) instead of skipping it.

    Example:
      >>> import tempfile, jax.numpy as jnp; from pztrain import CheckpointMismatchError
      >>> from pztrain.checkpoint import load_params, save_params
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = save_params(d + "/ckpt", {"w": jnp.ones(2)})
      ...     try:
      ...         load_params(path, {"w": jnp.zeros(3)})  # another model
      ...     except CheckpointMismatchError as e:
      ...         print(e)  # doctest: +ELLIPSIS
      Parameter 'w' in ... is float32[2], but the target expects float32[3]. ...
    """


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads a checkpoint's JSON metadata (names, shapes, dtypes, metadata).

    A `pztrain.Checkpoints` directory means its newest checkpoint.

    Raises:
      CheckpointError: if ``directory`` is not a complete pztrain checkpoint.

    Example:
      >>> import tempfile, jax.numpy as jnp; from pztrain import read_metadata
      >>> from pztrain.checkpoint import save_params
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = save_params(d + "/ckpt", {"w": jnp.ones(2)}, metadata={"lr": 0.1})
      ...     meta = read_metadata(path)
      ...
      >>> meta["metadata"], meta["params"]["names"], meta["params"]["shapes"]
      ({'lr': 0.1}, ['w'], [[2]])
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
    if isinstance(version, int) and version > FORMAT_VERSION:  # not corruption:
        raise CheckpointMismatchError(  # resume refuses it rather than skip it
            f"{path} was written by a newer pztrain (format version {version}); "
            "upgrade pztrain to read it."
        )
    bad = [] if isinstance(version, int) else ["format_version"]
    members = meta.get("members")
    if members is not None and not (_is_size(members) and members > 0):
        bad.append("members")
    for item in _META_LISTS:
        if item != "state" or item in meta:  # no state: a params-only checkpoint
            bad += _bad_item(item, meta.get(item))
    extra = meta.get("metadata", {})
    if not isinstance(extra, dict) or not isinstance(extra.get("callbacks", {}), dict):
        bad.append("metadata")
    if bad:
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: its metadata's {sorted(set(bad))} "
            "entries are not what pztrain writes (lists of one length per item, "
            "dicts of metadata, numbers as scalars, a member count >= 1 or null)."
        )


def _bad_item(item: str, part: Any) -> list[str]:
    """What is wrong with the JSON of an item (``params`` or ``state``)."""
    keys = _META_LISTS[item]
    lists = [part.get(k) for k in keys] if isinstance(part, dict) else [None]
    if not all(isinstance(x, list) for x in lists) or len(set(map(len, lists))) > 1:
        return [item]
    names, shapes, dtypes = lists
    bad = []
    if not all(isinstance(n, str) for n in names + dtypes) or not all(
        isinstance(s, list) and all(_is_size(n) for n in s) for s in shapes
    ):
        bad.append(f"{item} entries")
    elif item == "params" and not all(map(_is_numpy_dtype, dtypes)):
        bad.append("params dtypes")
    if not _is_checksums(part.get(CHECKSUM, [None] * len(names)), len(names)):
        bad.append(f"{item}.{CHECKSUM}")
    scalars = part.get("scalars", {})
    if not isinstance(scalars, dict):
        bad.append(f"{item}.scalars")
    else:
        bad += [
            f"{item}.scalars[{p!r}]"
            for p, v in scalars.items()
            if not isinstance(v, bool | int | float)
        ]
    return bad


def _is_size(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _is_checksums(sums: Any, n: int) -> bool:
    """A list of ``n`` checksums (16 hex digits) or ``None`` (not verified)."""
    return (
        isinstance(sums, list)
        and len(sums) == n
        and all(s is None or re.fullmatch("[0-9a-f]{16}", str(s)) for s in sums)
    )


def _is_numpy_dtype(name: str) -> bool:
    try:
        np.dtype(name)
    except TypeError:
        return False
    return True


def checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Resolves a checkpoint directory (a `Checkpoints` root means its newest)."""
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}: the directory does not exist.")
    if (path / "meta").is_dir():
        return path
    steps = checkpoint_steps(path)
    if steps:
        return path / str(max(steps))
    raise CheckpointError(
        f"{path} is not a pztrain checkpoint: it has no 'meta' item and no numbered "
        "step directories. Pass the directory that save_params/save_state wrote."
    )


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in a `Checkpoints` directory, in
    order, read from its listing alone (no lock, no orbax manager: a finished
    save is renamed into place whole, so a ``<step>/meta`` directory is
    complete). ``[]`` if the directory does not exist."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in path.iterdir()
        if p.name.isdigit() and (p / "meta").is_dir()
    )


def stored_params(meta: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name → (shape, dtype) of the stored params, in stored order."""
    p = meta["params"]
    return {
        n: (tuple(s), d)
        for n, s, d in zip(p["names"], p["shapes"], p["dtypes"], strict=True)
    }


# ----------------------------------------------------------------------------
# writing the JSON


def check_json(value: Any, where: str) -> None:
    """Raises `CheckpointError` naming the first entry JSON cannot hold."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where} has a non-string key {k!r}.")
            check_json(v, f"{where}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_json(v, f"{where}[{i}]")
    elif not isinstance(value, str | int | float | bool) and value is not None:
        raise CheckpointError(
            f"{where} is a {type(value).__name__}, which JSON cannot hold; store "
            "numbers, strings, lists and dicts (e.g. float(x), str(x))."
        )


def describe_params(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """The JSON of the params: names, shapes and dtypes, in order.

    Raises:
      CheckpointError: naming a leaf that is not an array (a Python number) or
        is empty, or if names repeat.
    """
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise CheckpointError("Parameter names must be unique to be saved.")
    for name, x in named:
        if not is_array(x):
            raise CheckpointError(
                f"Parameter {name!r} is a Python {type(x).__name__} ({x!r:.40}), not "
                "an array: a checkpoint stores params as arrays. Make it one "
                "(jnp.asarray(...)) or keep it out of the params."
            )
        if not _is_numpy_dtype(str(x.dtype)):
            raise CheckpointError(
                f"Parameter {name!r} is {describe(x)}, which a checkpoint stores "
                "only in the state: keep PRNG keys out of the params."
            )
        _check_not_empty(f"Parameter {name!r}", x)
    return {
        "names": names,
        "shapes": [list(np.shape(x)) for _, x in named],
        "dtypes": [str(x.dtype) for _, x in named],
    }


def describe_state(leaves: list[tuple[str, Any]]) -> tuple[dict, dict[str, Any]]:
    """The state's arrays (keyed ``"0"``, ``"1"``, …) and their JSON.

    Arrays are stored as arrays, Python and NumPy numbers (bool, int, float) in
    the JSON's ``scalars``; other leaves (functions, strings) are structure that
    a load takes from its target.

    Raises:
      CheckpointError: naming a complex number (which neither can hold exactly)
        or an empty array.
    """
    arrays, scalars, paths = {}, {}, []
    for path, leaf in leaves:
        kind = _scalar_kind(leaf)
        if is_array(leaf):
            _check_not_empty(f"State array {path}", leaf)
            arrays[str(len(paths))] = leaf
            paths.append((path, list(np.shape(leaf)), str(leaf.dtype)))
        elif kind is not None:
            scalars[path] = _SCALAR_TYPES[kind](leaf)
        elif isinstance(leaf, complex | np.complexfloating):
            raise CheckpointError(
                f"State leaf {path} is a {type(leaf).__name__} ({leaf!r}), which a "
                "checkpoint cannot store: make it an array (jnp.asarray(...)) or a "
                "static field."
            )
    meta = {
        "paths": [p for p, _, _ in paths],
        "shapes": [s for _, s, _ in paths],
        "dtypes": [d for _, _, d in paths],
        "scalars": scalars,
    }
    return arrays, meta


_SCALAR_TYPES = {"bool": bool, "int": int, "float": float}


def _scalar_kind(x: Any) -> str | None:
    """``"bool"``, ``"int"`` or ``"float"`` for a number the JSON stores."""
    if isinstance(x, bool | np.bool_):
        return "bool"
    if isinstance(x, int | np.integer):
        return "int"
    if isinstance(x, float | np.floating):
        return "float"
    return None


def _check_not_empty(label: str, x: Any) -> None:
    if np.size(x) == 0:
        raise CheckpointError(
            f"{label} is {describe(x)}, an empty array, which orbax cannot save. "
            "Leave it out of what you save, or give it at least one element."
        )


# ----------------------------------------------------------------------------
# the JSON against the target (a mismatch, not corruption)


def check_params(
    path: Path,
    stored: dict[str, Any],
    like_named: dict[str, Any],
    partial: bool,
    members: int | None = None,
) -> set[str]:
    """Checks names, shapes and dtypes; returns the names to load. ``members``:
    the checkpoint's population size (``None``: one run's).

    Raises:
      CheckpointMismatchError: naming the names, shapes or dtypes that differ.
    """
    missing = sorted(set(like_named) - set(stored))
    unexpected = sorted(set(stored) - set(like_named))
    if (missing or unexpected) and not partial:
        raise CheckpointMismatchError(
            f"Checkpoint {path} does not match the target: missing names {missing}, "
            f"unexpected names {unexpected}. Pass partial=True to load only the "
            "names both have (e.g. for fine-tuning)."
        )
    for name in sorted(set(like_named) & set(stored)):
        leaf = like_named[name]
        want = (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__)))
        if stored[name] != want:
            note = member_shape_note(stored[name][0], want[0], members)
            raise CheckpointMismatchError(
                f"Parameter {name!r} in {path} is {describe_shape(*stored[name])}, "
                f"but the target expects {describe_shape(*want)}. "
                + (
                    note
                    or "Build the model with the configuration it was trained with."
                )
            )
    return set(like_named) & set(stored)


def check_state(
    path: Path, stored: dict[str, Any], like_arrays: list[tuple[str, Any]]
) -> None:
    """Checks the state arrays' paths, shapes and dtypes against the target's.

    Raises:
      CheckpointMismatchError: naming the paths, shapes or dtypes that differ.
    """
    have = [p for p, _ in like_arrays]
    if have != stored["paths"]:
        missing = sorted(set(have) - set(stored["paths"]))
        unexpected = sorted(set(stored["paths"]) - set(have))
        raise CheckpointMismatchError(
            f"The state in {path} does not match the target state: missing "
            f"{missing}, unexpected {unexpected}. Build the state with the same "
            "model, optimizer and loss_fn_state as the run that saved it."
        )
    for (p, x), shape, dtype in zip(
        like_arrays, stored["shapes"], stored["dtypes"], strict=True
    ):
        if (list(np.shape(x)), str(x.dtype)) != (shape, dtype):
            raise CheckpointMismatchError(
                f"State array {p} in {path} is {describe_shape(shape, dtype)}, but "
                f"the target expects {describe(x)}.{shared_shape_note(shape, x.shape)}"
            )


def restored_scalars(
    path: Path, stored: dict[str, Any], like_leaves: list[tuple[str, Any]]
) -> dict[str, Any]:
    """The stored numbers of the state, each as the type the target has there.

    A float stays a float, a bool a bool: a stored number of another kind than
    the target's, or a path only one side has, is a mismatch.

    Raises:
      CheckpointMismatchError: naming the paths that differ.
    """
    want = {p: x for p, x in like_leaves if _scalar_kind(x) is not None}
    if set(want) != set(stored):
        raise CheckpointMismatchError(
            f"The state in {path} does not match the target state: its numbers "
            f"differ (missing {sorted(set(want) - set(stored))}, unexpected "
            f"{sorted(set(stored) - set(want))}). Build the state with the same "
            "fields as the run that saved it."
        )
    out = {}
    for p, x in want.items():
        value, kind = stored[p], _scalar_kind(x)
        if _scalar_kind(value) != kind:
            raise CheckpointMismatchError(
                f"State leaf {p} in {path} is stored as a {type(value).__name__} "
                f"({value!r}), but the target has a {kind} there "
                f"({type(x).__name__}). Build the state as the run that saved it."
            )
        out[p] = type(x)(value)
    return out
