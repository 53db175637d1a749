"""Every notebook in ``notebooks/`` runs from top to bottom twice in one kernel.

A reader presses "Run All" twice: nothing the first run wrote stops the second,
and nothing is left in the notebook's directory or the checkout. Each notebook
asserts its own results (an accuracy, equal predictions, pruned trials); here a
notebook fails when any cell raises, or when a cell writes to stderr (a warning,
tqdm's "IProgress not found"). The kernel is this interpreter's ipykernel (a
kernel spec written for ``sys.executable``) and imports pztrain from this
checkout; it runs in a temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import docs_checks
import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # subprocesses, notebooks, examples

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# run twice with its outputs checked by test_interrupt_notebook.py
TWICE_ELSEWHERE = {"05_interrupt_and_continue.ipynb"}
RUN_HERE = [p for p in NOTEBOOKS if p.name not in TWICE_ELSEWHERE]
CELL_TIMEOUT = 300  # seconds
PROGRESS_BAR = {"02_fit_and_plots.ipynb"}  # notebooks whose fit shows a bar
WIDGET = "application/vnd.jupyter.widget-view+json"

CHECK_KERNEL = "import sys, pztrain\nprint(sys.executable)\nprint(pztrain.__file__)"


def test_the_notebooks_are_there():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A ``python3`` kernel spec for this interpreter, found first; the env of
    the kernel, importing pztrain from this checkout."""
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's future default
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def test_the_notebooks_hold_no_checks():
    for path in NOTEBOOKS:
        code = [
            c.source
            for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code"
        ]
        scaffolding = [
            line
            for source in code
            for line in source.splitlines()
            if line.lstrip().startswith(("assert ", "np.testing."))
        ]
        assert scaffolding == [], f"{path.name}: move these into docs_checks.py"


def _outputs(nb, output_type, name=None):
    return [
        (cell.source, out)
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == output_type and name in (None, out.get("name"))
    ]


def _run_all(client: NotebookClient, nb) -> None:
    """Runs every code cell in order ("Run All"); a cell that raises or writes
    to stderr fails the test, naming the cell."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            client.execute_cell(cell, index)  # raises CellExecutionError
    assert not _outputs(nb, "error")
    stderr = [
        f"{source}\n--- wrote to stderr:\n{out.text}"
        for source, out in _outputs(nb, "stream", "stderr")
    ]
    assert not stderr, "\n\n".join(stderr)


def _untracked() -> str:
    """What ``git status`` shows in the checkout (a notebook leaves nothing)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.parametrize("path", RUN_HERE, ids=[p.name for p in RUN_HERE])
def test_notebook_runs_twice_in_one_kernel(path, tmp_path, kernel_env):
    before = _untracked()
    nb = docs_checks.with_checks(nbformat.read(path, as_version=4), path.name)
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_KERNEL))
    workdir = tmp_path / "work"
    workdir.mkdir()
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(workdir)}},
    )
    with client.setup_kernel(env=kernel_env):
        _run_all(client, nb)
        _run_all(client, nb)  # the outputs in nb are the second run's

    assert list(workdir.iterdir()) == []
    assert _untracked() == before
    executable, pztrain_file = nb.cells[-1].outputs[0].text.split()
    assert Path(executable) == Path(sys.executable)
    assert Path(pztrain_file).is_relative_to(ROOT / "pztrain"), pztrain_file
    if path.name in PROGRESS_BAR:  # tqdm.auto shows a widget (ipywidgets found)
        widgets = [
            out
            for _, out in _outputs(nb, "display_data")
            if WIDGET in out.data and "step/s" in out.data.get("text/plain", "")
        ]
        assert widgets, f"{path.name} shows no progress-bar widget"
