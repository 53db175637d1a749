"""The EMA notebook runs, and runs again in the same kernel (a reader who
re-runs every cell) without an error or a warning."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # a kernel, a notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "07_ema.ipynb"


def test_the_ema_notebook_runs_twice_in_one_kernel(tmp_path, monkeypatch):
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    nb.cells += copy.deepcopy(nb.cells)
    workdir = tmp_path / "work"
    workdir.mkdir()
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute(env=env)  # raises CellExecutionError naming the cell
    outputs = [out for c in nb.cells if c.cell_type == "code" for out in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    stderr = [o.text for o in outputs if o.get("name") == "stderr"]
    assert not stderr, stderr
    assert list(workdir.iterdir()) == []  # files went to a temporary directory
