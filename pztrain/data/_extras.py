"""The optional data libraries, imported when first needed.

``grain`` (and ``array_record``, its on-disk format) come with the ``data``
extra, Hugging Face ``datasets`` with the ``hf`` extra; an import error names
the extra to install. `loaded` tells whether an object could be one of theirs
without importing anything (an object of a library that was never imported
is not one of its objects).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from types import ModuleType
from typing import Any

__all__ = ["import_extra", "loaded", "quiet_grain_flags", "worker_init"]

_EXTRAS = {"grain": "data", "array_record": "data", "datasets": "hf"}


def import_extra(name: str) -> ModuleType:
    """``import name``, or an ImportError naming the extra that installs it.

    Example:
      >>> import_extra("grain").MapDataset.range(3)[1]
      1
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        extra = _EXTRAS[name.partition(".")[0]]
        raise ImportError(
            f"{name} is needed here and is not installed: pip install "
            f"'pztrain[{extra}]'."
        ) from e


def loaded(name: str) -> Any:
    """The module ``name`` if something imported it already, else ``None``."""
    return sys.modules.get(name)


def quiet_grain_flags() -> None:
    """Lets grain's worker processes start in a program that parses no absl
    flags: grain reads its ``grain_enable_multiprocess_worker_profiling`` flag
    there, which absl refuses before flags are parsed. Marking that one flag
    as given keeps its default value (grain does the same for its own debug
    flags)."""
    from absl import flags

    name = "grain_enable_multiprocess_worker_profiling"
    if not flags.FLAGS.is_parsed() and name in flags.FLAGS:
        flags.FLAGS[name].present = True


def worker_init(parent: int, worker: int = 0, workers: int = 1) -> None:
    """Sets up a grain worker process of process ``parent``: it ignores SIGINT
    and ends once ``parent`` is gone.

    Ctrl-C in a terminal, or a notebook's interrupt, goes to the whole process
    group: the workers would die with ``KeyboardInterrupt`` tracebacks while
    ``fit`` stops cleanly and closes them itself. grain's workers stop when
    their iterator is closed; a parent killed outright (SIGKILL, the OOM
    killer) closes nothing, and its workers would wait for it forever: a
    daemon thread checks every half second whether this process was handed to
    another parent. ``worker`` and ``workers`` are grain's worker index and
    count (unused).
    """
    del worker, workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="pztrain-orphan").start()
