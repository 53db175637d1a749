"""Fine-tuning with LoRA: memory beside full fine-tuning, reading a checkpoint onto
8 devices, and pztrain's LoRA step beside a hand-written one.

Run: ``python benchmarks/lora_bench.py`` (``--quick``: fewer rounds; ``--width``:
the model's width, 64 as in ``examples/char_lm.py``; ``--import-only``: the import
figures alone; ``--devices N``: N simulated CPU devices, set before jax is
imported, 8 by default).

* **Memory**: the example's model (char_lm's 2-block llama-like transformer) loaded
  from its Hugging Face checkpoint, fine-tuned whole (float32, Adam) or with rank-8
  adapters on the attention's query and value (bfloat16 base, float32 adapters):
  the bytes of params, optimizer state and frozen base in the state, and the
  compiled step's ``memory_analysis()`` (arguments, outputs, temporaries).
  Target: the adapters' optimizer state under 5% of full fine-tuning's.
* **Import**: `pztrain.finetune.load_pretrained` of the checkpoint onto a mesh of
  all devices (each param split over the first axis the device count divides;
  one device: the default device), the bytes it read, and its time (median of
  rounds) beside ``safetensors.numpy.load_file`` of the same file (the issue's
  baseline: read into host memory, placed nowhere), ``load_file`` then
  ``jax.device_put`` of each tensor as stored (the cost of placing), and
  ``load_file``, the mapping's transforms in NumPy and ``jax.device_put`` onto
  each param's sharding (what a hand-written loader does to get the same
  arrays). Target: each byte read once, and at most 1.3x the plain read.
* **Step**: steps/s of pztrain's LoRA step (`build_train_step`, adapters as params)
  over a hand-written ``jax.jit`` step of the same penzai model (adapters bound
  back into the frozen base, Adam, donation), median of rounds. Target >= 0.95.
"""

from __future__ import annotations

import argparse
import os


def _devices() -> int:
    """``--devices N`` (default 8), read before jax is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--devices", type=int, default=8)
    return pre.parse_known_args()[0].devices


os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={_devices()}"
)

import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from penzai import pz  # noqa: E402
from penzai.models.transformer.variants import llamalike_common  # noqa: E402

import pztrain  # noqa: E402
from pztrain import finetune  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_bench import timed_rounds  # noqa: E402

VOCAB, SEQ, BATCH = 110, 64, 16
LORA = finetune.LoraConfig(rank=8, alpha=16.0, targets="attention/(query|value)")


def config_of(width: int):
    """char_lm's configuration (width 64, 4 heads, 2 blocks) at ``width``."""
    return llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=4,
        query_head_multiplier=1,
        embedding_dim=width,
        projection_dim=width // 4,
        mlp_hidden_dim=3 * width,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
    )


def write_checkpoint(config, folder: Path) -> Path:
    model = llamalike_common.build_llamalike_transformer(
        config, init_base_rng=jax.random.key(0), name="lm"
    )
    mapping = finetune.llama_mapping(config, name="lm")
    return finetune.export_pretrained(
        folder,
        pz.freeze_params(model),
        mapping,
        config=finetune.hf_llama_config(config),
    )


def loss_fn(*, model, state, rng, tokens, targets):
    logits = model(pz.nx.wrap(tokens).tag("batch", "seq"))
    logits = logits.untag("batch", "seq", "vocabulary").unwrap().astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, state, {"loss": loss}


def batch() -> dict[str, jax.Array]:
    ids = jax.random.randint(jax.random.key(5), (BATCH, SEQ + 1), 0, VOCAB)
    return {"tokens": ids[:, :-1], "targets": ids[:, 1:]}


def states(path: Path, config) -> dict[str, pztrain.TrainState]:
    mapping = finetune.llama_mapping(config, name="lm")
    skeleton = finetune.llama_skeleton(config, name="lm")
    full, _ = finetune.load_pretrained(path, skeleton, mapping)
    base, _ = finetune.load_pretrained(path, skeleton, mapping, dtype=jnp.bfloat16)
    lora = finetune.add_lora(base, LORA, jax.random.key(1))
    key = jax.random.key(2)
    return {
        "full fine-tuning (f32)": pztrain.TrainState.initial_state(
            full, optax.adam(1e-3), key
        ),
        "LoRA r=8 (bf16 base)": pztrain.TrainState.initial_state(
            lora, optax.adam(1e-3), key, trainable=finetune.is_adapter
        ),
    }


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def memory_table(runs: dict[str, pztrain.TrainState]) -> list[dict]:
    step, rows = pztrain.build_train_step(loss_fn), []
    for name, state in runs.items():
        m = step.lower(state, batch()).compile().memory_analysis()
        rows.append(
            {
                "run": name,
                "params": _bytes(state.params),
                "opt_state": _bytes(state.opt_state),
                "frozen base": _bytes(state.model_without_params),
                "arguments": m.argument_size_in_bytes,
                "outputs": m.output_size_in_bytes,
                "temporaries": m.temp_size_in_bytes,
            }
        )
    return rows


def shardings(config, mesh) -> dict[str, NamedSharding]:
    """Each param split over the first axis 8 divides (else replicated)."""
    params, _ = pztrain.partition.split(
        finetune.llama_skeleton(config, name="lm"), frozen=True
    )
    return {name: split_first(x.shape, mesh) for name, x in params.items()}


def split_first(shape, mesh) -> NamedSharding:
    axes = [i for i, n in enumerate(shape) if n % mesh.size == 0]
    spec = [None] * len(shape)
    if axes:
        spec[axes[0]] = "x"
    return NamedSharding(mesh, P(*spec))


def by_hand(mapping, stored) -> list[tuple[str, str, tuple]]:
    """(stored name, param name, transforms) of each tensor: the plan a
    hand-written loader would follow."""
    out = []
    for name in stored:
        for rule in mapping.rules:
            target = rule.to_target(name)
            if target is not None:
                out.append((name, target, rule.transforms))
    return out


def transformed(x, transforms):
    """A stored tensor in the param's layout, as a hand-written loader does it."""
    for t in transforms:
        x = t.forward(x, t.shape(x.shape))
    return x


def model_arrays(model) -> list:
    """The model's param arrays, to block on."""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, pz.Parameter))
    return [x.value for x in leaves if isinstance(x, pz.Parameter)]


def import_runs(path: Path, config) -> tuple[dict, finetune.ImportReport]:
    """`load_pretrained` onto this process's devices (a mesh of all of them,
    else the default device) and the baselines, each a function whose result
    is blocked on: ``load_file`` alone (the issue's), placed as stored (each
    tensor onto a sharding of its own shape), and by hand (the mapping's
    transforms in NumPy, then onto the param's sharding: the same arrays as
    `load_pretrained`'s, without the model around them)."""
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    where = shardings(config, mesh) if mesh.size > 1 else {}
    skeleton = finetune.llama_skeleton(config, name="lm")
    mapping = finetune.llama_mapping(config, name="lm")
    file = str(path / "model.safetensors")
    plan = by_hand(mapping, safetensors.numpy.load_file(file))
    put = jax.device_put

    def of_own(shape):  # a stored tensor's own sharding, as `shardings` makes
        return split_first(shape, mesh) if mesh.size > 1 else None

    def ours():
        model, _ = finetune.load_pretrained(
            path, skeleton, mapping, shardings=where or None
        )
        return model_arrays(model)

    def placed():
        tensors = safetensors.numpy.load_file(file)
        return [put(x, of_own(x.shape)) for x in tensors.values()]

    def hand():
        tensors = safetensors.numpy.load_file(file)
        return [put(transformed(tensors[s], ts), where.get(t)) for s, t, ts in plan]

    _, report = finetune.load_pretrained(
        path, skeleton, mapping, shardings=where or None
    )
    runs = {
        "safetensors.numpy.load_file": lambda: safetensors.numpy.load_file(file),
        "load_file + device_put as stored": placed,
        "load_file + transforms + device_put": hand,
        "load_pretrained": ours,
    }
    return runs, report


def import_figures(path: Path, config, rounds: int) -> dict[str, float]:
    """Median wall and CPU (all threads: XLA's copies too) times of each run,
    the runs interleaved in each round."""
    runs, report = import_runs(path, config)
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for fn in runs.values():
        jax.block_until_ready(fn())  # warm up
    for _ in range(rounds):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    ms = {name: 1e3 * statistics.median(t) for name, t in wall.items()}
    cpu_ms = {name: 1e3 * statistics.median(t) for name, t in cpu.items()}
    hand = "load_file + transforms + device_put"
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    return {
        "tensor bytes in the file": sum(x.nbytes for x in tensors.values()),
        "bytes read by load_pretrained": report.bytes_read,
        **{f"{name} (ms)": t for name, t in ms.items()},
        **{f"{name} (CPU ms)": t for name, t in cpu_ms.items()},
        "ratio load_pretrained / load_file": (
            ms["load_pretrained"] / ms["safetensors.numpy.load_file"]
        ),
        f"ratio load_pretrained / {hand}": ms["load_pretrained"] / ms[hand],
    }


def hand_written_step(state: pztrain.TrainState):
    """A jitted penzai step: the adapters trained, the frozen base an argument."""
    unbound, values = pz.unbind_params(state.model, freeze=True)
    values = jax.tree.map(jnp.copy, values)  # pztrain's step donates the state's
    trained = [v for v in values if finetune.is_adapter(str(v.label))]
    frozen = [v for v in values if not finetune.is_adapter(str(v.label))]
    tx = optax.adam(1e-3)

    def step(trained, opt_state, frozen, tokens, targets):
        def loss(trained):
            model = pz.bind_variables(unbound, [*trained, *frozen])
            return loss_fn(
                model=model, state=None, rng=None, tokens=tokens, targets=targets
            )[0]

        value, grads = jax.value_and_grad(loss)(trained)
        updates, opt_state = tx.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state, value

    jitted = jax.jit(step, donate_argnums=(0, 1))
    carry = [trained, tx.init(trained)]

    def run(n: int):
        b = batch()
        for _ in range(n):
            carry[0], carry[1], value = jitted(carry[0], carry[1], frozen, **b)
        return value

    return run


def step_ratio(state: pztrain.TrainState, rounds: int, calls: int) -> float:
    step, b, carry = pztrain.build_train_step(loss_fn), batch(), [state]

    def ours(n: int):
        for _ in range(n):
            carry[0], aux = step(carry[0], **b)
        return aux

    times = timed_rounds(
        {"ours": ours, "hand": hand_written_step(state)}, rounds, calls
    )
    return statistics.median(t["hand"] / t["ours"] for t in times)


def import_table(path: Path, config, rounds: int) -> None:
    n = jax.device_count()
    print(f"\nImport onto {n} device{'s' * (n > 1)} (median of {rounds} rounds)")
    for k, v in import_figures(path, config, rounds).items():
        print(f"  {k}: {v:,.3f}" if isinstance(v, float) else f"  {k}: {v:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--import-only", action="store_true", help="the import alone")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    args = parser.parse_args()
    rounds, calls = (3, 5) if args.quick else (15, 30)
    config = config_of(args.width)
    print(f"jax {jax.__version__}, {jax.device_count()} devices, width {args.width}")
    with tempfile.TemporaryDirectory() as d:
        path = write_checkpoint(config, Path(d) / "ckpt")
        if args.import_only:
            return import_table(path, config, rounds)
        runs = states(path, config)
        rows = memory_table(runs)
        print("\nMemory (bytes)")
        for row in rows:
            print(
                "  "
                + ", ".join(f"{k}: {v:,}" if k != "run" else v for k, v in row.items())
            )
        share = rows[1]["opt_state"] / rows[0]["opt_state"]
        print(f"  adapters' optimizer state / full's: {share:.2%} (target < 5%)")
        import_table(path, config, rounds)
        ratio = step_ratio(runs["LoRA r=8 (bf16 base)"], rounds, calls)
        print(
            f"\nLoRA step, pztrain / hand-written steps/s: {ratio:.3f} (target >= 0.95)"
        )


if __name__ == "__main__":
    main()
