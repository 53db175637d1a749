"""Strict JAX settings for the test suite, and a persistent compilation cache.

The cache keeps XLA's compiled programs between runs (in the system's temporary
directory, or ``$PZTRAIN_JAX_CACHE``; ``PZTRAIN_JAX_CACHE=0`` turns it off), so a
second ``python -m pytest -m "not slow"`` compiles almost nothing; the processes
tests start use it too. JAX keys every entry by the program, the JAX version and
the flags: a hit is the same program.
"""

import getpass
import os
import shutil
import signal
import tempfile
from pathlib import Path

import jax
import pytest

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
    for item in items:
        if item.name in _SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
    # The tests that read the 8-device cases' outcomes go last: the cases run
    # in the background meanwhile (pytest_collection_finish).
    items.sort(key=lambda item: item.get_closest_marker("eight_devices") is not None)


_EIGHT_DEVICES = pytest.StashKey()


def _eight_device_files(session) -> list[str]:
    """The cases files that the session's selected tests name with
    ``@pytest.mark.eight_devices(file)``."""
    return sorted(
        {
            marker.args[0]
            for item in session.items
            for marker in item.iter_markers("eight_devices")
        }
    )


def pytest_collection_finish(session):
    """Starts the 8-device cases in the background (``tests/device_cases.py``):
    they run beside the session's other tests. pytest-xdist's workers share
    one run instead (the ``eight_device_outcomes`` fixture)."""
    files = _eight_device_files(session)
    if files and not session.config.option.collectonly:
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            from device_cases import CasesRun

            out = Path(tempfile.mkdtemp(prefix="pztrain-eight-devices-"))
            session.config.stash[_EIGHT_DEVICES] = CasesRun(files, out)


def pytest_sessionfinish(session):
    run = session.config.stash.get(_EIGHT_DEVICES, None)
    if run is not None:
        run.stop()
        shutil.rmtree(run.out, ignore_errors=True)


@pytest.fixture(scope="session")
def eight_device_outcomes(request, tmp_path_factory):
    """The outcomes of every cases file that the session's selected tests name
    with ``@pytest.mark.eight_devices(file)``, run once in one subprocess on 8
    simulated devices (``tests/device_cases.py``)."""
    run = request.config.stash.get(_EIGHT_DEVICES, None)
    if run is not None:  # started when the session was collected
        return run.outcomes()
    from device_cases import shared_run

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one run for all the workers
        base = base.parent
    return shared_run(_eight_device_files(request.session), base / "eight_devices")


@pytest.fixture
def eight_device_cases(request, eight_device_outcomes):
    """The outcomes of the cases file this test names with
    ``@pytest.mark.eight_devices(file)``."""
    marker = request.node.get_closest_marker("eight_devices")
    assert marker is not None, "mark the test with @pytest.mark.eight_devices(file)"
    return eight_device_outcomes[marker.args[0]]
