"""An annotated NNX model with BatchNorm and Dropout, trained on a 4×2 mesh of
simulated devices and on one device: the same params and statistics. Run by
``test_nnx_sharding.py`` with ``XLA_FLAGS`` set before jax is imported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pztrain
from pztrain.partition import model_state


class Net(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        # no bias before BatchNorm: its gradient is rounding noise, which Adam
        # scales up, so it would differ between reduction orders
        self.l1 = nnx.Linear(
            16,
            32,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, "model")),
        )
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(
            32, 4, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", None))
        )

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def loss_fn(*, model, state, rng, x, y):
    loss = jnp.mean((model(x) - y) ** 2)
    return loss, state, {"loss": loss}


def make_state():
    return pztrain.TrainState.initial_state(
        Net(nnx.Rngs(params=0, dropout=1)), optax.adam(1e-2), jax.random.key(0)
    )


def batches():
    key = jax.random.key(5)
    for s in range(10):
        kx, ky = jax.random.split(jax.random.fold_in(key, s))
        yield {
            "x": jax.random.normal(kx, (32, 16)),
            "y": jax.random.normal(ky, (32, 4)),
        }


def main():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        state = pztrain.sharded_initial_state(make_state, mesh)
    assert state.params["l1/kernel"].sharding.spec == P(None, "model")
    step = pztrain.build_train_step(loss_fn, mesh=mesh)
    for b in batches():
        state, _ = step(state, **b)
    assert state.params["l2/kernel"].sharding.spec == P("model")

    one_mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(one_mesh):
        single = make_state()
    single = jax.device_put(single, jax.devices()[0])
    one = pztrain.build_train_step(loss_fn)
    for b in batches():
        single, _ = one(single, **b)
    for name, value in single.params.items():
        np.testing.assert_allclose(state.params[name], value, atol=2e-5, err_msg=name)
    own, own_single = (model_state(s.model_without_params) for s in (state, single))
    for name in ("bn/mean", "bn/var"):
        np.testing.assert_allclose(own[name], own_single[name], atol=2e-5)
    print("nnx on 8 devices: ok")


if __name__ == "__main__":
    main()
