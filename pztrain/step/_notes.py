"""What a step was given, added to an error raised inside it (PEP 678 notes).

An error from inside the user's loss function (``dot_general requires
contracting dimensions to have the same shape``) or the optimizer update names
no input. `note_inputs` adds one short note listing the batch (key, dtype,
shape) and the params (name, dtype, shape), so the wrong entry can be read off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pztrain._tree import describe, is_array_like, named_leaves

__all__ = ["inputs_note", "note_inputs", "refuse_text"]

_MARK = "pztrain: the step's inputs"
_BATCH_LINES = 5
_PARAM_LINES = 5


def _entry(name: str, value: Any) -> str:
    if is_array_like(value):
        return f"    {name}: {describe(value)}"
    if isinstance(value, list | tuple):
        return (
            f"    {name}: a Python {type(value).__name__} of {len(value)} (a batch "
            "holds arrays: np.asarray it)"
        )
    return f"    {name}: {describe(value)}"


def _lines(title: str, entries: list[tuple[str, Any]], most: int) -> list[str]:
    lines = [f"  {title} ({len(entries)}):"]
    lines += [_entry(name, value) for name, value in entries[:most]]
    if len(entries) > most:
        lines.append(f"    ... and {len(entries) - most} more")
    return lines


def inputs_note(params: Any, batch: Any, where: str) -> str:
    """The note: at most 15 lines (5 batch entries, 5 params, then a count).

    Batches on device (`pztrain.data.IndexedBatches`, as `pztrain.fit` feeds
    on-device and grain data) are listed by one step's batch, as a dict's.

    Example:
      >>> import numpy as np
      >>> print(inputs_note({"w": np.zeros((4, 1), np.float32)},
      ...                   {"x": np.zeros((8, 5), np.float32), "y": [1.0, 2.0]},
      ...                   "train_step"))
      pztrain: the step's inputs when train_step raised:
        batch (2):
          x: float32[8, 5]
          y: a Python list of 2 (a batch holds arrays: np.asarray it)
        params (1):
          w: float32[4, 1]
    """
    if not isinstance(batch, Mapping) and hasattr(batch, "batch_shapes"):
        batch = batch.batch_shapes()  # batches on device: a step's, as one dict
    if isinstance(batch, Mapping):
        batch_entries = [(str(k), v) for k, v in batch.items()]
        batch_lines = _lines("batch", batch_entries, _BATCH_LINES)
    else:
        batch_lines = [f"  batch: {type(batch).__name__}"]
    is_leaf = lambda x: isinstance(x, list | tuple) and not x  # noqa: E731
    params_lines = _lines("params", named_leaves(params, is_leaf), _PARAM_LINES)
    return "\n".join([f"{_MARK} when {where} raised:", *batch_lines, *params_lines])


def note_inputs(err: BaseException, params: Any, batch: Any, where: str) -> None:
    """Adds `inputs_note` to ``err`` once (a nested step does not add another).

    Raises:
      TypeError: from ``err``, naming the key, if the batch holds text (an
        array of strings or objects), which no step can take.
    """
    if any(note.startswith(_MARK) for note in getattr(err, "__notes__", ())):
        return
    refuse_text(batch, where, err)
    try:
        note = inputs_note(params, batch, where)
    except Exception:  # a note must never hide the error itself
        return
    err.add_note(note)


def refuse_text(batch: Any, where: str, cause: BaseException | None = None) -> None:
    """Raises a TypeError naming the first entry of ``batch`` that holds text.

    Example:
      >>> import numpy as np
      >>> from pztrain.step._notes import refuse_text
      >>> refuse_text({"x": np.ones(2), "y": np.array(["cat", "dog"])}, "step")
      Traceback (most recent call last):
      ...
      TypeError: step got batch['y'] of strings (str96[2]): a step takes numbers only; \
encode it first (e.g. token or class ids).
    """
    if not isinstance(batch, Mapping):
        return
    for key, value in batch.items():
        kind = getattr(getattr(value, "dtype", None), "kind", None)
        if kind in ("U", "S", "O"):
            what = "strings" if kind in "US" else "Python objects"
            raise TypeError(
                f"{where} got batch[{str(key)!r}] of {what} ({describe(value)}): a "
                "step takes numbers only; encode it first (e.g. token or class ids)."
            ) from cause
