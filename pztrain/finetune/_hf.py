"""Hugging Face's checkpoint layout on disk: ``model.safetensors``, or shards
named by ``model.safetensors.index.json``'s ``weight_map``, beside
``config.json``. Headers are read without the tensors; tensors (or boxes of
them) through ``safetensors.safe_open(..., framework="numpy")``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CheckpointFiles",
    "checkpoint_files",
    "read_config",
    "safetensors_module",
    "write_checkpoint",
]

INDEX = "model.safetensors.index.json"
# safetensors' dtype names as NumPy's (ml_dtypes' for the 8-bit floats)
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
SINGLE = "model.safetensors"


def safetensors_module() -> Any:
    """``safetensors`` (the extra ``pztrain[safetensors]``)."""
    try:
        import ml_dtypes  # noqa: F401  (NumPy's bfloat16, for BF16 slices)
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "Reading or writing Hugging Face checkpoints needs the extra: pip "
            "install 'pztrain[safetensors]'."
        ) from None
    return safetensors


class CheckpointFiles:
    """The tensors of a checkpoint: for each name its shape, dtype and file.
    Each file is opened once, for its header and its reads, until `close` (or
    the end of a ``with`` block).

    Attributes:
      where: The path given (a directory, a ``.safetensors`` file or an index).
      header: name → ``(shape, dtype name)`` (NumPy's: ``"float32"``).
      files: name → the file holding it.
      bytes_read: bytes of tensor data read so far through `read`.
    """

    def __init__(
        self,
        where: Path,
        shards: Sequence[Path],
        weight_map: Mapping[str, Path] | None = None,
    ) -> None:
        self.where, self.files, self.bytes_read = where, {}, 0
        self.header: dict[str, tuple[tuple[int, ...], str]] = {}
        self._open: dict[Path, Any] = {}
        try:
            for path in shards:
                self._scan(path, weight_map or {})
        except BaseException:
            self.close()
            raise
        absent = [n for n in weight_map or () if n not in self.header]
        if absent:
            self.close()
            raise ValueError(
                f"{where}: the index names tensors its shards lack: {absent[:5]}."
            )

    def _scan(self, path: Path, weight_map: Mapping[str, Path]) -> None:
        f = safetensors_module().safe_open(str(path), framework="numpy")
        f = self._open[path] = f.__enter__()
        for name in f.keys():
            if weight_map.get(name, path) != path:
                continue  # the index says another shard holds it
            s = f.get_slice(name)
            dtype = _DTYPES.get(s.get_dtype(), s.get_dtype().lower())
            self.header[name] = (tuple(s.get_shape()), dtype)
            self.files[name] = path

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The ``box`` of tensor ``name``: only those bytes are read."""
        s = self._open[self.files[name]].get_slice(name)
        x = np.asarray(s[tuple(slice(a, b) for a, b in box)] if box else s[...])
        self.bytes_read += x.nbytes
        return x

    def close(self) -> None:
        """Closes the files."""
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open = {}

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checkpoint_files(path: str | os.PathLike) -> CheckpointFiles:
    """The tensors at ``path``: a directory in Hugging Face's layout, one
    ``.safetensors`` file, or a ``.safetensors.index.json``.

    Raises:
      FileNotFoundError: no checkpoint there, or a shard the index names is
        missing (named, before any tensor is read).
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX).exists():
            return _indexed(path / INDEX)
        if (path / SINGLE).exists():
            return _single(path / SINGLE, path)
        raise FileNotFoundError(
            f"{path} holds neither {SINGLE} nor {INDEX}: not a checkpoint in Hugging "
            "Face's layout (give the .safetensors file itself if it has another name)."
        )
    if path.name.endswith(".json"):
        return _indexed(path)
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    return _single(path, path)


def _single(file: Path, where: Path) -> CheckpointFiles:
    return CheckpointFiles(where, [file])


def _indexed(index: Path) -> CheckpointFiles:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise FileNotFoundError(
            f"{index} is not a readable safetensors index with a 'weight_map' ({e})."
        ) from None
    files = {name: index.parent / shard for name, shard in weight_map.items()}
    for name, file in files.items():
        if not file.exists():
            raise FileNotFoundError(
                f"{index} maps {name!r} to the shard {file.name}, which is missing "
                f"from {index.parent}. Download every shard the index names."
            )
    return CheckpointFiles(index, list(dict.fromkeys(files.values())), files)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` beside a checkpoint (``path``: its directory or a file
    in it).

    Example:
      >>> import json, tempfile
      >>> from pztrain.finetune import read_config
      >>> with tempfile.TemporaryDirectory() as d:
      ...     with open(d + "/config.json", "w") as f:
      ...         json.dump({"hidden_size": 16}, f)
      ...     print(read_config(d))
      {'hidden_size': 16}
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    return json.loads((folder / "config.json").read_text())


def write_checkpoint(
    folder: Path,
    tensors: Mapping[str, np.ndarray],
    *,
    config: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Writes ``tensors`` in Hugging Face's layout: one ``model.safetensors``,
    or shards of at most ``max_shard_bytes`` each and their index."""
    save_file = safetensors_module().numpy.save_file
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}  # what transformers expects of a checkpoint
    if config is not None:
        (folder / "config.json").write_text(json.dumps(dict(config), indent=2))
    if max_shard_bytes is None:
        save_file(dict(tensors), str(folder / SINGLE), metadata=meta)
        return folder
    shards: list[dict[str, np.ndarray]] = [{}]
    for name, x in tensors.items():
        size = sum(t.nbytes for t in shards[-1].values())
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = x
    n, weight_map = len(shards), {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / file), metadata=meta)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(x.nbytes for x in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return folder
