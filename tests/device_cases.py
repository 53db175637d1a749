"""One pytest subprocess on simulated devices for the ``*_cases.py`` files of
the suite (``XLA_FLAGS`` must be set before jax is imported, so those cases
cannot run in the main test process).

A test names the file whose cases it stands for with
``@pytest.mark.eight_devices("mesh_cases.py")`` and takes the
``eight_device_cases`` fixture (``tests/conftest.py``): once collected, a
session starts every file named by its selected tests in one subprocess, in
the background (one Python, jax and pytest start instead of one per file, and
the cases run beside the main process's tests); each test then checks its own
file's outcomes, read from the run's JUnit XML.
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


class CasesRun:
    """The cases ``files`` (names in ``tests/``, or paths) running in one pytest
    subprocess on ``devices`` simulated devices, started at once; ``out``: a
    directory for its report and output."""

    def __init__(self, files: list[str], out: Path, devices: int = 8):
        self.files, self.out = list(files), out
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        paths = [str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={out / 'cases.xml'}"]
        with open(out / "output.txt", "w") as log:  # a file: nothing blocks on a pipe
            self.process = subprocess.Popen(
                [*cmd, *(str(HERE / f) for f in self.files)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def outcomes(self, timeout: float = 1800) -> dict[str, Outcomes]:
        """Waits for the run; each file's outcomes, read from its JUnit XML."""
        try:
            self.process.wait(timeout)
        finally:
            self.stop()
        log = (self.out / "output.txt").read_text(errors="replace")[-7000:]
        outcomes = {f: Outcomes(f, log=log) for f in self.files}
        report = self.out / "cases.xml"
        if report.exists():
            for case in ET.parse(report).getroot().iter("testcase"):
                module = case.get("classname", "").split(".")
                for f in self.files:
                    if Path(f).stem in module:
                        name, cases = case.get("name", ""), outcomes[f].cases
                        cases[name] = cases.get(name) or _failure(case)  # teardown
        return outcomes

    def stop(self) -> None:
        """Ends the subprocess if it still runs (a session cut short)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def run_cases(files: list[str], out: Path, devices: int = 8) -> dict[str, Outcomes]:
    """The outcomes of the cases ``files`` run in one subprocess (`CasesRun`)."""
    return CasesRun(files, out, devices).outcomes() if files else {}


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
