"""The site says where the code is: the repository's address, set once in
pyproject.toml, atop every page and in the installation commands; the benchmark
figures and the cluster recipes shown on the site, from the files themselves.

The built site's header and links: ``tests/test_docs_build.py`` (slow).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TOKEN = "{{ repository }}"


def repository() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["urls"]["Repository"]


def test_the_address_is_set_once_and_every_page_header_links_it():
    assert re.fullmatch(r"https://\S+[^/]", repository())
    conf = (DOCS / "conf.py").read_text()
    assert '"repository_url": repository_url' in conf
    assert '"use_repository_button": True' in conf
    assert 'source[0].replace("{{ repository }}", repository_url)' in conf
    pages = [*DOCS.rglob("*.md"), ROOT / "examples" / "cluster" / "README.md"]
    written = [p for p in pages if repository() in p.read_text()]
    assert not written, f"write {TOKEN} instead of the address in {written}"


def test_installation_from_git_a_clone_and_a_wheel():
    page = (DOCS / "installation.md").read_text()
    for command in [
        f'pip install "pztrain @ git+{TOKEN}"',
        f"git clone {TOKEN} pztrain",
        "pip install -e .",
        "python -m build --wheel",
        "pip wheel --no-deps -w dist .",
        "pip install dist/pztrain-*-py3-none-any.whl",
    ]:
        assert command in page, command
    assert "<the pztrain repository>" not in page


def test_the_speed_guide_shows_the_benchmark_figures():
    speed = (DOCS / "guides" / "speed.md").read_text()
    include = "```{include} ../../benchmarks/README.md\n:heading-offset: 1\n```"
    assert include in speed
    assert (DOCS / "guides" / "../../benchmarks/README.md").resolve().exists()


def test_the_many_devices_guide_shows_the_cluster_recipes():
    guide = (DOCS / "guides" / "many_devices.md").read_text()
    shown = re.findall(r"```\{literalinclude\} \.\./\.\./(\S+)", guide)
    assert shown == [
        "examples/cluster/slurm.sbatch",
        "examples/cluster/k8s-indexed-job.yaml",
        "examples/cluster/tpu_vm.sh",
        "examples/cluster/train.py",
    ]
    for path in shown:
        assert (ROOT / path).exists(), path


def test_the_cluster_examples_have_a_readme_naming_each_file():
    cluster = ROOT / "examples" / "cluster"
    readme = (cluster / "README.md").read_text()
    for path in cluster.iterdir():
        if path.suffix in (".py", ".sh", ".sbatch", ".yaml"):
            assert f"`{path.name}`" in readme, path.name
    assert "../../docs/guides/many_devices.md#launching-on-a-cluster" in readme
