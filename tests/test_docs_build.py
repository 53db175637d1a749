"""The documentation site builds with warnings as errors, as README says.

``sphinx-build -W -b html docs <out>`` runs every notebook (myst-nb through
jupyter-cache), renders the guides and the API reference, and checks every
internal link and every reference to a pztrain name (``nitpicky``; other
libraries' names are not checked), and that every public name has an entry.
Small sites built with the same ``conf.py`` show that a notebook that raises, a
broken internal link, a reference to a name without an entry and a public name
without one each fail the build, naming what is wrong.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec

pytestmark = pytest.mark.slow  # notebooks run, a kernel per notebook

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(tmp_path):
    """A ``python3`` kernel for this interpreter, importing this checkout."""
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(
        os.environ,
        JUPYTER_PATH=str(tmp_path / "jupyter"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONPATH=os.pathsep.join(path),
    )


def sphinx(src: Path, out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    return subprocess.run(
        [*cmd, *extra, str(src), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_the_site_builds(tmp_path, env):
    """The README command, into a temporary directory (its own notebook cache)."""
    out = tmp_path / "html"
    cache = tmp_path / "jupyter_cache"
    run = sphinx(ROOT / "docs", out, env, "-D", f"nb_execution_cache_path={cache}")
    assert run.returncode == 0, run.stderr[-5000:]
    for page in ["index", "guides/quickstart", "api/pztrain", "api/pztrain.step"]:
        assert (out / f"{page}.html").exists(), page
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        html = (out / "notebooks" / f"{notebook.stem}.html").read_text()
        assert 'class="output' in html, f"{notebook.name}: no outputs on its page"
    summary = (out / "notebooks" / "01_functional_loop.html").read_text()
    assert "treescope" in summary  # treescope's interactive HTML is on the page
    api = (out / "api" / "pztrain.html").read_text()
    assert 'id="pztrain.TrainState"' in api and 'id="pztrain.fit"' in api


def _small_site(tmp_path: Path, index: str, notebook_cells=None) -> Path:
    """docs/ with the real conf.py, one page, and the notebooks given."""
    site = tmp_path / "site"
    (site / "docs").mkdir(parents=True)
    (site / "notebooks").mkdir()
    shutil.copyfile(ROOT / "docs" / "conf.py", site / "docs" / "conf.py")
    shutil.copytree(ROOT / "docs" / "_static", site / "docs" / "_static")
    (site / "docs" / "index.md").write_text(index)
    if notebook_cells is not None:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell("# Broken")]
        nb.cells += [nbformat.v4.new_code_cell(c) for c in notebook_cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
        nbformat.write(nb, site / "notebooks" / "broken.ipynb")
    return site / "docs"


TOC = "# Site\n\n```{toctree}\n:glob:\n\nnotebooks/*\n```\n"


def test_a_notebook_that_raises_fails_the_build_naming_it(tmp_path, env):
    cells = ["x = 1", "raise ValueError('the third cell fails')"]
    docs = _small_site(tmp_path, TOC, cells)
    run = sphinx(docs, tmp_path / "out", env)
    assert run.returncode != 0
    assert "broken.ipynb" in run.stderr
    assert "the third cell fails" in run.stderr  # the cell's source and error


def test_a_broken_internal_link_fails_the_build(tmp_path, env):
    docs = _small_site(tmp_path, "# Site\n\nSee [the guide](guides/missing.md).\n")
    run = sphinx(docs, tmp_path / "out", env)
    assert run.returncode != 0
    assert "guides/missing" in run.stderr, run.stderr[-2000:]


def test_a_reference_without_an_api_entry_fails_the_build(tmp_path, env):
    page = "# Site\n\n{py:func}`pztrain.no_such_function` and {py:class}`jax.Array`.\n"
    docs = _small_site(tmp_path, page)
    run = sphinx(docs, tmp_path / "out", env)
    assert run.returncode != 0
    assert "pztrain.no_such_function" in run.stderr
    assert "jax.Array" not in run.stderr  # other libraries' names are not checked


EMA_ENTRIES = """# Site

```{eval-rst}
.. automodule:: pztrain.ema
   :no-members:

.. autoclass:: pztrain.ema.EmaState

.. autoexception:: pztrain.ema.NoEmaError

.. autofunction:: pztrain.ema.ema_decay

.. autofunction:: pztrain.ema.ema_params_of

.. autofunction:: pztrain.with_ema
```
"""


def test_a_public_name_without_an_api_entry_fails_the_build(tmp_path, env):
    """pztrain.ema's names but ``has_ema``: ``with_ema`` has its entry under its
    first public name (``pztrain.with_ema``), ``has_ema`` none. With it, the same
    site builds."""
    only_ema = ("-D", "pztrain_api_modules=pztrain.ema")
    docs = _small_site(tmp_path / "without", EMA_ENTRIES)
    run = sphinx(docs, tmp_path / "out", env, *only_ema)
    assert run.returncode != 0
    assert "pztrain.ema.has_ema has no entry in the API reference" in run.stderr
    assert "autofunction:: pztrain.ema.has_ema" in run.stderr  # the fix
    for documented in ["EmaState", "NoEmaError", "ema_decay", "with_ema"]:
        assert f"pztrain.ema.{documented} has no entry" not in run.stderr
    has_ema = "\n.. autofunction:: pztrain.ema.has_ema\n```\n"
    docs = _small_site(tmp_path / "with", EMA_ENTRIES.replace("```\n", has_ema))
    run = sphinx(docs, tmp_path / "out2", env, *only_ema)
    assert run.returncode == 0, run.stderr[-2000:]
