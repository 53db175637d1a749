"""Text and images in the loggers: the value types `Text` and `Image`,
`split_media` (an evaluation's values as numbers and media) and `log_media`
(media to each logger that records them, one warning for each that cannot).

A logger records media if it has a method ``log_media(step, media)``, where
``media`` maps a name (e.g. ``"samples/text"``, used as the logger's tag) to a
`Text` or an `Image`. `JsonlLogger`, `TensorBoardLogger`, `MLflowLogger` and
`WandbLogger` have it; `CSVLogger` (a table of numbers) has not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import numbers
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = [
    "Image",
    "Text",
    "file_stem",
    "key_hash",
    "log_media",
    "not_media",
    "split_media",
]


@dataclasses.dataclass(frozen=True)
class Text:
    """A text to log (e.g. a sampled sequence): the loggers show it as text.

    Attributes:
      text: The text.

    Example:
      >>> from pztrain.loggers import Text
      >>> Text("The cat sat").text
      'The cat sat'
    """

    text: str

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise TypeError(f"Text(text) takes a str; got {type(self.text).__name__}.")


@dataclasses.dataclass(frozen=True, eq=False)
class Image:
    """An image to log: an array of shape ``(H, W)`` (grey), ``(H, W, 3)``
    (RGB) or ``(H, W, 4)`` (RGBA), of ``uint8`` or of floats in ``[0, 1]``.

    The array is kept as a read-only NumPy copy. `Image.from_figure` renders a
    matplotlib figure.

    Attributes:
      array: The image's pixels.

    Raises:
      TypeError: naming the shape or dtype, if the array is no such image.

    Example:
      >>> import numpy as np
      >>> from pztrain.loggers import Image
      >>> image = Image(np.zeros((2, 3, 3)))
      >>> image, image.to_uint8().dtype
      (Image(shape=(2, 3, 3), dtype=float64), dtype('uint8'))
      >>> Image(np.zeros(5))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: Image(array): an image is an array of shape ...; got shape (5,).
    """

    array: np.ndarray

    def __post_init__(self):
        array = np.array(self.array)  # a copy: the caller may change theirs
        problem = image_problem(array)
        if problem:
            raise TypeError(f"Image(array): {problem}.")
        array.flags.writeable = False
        object.__setattr__(self, "array", array)

    @classmethod
    def from_figure(cls, figure: Any, *, dpi: float | None = None) -> Image:
        """The RGBA pixels of a matplotlib ``Figure``, rendered as a PNG is.

        Args:
          figure: A ``matplotlib.figure.Figure`` (any backend; it is not changed).
          dpi: Dots per inch (default: the figure's own).

        Raises:
          ImportError: if matplotlib is missing, naming the extra to install.

        Example:
          >>> import matplotlib.figure
          >>> from pztrain.loggers import Image
          >>> fig = matplotlib.figure.Figure(figsize=(2, 1), dpi=50)
          >>> Image.from_figure(fig).array.shape
          (50, 100, 4)
        """
        pil = _pil("Image.from_figure")
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=dpi or figure.dpi)
        buffer.seek(0)
        return cls(np.asarray(pil.open(buffer).convert("RGBA")))

    def __repr__(self) -> str:  # not the pixels
        return f"Image(shape={self.array.shape}, dtype={self.array.dtype})"

    def to_uint8(self) -> np.ndarray:
        """The pixels as ``uint8`` (floats scaled by 255 and rounded)."""
        if self.array.dtype == np.uint8:
            return self.array
        return np.round(self.array * 255.0).astype(np.uint8)

    def png(self) -> bytes:
        """The image as PNG bytes (Pillow, which matplotlib brings).

        Raises:
          ImportError: if Pillow is missing, naming the extra to install.
        """
        buffer = io.BytesIO()
        _pil("Image.png").fromarray(self.to_uint8()).save(buffer, format="PNG")
        return buffer.getvalue()


def _pil(who: str) -> Any:
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise ImportError(
            f"{who} needs matplotlib and Pillow: pip install 'pztrain[plot]'."
        ) from None
    return PILImage


def image_problem(array: np.ndarray) -> str | None:
    """Why ``array`` is no image `Image` takes, or None if it is one.

    Example:
      >>> image_problem(np.full((2, 2), 2.0))
      'an image of floats has values in [0, 1]; got values from 2.0 to 2.0'
    """
    shape = array.shape
    if not (array.ndim == 2 or (array.ndim == 3 and shape[2] in (3, 4))):
        return (
            "an image is an array of shape (H, W), (H, W, 3) or (H, W, 4); got "
            f"shape {shape}"
        )
    if array.dtype == np.uint8:
        return None
    if not np.issubdtype(array.dtype, np.floating):
        return (
            f"an image holds uint8 or floats in [0, 1]; got dtype {array.dtype} "
            "(convert it: array.astype(np.uint8), or array / 255.0)"
        )
    if not np.isfinite(array).all():
        return "an image of floats has finite values; got NaN or infinity"
    if array.size and not (array.min() >= 0 and array.max() <= 1):
        return (
            "an image of floats has values in [0, 1]; got values from "
            f"{array.min()} to {array.max()}"
        )
    return None


def _is_figure(value: Any) -> bool:
    """A matplotlib figure, told without importing matplotlib."""
    return type(value).__module__.startswith("matplotlib.") and hasattr(
        value, "savefig"
    )


_ACCEPTED = (
    "a number (Python, NumPy or JAX scalar), text (a str or Text), an image (an "
    "array of shape (H, W), (H, W, 3) or (H, W, 4), a matplotlib Figure or an "
    "Image)"
)


def split_media(
    values: dict[str, Any],
    where: str,
    *,
    keep: Callable[[Any], bool] | None = None,
) -> tuple[dict[str, Any], dict[str, Text | Image]]:
    """An evaluation's values as numbers (floats) and media (`Text`, `Image`).

    A ``str`` becomes `Text`; a matplotlib ``Figure`` or an array of shape
    ``(H, W)``, ``(H, W, 3)`` or ``(H, W, 4)`` becomes `Image`; a scalar
    (Python, NumPy, JAX; a 0-d array) becomes a float.

    Args:
      values: Name → value, e.g. what a host-function evaluation returned.
      where: Who returned them, for the error (e.g. ``"evaluation 'samples'"``).
      keep: Values it is true for are returned unchanged with the numbers: a
        caller that finalises values of its own takes them here (`pztrain.fit`
        passes ``keep=pztrain.metric_states.is_metric_state``: mergeable
        metrics); without it they are refused like any other value.

    Returns:
      ``(numbers, media)``, each in the order of ``values``.

    Raises:
      TypeError: naming ``where``, the key and what is accepted, for any other
        value (an array of another shape, ``None``, a list …).

    Example:
      >>> import numpy as np
      >>> from pztrain.loggers import split_media
      >>> numbers, media = split_media(
      ...     {"loss": np.float32(0.5), "sample": "The cat"}, "evaluation 'lm'"
      ... )
      >>> numbers, media
      ({'loss': 0.5}, {'sample': Text(text='The cat')})
      >>> split_media({"ids": [1, 2]}, "evaluation 'lm'")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: evaluation 'lm' returned 'ids': list, which is neither a number, ...
    """
    numbers_: dict[str, Any] = {}
    media: dict[str, Text | Image] = {}
    for key, value in values.items():
        if keep is not None and keep(value):
            numbers_[key] = value
        elif isinstance(value, Text | Image):
            media[key] = value
        elif isinstance(value, str):
            media[key] = Text(value)
        elif _is_figure(value):
            media[key] = Image.from_figure(value)
        elif isinstance(value, numbers.Real):  # Python and NumPy scalars
            numbers_[key] = float(value)
        elif hasattr(value, "shape") and hasattr(value, "dtype"):  # NumPy, JAX
            _array(numbers_, media, key, np.asarray(value), where)
        else:
            raise _refused(key, type(value).__name__, where, keep)
    return numbers_, media


def _array(numbers_: dict, media: dict, key: str, array: np.ndarray, where: str):
    """An array value: a 0-d number, an image, or refused (naming its shape)."""
    if array.ndim == 0 and (
        np.issubdtype(array.dtype, np.number) or array.dtype == bool
    ):
        numbers_[key] = float(array)
        return
    problem = image_problem(array) if array.ndim >= 2 else None
    if array.ndim < 2 or (problem and problem.startswith("an image is an")):
        what = f"an array of shape {array.shape} and dtype {array.dtype}"
        raise _refused(key, what, where, None)
    if problem:
        raise TypeError(f"{where} returned {key!r}: {problem}.")
    media[key] = Image(array)


def _refused(key: str, what: str, where: str, keep: Any) -> TypeError:
    also = " or a value its caller finalises (a mergeable metric)" if keep else ""
    return TypeError(
        f"{where} returned {key!r}: {what}, which is neither a number, text nor "
        f"an image. It may return {_ACCEPTED}{also}."
    )


def not_media(who: str, key: str, value: Any) -> TypeError:
    """The error of a logger's ``log_media`` given a value that is not media.

    Example:
      >>> print(not_media("MyLogger", "ids", [1, 2]))
      MyLogger.log_media: 'ids' is a list, not a Text or an Image (pztrain.loggers.split_media makes them).
    """  # noqa: E501
    return TypeError(
        f"{who}.log_media: {key!r} is a {type(value).__name__}, not a Text or an "
        "Image (pztrain.loggers.split_media makes them)."
    )


_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
_SLUG_CHARS = 60  # a file name stays well under the 255 bytes file systems take


def file_stem(key: str) -> str:
    """A media name as a file name that no other name gets: a readable slug
    (runs of other characters than letters, digits, ``_``, ``.`` and ``-``
    become ``_``; at most 60 of them) and a hash of the exact name, so names
    that differ only in other characters (``"grid 1"``, ``"grid/1"``), in
    non-Latin letters or in case (on a file system that ignores case) get
    files of their own.

    Example:
      >>> file_stem("samples/text 1")
      'samples_text_1-510d0b2c2a'
      >>> file_stem("samples/text_1") != file_stem("samples/text 1")
      True
    """
    slug = _NOT_A_NAME.sub("_", key).strip("_.")[:_SLUG_CHARS] or "media"
    return f"{slug}-{key_hash(key)}"


def key_hash(key: str) -> str:
    """Ten hex digits of the SHA-256 of ``key``: what tells apart names that
    a logger's rules for names would make one.

    Example:
      >>> key_hash("grey")
      '67fc36385b'
    """
    return hashlib.sha256(key.encode()).hexdigest()[:10]


_warned: set[type] = set()  # logger classes already warned about, in this process


def log_media(loggers: Iterable[Any], step: int, media: dict[str, Text | Image]):
    """Gives ``media`` to each logger that has ``log_media(step, media)``.

    A logger without it (e.g. `CSVLogger`) skips them: a ``UserWarning``
    naming the logger's class and the keys skipped, once per class in a process.

    Args:
      loggers: The run's loggers.
      step: The step the media belong to.
      media: Name → `Text` or `Image` (see `split_media`).

    Example:
      >>> from pztrain.loggers import Text, log_media
      >>> class Printer:
      ...     def log_media(self, step, media): print(step, media)
      ...
      >>> log_media([Printer()], 10, {"sample": Text("The cat")})
      10 {'sample': Text(text='The cat')}
    """
    if not media:
        return
    for logger in loggers:
        method = getattr(logger, "log_media", None)
        if method is not None:
            method(step, media)
        elif type(logger) not in _warned:
            _warned.add(type(logger))
            warnings.warn(
                f"{type(logger).__name__} records no text or images (it has no "
                f"log_media method): it skips {sorted(media)} at step {step} and "
                "later. Use JsonlLogger, TensorBoardLogger, MLflowLogger or "
                "WandbLogger for them.",
                UserWarning,
                stacklevel=2,
            )
