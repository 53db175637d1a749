"""Per-tensor transforms between a checkpoint's layout and a model's: each one
invertible, so exporting is the import run backwards.

A transform maps a stored (source) tensor to the model's (target) array:
`Transpose` (PyTorch's ``Linear`` stores ``(out, in)``), `SplitAxis` (a
``heads * head_dim`` axis into ``(heads, head_dim)``), `MergeAxes` (its
inverse) and `Slice` (one part of a fused projection: a ``qkv_proj`` split into
three targets; on export the parts are put back side by side). Each states the
shape it makes (checked before any tensor is read) and which box of the source
a box of the target needs, so a process reads only the slices its devices hold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "Box",
    "MergeAxes",
    "Slice",
    "SplitAxis",
    "Transform",
    "TransformError",
    "Transpose",
    "read_plan",
    "to_target",
    "shapes_along",
    "to_source",
]

Box = tuple[tuple[int, int], ...]  # a (start, stop) range per axis


class TransformError(ValueError):
    """A transform that does not fit a tensor's shape.

    Example:
      >>> from pztrain.finetune import SplitAxis, TransformError
      >>> try:
      ...     SplitAxis(0, (2, -1)).shape((3, 4))
      ... except TransformError as e:
      ...     print(e)
      SplitAxis(axis=0, sizes=(2, -1)) does not fit an axis of 3
    """


def _whole(box: Box, shape: Sequence[int], axes: range) -> bool:
    return all(box[a] == (0, shape[a]) for a in axes)


@dataclasses.dataclass(frozen=True)
class Transpose:
    """``target = source.transpose(axes)``: ``Transpose((1, 0))`` for a
    PyTorch ``Linear`` weight stored ``(out, in)`` into a JAX ``(in, out)``.

    Example:
      >>> from pztrain.finetune import Transpose
      >>> Transpose((1, 0)).shape((8, 4))
      (4, 8)
    """

    axes: tuple[int, ...]

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if sorted(self.axes) != list(range(len(shape))):
            raise TransformError(f"{self} does not fit a {len(shape)}-d shape")
        return tuple(shape[a] for a in self.axes)

    def back_box(self, box: Box, after: Sequence[int]) -> Box | None:
        back = [(0, 0)] * len(box)
        for i, a in enumerate(self.axes):
            back[a] = box[i]
        return tuple(back)

    def inverse_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape[a] for a in np.argsort(self.axes))

    def forward(self, x: np.ndarray, out_shape: Sequence[int]) -> np.ndarray:
        return np.transpose(x, self.axes)

    def inverse(self, x: np.ndarray, before: Sequence[int]) -> np.ndarray:
        return np.transpose(x, np.argsort(self.axes))


@dataclasses.dataclass(frozen=True)
class SplitAxis:
    """Splits source axis ``axis`` into ``sizes`` (one may be ``-1``) in
    row-major order: ``SplitAxis(0, (heads, -1))`` makes ``(heads * head_dim,
    embed)`` into ``(heads, head_dim, embed)``.

    Example:
      >>> from pztrain.finetune import SplitAxis
      >>> SplitAxis(0, (4, -1)).shape((32, 16))
      (4, 8, 16)
    """

    axis: int
    sizes: tuple[int, ...]

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        a = self.axis
        if not 0 <= a < len(shape) or list(self.sizes).count(-1) > 1:
            raise TransformError(f"{self} does not fit a {len(shape)}-d shape")
        known = math.prod(s for s in self.sizes if s != -1)
        sizes = tuple(shape[a] // known if s == -1 else s for s in self.sizes)
        if math.prod(sizes) != shape[a]:
            raise TransformError(f"{self} does not fit an axis of {shape[a]}")
        return (*shape[:a], *sizes, *shape[a + 1 :])

    def inverse_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        a, k = self.axis, len(self.sizes)
        return (*shape[:a], math.prod(shape[a : a + k]), *shape[a + k :])

    def back_box(self, box: Box, after: Sequence[int]) -> Box | None:
        a, k = self.axis, len(self.sizes)
        if not _whole(box, after, range(a + 1, a + k)):
            return None  # a part of an inner axis is not one range of the source
        inner = math.prod(after[a + 1 : a + k])
        start, stop = box[a]
        return (*box[:a], (start * inner, stop * inner), *box[a + k :])

    def forward(self, x: np.ndarray, out_shape: Sequence[int]) -> np.ndarray:
        return x.reshape(out_shape)

    def inverse(self, x: np.ndarray, before: Sequence[int]) -> np.ndarray:
        return x.reshape(before)


@dataclasses.dataclass(frozen=True)
class MergeAxes:
    """Merges the source axes from ``axis`` on, of sizes ``sizes``, into one
    (the inverse of `SplitAxis`).

    Example:
      >>> from pztrain.finetune import MergeAxes
      >>> MergeAxes(0, (4, 8)).shape((4, 8, 16))
      (32, 16)
    """

    axis: int
    sizes: tuple[int, ...]

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        a, k = self.axis, len(self.sizes)
        if not (0 <= a and a + k <= len(shape)) or tuple(shape[a : a + k]) != tuple(
            self.sizes
        ):
            raise TransformError(f"{self} does not fit shape {tuple(shape)}")
        return (*shape[:a], math.prod(self.sizes), *shape[a + k :])

    def inverse_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (*shape[: self.axis], *self.sizes, *shape[self.axis + 1 :])

    def back_box(self, box: Box, after: Sequence[int]) -> Box | None:
        if box[self.axis] != (0, after[self.axis]):
            return None
        whole = tuple((0, n) for n in self.sizes)
        return (*box[: self.axis], *whole, *box[self.axis + 1 :])

    def forward(self, x: np.ndarray, out_shape: Sequence[int]) -> np.ndarray:
        return x.reshape(out_shape)

    def inverse(self, x: np.ndarray, before: Sequence[int]) -> np.ndarray:
        return x.reshape(before)


@dataclasses.dataclass(frozen=True)
class Slice:
    """``target = source[start:stop]`` along ``axis``: one part of a fused
    tensor (``Slice(0, 0, 64)``: the query rows of a ``qkv_proj``). On export
    the parts are written back side by side; they must cover the fused tensor.

    Example:
      >>> from pztrain.finetune import Slice
      >>> Slice(0, 0, 64).shape((192, 64))  # the query third of a qkv_proj
      (64, 64)
    """

    axis: int
    start: int
    stop: int

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        a = self.axis
        if not (0 <= a < len(shape) and 0 <= self.start < self.stop <= shape[a]):
            raise TransformError(f"{self} does not fit shape {tuple(shape)}")
        return (*shape[:a], self.stop - self.start, *shape[a + 1 :])

    def inverse_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(shape)  # the part's own shape: the caller places it

    def back_box(self, box: Box, after: Sequence[int]) -> Box | None:
        a, (s, e) = self.axis, box[self.axis]
        return (*box[:a], (s + self.start, e + self.start), *box[a + 1 :])

    def forward(self, x: np.ndarray, out_shape: Sequence[int]) -> np.ndarray:
        return x  # the box read is already the part

    def inverse(self, x: np.ndarray, before: Sequence[int]) -> np.ndarray:
        return x  # the caller places the part (see `to_source`)


Transform = Transpose | SplitAxis | MergeAxes | Slice


def shapes_along(
    transforms: Sequence[Transform], shape: Sequence[int]
) -> list[tuple[int, ...]]:
    """The shapes before and after each transform, the source's first.

    Raises:
      TransformError: a transform that does not fit the shape before it.
    """
    shapes = [tuple(int(n) for n in shape)]
    for t in transforms:
        shapes.append(t.shape(shapes[-1]))
    return shapes


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def read_plan(
    transforms: Sequence[Transform], shapes: Sequence[tuple[int, ...]], box: Box
) -> tuple[list[Box], Box]:
    """What to read for ``box`` of the target: the box at each stage (the
    source's first, the target's last), and the box of the target that read
    yields. Where no chain of ranges of the source gives ``box`` (a part of an
    axis split into inner ones), the whole tensor is read and the caller
    slices ``box`` out of the returned (whole) target box."""
    boxes = [box]
    for i in reversed(range(len(transforms))):
        back = transforms[i].back_box(boxes[0], shapes[i + 1])
        if back is None:
            whole = tuple((0, n) for n in shapes[-1])
            return read_plan(transforms, shapes, whole)[0], whole
        boxes.insert(0, back)
    return boxes, box


def to_target(
    transforms: Sequence[Transform], x: np.ndarray, boxes: Sequence[Box]
) -> np.ndarray:
    """A source box ``x`` read as `read_plan` said, in the target's layout."""
    for t, after in zip(transforms, boxes[1:], strict=True):
        x = t.forward(x, _box_shape(after))
    return x


def to_source(transforms: Sequence[Transform], x: np.ndarray) -> np.ndarray:
    """A target array back in the source's layout (a `Slice`'s part as it
    sits in the fused tensor: the caller places it)."""
    for t in reversed(transforms):
        x = t.inverse(x, t.inverse_shape(x.shape))
    return x
