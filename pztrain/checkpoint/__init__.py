"""Checkpoints: the on-disk format, periodic saves during `pztrain.fit`, resume.

A checkpoint is orbax arrays + JSON, written atomically; nothing is pickled and
loading runs no code (the structure comes from a target built in code).

* `pztrain.checkpoint._format`: params-only and full-state save and load;
* `pztrain.checkpoint._warm`: renames for a warm start, and `LoadReport`;
* `pztrain.checkpoint._safetensors`: params as a ``.safetensors`` file;
* `pztrain.checkpoint._metadata`: the JSON, and the two errors;
* `pztrain.checkpoint._integrity`: checksums of what is written and read;
* `pztrain.checkpoint._orbax`: pztrain's orbax settings and atomic writes;
* `pztrain.checkpoint._targets`: where loaded arrays go;
* `pztrain.checkpoint._rebuild`: `load_from_checkpoint`;
* `pztrain.checkpoint._directory`: a `Checkpoints` directory on disk;
* `pztrain.checkpoint._lock`: one run per directory;
* `pztrain.checkpoint._store`: the checkpoints of one directory (`CheckpointStore`);
* `pztrain.checkpoint._callback`: the `Checkpoints` callback.
"""

from pztrain.checkpoint._callback import Checkpoints
from pztrain.checkpoint._format import (
    load_params,
    load_state,
    save_params,
    save_state,
)
from pztrain.checkpoint._lock import DirectoryInUseError
from pztrain.checkpoint._metadata import (
    CheckpointError,
    CheckpointMismatchError,
    read_metadata,
)
from pztrain.checkpoint._rebuild import load_from_checkpoint
from pztrain.checkpoint._safetensors import export_safetensors, import_safetensors
from pztrain.checkpoint._warm import LoadReport

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "Checkpoints",
    "DirectoryInUseError",
    "LoadReport",
    "export_safetensors",
    "import_safetensors",
    "load_from_checkpoint",
    "load_params",
    "load_state",
    "read_metadata",
    "save_params",
    "save_state",
]
