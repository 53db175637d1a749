"""Sphinx configuration of pztrain's documentation site.

Build with ``sphinx-build -W -b html docs docs/_build/html`` (``pip install -e
".[docs]"`` first). The notebooks of ``notebooks/`` are copied into
``docs/notebooks/`` (git-ignored) and executed by myst-nb through jupyter-cache,
as are the guides (MyST-NB text notebooks): a rebuild with unchanged pages and an
unchanged ``pztrain`` runs none of them.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import pkgutil
import shutil
import sys
import tomllib
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # this checkout's pztrain, installed or not
sys.path.insert(0, str(DOCS / "_ext"))  # the API reference's extensions


def _copy_notebooks() -> None:
    """Every ``notebooks/*.ipynb`` gets a page: copied when its bytes changed."""
    target = DOCS / "notebooks"
    target.mkdir(exist_ok=True)
    sources = {p.name: p for p in (ROOT / "notebooks").glob("*.ipynb")}
    for stale in target.glob("*.ipynb"):
        if stale.name not in sources:
            stale.unlink()
    for name, source in sources.items():
        copy = target / name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)


_copy_notebooks()

# The repository's address, set once in pyproject.toml's [project.urls]: the
# header's repository button links it, and "{{ repository }}" in a page's text or
# code block becomes it (`_fill_repository`).
_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
repository_url = _PROJECT["urls"]["Repository"].rstrip("/")

import pztrain_api  # noqa: E402

import pztrain  # noqa: E402

project = "pztrain"
author = "pztrain contributors"
copyright = "pztrain contributors"  # noqa: A001
release = version = pztrain.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "pztrain_api",  # each object once, on its home module's page; summary tables
    "pztrain_autolink",  # the guides' `pztrain.fit`, `TrainState`: links
    "sphinx_copybutton",
]

exclude_patterns = ["_build", "_tools", "**.ipynb_checkpoints", "jupyter_execute"]
suppress_warnings = ["mystnb.unknown_mime_type"]  # treescope's and tqdm's widget JSON

# Notebooks: executed at build time through jupyter-cache (docs/_build/.jupyter_cache),
# each in a temporary working directory; a cell that raises fails the build, naming
# the notebook and the cell.
nb_execution_mode = "cache"


def _source_hash() -> str:
    """A short hash of pztrain's sources: a page's cached outputs are reused only
    when neither its code nor the library changed (jupyter-cache keys on code)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "pztrain").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache" / _source_hash())
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_in_temp = True
nb_merge_streams = True
# A tqdm widget saved by a run without a browser renders only where its script
# loads from the web: the kernels the build starts draw text bars instead.
os.environ.setdefault("PZTRAIN_PROGRESS", "text")
# Plots shown in an article about 800 px wide: text that stays readable shrunk.
os.environ.setdefault("MATPLOTLIBRC", str(DOCS / "_tools" / "matplotlibrc"))

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The API reference: signatures, Google-style docstrings and their examples.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The copy button copies the code, without ">>> " and "... " prompts or outputs;
# a bare "..." (the blank line that ends a def/for/with block in a docstring's
# example) is copied as a blank line, which the REPL needs: tests/test_repl_paste.py.
copybutton_prompt_text = r">>> |\.\.\. |\.\.\.$"
copybutton_prompt_is_regexp = True
copybutton_selector = "div:not(.output) > div.highlight pre"  # code, not outputs

# The page's contents lists a method under its class as `steps_per_epoch()`, not
# `ArrayLoader.steps_per_epoch()`: the names fit the narrow column.
toc_object_entries_show_parents = "hide"

html_theme = "sphinx_book_theme"
html_title = f"pztrain {version}"  # the version, atop every page
html_static_path = ["_static"]
html_css_files = ["wide.css"]
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "repository_url": repository_url,  # a button atop every page
    "use_repository_button": True,
}

# Every reference to a pztrain name must resolve (a missing API entry is an error);
# references to other libraries' types (jax, optax, numpy, typing) are not checked.
# Every public name must have an entry, referenced or not (`_missing_api_entries`).
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"^(?!pztrain\b).*")]
napoleon_use_ivar = True  # "Attributes:" as fields: NamedTuple fields documented once
# A docstring's `name` is a reference: a pztrain name must resolve (docs/_ext/).
default_role = "py:obj"


def _public_modules() -> list[str]:
    """``pztrain`` and each of its modules with no ``_`` in its dotted name."""
    found = pkgutil.walk_packages(pztrain.__path__, "pztrain.")
    public = (m.name for m in found if "._" not in m.name)
    return ["pztrain", *sorted(public)]


# The modules whose ``__all__`` names must each have an entry in the built site.
pztrain_api_modules = _public_modules()


def _missing_api_entries(app, env):
    """A warning (an error with ``-W``) for each name in the ``__all__`` of
    ``pztrain_api_modules`` that has no entry in the site: no autodoc directive of
    that name or of another public name of the same object (documented once, on
    its home module's page: docs/_ext/pztrain_api.py), and, for a submodule, no
    ``automodule``."""
    from sphinx.util import logging

    domain = env.get_domain("py")
    documented = set()  # ids of the objects that have an entry
    for full in domain.objects:
        modname, _, attr = full.rpartition(".")
        if full.startswith("pztrain.") and modname in sys.modules:
            documented.add(id(getattr(sys.modules[modname], attr, None)))
    for module in app.config.pztrain_api_modules:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj, full = getattr(mod, name), f"{module}.{name}"
            if inspect.ismodule(obj):
                found = obj.__name__ in domain.modules
            else:
                found = full in domain.objects or id(obj) in documented
            if not found:
                home = pztrain_api.home_name(obj) if not inspect.ismodule(obj) else None
                entry = home or full  # documented on its home module's page
                page = f"api/{entry.rpartition('.')[0]}"
                logging.getLogger(__name__).warning(
                    f"{full} has no entry in the API reference: add '.. auto"
                    f"{_directive(obj)}:: {entry}' to docs/{page}.md (or "
                    "'.. automodule::' for a submodule)",
                    location=page if page in env.found_docs else None,
                    type="pztrain",
                    subtype="api_entry",
                )


def _directive(obj: object) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) else "data"


def _fill_repository(app, docname, source):
    """``{{ repository }}`` in a page (its text and its code blocks alike) becomes
    the repository's address."""
    source[0] = source[0].replace("{{ repository }}", repository_url)


def setup(app):
    app.connect("source-read", _fill_repository)
    app.add_config_value("pztrain_api_modules", [], "env", types=frozenset({list}))
    app.connect("env-check-consistency", _missing_api_entries)
