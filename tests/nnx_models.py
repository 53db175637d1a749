"""Small Flax NNX models and a hand-written functional NNX loop, for the tests."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pztrain._tree import path_name


class MLP(nnx.Module):
    """Linear → BatchNorm → relu → Dropout → Linear, on ``[batch, 4]``."""

    def __init__(self, rngs: nnx.Rngs, hidden: int = 16, rate: float = 0.5):
        self.l1 = nnx.Linear(4, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.l2 = nnx.Linear(hidden, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def mlp(seed: int = 0, **kwargs) -> MLP:
    return MLP(nnx.Rngs(params=seed, dropout=seed + 100), **kwargs)


def batch(seed: int = 1, n: int = 32) -> dict[str, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, (n, 4)),
        "y": jax.random.randint(ky, (n,), 0, 3),
    }


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def loss_fn(*, model, state, rng, x, y):
    loss = xent(model(x), y)
    return loss, state, {"loss": loss}


def stream_key(step_key, tag: str):
    """The documented key of rng stream ``tag`` at a step."""
    return jax.random.fold_in(step_key, zlib.crc32(tag.encode()))


def hand_loop(model, tx, root_rng, batches):
    """Flax's functional pattern, written by hand: split once, merge fresh
    variables inside the loss, train mode, streams reseeded from the step key,
    the new non-param state read back with ``nnx.split``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, rest, opt_state, s, x, y):
        key = jax.random.fold_in(root_rng, s)

        def loss(params):
            m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
            m.train()
            nnx.reseed(m, dropout=stream_key(key, "dropout"))
            return xent(m(x), y), nnx.split(m, nnx.Param, ...)[2]

        (_, rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state

    for s, b in enumerate(batches):
        params, rest, opt_state = step(params, rest, opt_state, s, b["x"], b["y"])
    return graphdef, params, rest


def by_name(nnx_state) -> dict[str, np.ndarray]:
    """An ``nnx.State``'s arrays by variable path (keys as their key data)."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    out = {}
    for path, var in jax.tree_util.tree_flatten_with_path(nnx_state, is_leaf=is_var)[0]:
        value = var.get_value()
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out[path_name(path)] = np.asarray(value)
    return out
