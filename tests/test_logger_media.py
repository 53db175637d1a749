"""Text and images in the loggers: `Text`, `Image`, `split_media`, `log_media`,
each built-in logger's ``log_media``, and a resumed JSONL log's media."""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.figure
import numpy as np
import pytest
from PIL import Image as PILImage
from test_callbacks_loggers import _read_events
from test_loggers_history import _wandb_records

import pztrain
from pztrain.loggers import (
    CSVLogger,
    Image,
    JsonlLogger,
    TensorBoardLogger,
    Text,
    log_media,
    read_media,
    split_media,
)

GREY = np.linspace(0.0, 1.0, 12).reshape(3, 4)  # floats in [0, 1], (H, W)
RGB = np.arange(2 * 5 * 3, dtype=np.uint8).reshape(2, 5, 3) * 8


def figure() -> matplotlib.figure.Figure:
    """A small figure (no pyplot: no backend, nothing to close)."""
    fig = matplotlib.figure.Figure(figsize=(2, 1), dpi=40)
    fig.add_subplot().plot([0, 1, 0])
    return fig


def decoded(png: bytes | str) -> np.ndarray:
    return np.asarray(PILImage.open(png if isinstance(png, str) else io.BytesIO(png)))


# ------------------------------------------------------------ values and split


def test_split_media_numbers_text_and_images():
    values = {
        "loss": np.float32(0.25),
        "n": 3,
        "ok": True,
        "jax": jnp.float32(1.5),
        "zero_d": np.array(2.0),
        "sample": "The cat",
        "note": Text("kept"),
        "grey": GREY,
        "rgb": jnp.asarray(RGB),
        "rgba": np.zeros((2, 2, 4), np.uint8),
        "plot": figure(),
    }
    numbers, media = split_media(values, "evaluation 'x'")
    assert numbers == {"loss": 0.25, "n": 3.0, "ok": 1.0, "jax": 1.5, "zero_d": 2.0}
    assert all(type(v) is float for v in numbers.values())
    assert list(media) == ["sample", "note", "grey", "rgb", "rgba", "plot"]
    assert media["sample"] == Text("The cat") and media["note"] == Text("kept")
    np.testing.assert_array_equal(media["grey"].array, GREY)
    np.testing.assert_array_equal(media["rgb"].array, RGB)
    assert media["plot"].array.shape == (40, 80, 4)  # 2 x 1 inches at 40 dpi
    assert media["plot"].array.dtype == np.uint8


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ([1, 2], "'ids': list, which is neither a number, text nor an image"),
        (None, "'ids': NoneType, which is neither"),
        (np.zeros(4), "'ids': an array of shape (4,) and dtype float64, which is"),
        (np.zeros((3, 3, 2)), "'ids': an array of shape (3, 3, 2) and dtype"),
        (np.array("a"), "'ids': an array of shape () and dtype <U1, which is"),
    ],
)
def test_split_media_refuses_other_values_naming_the_key(value, what):
    with pytest.raises(TypeError, match=re.escape(what)) as e:
        split_media({"ok": 1.0, "ids": value}, "Evaluation('lm')")
    message = str(e.value)
    assert message.startswith("Evaluation('lm') returned 'ids'")
    assert "It may return a number (Python, NumPy or JAX scalar), text" in message


@pytest.mark.parametrize(
    ("array", "why"),
    [
        (np.full((2, 2), 3.0), "an image of floats has values in [0, 1]; got values"),
        (np.ones((2, 2), np.int32), "an image holds uint8 or floats in [0, 1]; got"),
        (np.full((2, 2), np.nan), "an image of floats has finite values"),
    ],
)
def test_split_media_refuses_bad_images_naming_the_key_and_the_fix(array, why):
    with pytest.raises(TypeError, match=re.escape(f"E returned 'img': {why}")):
        split_media({"img": array}, "E")
    with pytest.raises(TypeError, match=re.escape(f"Image(array): {why}")):
        Image(array)


def test_split_media_keeps_what_the_caller_finalises():
    class Mergeable:
        def merge(self, other): ...
        def compute(self): ...

    metric = Mergeable()
    keep = lambda v: hasattr(v, "merge") and hasattr(v, "compute")  # noqa: E731
    numbers, media = split_media({"f1": metric, "s": "x"}, "E", keep=keep)
    assert numbers == {"f1": metric} and media == {"s": Text("x")}
    with pytest.raises(TypeError, match="or a value its caller finalises"):
        split_media({"f1": object()}, "E", keep=keep)
    with pytest.raises(TypeError, match=re.escape("'f1': Mergeable, which is")):
        split_media({"f1": metric}, "E")  # without keep: refused


def test_image_is_a_read_only_copy_and_its_png_holds_its_pixels():
    array = GREY.copy()
    image = Image(array)
    array[0, 0] = 0.5
    assert image.array[0, 0] == 0.0 and not image.array.flags.writeable
    expected = np.round(GREY * 255).astype(np.uint8)
    np.testing.assert_array_equal(image.to_uint8(), expected)
    np.testing.assert_array_equal(decoded(image.png()), expected)
    np.testing.assert_array_equal(decoded(Image(RGB).png()), RGB)
    with pytest.raises(TypeError, match=re.escape("Text(text) takes a str; got int")):
        Text(3)


# ------------------------------------------------------------------ log_media


def test_log_media_gives_media_to_loggers_that_take_them_and_warns_once():
    class Taker:
        def __init__(self):
            self.got = []

        def log_media(self, step, media):
            self.got.append((step, media))

    class NumbersOnly:  # a logger without log_media
        pass

    taker, media = Taker(), {"b": Text("x"), "a": Image(GREY)}
    with pytest.warns(UserWarning) as caught:
        log_media([NumbersOnly(), taker], 4, media)
    (warning,) = caught
    assert str(warning.message).startswith(
        "NumbersOnly records no text or images (it has no log_media method): it "
        "skips ['a', 'b'] at step 4 and later."
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per logger class: no second warning
        log_media([NumbersOnly(), taker], 6, media)
        log_media([NumbersOnly()], 8, {})  # nothing to skip
    assert [step for step, _ in taker.got] == [4, 6]
    assert taker.got[0][1] is media


def test_csv_logger_skips_media_with_the_warning(tmp_path):
    class RunCSV(CSVLogger):  # a class of its own: its warning not yet given
        pass

    logger = RunCSV(tmp_path)
    with pytest.warns(UserWarning, match=re.escape("RunCSV records no text or")):
        log_media([logger], 2, {"s": Text("x")})
    assert list(tmp_path.iterdir()) == []  # nothing written


# --------------------------------------------------------------------- JSONL


def test_jsonl_logger_writes_text_inline_and_images_as_png(tmp_path):
    logger = JsonlLogger(tmp_path)
    fig = Image.from_figure(figure())
    logger.log_record({"step": 2, "split": "train", "metrics": {"loss": 1.0}})
    logger.log_media(2, {"eval/s/sample": Text("The cat"), "eval/s/grey": Image(GREY)})
    logger.log_media(4, {"eval/s/rgb": Image(RGB), "eval/s/plot": fig})
    logger.close()
    lines = (tmp_path / "media.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {
        "step": 2,
        "key": "eval/s/sample",
        "text": "The cat",
    }
    got = read_media(tmp_path)
    assert [(m["step"], m["key"]) for m in got] == [
        (2, "eval/s/sample"),
        (2, "eval/s/grey"),
        (4, "eval/s/rgb"),
        (4, "eval/s/plot"),
    ]
    assert got[1]["image"] == tmp_path / "images" / "eval_s_grey-4e5111d316-2.png"
    expected = [Image(GREY).to_uint8(), RGB, fig.array]
    for entry, pixels in zip(got[1:], expected, strict=True):
        np.testing.assert_array_equal(decoded(str(entry["image"])), pixels)
    assert pztrain.loggers.read_jsonl(tmp_path)[0]["metrics"] == {"loss": 1.0}


def test_jsonl_logger_refuses_values_that_are_not_media(tmp_path):
    logger = JsonlLogger(tmp_path)
    with pytest.raises(
        TypeError, match=re.escape("JsonlLogger.log_media: 'x' is a list, not a Text")
    ):
        logger.log_media(1, {"x": [1]})


def test_read_media_of_a_file_name_and_of_a_run_without_media(tmp_path):
    logger = JsonlLogger(tmp_path / "train.jsonl")
    logger.log_record({"step": 1, "split": "train", "metrics": {"loss": 1.0}})
    assert read_media(tmp_path / "train.jsonl") == []
    logger.log_media(1, {"p": Image(RGB)})
    logger.close()
    (entry,) = read_media(tmp_path / "train.jsonl")
    assert entry["image"] == tmp_path / "train.images" / "p-148de9c5a7-1.png"
    assert (tmp_path / "train.media.jsonl").exists()
    with pytest.raises(FileNotFoundError, match=re.escape("no log there")):
        read_media(tmp_path / "nothing")


def _media_run(path, steps):
    logger = JsonlLogger(path)
    for step in steps:
        logger.log_record({"step": step, "split": "train", "metrics": {"x": 1.0}})
        logger.log_media(step, {"s": Text(f"at {step}"), "p": Image(RGB)})
    logger.close()


def test_a_resumed_jsonl_log_drops_later_media_and_their_pngs(tmp_path):
    _media_run(tmp_path, [2, 4, 6])
    pngs = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert pngs == [f"p-148de9c5a7-{step}.png" for step in (2, 4, 6)]

    # Another run (not resumed) is refused, every file left as it was.
    before = (tmp_path / "media.jsonl").read_text()
    with pytest.raises(ValueError, match="holds another run's log"):
        JsonlLogger(tmp_path).start_run(4, resumed=False)
    assert (tmp_path / "media.jsonl").read_text() == before

    # Resumed at 4: at its first record the entries after 4 go, and their PNGs.
    logger = JsonlLogger(tmp_path)
    logger.start_run(4, resumed=True)
    assert len(read_media(tmp_path)) == 6  # checked, not yet cut
    logger.log_record({"step": 5, "split": "train", "metrics": {"x": 2.0}})
    assert [m["step"] for m in read_media(tmp_path)] == [2, 2, 4, 4]
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == pngs[:2]
    logger.log_media(6, {"s": Text("again")})
    logger.close()
    assert [m.get("text") for m in read_media(tmp_path)][-1] == "again"


@pytest.mark.parametrize(
    "keys",
    [
        ("eval/s/grid/1", "eval/s/grid 1"),  # one slug: eval_s_grid_1
        ("eval/s/网格", "eval/s/グリッド"),  # non-Latin: one slug, eval_s
        ("eval/s/Grid", "eval/s/grid"),  # one file on a file system ignoring case
    ],
)
def test_media_keys_that_make_one_slug_get_files_of_their_own(tmp_path, keys):
    logger = JsonlLogger(tmp_path)
    first, second = Image(RGB), Image(GREY)
    logger.log_media(3, {keys[0]: first, keys[1]: second})
    logger.close()
    got = read_media(tmp_path)
    assert [m["key"] for m in got] == list(keys)
    names = {m["image"].name.lower() for m in got}
    assert len(names) == 2 and len(list((tmp_path / "images").iterdir())) == 2
    np.testing.assert_array_equal(decoded(str(got[0]["image"])), first.to_uint8())
    np.testing.assert_array_equal(decoded(str(got[1]["image"])), second.to_uint8())


def test_a_log_written_before_hashed_names_is_read_as_written(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "eval_s_grey-2.png").write_bytes(Image(GREY).png())
    (tmp_path / "metrics.jsonl").write_text("")
    entry = {"step": 2, "key": "eval/s/grey", "image": "images/eval_s_grey-2.png"}
    (tmp_path / "media.jsonl").write_text(json.dumps(entry) + "\n")
    (got,) = read_media(tmp_path)
    assert got["image"] == tmp_path / "images" / "eval_s_grey-2.png"
    np.testing.assert_array_equal(decoded(str(got["image"])), Image(GREY).to_uint8())
    logger = JsonlLogger(tmp_path)  # a resumed run goes on beside it
    logger.start_run(2, resumed=True)
    logger.log_media(4, {"eval/s/grey": Image(RGB)})
    logger.close()
    assert [m["image"].name for m in read_media(tmp_path)] == [
        "eval_s_grey-2.png",
        "eval_s_grey-4e5111d316-4.png",
    ]


# --------------------------------------------------------------- TensorBoard


def test_tensorboard_logger_writes_text_and_images(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    media = {"s/sample": Text("The cat"), "s/grey": Image(GREY), "s/rgb": RGB}
    _, media = split_media(media, "test")
    logger.log_media(3, media)
    logger.log_media(3, {"s/plot": Image.from_figure(figure())})
    with pytest.raises(TypeError, match=re.escape("TensorBoardLogger.log_media: 'x'")):
        logger.log_media(3, {"x": 1.0})
    logger.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    values = {
        v.tag: (e.step, v)
        for e in _read_events(path)
        for v in e.summary.value
        if e.HasField("summary")
    }
    assert set(values) == {"s/sample/text_summary", "s/grey", "s/rgb", "s/plot"}
    step, text = values["s/sample/text_summary"]
    assert step == 3 and text.tensor.string_val == [b"The cat"]
    for tag, pixels in [("s/grey", Image(GREY).to_uint8()), ("s/rgb", RGB)]:
        step, image = values[tag]
        assert step == 3 and (image.image.height, image.image.width) == (
            pixels.shape[0],
            pixels.shape[1],
        )
        got = decoded(image.image.encoded_image_string)
        grey = got[..., 0] if pixels.ndim == 2 else got  # stored as RGB
        np.testing.assert_array_equal(grey, pixels)
    assert values["s/plot"][1].image.colorspace == 4  # RGBA


# ------------------------------------------------------------ MLflow and W&B


@pytest.mark.slow  # imports mlflow and writes a file store
def test_mlflow_logger_logs_text_artifacts_and_images(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pztrain.loggers import MLflowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLflowLogger("media", tracking_uri=uri)
    logger.log_media(5, {"eval/s/sample": Text("The cat"), "eval/s/rgb": Image(RGB)})
    logger.log_media(6, {"odd:key": Image(GREY)})  # ":" is no MLflow key's
    with pytest.raises(TypeError, match=re.escape("MLflowLogger.log_media: 'x'")):
        logger.log_media(5, {"x": 1.0})
    logger.close()
    client = MlflowClient(tracking_uri=uri)
    text = client.download_artifacts(
        logger.run_id, "media/eval_s_sample-e35caad6a4-5.txt"
    )
    assert Path(text).read_text() == "The cat"
    images = [f.path for f in client.list_artifacts(logger.run_id, "images")]
    pngs = sorted(p for p in images if p.endswith(".png"))  # and small .webp
    assert len(pngs) == 2, images
    assert re.search(r"/eval.s.rgb.step.5.", pngs[0]), pngs
    assert re.search(r"/odd_key-b00d297f97.step.6.", pngs[1]), pngs  # its hash
    local = client.download_artifacts(logger.run_id, pngs[0])
    np.testing.assert_array_equal(decoded(local), RGB)


@pytest.mark.slow  # imports wandb and writes an offline run
def test_wandb_logger_logs_html_text_and_images(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    from pztrain.loggers import WandbLogger

    logger = WandbLogger("media", dir=tmp_path, mode="offline")
    logger.log_media(5, {"s/sample": Text("a < b"), "s/rgb": Image(RGB)})
    with pytest.raises(TypeError, match=re.escape("WandbLogger.log_media: 'x'")):
        logger.log_media(5, {"x": 1.0})
    files = Path(logger.run.dir)
    logger.close()
    import wandb

    wandb.teardown()  # W&B's service process writes the run file: let it finish
    (html,) = files.glob("media/html/s/sample_*.html")
    assert html.read_text() == "<pre>a &lt; b</pre>"
    (png,) = files.glob("media/images/s/rgb_*.png")
    np.testing.assert_array_equal(decoded(str(png)), RGB)
    (run_file,) = files.parent.glob("run-*.wandb")
    rows = [r.history for r in _wandb_records(run_file) if r.HasField("history")]
    (row,) = rows
    items = {"/".join(i.nested_key) or i.key: i.value_json for i in row.item}
    assert json.loads(items["_step"]) == 5
    assert json.loads(items["s/sample/_type"]) == "html-file"
    assert json.loads(items["s/rgb/_type"]) == "image-file"
    assert json.loads(items["s/rgb/path"]) == png.relative_to(files).as_posix()


# ---------------------------------------------------- through fit, end to end


def test_fit_gives_an_evaluations_text_and_images_to_its_loggers(tmp_path):
    import optax

    def loss_fn(*, model, state, rng, x):
        del rng
        loss = jnp.mean((x @ model["w"] - 1.0) ** 2)
        return loss, state, {"loss": loss}

    def samples(state):
        w = float(np.asarray(state.params["w"]).mean())
        return {"w": w, "sample": f"w={w:.3f}", "grey": GREY}

    state = pztrain.TrainState.initial_state(
        {"w": jnp.zeros(3)}, optax.sgd(0.1), jax.random.key(0)
    )
    data = pztrain.ArrayLoader({"x": np.ones((8, 3), np.float32)}, 4, seed=0)
    evaluation = pztrain.Evaluation("samples", samples, every=2, at_end=False)
    _, history = pztrain.fit(
        state,
        pztrain.build_train_step(loss_fn),
        data,
        num_steps=4,
        evaluations=[evaluation],
        run_dir=tmp_path,
        progress=False,
        log_every=2,
    )
    media = read_media(tmp_path)
    assert [(m["step"], m["key"]) for m in media] == [
        (2, "eval/samples/sample"),
        (2, "eval/samples/grey"),
        (4, "eval/samples/sample"),
        (4, "eval/samples/grey"),
    ]
    ws = history.series("samples/w", "eval")[1]
    assert [m["text"] for m in media[::2]] == [f"w={w:.3f}" for w in ws]
