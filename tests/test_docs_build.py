"""The documentation site builds with warnings as errors, as README says.

``sphinx-build -W -b html docs <out>`` runs every notebook (myst-nb through
jupyter-cache), renders the guides and the API reference, and checks every
internal link and every reference to a pztrain name (``nitpicky``; other
libraries' names are not checked), and that every public name has an entry.
Then every link of the built pages to a page or an anchor of the site lands
(``docs/_ext/pztrain_links.py``: the source pages' "[docs]" links too), the API
reference documents each object once, on its home module's page, and the guides
link the names they use. Small sites built with the same ``conf.py`` show that a
notebook that raises, a broken internal link, a reference to a name without an
entry and a public name without one each fail the build, naming what is wrong.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from html import unescape
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec

import pztrain

pytestmark = pytest.mark.slow  # notebooks run, a kernel per notebook

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
from pztrain_links import broken_links  # noqa: E402


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
    _the_reference_links(out)
    _pages_show_what_they_say(out)
    assert not long_output_lines(out), long_output_lines(out)


# The pages issue 41 read at 1280 px: no line of their outputs is cut there.
READ_AT_1280 = [
    *(f"guides/{g}" for g in ["quickstart", "fit", "checkpoints", "populations"]),
    *(f"guides/{g}" for g in ["data", "finetuning"]),
    *(f"guides/{g}" for g in ["loss_and_models", "metrics", "parameter_groups"]),
    *(f"notebooks/{n}" for n in ["03_params_only", "04_optuna", "06_many_devices"]),
    *(f"notebooks/{n}" for n in ["07_ema", "09_populations", "10_evaluations"]),
    "notebooks/11_finetuning",
]
_OUTPUT_TEXT = re.compile(
    r'<div class="output [^"]*">\s*<div class="highlight"><pre>(.*?)</pre>', re.S
)


def long_output_lines(out: Path, pages=READ_AT_1280, width: int = 100) -> list[str]:
    """The lines of the pages' text outputs wider than ``width`` characters (at
    1280 px an output shows 100 (docs/_static/wide.css), a longer line is cut
    at the article's edge, behind a scrollbar) or naming a path of the build
    machine (a traceback's frames: an intended error shows its message)."""
    machine = (str(ROOT), "site-packages")
    long = []
    for page in pages:
        html = (out / f"{page}.html").read_text()
        for block in _OUTPUT_TEXT.findall(html):
            text = unescape(re.sub(r"<[^>]+>", "", block))
            long += [
                f"{page}: {line}"
                for line in text.splitlines()
                if len(line) > width or any(path in line for path in machine)
            ]
    return long


def _pages_show_what_they_say(out: Path) -> None:
    """The guides show their outputs; a progress bar is text; the pages a user
    looks for are there, the version atop each, a copy button on code."""
    for guide in ["quickstart", "checkpoints", "populations"]:
        html = (out / "guides" / f"{guide}.html").read_text()
        assert "cell_output" in html, f"guides/{guide}: no outputs on its page"
    fit_page = unescape((out / "notebooks" / "02_fit_and_plots.html").read_text())
    assert "widget-view+json" not in fit_page  # a widget is an empty box offline
    assert re.search(r"100%\|█+\| (\d+)/\1 \[[\d:]+<[\d:]+, +[\d.]+step/s", fit_page), (
        "notebook 02 shows no text progress bar"
    )
    install_html = (out / "installation.html").read_text()
    install = unescape(re.sub(r"<[^>]+>", "", install_html))
    assert "pip install -e ." in install
    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert f'pip install "pztrain @ git+{url["Repository"]}"' in install
    assert "{{ repository }}" not in install
    assert 'href="api/pztrain.loggers.html#pztrain.loggers.TensorBoardLogger"' in (
        install_html
    )  # the installation page links the names it uses
    assert "tensorboardX" in install  # each extra, with what it brings
    changelog = (out / "changelog.html").read_text()
    assert "Unreleased" in changelog
    index = (out / "index.html").read_text()
    assert f"pztrain {pztrain.__version__}" in index
    assert f'href="{url["Repository"]}"' in index  # the header's repository button
    speed = (out / "guides" / "speed.html").read_text()
    assert 'id="benchmarks"' in speed and "step_bench.py" in speed
    assert "copybutton.js" in index


def _the_reference_links(out: Path) -> None:
    """Each object's entry is on its home module's page, the top-level page a
    table of links to them; the guides link the names they use; no internal link
    of the site (the source pages' "[docs]" links included) is broken."""
    top = (out / "api" / "pztrain.html").read_text()
    assert 'href="pztrain.state.html#pztrain.state.TrainState"' in top
    assert 'id="pztrain.TrainState"' not in top  # documented once, at home
    state = (out / "api" / "pztrain.state.html").read_text()
    assert 'id="pztrain.state.TrainState"' in state
    fit_guide = (out / "guides" / "fit.html").read_text()
    assert 'href="../api/pztrain.loop.html#pztrain.loop.fit"' in fit_guide
    for page in sorted((out / "api").glob("*.html")):  # no private names shown
        html = page.read_text()
        text = re.sub(r"<[^>]+>", "", html[html.find("<main") : html.find("</main>")])
        private = set(re.findall(r"\bpztrain(?:\.\w+)*\._[a-z]\w*", text))
        assert not private, f"{page.name} shows private names: {sorted(private)}"
    broken = broken_links(out)
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(
        broken[:50]
    )


def _small_site(tmp_path: Path, index: str, notebook_cells=None) -> Path:
    """docs/ with the real conf.py, one page, and the notebooks given."""
    site = tmp_path / "site"
    (site / "docs").mkdir(parents=True)
    (site / "notebooks").mkdir()
    shutil.copyfile(ROOT / "docs" / "conf.py", site / "docs" / "conf.py")
    shutil.copyfile(ROOT / "pyproject.toml", site / "pyproject.toml")  # its address
    shutil.copytree(ROOT / "docs" / "_static", site / "docs" / "_static")
    shutil.copytree(ROOT / "docs" / "_ext", site / "docs" / "_ext")
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
    page = (
        "# Site\n\n{py:func}`pztrain.no_such_function` and {py:class}`jax.Array`; "
        "{py:obj}`TrainState.no_such_method`.\n"
    )
    docs = _small_site(tmp_path, page)
    run = sphinx(docs, tmp_path / "out", env)
    assert run.returncode != 0
    assert "pztrain.no_such_function" in run.stderr
    assert "`TrainState.no_such_method` names pztrain.state.TrainState" in run.stderr
    assert "jax.Array" not in run.stderr  # other libraries' names are not checked


EMA_ENTRIES = """# Site

Average with `pztrain.with_ema` or `ema_decay()`; `state` and `with_ema_x` stay code.

```{eval-rst}
.. automodule:: pztrain.ema
   :no-members:

.. autoclass:: pztrain.ema.EmaState

.. autoexception:: pztrain.ema.NoEmaError

.. autofunction:: pztrain.ema.ema_decay

.. autofunction:: pztrain.ema.ema_params_of

.. autofunction:: pztrain.ema.with_ema
```
"""


def test_a_public_name_without_an_api_entry_fails_the_build(tmp_path, env):
    """pztrain.ema's names but ``has_ema``: ``with_ema`` has its entry on its home
    page (``pztrain.ema.with_ema``, also ``pztrain.with_ema``), ``has_ema`` none.
    With it, the same site builds, and its page's literals naming them are links
    (the docstrings' names are not references here: most have no entry)."""
    only_ema = ("-D", "pztrain_api_modules=pztrain.ema", "-D", "default_role=")
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
    page = (tmp_path / "out2" / "index.html").read_text()
    for name, target in [
        ("pztrain.with_ema", "with_ema"),
        ("ema_decay()", "ema_decay"),
    ]:
        link = f'href="#pztrain.ema.{target}"><code class="docutils literal'
        assert link in page and f'<span class="pre">{name}</span>' in page, name
    for literal in ["state", "with_ema_x"]:
        assert f'literal notranslate"><span class="pre">{literal}</span>' in page
