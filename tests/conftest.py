"""Strict JAX settings for the test suite, and a persistent compilation cache.

The cache keeps XLA's compiled programs between runs (in the system's temporary
directory, or ``$PZTRAIN_JAX_CACHE``; ``PZTRAIN_JAX_CACHE=0`` turns it off), so a
second ``python -m pytest -m "not slow"`` compiles almost nothing; the processes
tests start use it too. JAX keys every entry by the program, the JAX version and
the flags: a hit is the same program.
"""

import getpass
import os
import signal
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")

# A run started in the background of a non-interactive shell (``pytest &``)
# inherits SIGINT ignored, and fit then leaves it alone (as it should): the stop
# tests, which send SIGINT to themselves, need Python's own handler, as an
# interactive run has.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_cache = os.environ.get(
    "PZTRAIN_JAX_CACHE",
    str(Path(tempfile.gettempdir()) / f"pztrain-jax-cache-{getpass.getuser()}"),
)
if _cache not in ("", "0"):
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # The processes the tests start (workers, examples, kill campaigns that
    # resume the same run again and again) share it through JAX's variables.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


# Doctests that import a heavy library (seconds each) leave the fast subset.
_SLOW_DOCTESTS = (
    "pztrain.loggers._tracking.MLflowLogger",
    "pztrain.loggers._tracking.WandbLogger",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.name in _SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
