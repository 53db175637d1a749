"""`StepLoader`: what `pztrain.fit` and `pztrain.evaluate` ask of a loader whose
position is a function of the step (DESIGN.md contract 5).

`pztrain.ArrayLoader` (arrays in memory) and `pztrain.GrainLoader` (a
random-access dataset read through grain) are the two kinds; `fit` starts
either at any step, so resuming needs no iterator state.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["StepLoader"]


class StepLoader(abc.ABC):
    """A loader whose batch for global step ``s`` is a function of ``s``.

    Subclasses set ``sharding`` (the `jax.sharding.NamedSharding` of one
    global batch, or ``None``) and give the batches of a step, of an epoch and
    from a step on. Across processes each process yields only its rows of
    every global batch, for `pztrain.data.put_batch` to assemble.

    Attributes:
      sharding: The sharding of one batch, or ``None``.
      on_device: Whether `pztrain.fit` slices each step's batch from an epoch
        kept on the device (`pztrain.ArrayLoader` only).

    Example:
      A loader of synthetic batches, each made from its step's number:

      >>> import numpy as np; from pztrain.data import StepLoader
      >>> class Counting(StepLoader):
      ...     steps_per_epoch = 3  # a class attribute stands for the property
      ...     def batch_at(self, step):
      ...         return {"x": np.full(2, step, np.float32)}
      ...     def epoch(self, epoch=0):
      ...         first = epoch * self.steps_per_epoch
      ...         return (self.batch_at(first + i) for i in range(3))
      ...     def iter_from_step(self, step, steps_per_call=1):
      ...         while True:  # steps_per_call=1 only, for brevity
      ...             yield self.batch_at(step)
      ...             step += 1
      ...
      >>> loader = Counting()
      >>> len(loader), [float(b["x"][0]) for b in loader.epoch(1)]
      (3, [3.0, 4.0, 5.0])
      >>> next(loader.iter_from_step(7))["x"]  # resume anywhere, no iterator state
      array([7., 7.], dtype=float32)
    """

    sharding: NamedSharding | None = None
    on_device: bool = False

    @property
    @abc.abstractmethod
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""

    @abc.abstractmethod
    def batch_at(self, step: int) -> dict[str, Any]:
        """The batch that global step ``step`` trains on (this process's rows)."""

    @abc.abstractmethod
    def epoch(self, epoch: int = 0) -> Iterator[dict[str, Any]]:
        """The batches of one epoch, in order (evaluation: one pass)."""

    @abc.abstractmethod
    def iter_from_step(
        self, step: int, steps_per_call: int = 1
    ) -> Iterator[dict[str, Any]]:
        """Batches from global step ``step`` on, endlessly; with
        ``steps_per_call=k`` each item stacks ``k`` steps' batches."""

    def batch_sharding(self, steps_per_call: int = 1) -> NamedSharding | None:
        """The sharding of a batch fed to the step (``None`` without a mesh):
        ``sharding``, behind a leading unsharded axis if ``steps_per_call > 1``."""
        if self.sharding is None or steps_per_call == 1:
            return self.sharding
        spec = PartitionSpec(None, *self.sharding.spec)
        return NamedSharding(self.sharding.mesh, spec)

    def rest(self, epoch: int = 0) -> dict[str, Any] | None:
        """The examples of ``epoch`` that none of its batches holds (the last
        partial batch a loader drops), all of them on every process, for an
        evaluation to count (`pztrain.data.eval_batches`); ``None`` (the
        default) when the batches hold them all."""
        del epoch
        return None

    def fit_source(
        self, start: int, steps_per_call: int, prefetch: int, sharding: Any
    ) -> Any:
        """How `pztrain.fit` reads this loader from step ``start``: a batch
        source of its own (e.g. blocks of steps), or
        ``None`` (the default) for host batches from `iter_from_step`, one
        call of the step each. ``sharding`` is the step's batch sharding
        (``None`` without a mesh)."""
        del start, steps_per_call, prefetch, sharding
        return None

    def data_order(self) -> str | None:
        """The name of the order this loader shuffles its examples in, which a
        checkpoint keeps and a resumed run checks; ``None`` (the default) when
        there is nothing to check."""
        return None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.epoch(0)

    def __len__(self) -> int:
        return self.steps_per_epoch
