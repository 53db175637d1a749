"""Interrupting `fit` in a real Jupyter kernel (issue 21).

The kernel is interrupted the way Jupyter's button does it (the kernel
manager's ``interrupt_kernel()``, a SIGINT to the kernel) while a cell runs
`fit`: the cell ends without an error, `fit` having returned its state, and the
next cell goes on training from it. Afterwards the kernel's own SIGINT handling
is back: interrupting a ``time.sleep`` raises `KeyboardInterrupt` as usual.
``notebooks/05_interrupt_and_continue.ipynb`` runs twice in one kernel and
leaves no file behind.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import docs_checks
import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # a kernel

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "05_interrupt_and_continue.ipynb"

SETUP = """
import signal
import jax, jax.numpy as jnp, numpy as np, optax
import pztrain

handler_before = signal.getsignal(signal.SIGINT)
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype(np.float32)
y = (x @ rng.normal(size=(8, 1))).astype(np.float32)


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((x @ model["w"] - y) ** 2)
    return loss, state, {"loss": loss}


class Running(pztrain.Callback):
    def on_log(self, state, record):
        if record["step"] == 20:
            print("running", flush=True)


step = pztrain.build_train_step(loss_fn)
data = pztrain.ArrayLoader({"x": x, "y": y}, 16, seed=0)
state = pztrain.TrainState.initial_state(
    {"w": jnp.zeros((8, 1))}, optax.sgd(0.01), jax.random.key(0)
)
"""

LONG_FIT = """
state, history = pztrain.fit(state, step, data, num_steps=10**7, log_every=10,
                             callbacks=[Running()], progress=False)
print("returned", history.stop_reason, int(state.step))
"""

GO_ON = """
start = int(state.step)
state, history = pztrain.fit(state, step, data, num_steps=start + 30, progress=False)
print("went on from", start, "to", int(state.step), history.stop_reason)
assert int(state.step) == start + 30
assert signal.getsignal(signal.SIGINT) is handler_before
"""

SLEEP = "import time\nprint('sleeping', flush=True)\ntime.sleep(120)"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _client(nb, workdir: Path) -> NotebookClient:
    return NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        allow_errors=True,
        resources={"metadata": {"path": str(workdir)}},
    )


def _text(cell, name="stdout") -> str:
    return "".join(
        o.get("text", "")
        for o in cell.outputs
        if o.output_type == "stream" and o.get("name") == name
    )


def _errors(cell) -> list[str]:
    return [o.ename for o in cell.outputs if o.output_type == "error"]


async def _interrupt_when(client, cell, marker: str, timeout: float = 240) -> None:
    """Interrupts the kernel once ``cell`` has printed ``marker``."""
    for _ in range(int(timeout / 0.1)):
        if marker in _text(cell):
            await client.km.interrupt_kernel()
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the cell never printed {marker!r}: {cell.outputs}")


def test_interrupting_a_running_fit_keeps_the_state(tmp_path, kernel_env):
    cells = [nbformat.v4.new_code_cell(src) for src in (SETUP, LONG_FIT, GO_ON)]
    cells.append(nbformat.v4.new_code_cell(SLEEP))
    nb = nbformat.v4.new_notebook(cells=cells)
    client = _client(nb, tmp_path)

    async def session():
        async with client.async_setup_kernel(env=kernel_env):
            await client.async_execute_cell(cells[0], 0)
            running = asyncio.ensure_future(client.async_execute_cell(cells[1], 1))
            await _interrupt_when(client, cells[1], "running")
            await running
            await client.async_execute_cell(cells[2], 2)
            sleeping = asyncio.ensure_future(client.async_execute_cell(cells[3], 3))
            await _interrupt_when(client, cells[3], "sleeping")
            await sleeping

    asyncio.run(session())
    assert [_errors(c) for c in cells[:3]] == [[], [], []], [c.outputs for c in cells]
    out = _text(cells[1])
    assert "pztrain.fit: interrupted (SIGINT) at step" in out
    returned = out.rsplit("returned ", 1)[1].split()
    assert returned[0] == "interrupted" and int(returned[1]) >= 20
    assert f"went on from {returned[1]} to {int(returned[1]) + 30} None" in _text(
        cells[2]
    )
    assert _errors(cells[3]) == ["KeyboardInterrupt"]  # the kernel's handler is back


def test_the_interrupt_notebook_runs_twice_in_one_kernel(tmp_path, kernel_env):
    before = _untracked()
    nb = docs_checks.with_checks(nbformat.read(NOTEBOOK, as_version=4), NOTEBOOK.name)
    workdir = tmp_path / "work"
    workdir.mkdir()
    client = _client(nb, workdir)
    with client.setup_kernel(env=kernel_env):
        for _ in range(2):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type == "code":
                    client.execute_cell(cell, index)
                    assert not _errors(cell), cell.outputs
                    assert not _text(cell, "stderr"), _text(cell, "stderr")
    text = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "interrupted at step 100" in text
    assert "the same params as the uninterrupted run" in text
    assert "kept: step 350" in text
    assert list(workdir.iterdir()) == []
    assert _untracked() == before


def _untracked() -> str:
    """The files git does not track in the checkout (none is left behind)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
