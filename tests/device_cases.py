"""One pytest subprocess on simulated devices for the ``*_cases.py`` files of
the suite (``XLA_FLAGS`` must be set before jax is imported, so those cases
cannot run in the main test process).

A test names the file whose cases it stands for with
``@pytest.mark.eight_devices("mesh_cases.py")`` and takes the
``eight_device_cases`` fixture (``tests/conftest.py``): the first such test of
a session runs every file named by the session's selected tests in one
subprocess (one Python, jax and pytest start instead of one per file), and each
test then checks its own file's outcomes, read from the run's JUnit XML.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass
class Outcomes:
    """The outcomes of one cases file's tests in a run.

    Attributes:
      file: the cases file, e.g. ``"mesh_cases.py"``.
      cases: ``{test name: None if it passed, else its failure text}``, e.g.
        ``{"test_fit_keeps_every_sharding": None}``.
      log: the end of the subprocess's output, for a failure message.
    """

    file: str
    cases: dict[str, str | None] = field(default_factory=dict)
    log: str = ""

    def check(self, passed: int | None = None) -> None:
        """Every case passed (``passed``: exactly that many), else an
        AssertionError that shows the failures."""
        failed = {k: v for k, v in self.cases.items() if v is not None}
        shown = "\n\n".join(f"{k}:\n{v[-3000:]}" for k, v in failed.items())
        assert self.cases, f"no case of {self.file} ran:\n{self.log}"
        assert not failed, f"{len(failed)} of {self.file} failed:\n{shown[-8000:]}"
        if passed is not None:
            assert len(self.cases) == passed, (self.file, sorted(self.cases))

    def check_case(self, name: str) -> None:
        """The case ``name`` (e.g. ``"test_row[a-b]"``) ran and passed."""
        assert name in self.cases, f"{name} of {self.file} did not run:\n{self.log}"
        assert self.cases[name] is None, self.cases[name][-8000:]


def run_cases(files: list[str], out: Path, devices: int = 8) -> dict[str, Outcomes]:
    """Runs the cases ``files`` (names in ``tests/``) in one pytest subprocess
    on ``devices`` simulated devices; ``out``: a directory for its report."""
    if not files:
        return {}
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    paths = [str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    report = out / "cases.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={report}"]
    result = subprocess.run(
        [*cmd, *(str(HERE / f) for f in files)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    log = result.stdout[-4000:] + result.stderr[-3000:]
    outcomes = {f: Outcomes(f, log=log) for f in files}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            for f in files:
                if Path(f).stem in module:
                    name, cases = case.get("name", ""), outcomes[f].cases
                    cases[name] = cases.get(name) or _failure(case)  # teardown
    return outcomes


def shared_run(files: list[str], out: Path) -> dict[str, Outcomes]:
    """`run_cases` once for the processes that share ``out`` (pytest-xdist's
    workers): the first runs them, the others wait and read its outcomes."""
    out.mkdir(parents=True, exist_ok=True)
    done = out / "outcomes.json"
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            outcomes = run_cases(files, out)
            done.write_text(json.dumps({f: asdict(o) for f, o in outcomes.items()}))
    return {f: Outcomes(**o) for f, o in json.loads(done.read_text()).items()}


def _failure(case: ET.Element) -> str | None:
    """A testcase's failure, error or skip text (``None``: it passed)."""
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            return f"{tag}: {found.get('message', '')}\n{found.text or ''}"
    return None
