"""The cluster example (``examples/cluster``): ``train.py``'s choice of
``jax.distributed.initialize`` arguments from the environment (no runtime
started), and ``launch_local.py`` running it as 2 processes on this machine
(JAX's distributed runtime on loopback, gloo CPU collectives), then again on
the same run directory, which resumes."""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("cluster_train", CLUSTER / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docstring_examples(train):
    assert doctest.testmod(train).failed == 0


def test_alone_without_a_cluster(train):
    assert train.distributed_args({}) is None
    assert train.distributed_args({"HOME": "/root"}) is None
    # one SLURM task, or an Indexed Job without the coordinator: one process
    one_task = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    assert train.distributed_args(one_task) is None
    assert train.distributed_args({"JOB_COMPLETION_INDEX": "3"}) is None
    assert train.distributed_args({"PZTRAIN_NUM_PROCESSES": "1"}) is None


def test_slurm_and_tpu_vms_are_left_to_jax(train):
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
    }
    assert train.distributed_args(slurm) == {}  # initialize() reads them
    assert train.distributed_args({}, auto_detect=True) == {}


def test_kubernetes_indexed_job(train):
    pod = {
        "PZTRAIN_COORDINATOR": "pztrain-digits-0.pztrain-digits:1234",
        "PZTRAIN_NUM_PROCESSES": "4",
        "JOB_COMPLETION_INDEX": "2",
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    }
    assert train.distributed_args(pod) == {
        "coordinator_address": "pztrain-digits-0.pztrain-digits:1234",
        "num_processes": 4,
        "process_id": 2,
        "cluster_detection_method": "deactivate",  # no API lookups
    }
    # PZTRAIN_PROCESS_ID wins over the index; explicit wins over SLURM
    both = dict(pod, PZTRAIN_PROCESS_ID="0", SLURM_NTASKS="8", SLURM_PROCID="5")
    assert train.distributed_args(both)["process_id"] == 0


def test_flags_and_loopback(train):
    env = {"PZTRAIN_COORDINATOR": "elsewhere:1", "PZTRAIN_NUM_PROCESSES": "9"}
    got = train.distributed_args(
        env, coordinator="127.0.0.1:5555", num_processes=2, process_id=1
    )
    assert got == {
        "coordinator_address": "127.0.0.1:5555",
        "num_processes": 2,
        "process_id": 1,
        "cluster_detection_method": "deactivate",
        "coordinator_bind_address": "127.0.0.1:5555",  # loopback only
    }
    flags = train.parse(
        "--run-dir r --coordinator localhost:9 --num-processes 3 --process-id 0".split()
    )
    assert train.distributed_args(
        {},
        coordinator=flags.coordinator,
        num_processes=flags.num_processes,
        process_id=flags.process_id,
    ) == {
        "coordinator_address": "localhost:9",
        "num_processes": 3,
        "process_id": 0,
        "cluster_detection_method": "deactivate",
        "coordinator_bind_address": "localhost:9",
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coordinator": "h:1"}, "pass --num-processes or set PZTRAIN_NUM_PROCESSES"),
        ({"num_processes": 2, "process_id": 0}, "pass --coordinator or set"),
        ({"coordinator": "h", "num_processes": 2, "process_id": 0}, "HOST:PORT"),
        ({"coordinator": "h:1", "num_processes": 2}, "id in 0..1; got None"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "got 2"),
        ({"coordinator": "h:1", "num_processes": 0}, "must be >= 1; got 0"),
    ],
)
def test_incomplete_arguments_are_named(train, kwargs, message):
    with pytest.raises(ValueError, match=message):
        train.distributed_args({}, **kwargs)


def test_the_recipes_agree_with_the_script(train):
    """The files that cannot run here: their shell parses, and the names and
    numbers they share with train.py are train.py's."""
    import yaml

    for name in ("slurm.sbatch", "tpu_vm.sh"):
        subprocess.run(["bash", "-n", str(CLUSTER / name)], check=True)
    sbatch = (CLUSTER / "slurm.sbatch").read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=TERM@", "srun python"):
        assert line in sbatch
    assert f'if [ "$code" -eq {train.STOPPED} ]' in sbatch
    assert "--auto-detect" in (CLUSTER / "tpu_vm.sh").read_text()

    service, job = yaml.safe_load_all((CLUSTER / "k8s-indexed-job.yaml").read_text())
    assert service["spec"]["clusterIP"] == "None"  # headless
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) == {train.COORDINATOR, train.NUM_PROCESSES}
    assert spec["completions"] == spec["parallelism"] == int(env[train.NUM_PROCESSES])
    host, port = env[train.COORDINATOR].rsplit(":", 1)
    name = job["metadata"]["name"]
    assert host == f"{name}-0.{service['metadata']['name']}"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": name}
    assert container["ports"] == [{"containerPort": int(port)}]
    exits = spec["podFailurePolicy"]["rules"][0]["onExitCodes"]
    assert exits["containerName"] == container["name"]
    assert exits["values"] == [train.STOPPED]
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy needs


def test_the_recipes_make_the_environment_they_run_in(train):
    """Each recipe runs train.py from the checkout, in an environment it made
    with JAX's build for the devices it asks for, and refuses to train on the
    CPU instead (--platform)."""
    import tomllib

    import yaml

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["cuda"][0].startswith("jax[cuda12]>=")
    assert extras["tpu"][0].startswith("jax[tpu]>=")

    sbatch = (CLUSTER / "slurm.sbatch").read_text()
    order = [
        'cd "${SLURM_SUBMIT_DIR',
        'python3 -m venv "$VENV"',
        '"$VENV/bin/pip" install -e ".[examples,cuda]"',
        'source "$VENV/bin/activate"',
        "srun python examples/cluster/train.py --platform gpu ",
    ]
    assert [sbatch.index(line) for line in order] == sorted(
        sbatch.index(line) for line in order
    )
    assert "#SBATCH --gpus-per-node" in sbatch

    _, job = yaml.safe_load_all((CLUSTER / "k8s-indexed-job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["workingDir"].startswith("/")
    assert container["command"][:2] == ["python", "examples/cluster/train.py"]

    tpu = (CLUSTER / "tpu_vm.sh").read_text()
    assert "--recurse" not in tpu  # the checkout's .venv would go too
    assert 'pip install -e "./pztrain[examples,tpu]"' in tpu
    assert "source ../pztrain-venv/bin/activate" in tpu
    assert "train.py --auto-detect --platform tpu" in tpu


def test_the_tpu_recipe_copies_the_checkout_without_its_venv(tmp_path):
    """tpu_vm.sh's archive line, run in a checkout with a .venv, local edits
    and a new file: the files git lists, and nothing git ignores."""
    (line,) = [
        line
        for line in (CLUSTER / "tpu_vm.sh").read_text().splitlines()
        if line.startswith("git ls-files")
    ]
    repo = tmp_path / "checkout"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").write_text("a big environment")
    (repo / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    (repo / "train.py").write_text("print(1)\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    (repo / "train.py").write_text("print(2)\n")  # an edit, not committed
    (repo / "new.py").write_text("")
    archive = tmp_path / "a.tar.gz"
    env = dict(os.environ, ARCHIVE=str(archive))
    subprocess.run(["bash", "-c", line], cwd=repo, env=env, check=True)
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
        edited = tar.extractfile("train.py").read()
    assert names == [".gitignore", "new.py", "train.py"]
    assert edited == b"print(2)\n"


def test_platform_refuses_to_train_on_the_cpu(train, tmp_path):
    args = train.parse(["--run-dir", str(tmp_path), "--platform", "gpu"])
    with pytest.raises(SystemExit, match=r"--platform gpu: JAX runs on cpu here"):
        train.main(args)
    assert not list(tmp_path.iterdir())  # nothing written


def _launch(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    args = [sys.executable, str(CLUSTER / "launch_local.py")]
    args += ["--num-processes", "2", "--devices-per-process", "2", "--"]
    args += ["--run-dir", str(run_dir), "--steps", str(steps), "--log-every", "5"]
    args += ["--eval-every", "10", "--save-every", "10"]
    return subprocess.run(
        args,
        cwd=run_dir.parent,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_two_local_processes_train_and_resume(tmp_path):
    run = tmp_path / "run"
    first = _launch(run, 20)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    for i in (0, 1):
        assert f"[{i}] process {i} of 2: 2 of 4 devices" in first.stdout
        assert f"[{i}] process {i} of 2: starting at step 0" in first.stdout
        assert f"[{i}] process {i} of 2: done at step 20" in first.stdout
    assert "[0] step 20: eval accuracy" in first.stdout  # process 0 reports
    assert "[1] step" not in first.stdout
    assert {"10", "20"} <= set(os.listdir(run / "ckpt"))

    second = _launch(run, 30)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    for i in (0, 1):
        resumed = f"[{i}] process {i} of 2: resumed from a checkpoint at step 20"
        assert resumed in second.stdout
        assert f"[{i}] process {i} of 2: done at step 30" in second.stdout
    assert "30" in os.listdir(run / "ckpt")
    # one log, continued: every log point once
    lines = (run / "log" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records if r["split"] == "train"] == [
        5,
        10,
        15,
        20,
        25,
        30,
    ]
    assert [r["step"] for r in records if r["split"] == "eval"] == [10, 20, 30]
