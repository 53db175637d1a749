"""The reader's second pass (issue 41), the points the pages' own checks do not
cover: what a page shows besides its outputs, and how its words read.

The figures a page prints are checked by ``tests/docs_checks.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"


def test_the_data_guide_saves_its_hf_dataset_without_a_progress_widget():
    """``save_to_disk``'s progress bar is a widget whose script loads from a CDN:
    an empty box offline."""
    page = (GUIDES / "data.md").read_text()
    quiet = page.find("datasets.disable_progress_bars()")
    assert 0 <= quiet < page.find(".save_to_disk(")


def test_the_quickstart_shows_no_lint_comment_and_states_the_contract():
    page = (GUIDES / "quickstart.md").read_text()
    assert not re.search(r"#\s*(noqa|type: ignore|pylint)", page)
    for words in ["keyword arguments only", "`(loss, new_state, aux)`", "`rng`"]:
        assert words in page, words


def test_the_quickstart_replaces_no_trained_state_silently():
    """One cell makes ``state``; later cells train it on (``state, aux =
    train_step(state, ...)``) but none puts another state in its place: the
    later sections show the model trained there (their figures:
    tests/docs_checks.py)."""
    page = (GUIDES / "quickstart.md").read_text()
    made = re.findall(r"^\s*state(?:, \w+)? = (?!.*\(state\b)(.*)$", page, re.M)
    assert made == [
        "pztrain.TrainState.initial_state(model, optax.adam(0.05), jax.random.key(1))"
    ]


def test_perturb_reads_as_a_choice_of_factors():
    page = (GUIDES / "populations.md").read_text()
    assert "a factor drawn from" not in page
    assert "a choice of two factors, times 0.8 or times 1.25" in page


def test_the_dropout_example_does_not_reuse_the_learning_rates():
    page = (GUIDES / "populations.md").read_text()
    assert 'loss_fn_state={"rate": jnp.asarray(rates)}' not in page
    assert 'loss_fn_state={"dropout": jnp.asarray([0.0, 0.1, 0.2, 0.3])}' in page


def test_notebook_10_shows_its_digit_strip_large_enough_to_read():
    """The logged strip is 12 digits of 8 x 8 pixels (96 x 8 px): shown at its
    own size it was a thin line on the page."""
    notebook = GUIDES.parents[1] / "notebooks" / "10_evaluations.ipynb"
    source = notebook.read_text()
    assert "IPython.display.Image(filename=strips[-1], width=12 * 8 * 6)" in source


def test_the_fit_guide_shows_its_confusion_image_large_enough_to_read():
    """The logged figure is 3 x 3 inches at 50 dpi (150 px): its tick labels
    were about 6 px tall on the page."""
    page = (GUIDES / "fit.md").read_text()
    assert "IPython.display.Image(filename=matrix, width=300)" in page
