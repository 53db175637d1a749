"""Small models of every supported family, shared by the tests."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from penzai import pz
from penzai.deprecated.v1 import pz as pz1
from penzai.deprecated.v1.example_models import simple_mlp as simple_mlp_v1
from penzai.models import simple_mlp

XOR_X = jnp.array([[0, 0], [0, 1], [1, 0], [1, 1]], jnp.float32)
XOR_Y = jnp.array([0, 1, 1, 0], jnp.int32)


def penzai_v2_mlp(seed: int = 0, hidden: int = 16, inputs: int = 2):
    return simple_mlp.MLP.from_config(
        name="mlp",
        init_base_rng=jax.random.key(seed),
        feature_sizes=[inputs, hidden, 2],
    )


def penzai_v1_mlp(seed: int = 0, hidden: int = 16, inputs: int = 2):
    model = simple_mlp_v1.MLP.from_config(feature_sizes=[inputs, hidden, 2])
    return pz1.nn.initialize_parameters(model, jax.random.key(seed))


def equinox_mlp(seed: int = 0, hidden: int = 16, inputs: int = 2):
    return eqx.nn.MLP(inputs, 2, hidden, 1, key=jax.random.key(seed))


def dict_mlp_params(seed: int = 0, hidden: int = 16, inputs: int = 2):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "dense0": {
            "kernel": jax.random.normal(k1, (inputs, hidden)) * 0.5,
            "bias": jnp.zeros(hidden),
        },
        "dense1": {
            "kernel": jax.random.normal(k2, (hidden, 2)) * 0.5,
            "bias": jnp.zeros(2),
        },
    }


def dict_mlp_apply(variables, x):
    p = variables["params"]
    h = jax.nn.relu(x @ p["dense0"]["kernel"] + p["dense0"]["bias"][None])
    return h @ p["dense1"]["kernel"] + p["dense1"]["bias"][None]


def logits_of(model, x):
    """Runs any test model family on a [batch, 2] input."""
    if isinstance(model, pz.nn.Layer):
        named = pz.nx.wrap(x).tag("batch", "features")
        return model(named).untag("batch", "features").unwrap()
    if isinstance(model, pz1.Layer):
        named = pz1.nx.wrap(x).tag("batch", "features")
        return model(named).untag("batch", "features").unwrap()
    if isinstance(model, eqx.Module):
        return jax.vmap(model)(x)
    return model(x)


def xor_loss(*, model, state, rng, x, y):
    """Cross-entropy on XOR; the penzai loss-function contract."""
    del rng
    logits = logits_of(model, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, state, {"loss": loss}


FAMILIES = {
    "penzai_v2": penzai_v2_mlp,
    "penzai_v1": penzai_v1_mlp,
    "equinox": equinox_mlp,
}


def family_state(family: str, *, seed: int = 0, lr: float = 0.05, key_seed=None):
    """A TrainState of one family's XOR model with Adam (``"flax"``: create())."""
    import pztrain

    tx = optax.adam(lr)
    if family == "flax":
        return pztrain.TrainState.create(
            apply_fn=dict_mlp_apply, params=dict_mlp_params(seed), tx=tx
        )
    key = jax.random.key(seed if key_seed is None else key_seed)
    return pztrain.TrainState.initial_state(FAMILIES[family](seed), tx, key)
