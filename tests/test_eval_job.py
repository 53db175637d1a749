"""`pztrain.evaluate_checkpoints`: an evaluation job beside training."""

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import jax
import optax
import pytest

import pztrain
from pztrain.records import read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
import eval_job_trainer as trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _eval_step():
    def eval_fn(*, model, state, rng, x, y):
        return {"mse": ((x @ model["w"] - y) ** 2).mean()}

    return pztrain.build_eval_step(eval_fn)


def _val_loader():
    return pztrain.ArrayLoader(trainer.data(), batch_size=24, shuffle=False,
                               drop_remainder=False)  # fmt: skip


def _train(directory: Path, num_steps: int, pause: float = 0.0) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "tests/eval_job_trainer.py"), str(directory),
         str(num_steps), str(pause)],
        check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300,
    )  # fmt: skip


def _job(directory, run_dir, **kwargs):
    evaluations = [
        pztrain.Evaluation("val", _eval_step(), _val_loader()),
        pztrain.Evaluation("norm", lambda s: {"w0": s.params["w"][0], "step": s.step}),
    ]
    kwargs.setdefault("priority", None)
    return pztrain.evaluate_checkpoints(
        directory, trainer.initial_state(), evaluations, run_dir=run_dir, **kwargs
    )


def test_each_checkpoint_is_evaluated_once_in_step_order(tmp_path):
    _train(tmp_path / "ckpt", 6)
    history = _job(tmp_path / "ckpt", tmp_path / "eval_job", follow=False)
    assert [r["step"] for r in history.records] == [2, 4, 6]
    like = trainer.initial_state()
    for record in history.records:  # each equals an evaluation of its checkpoint
        state = pztrain.load_state(tmp_path / "ckpt" / str(record["step"]), like)
        want = pztrain.evaluate(state, _eval_step(), _val_loader())["mse"]
        assert record["metrics"]["val/mse"] == pytest.approx(want, rel=1e-6)
        assert record["metrics"]["norm/w0"] == pytest.approx(
            float(state.params["w"][0]), rel=1e-6
        )
        assert record["metrics"]["norm/step"] == record["step"]
    logged = read_jsonl(tmp_path / "eval_job")
    assert [r["step"] for r in logged] == [2, 4, 6]
    assert (
        history.records[0]["metrics"]["val/mse"]
        > history.records[-1]["metrics"]["val/mse"]
    )


def test_started_again_it_skips_what_it_logged(tmp_path):
    _train(tmp_path / "ckpt", 4)
    first = _job(tmp_path / "ckpt", tmp_path / "eval_job", follow=False)
    _train(tmp_path / "ckpt", 8)  # a second run on, resumed or not: more steps
    second = _job(tmp_path / "ckpt", tmp_path / "eval_job", follow=False)
    assert [r["step"] for r in first.records] == [2, 4]
    assert [r["step"] for r in second.records] == [6, 8]
    logged = [r["step"] for r in read_jsonl(tmp_path / "eval_job")]
    assert logged == [2, 4, 6, 8]


@pytest.mark.slow
def test_it_follows_a_training_process_running_beside_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/eval_job_trainer.py"), str(ckpt), "20",
         "0.3"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        history = _job(ckpt, tmp_path / "eval_job", timeout=120, poll=0.2)
        assert proc.wait(timeout=120) == 0  # the job never held the run's lock
    finally:
        proc.kill()
    steps = [r["step"] for r in history.records]
    assert steps == list(range(2, 21, 2))  # every one, in order, the last too
    assert history.stop_reason is None  # it ended because training did


def test_a_directory_without_checkpoints_is_waited_for_then_refused(tmp_path, capsys):
    with pytest.raises(TimeoutError, match=r"no checkpoint appeared in .*empty"):
        _job(tmp_path / "empty", tmp_path / "eval_job", timeout=0.3, poll=0.1)
    assert "waiting for checkpoints in" in capsys.readouterr().out


def _checkpoint(path: Path) -> None:
    pztrain.save_state(path, trainer.initial_state())


def test_a_missing_directory_is_refused_at_once_without_follow(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*/ckpt'\): no such directory"):
        _job(tmp_path / "ckpt", tmp_path / "job", follow=False)
    assert not (tmp_path / "job").exists()


def test_an_empty_directory_is_refused_at_once_without_follow(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match=r"ckpt'\): the directory holds no checkpoint"):
        _job(tmp_path / "ckpt", tmp_path / "job", follow=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"file'\): it is a file"):
        _job(tmp_path / "file", tmp_path / "job")  # following or not
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("follow", [False, True])
def test_the_run_directory_is_refused_naming_its_checkpoint_folder(tmp_path, follow):
    _checkpoint(tmp_path / "run" / "ckpt" / "2")
    want = f"pass directory={str(tmp_path / 'run' / 'ckpt')!r}"
    with pytest.raises(ValueError, match=re.escape(want)):
        _job(tmp_path / "run", tmp_path / "job", follow=follow, timeout=0.2, poll=0.1)
    with pytest.raises(ValueError, match="it is one checkpoint"):
        _job(tmp_path / "run" / "ckpt" / "2", tmp_path / "job", follow=follow)
    assert not (tmp_path / "job").exists()


def test_a_followed_run_directory_is_refused_at_the_runs_first_save(tmp_path):
    _checkpoint(tmp_path / "saved" / "2")
    (tmp_path / "run" / "ckpt").mkdir(parents=True)  # a run that has not saved yet
    first_save = threading.Timer(
        0.2, lambda: (tmp_path / "saved").replace(tmp_path / "run" / "ckpt")
    )
    first_save.start()
    try:
        with pytest.raises(ValueError, match="its subfolder 'ckpt' does"):
            _job(tmp_path / "run", tmp_path / "job", timeout=30, poll=0.05)
    finally:
        first_save.join()


def test_an_empty_directory_is_waited_for_and_said_at_once(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(TimeoutError, match=r"no checkpoint appeared in .*ckpt within"):
        _job(tmp_path / "ckpt", tmp_path / "job", timeout=0.3, poll=0.1)
    out = capsys.readouterr().out
    assert f"waiting for checkpoints in {tmp_path / 'ckpt'}, which holds none" in out
    assert "no training run holds it" in out


def test_a_missing_directory_is_named_at_once_when_followed(tmp_path, capsys):
    _checkpoint(tmp_path / "run" / "ckpt" / "2")
    with pytest.raises(TimeoutError, match=r"\(it does not exist\)"):
        _job(tmp_path / "run" / "ckp", tmp_path / "job", timeout=0.3, poll=0.1)
    out = capsys.readouterr().out
    assert f"{tmp_path / 'run' / 'ckp'}, which does not exist yet" in out
    assert f"{tmp_path / 'run' / 'ckpt'} holds checkpoints" in out  # a near miss


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="run_dir is the checkpoint directory"):
        _job(tmp_path / "ckpt", tmp_path / "ckpt", follow=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        _job(tmp_path / "ckpt", tmp_path / "file", follow=False)
    with pytest.raises(ValueError, match="Two evaluations are named 'a'"):
        f = pztrain.Evaluation("a", lambda s: {"x": 1.0})
        pztrain.evaluate_checkpoints(
            tmp_path, trainer.initial_state(), [f, f], run_dir=tmp_path / "j"
        )
    assert not (tmp_path / "j").exists()


def test_the_ema_params_are_evaluated_when_asked(tmp_path):
    optimizer = pztrain.with_ema(optax.sgd(0.1), decay=0.5)
    state = pztrain.TrainState.initial_state(
        {"w": jax.numpy.ones(())}, optimizer, jax.random.key(0)
    ).apply_gradients(grads={"w": jax.numpy.ones(())})
    pztrain.save_state(tmp_path / "ckpt" / "3", state)
    ev = pztrain.Evaluation("p", lambda s: {"w": s.params["w"]}, ema="both")
    history = pztrain.evaluate_checkpoints(
        tmp_path / "ckpt", state, [ev], run_dir=tmp_path / "j", follow=False,
        priority=None,
    )  # fmt: skip
    metrics = history.records[0]["metrics"]
    assert set(metrics) == {"p/w", "p/ema/w"}
    assert metrics["p/w"] == pytest.approx(float(state.params["w"]))
    ema = float(state.using_ema().params["w"])
    assert metrics["p/ema/w"] == pytest.approx(ema) and ema != metrics["p/w"]


def test_params_alone_are_read_only_when_they_are_all_an_evaluation_needs():
    from pztrain.loop._eval_job import params_suffice

    like = trainer.initial_state()
    plain = [pztrain.Evaluation("a", lambda s: {"x": 1.0})]
    assert params_suffice(like, plain)  # no EMA, no model state: params and step
    ema = [pztrain.Evaluation("a", lambda s: {"x": 1.0}, ema=True)]
    assert not params_suffice(like, ema)  # the EMA is in the optimizer state
    stateful = like.replace(loss_fn_state={"count": jax.numpy.zeros(())})
    assert not params_suffice(stateful, plain)  # e.g. batch-norm statistics
    abstract = jax.eval_shape(lambda: like)
    assert not params_suffice(abstract, plain)  # nothing to stand in for the rest


def _priorities() -> dict[int, tuple[int, int]]:
    tasks = Path("/proc/self/task")
    return {
        int(t.name): (
            os.getpriority(os.PRIO_PROCESS, int(t.name)),
            os.sched_getscheduler(int(t.name)),
        )
        for t in tasks.iterdir()
    }


@pytest.mark.slow
def test_an_in_process_job_gives_the_callers_priority_back(tmp_path):
    _train(tmp_path / "ckpt", 2)
    before = _priorities()
    during = []

    class Spy:
        def log_hparams(self, hparams):
            pass

        def log_record(self, record):
            during.append(_priorities()[threading.get_native_id()])

        def close(self):
            pass

    history = _job(
        tmp_path / "ckpt", tmp_path / "eval_job", follow=False, priority=19,
        loggers=[Spy()],
    )  # fmt: skip
    assert [r["step"] for r in history.records] == [2]
    assert during == [(19, os.SCHED_IDLE)]  # lowered while it ran
    after = _priorities()
    assert {t: after[t] for t in before if t in after} == {
        t: v for t, v in before.items() if t in after
    }
