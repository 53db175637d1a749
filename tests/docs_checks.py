"""The checks of the guides' figures, run by ``tests/test_docs_snippets.py``.

A guide shows its code and outputs; what it states is checked here, not on the
page. Each entry of ``CHECKS[page]`` is ``(anchor, check)``: ``check`` runs in
the page's namespace right after the one code cell holding ``anchor`` (a line of
its code). ``docs/_tools/to_mystnb.py`` prints a page's asserts in this form. A
cell tagged ``raises-exception`` shows its error on the page; its checks read
the error as ``sys.last_value``, as in IPython.
"""

from __future__ import annotations

import nbformat


def _raises(call: str, error: str, holds: str = "True") -> str:
    """A check that ``call`` (a page's intended error, caught and printed there)
    still raises ``error`` and that ``holds`` is true of it (``e``)."""
    return (
        f"try:\n    {call}\nexcept {error} as e:\n    assert {holds}, str(e)\n"
        f"else:\n    raise AssertionError('no {error}')"
    )


# page name -> (anchor: a line of the cell the check follows, check: code).
CHECKS: dict[str, list[tuple[str, str]]] = {
    "checkpoints.md": [
        (
            'state = pztrain.load_state("ckpt/full", fresh_state())',
            "assert int(state.step) == 50",
        ),
        (
            "return_report=True,",
            'left = ("clf/Affine_1/AddBias.bias", "clf/Affine_1/Linear.weights")\n'
            "assert report.left == left",
        ),
        ("num_steps=250,", "assert int(state.step) == 250"),
        (
            'pztrain.Evaluation("valid", eval_step, valid_loader),',
            'assert [r["step"] for r in job_history.records] == [150, 200, 250]\n'
            "losses = [r['metrics']['valid/loss'] for r in job_history.records]\n"
            "assert losses == sorted(losses, reverse=True)",
        ),
    ],
    "data.md": [
        (
            "loader = pztrain.GrainLoader(source, batch_size=64, seed=0, "
            "decode=layout)",
            'np.testing.assert_array_equal(batch["x"], x[loader.example_ids(0)])\n'
            'assert batch["x"].shape == (64, 64) and batch["y"].dtype == np.int32',
        ),
        (
            'datasets.Dataset.from_dict({"x": x, "y": y}).save_to_disk("digits_hf")',
            'assert loader.batch_at(0)["y"].dtype == np.int64',
        ),
        (
            'pztrain.ArrayLoader({"x": x, "y": y}, batch_size=64, seed=0, '
            "on_device=True),",
            'assert np.array_equal(loader.batch_at(30)["y"], '
            'next(again.iter_from_step(30))["y"]) and same',
        ),
        (
            "examples = grain.MapDataset.source(source).map(decode_one)",
            "assert loader.steps_per_epoch == len(x) // 64\n"
            'np.testing.assert_array_equal(loader.batch_at(5)["x"], '
            "x[loader.example_ids(5)])",
        ),
        (
            "noise = np.stack([np.random.default_rng(p).normal(0, 0.01, 64) "
            "for p in positions])",
            'assert loader.batch_at(3)["x"].shape == (64, 64)\n'
            "assert 0 < moved < 0.1  # noise of scale 0.01",
        ),
        (
            "valid = pztrain.GrainLoader(source, batch_size=500, shuffle=False, "
            "decode=layout)",
            'assert valid.steps_per_epoch == 3\nassert len(valid.rest()["y"]) == 297',
        ),
    ],
    "ema.md": [
        (
            'print("ema_step:"',
            "assert on_ema == pztrain.evaluate(state, ema_step, eval_data)",
        ),
        (
            "ema_model = pztrain.load_params(",
            'np.testing.assert_array_equal(ema_model["w"], state.ema_params["w"])',
        ),
    ],
    "fit.md": [
        (
            'fig.savefig("runs/exp1/history.png")',
            'assert history.last("eval")["metrics"]["accuracy"] > 0.9',
        ),
        (
            'print(record.get("mfu"))',
            'assert record["flops_per_step"] > 0 and record["flops_per_sec"] > 0',
        ),
        (
            "def on_eval_end(self, state, record):",
            'assert history.stop_reason == "accurate enough"',
        ),
        (
            'return {"first_8_correct"',
            'assert history.last("eval")["metrics"]["test/accuracy"] > 0.8',
        ),
        (
            "np.add.at(counts,",
            'steps = [e["step"] for e in pztrain.loggers.read_media("runs/media")]\n'
            "assert steps == [20] * 3 + [40] * 3",
        ),
        (
            'print("trained state:", pztrain.evaluate(state, eval_step, valid_loader))',
            "trained = pztrain.evaluate(state, eval_step, valid_loader)\n"
            "fresh = pztrain.TrainState.initial_state(model, optax.identity(), "
            "jax.random.key(0))\n"
            "untrained = pztrain.evaluate(fresh, eval_step, valid_loader)\n"
            'assert trained["accuracy"] > 0.5 > 0.2 > untrained["accuracy"]',
        ),
        (
            "pztrain.evaluate(model, eval_step, valid_loader)  # a model",
            "try:\n"
            "    pztrain.evaluate(model, eval_step, valid_loader)\n"
            "except TypeError as e:\n"
            '    assert "initial_state(model, optax.identity()" in str(e)\n'
            "else:\n"
            '    raise AssertionError("no TypeError")',
        ),
    ],
    "loss_and_models.md": [
        (
            "state = pztrain.TrainState.initial_state(model, optax.adam(1e-2), "
            "jax.random.key(1))",
            "assert jax.random.key_data(jax.random.fold_in(state.root_rng, 0))"
            ".shape == (2,)",
        ),
        (
            "print(sorted(state.params))",
            "assert sorted(state.params) == [\n"
            '    "layers/0/bias", "layers/0/weight",\n'
            '    "layers/1/bias", "layers/1/weight",\n'
            "]",
        ),
        (
            'model, optax.adam(1e-2), jax.random.key(1), trainable=r"layers/1"',
            "assert sorted(frozen_first.params) == "
            '["layers/1/bias", "layers/1/weight"]',
        ),
        (
            "train_step(old, x=x, y=y)  # its arrays went",
            _raises("train_step(old, x=x, y=y)", "pztrain.DonatedStateError"),
        ),
        (
            "train_step(shared, x=x, y=y)  # the error names",
            _raises(
                "train_step(shared, x=x, y=y)",
                "pztrain.DonatedStateError",
                '"pztrain.fit(...) called at" in str(e)',
            ),
        ),
        (
            "train_step(state, x=jnp.ones((32, 3)), y=y)",
            _raises(
                "train_step(state, x=jnp.ones((32, 3)), y=y)",
                "TypeError",
                '"x: float32[32, 3]" in e.__notes__[-1]',
            ),
        ),
        (
            "state.replace(opt_state=optax.sgd(0.1).init(state.params))",
            _raises(
                "state.replace(opt_state=optax.sgd(0.1).init(state.params))",
                "ValueError",
                "\"[0].mu['layers/0/bias']\" in str(e)",
            ),
        ),
    ],
    "migrating.md": [("print(type(model).__name__", "assert isinstance(model, CNN)")],
    "metrics.md": [
        (
            'print(round(whole, 6), round(record["classes/f1"], 6))',
            'assert abs(whole - record["classes/f1"]) < 1e-12',
        ),
        (
            'print(sums.read()["ppl"]',
            'assert abs(sums.read()["ppl"] - float(np.exp(12 / 5))) < 1e-4',
        ),
    ],
    "parameter_groups.md": [
        ("optax.adamw(1e-2, weight_decay=1e-2, mask=mask)", "assert loss < 0.5, loss"),
        (
            "# frozen: no moments",
            'assert not [p for p in moment_paths if "Linear.weights" in p]\n'
            'w = state.params["mlp/Affine_0/Linear.weights"]\n'
            "np.testing.assert_array_equal(w, before)",
        ),
        (
            '"layer_1/learning_rate": 0.0',
            'w = state.params["mlp/Affine_1/Linear.weights"]\n'
            "np.testing.assert_array_equal(w, head)",
        ),
        (
            "print(textwrap.fill(found.line(), 88))",
            'assert "mlp/Affine_1/Linear.weights" in found.line()',
        ),
    ],
    "finetuning.md": [
        (
            'pop = pztrain.make_population(adapters, seeds=range(4), shared="model_',
            "one_base = nbytes(adapters(0).model_without_params)\n"
            "assert nbytes(pop.model_without_params) == one_base\n"
            "assert all(x.shape[0] == 4 for x in pop.params.values())\n"
            "assert int(pop.step) == 10",
        ),
    ],
    "populations.md": [
        (
            "own, own_step, stacked_batches, num_steps=12, log_every=12, "
            "progress=False",
            'assert stacked_batches[0]["x"].shape == (4, 16, 4)\n'
            "assert int(own.step) == 12 and len(stacked_batches) == 12\n"
            "own_losses = [own_train[f'loss/member_{i}'] for i in range(4)]\n"
            "assert np.isclose(own_train['loss'], np.mean(own_losses))",
        ),
        (
            'fig = history.plot(["loss", "eval/mse"], member_labels=labels)  '
            "# mean bold",
            "legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]\n"
            'assert legend[:4] == ["lr=0.001", "lr=0.003", "lr=0.01", "lr=0.03"]',
        ),
        (
            "print(pop.summary())",
            "assert pztrain.population_size(pop) == 4 and pop.step.shape == ()\n"
            'assert pop.params["w"].shape == (4, 4)\n'
            'lr = pop.hyperparams["learning_rate"]\n'
            "np.testing.assert_allclose(lr, rates, rtol=1e-6)",
        ),
        (
            "stacked = pztrain.stack_members(",
            "assert pztrain.population_size(mapped) == 4\n"
            'np.testing.assert_array_equal(stacked.params["w"], mapped.params["w"])',
        ),
        (
            "fused = pztrain.build_train_step(loss_fn, steps_per_call=2",
            'assert aux["loss"].shape == (4, 2)  # per member, per step\n'
            "assert int(pop.step) == 4",
        ),
        (
            "sharded, aux = train_step(sharded",
            "pop4 = pztrain.make_population(init, seeds=range(4))\n"
            "placed = shard_members(pop4, mesh)\n"
            'assert placed.params["w"].sharding.spec[0] == "members"',
        ),
        (
            'labels = [f"lr={rate:g}" for rate in rates]',
            'assert np.isclose(train["loss"], np.mean(losses))\n'
            'assert train["loss/min"] == min(losses)\n'
            'assert np.isclose(train["learning_rate/member_2"], rates[2])',
        ),
        (
            "one = pztrain.member(pop, best)",
            "assert pztrain.population_size(one) is None\n"
            'assert one.params["w"].shape == (4,)\n'
            'want = result[f"mse/member_{best}"]\n'
            'np.testing.assert_allclose(alone["mse"], want, rtol=1e-5)\n'
            "assert [int(m.step) for m in pztrain.members(pop)] == [int(pop.step)] * 4",
        ),
        (
            "pbt.decisions:",
            'assert [d["step"] for d in pbt.decisions] == [12, 24, 36, 48]',
        ),
        ("states = jax.vmap(init)(jnp.arange(3))", 'assert aux["loss"].shape == (3,)'),
        (
            "numeric = (loss_after_3_steps",
            "np.testing.assert_allclose(grad, numeric, rtol=2e-2)",
        ),
    ],
    "precision.md": [
        ("bf16 = final_loss(train_step", "assert abs(f32 - bf16) < 0.05 * f32"),
        (
            "accumulated = one_step(",
            "for name in whole:\n"
            "    assert jnp.allclose(whole[name], accumulated[name], atol=1e-5), name",
        ),
    ],
    "quickstart.md": [
        ('int(state.step), float(aux["loss"])', "assert int(state.step) == 300"),
        ('int(state.step), float(aux["loss"])', 'assert float(aux["loss"]) < 0.05'),
        (
            "fused_step = pztrain.build_train_step(loss_fn, steps_per_call=32)",
            "assert int(fused.step) == 32\n"
            "for name in one.params:\n"
            "    assert jnp.allclose(one.params[name], fused.params[name], atol=1e-5)",
        ),
        (
            "state0 = state0.with_hyperparams(learning_rate=1e-3)",
            'assert abs(float(other.hyperparams["learning_rate"]) - 1e-3) < 1e-9\n'
            'assert abs(float(trial.hyperparams["learning_rate"]) - 1e-2) < 1e-9\n'
            "assert int(state.step) == 300  # the trained state, left alone",
        ),
        (
            "print(state.summary())",
            # The summary fits 100 columns; treescope's view 80, but a line of one
            # item that treescope does not break (a fresh state's view: the trained
            # one's small arrays are written out in full, over several lines).
            "import re, treescope\n"
            "assert max(map(len, str(state.summary()).splitlines())) <= 100\n"
            "for line in treescope.render_to_text(fresh()).splitlines():\n"
            "    one_item = re.match(\n"
            "        r\" *('[^']*'|\\w+)(: |=)(<|# )(jax\\.Array|function)\\b\", line\n"
            "    )\n"
            "    assert len(line) <= 80 or one_item, line\n"
            "assert int(state.step) == 300  # the trained model's summary",
        ),
        (
            "print(sums.read().means)  # one read: {'loss': ...}",
            'assert float(sums.read().means["loss"]) < 0.05  # trained, not fresh',
        ),
    ],
    "stops.md": [
        (
            "callbacks=[CtrlCAt(30)],",
            'assert history.stop_reason == "interrupted"\n'
            "assert int(state.step) <= 31  # at most one call after the signal",
        ),
        (
            "num_steps=100,\n    log_every=10,\n    checkpoints",
            "assert int(state.step) == 100",
        ),
    ],
    "tuning.md": [
        ("study.optimize(objective, n_trials=4)", "assert len(study.trials) == 4"),
        (
            "trials, history = runs[1]",
            "assert [t.number for t in trials] == [4, 5, 6, 7]\n"
            "assert len(study.trials) == 8\n"
            "for i, trial in enumerate(trials):\n"
            "    frozen = study.trials[trial.number]\n"
            "    if frozen.state == optuna.trial.TrialState.COMPLETE:\n"
            '        assert frozen.value == final[f"loss/member_{i}"]',
        ),
        (
            "told = tell_population(",
            "assert [t.number for t in told] == [8, 9, 10, 11]",
        ),
    ],
}

# notebook file name -> (anchor: a line of the code cell the check follows,
# check: code); tests/test_notebooks.py runs each right after that cell.
NOTEBOOK_CHECKS = {
    "01_functional_loop.ipynb": [
        (
            "for name, value in state.params.items():",
            'for field in ("step=", "root_rng=", "params=", '
            '"opt_state=", "ScaleByAdamState"):\n'
            "    assert field in text, field",
        ),
        (
            "predictions = jnp.argmax(logits_of(state.model, x[test]), axis=-1)",
            "assert accuracy > 0.9, accuracy",
        ),
        (
            "predictions = jnp.argmax(logits_of(state.model, x[test]), axis=-1)",
            "assert int(state.step) == 10 * (len(train) // batch_size)",
        ),
    ],
    "02_fit_and_plots.ipynb": [
        (
            'print(len(logged.records), "records;", '
            'sorted(logged.metric_names("eval")))',
            'assert [(r["step"], r["split"]) for r in '
            "logged.records] == [\n"
            '    (r["step"], r["split"]) for r in history.records\n'
            "]",
        ),
        (
            'print(len(logged.records), "records;", '
            'sorted(logged.metric_names("eval")))',
            'assert logged.series("accuracy", "eval") == '
            'history.series("accuracy", "eval")',
        ),
        (
            "pztrain.ArrayLoader(test, 256, shuffle=False, drop_remainder=False),",
            'assert result["accuracy"] > 0.9, result',
        ),
        (
            "pztrain.ArrayLoader(test, 256, shuffle=False, drop_remainder=False),",
            "assert live.draws >= 2 * epochs  # redrawn at each log "
            "point and evaluation",
        ),
    ],
    "03_params_only.ipynb": [
        (
            'print("fresh model differs before loading:", not '
            "np.allclose(before, expected))",
            "np.testing.assert_array_equal(np.asarray(after), np.asarray(expected))",
        ),
        (
            'pztrain.export_safetensors(out / "mlp.safetensors", state)',
            "assert sorted(tensors) == sorted(state.params)",
        ),
        (
            'pztrain.export_safetensors(out / "mlp.safetensors", state)',
            "for name, value in state.params.items():\n"
            "    np.testing.assert_array_equal(tensors[name], "
            "np.asarray(value))",
        ),
        (
            'w1, b1 = tensors["mlp/Affine_0/Linear.weights"], '
            'tensors["mlp/Affine_0/AddBias.bias"]',
            "assert agree == 1.0",
        ),
    ],
    "04_optuna.ipynb": [
        (
            'print(f"best: {best.params}  validation accuracy '
            "{best.user_attrs['accuracy']:.4f}\")",
            'assert best.user_attrs["accuracy"] > 0.9, best.user_attrs',
        ),
        (
            'print(f"best: {best.params}  validation accuracy '
            "{best.user_attrs['accuracy']:.4f}\")",
            'assert pruned >= 1, "the median pruner stopped no trial"',
        ),
        (
            'print(f"best: {best.params}  validation accuracy '
            "{best.user_attrs['accuracy']:.4f}\")",
            "assert all(len(t.intermediate_values) >= 1 for t in "
            "study.trials)  # reports each eval",
        ),
    ],
    "05_interrupt_and_continue.ipynb": [
        (
            '"""What the interrupt button does (SIGINT to '
            'the kernel), at one log point."""',
            'assert history.stop_reason == "interrupted" and int(state.step) == 100',
        ),
        (
            'print("step", int(state.step), "- the same '
            'params as the uninterrupted run")',
            "for name in whole.params:\n"
            "    np.testing.assert_array_equal(\n"
            "        np.asarray(state.params[name]), "
            "np.asarray(whole.params[name])\n"
            "    )",
        ),
        (
            'print("resumed from checkpoint 100 to step", int(resumed.step))',
            "for name in whole.params:\n"
            "    np.testing.assert_array_equal(\n"
            "        np.asarray(resumed.params[name]), "
            "np.asarray(whole.params[name])\n"
            "    )",
        ),
        ('raise RuntimeError("a callback failed")', "assert int(state.step) == 350"),
    ],
    "06_many_devices.ipynb": [
        (
            'os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"',
            "assert jax.device_count() == 8",
        ),
        (
            "eval_step = pztrain.build_eval_step(eval_fn)  # follows "
            "the state's shardings",
            "assert accuracy > 0.9",
        ),
    ],
    "07_ema.ipynb": [
        (
            "print({name: round(value, 4) for name, value in sorted(last.items())})",
            'assert last["ema/accuracy"] > 0.9 and last["accuracy"] > 0.9',
        ),
        (
            'pztrain.export_safetensors(run_dir / "ema.safetensors", state, ema=True)',
            'assert abs(on_ema["accuracy"] - last["ema/accuracy"]) < 1e-6',
        ),
        (
            'pztrain.export_safetensors(run_dir / "ema.safetensors", state, ema=True)',
            "for name, value in loaded.items():\n"
            "    np.testing.assert_array_equal(value, "
            "state.ema_params[name])",
        ),
        (
            'pztrain.export_safetensors(run_dir / "ema.safetensors", state, ema=True)',
            "for name, value in exported.items():\n"
            "    np.testing.assert_array_equal(value, "
            "state.ema_params[name])",
        ),
    ],
    "08_parameter_groups.ipynb": [
        (
            "state = "
            'state.with_hyperparams(**{"first/learning_rate": '
            "0.0})  # freeze the first layer",
            "np.testing.assert_array_equal(\n"
            '    state.params["mlp/Affine_0/Linear.weights"], '
            "frozen_before\n"
            ")",
        ),
        (
            "state = "
            'state.with_hyperparams(**{"first/learning_rate": '
            "0.0})  # freeze the first layer",
            "assert accuracy > 0.9, accuracy",
        ),
        (
            "found = pztrain.step.find_nonfinite(train_step, "
            "broken_state(), train.batch_at(0))",
            'assert found.forward == ("mlp/Affine_2/Linear.weights",), found',
        ),
    ],
    "09_populations.ipynb": [
        (
            'fig = history.plot(["loss", "eval/accuracy"], member_labels=labels)',
            "legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]\n"
            'assert legend[:8] == [f"seed {i}" for i in range(8)], legend',
        ),
        (
            "result = pztrain.evaluate(pop, eval_step, test_data)  # "
            "mean, min, max, per member",
            "assert accuracy.mean() > 0.9 and "
            'np.isclose(result["accuracy"], accuracy.mean())',
        ),
        (
            "result = pztrain.evaluate(pop, eval_step, test_data)  # "
            "mean, min, max, per member",
            "assert difference <= 2 / 360  # at most 2 of the 360 test digits",
        ),
        (
            'print(f"best rate {rates[best]:.1e}: test accuracy '
            "{best_test['accuracy']:.4f}\")",
            'assert losses[0] > 2 * losses[best] and best_test["accuracy"] > 0.9',
        ),
        (
            'print("replaced per decision, from the log:", '
            'logged.series("pbt/replaced", "eval")[1])',
            "assert len(pbt.decisions) == 6",
        ),
        (
            "print(f\"eval accuracy: mean {last['accuracy']:.4f}, "
            "best {last['accuracy/max']:.4f}\")",
            'assert last["accuracy/max"] > 0.95',
        ),
    ],
    "10_evaluations.ipynb": [
        (
            "predicted = np.asarray(jnp.argmax(logits_of(state.model, "
            'jnp.asarray(test["x"])), -1))',
            'assert abs(final["classes/f1"] - whole_set) < 1e-9',
        )
    ],
    "11_finetuning.ipynb": [
        (
            "best = min(range(4), key=lambda i:",
            "one_run = nbytes(adapters(0).model_without_params)\n"
            "assert nbytes(pop.model_without_params) == one_run\n"
            "assert int(pop.step) == 20 and pztrain.population_size(pop) == 4",
        ),
        (
            "one = pztrain.member(pop, best)",
            'assert "adapter_config.json" in written and "config.json" in written\n'
            "assert not work.exists()",
        ),
    ],
}


def with_checks(nb, name: str):
    """``nb`` with a code cell after each cell that holds the anchor of one of
    its checks (`NOTEBOOK_CHECKS`): the checks are here, not in the
    notebook a reader runs. A check whose anchor is in no cell, or in two,
    fails the test."""
    after: dict[int, list[str]] = {}
    for anchor, check in NOTEBOOK_CHECKS.get(name, []):
        found = [
            i
            for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and anchor in cell.source
        ]
        assert len(found) == 1, f"{name}: anchor {anchor!r} in cells {found}"
        after.setdefault(found[0], []).append(check)
    cells = []
    for i, cell in enumerate(nb.cells):
        cells.append(cell)
        cells += [nbformat.v4.new_code_cell(c) for c in after.get(i, [])]
    nb.cells = cells
    return nb
