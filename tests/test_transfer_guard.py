"""fit moves nothing implicitly between host points: every run here trains under
``jax.transfer_guard("disallow")`` (every direction), so any implicit transfer
in the loop's thread fails the run.

What fit moves, it moves explicitly or at a host point (docs/guides/speed.md,
"What fit transfers"): host batches by ``jax.device_put`` (ahead of time, in the
prefetch thread), a device epoch's permutation once an epoch and fresh metric
sums under an explicit ``jax.transfer_guard_host_to_device("allow")`` (cheaper
than a ``jax.device_put``); the device is read only inside
the loop's ``host_reads`` (log, eval, epoch and checkpoint points); an
evaluation hands its host batches to the eval step (``eval_inputs``, at its
eval point). On CPU a device→host read never trips JAX's own guard (the array
is already in host memory): the ``d2h_guard`` fixture of ``test_loop.py``
emulates it. The 8-device cases run in a subprocess
(``transfer_guard_mesh_cases.py``, with the suite's other 8-device cases).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from test_loop import (  # noqa: F401 - d2h_guard: a fixture, used by name
    DISALLOWED,
    EVAL,
    EVAL_DATA,
    STEP,
    STEP2,
    _batches,
    d2h_guard,
    loader,
    loss_fn,
    new_state,
    run,
    steps_of,
)

import pztrain
from pztrain.loop import _sources
from pztrain.metric_states import Max


def population():
    return pztrain.make_population(lambda seed: new_state(), seeds=range(3))


def loss_with_a_state(**kwargs):
    """`test_loop.loss_fn` with a metric state in its aux (reset at each log)."""
    loss, state, aux = loss_fn(**kwargs)
    return loss, state, {**aux, "top": Max.of(jnp.abs(aux["err"]))}


SOURCES = {
    "host": lambda: (new_state(), STEP, loader()),
    "device": lambda: (new_state(), STEP, loader(on_device=True)),
    "metric_state": lambda: (
        new_state(),
        pztrain.build_train_step(loss_with_a_state),
        loader(),
    ),
    "host_list_fused": lambda: (new_state(), STEP2, _batches(6)),
    "population_host": lambda: (population(), STEP, loader()),
    "population_device": lambda: (population(), STEP, loader(on_device=True)),
}
SLOW = ("metric_state", "host_list_fused", "population_host", "population_device")


@pytest.mark.parametrize(
    "source",
    [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SOURCES],
)
@pytest.mark.usefixtures("d2h_guard")
def test_fit_moves_nothing_implicitly_between_host_points(source):
    state, step, data = SOURCES[source]()  # made before the guard: the user's
    with jax.transfer_guard("disallow"):
        state, history = run(
            state,
            step,
            data,
            num_steps=12,
            log_every=4,
            eval_step=EVAL,
            eval_data=EVAL_DATA,
            eval_every=4,
        )
        with pytest.raises(Exception, match=DISALLOWED):
            float(state.step.sum())  # the guard was on all along
    assert int(state.step) == 12
    assert steps_of(history) == steps_of(history, "eval") == [4, 8, 12]


@pytest.mark.slow  # orbax: a checkpoint every 4 steps
@pytest.mark.usefixtures("d2h_guard")
def test_fit_with_checkpoints_moves_nothing_implicitly(tmp_path):
    state = new_state()
    ckpt = pztrain.Checkpoints(tmp_path / "ckpt", every_steps=4)
    with jax.transfer_guard("disallow"):
        state, history = run(state, num_steps=8, log_every=4, callbacks=[ckpt])
    assert int(state.step) == 8 and steps_of(history) == [4, 8]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())


@pytest.mark.usefixtures("d2h_guard")
def test_control_an_implicit_batch_transfer_fails_fit(monkeypatch):
    # Host batches handed to the step as NumPy arrays (jit's implicit transfer)
    # instead of placed by jax.device_put: the guard stops the run.
    monkeypatch.setattr(_sources, "put_batch", lambda batch, sharding=None: batch)
    state = new_state()
    with jax.transfer_guard("disallow"):
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            run(state, num_steps=4, log_every=4)
    run(new_state(), num_steps=4, log_every=4)  # no guard: fine


@pytest.mark.slow  # a subprocess on 8 simulated devices
@pytest.mark.eight_devices("transfer_guard_mesh_cases.py")
def test_fit_on_eight_devices_moves_nothing_implicitly(eight_device_cases):
    eight_device_cases.check()
