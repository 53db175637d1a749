"""Many devices: the digits MLP trained on a 4 × 2 (data × model) mesh of 8
simulated CPU devices.

Run: ``python examples/many_devices.py`` (after ``pip install -e ".[examples]"``).
The script asks XLA for 8 CPU devices before jax is imported; on a machine with
8 accelerators, drop that line and the same code runs on them.

The params are split by `pztrain.ShardingRules`: each penzai layer's
``features_out`` axis over the ``model`` mesh axis, and every other parameter
fully sharded (FSDP) over ``data``. The state is built directly sharded
(`pztrain.sharded_initial_state`), every batch is split over ``data``
(``build_train_step(mesh=...)``), and the state keeps its shardings through
`pztrain.fit`, its evaluation and its checkpoints. The mesh is made as JAX
makes it by default, with Explicit axes: inside each step the params are
gathered to their compute layout and the loss runs in auto mode, so it needs no
change.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from digits import eval_fn, load, loss_fn  # noqa: E402  (the same model and data)
from penzai.models import simple_mlp  # noqa: E402

import pztrain  # noqa: E402


def main(epochs: int = 10, batch_size: int = 32, seed: int = 0) -> float:
    train, valid, test = load(seed)
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # JAX's default: Explicit axes
    rules = pztrain.ShardingRules(axes={"features_out": "model"}, fsdp="data")

    def make_state():
        model = simple_mlp.MLP.from_config(
            name="mlp", init_base_rng=jax.random.key(seed), feature_sizes=[64, 128, 10]
        )
        return pztrain.TrainState.initial_state(
            model, optax.adam(3e-3), jax.random.key(seed)
        )

    state = pztrain.sharded_initial_state(make_state, mesh, rules)
    for name, value in state.params.items():
        print(f"{name:24s} {str(value.shape):12s} {value.sharding.spec}")

    with tempfile.TemporaryDirectory() as directory:
        state, history = pztrain.fit(
            state,
            pztrain.build_train_step(loss_fn, mesh=mesh),
            pztrain.ArrayLoader(train, batch_size, seed=seed),
            num_epochs=epochs,
            eval_step=pztrain.build_eval_step(eval_fn),
            eval_data=pztrain.ArrayLoader(valid, 180, shuffle=False),
            log_every=20,
            checkpoints=pztrain.Checkpoints(directory, keep_last=1),
            progress=False,
        )
    result = pztrain.evaluate(
        state,
        pztrain.build_eval_step(eval_fn),
        pztrain.ArrayLoader(test, 360, shuffle=False, drop_remainder=False),
    )
    print(
        f"after {int(state.step)} steps on {jax.device_count()} devices: "
        f"test accuracy {result['accuracy']:.4f}"
    )
    return result["accuracy"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    main(args.epochs)
