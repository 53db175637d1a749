"""A population's step counter is counted after the members' update (see
`pztrain.step._members.counted_after`: with ``step + 1`` ready at the start,
XLA:CPU handed half of the step's work to another thread on every call), and
the count stays exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Var

import pztrain
from pztrain.step._programs import flat_args

X = jnp.ones((4, 3))


def loss_fn(*, model, state, rng, x):
    loss = jnp.mean((x @ model["w"] - 1.0) ** 2)
    return loss, state, {"loss": loss}


def init(seed):
    return pztrain.TrainState.initial_state(
        {"w": jnp.full((3,), 0.1 * seed)}, optax.adam(1e-2), jax.random.key(seed)
    )


def _inputs_of_output(jaxpr, index: int) -> set[int]:
    """Positions of the jaxpr's inputs that its output ``index`` depends on (an
    equation's outputs depend on all its inputs: coarse, never missing one)."""
    reach = {jaxpr.outvars[index]}
    for eqn in reversed(jaxpr.eqns):
        if any(v in reach for v in eqn.outvars):
            reach.update(v for v in eqn.invars if isinstance(v, Var))
    return {i for i, v in enumerate(jaxpr.invars) if v in reach}


def test_the_new_step_waits_for_the_members_update():
    pop = pztrain.make_population(init, seeds=range(3))
    step = pztrain.build_train_step(loss_fn)
    found = step._lookup(pop)
    args = flat_args(pop, found, {"x": X})
    closed = jax.make_jaxpr(found.program.step)(*args)
    jaxpr = closed.jaxpr.eqns[0].params["jaxpr"].jaxpr  # inside the jit
    leaves = jax.tree.leaves(args)
    params = {id(x) for x in jax.tree.leaves(pop.params)}
    used = _inputs_of_output(jaxpr, 0)  # output 0: the new step
    assert 0 in used  # the old step, of course
    assert any(id(leaves[i]) in params for i in used)  # and the updated params
    pop, _ = step(pop, x=X)
    assert int(pop.step) == 1


def test_the_count_is_exact_even_when_a_member_is_nan():
    pop = pztrain.make_population(init, seeds=range(3))
    w = pop.params["w"].at[0, 0].set(jnp.nan)  # the param the counter reads
    pop = pop.replace(params={"w": w})
    step = pztrain.build_train_step(loss_fn)
    for expected in (1, 2, 3):
        pop, aux = step(pop, x=X)
        assert int(pop.step) == expected
    assert np.isnan(aux["loss"][0]) and np.isfinite(aux["loss"][1:]).all()
