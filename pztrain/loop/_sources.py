"""Where a run's batches come from: one interface, two sources.

`BatchSource.stretch` gives the batches for the calls from one step up to the
next host point, each with the number of calls to run on it:

* `HostBatches`: batch dicts from the host (a `StepLoader` from the run's
  step, a grain ``IterDataset`` from its saved iterator state, or any
  iterable), moved to the device ahead of time in a background thread; one
  call per batch.
* `DeviceEpochs`: an `ArrayLoader(on_device=True)`: the epoch's data on the
  device, from which every call slices its own batch; one item per stretch.

`IteratorState` is the callback that keeps a sequential source's iterator
state with each checkpoint.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from pztrain.callbacks import Callback
from pztrain.data import ArrayLoader, StepLoader, prefetch_to_device, put_batch
from pztrain.data._batch import BatchError, check_batch, stack_batches
from pztrain.data._sequential import SequentialData
from pztrain.loop._data_order import DataOrder
from pztrain.step._notes import refuse_text

__all__ = [
    "BatchSource",
    "DeviceEpochs",
    "HostBatches",
    "IteratorState",
    "batch_source",
    "check_epochs",
    "check_placement",
    "data_callbacks",
    "one_shot_without_length",
]


class BatchSource(Protocol):
    """Batches for a run, stretch by stretch.

    Attributes:
      ended_pass: Whether the last stretch ended a pass over the data.
      ran_out: Whether one-shot data has run out.
    """

    ended_pass: bool
    ran_out: bool

    def stretch(self, step: int, stop: float) -> Iterator[tuple[Any, int]]:
        """``(batch, calls)`` for the calls from ``step`` up to ``stop`` (fewer
        at the end of a pass or of the data)."""

    def close(self) -> None:
        """Stops reading ahead (prefetch threads, grain's worker processes)."""


def check_placement(data: Any, sharding: Any) -> None:
    """Refuses data on the device that a mesh step would move whole each step
    (``sharding``: the step's batch sharding, ``None`` off a mesh)."""
    on_device = isinstance(data, ArrayLoader) and data.on_device
    if on_device and sharding is not None and data.sharding is None:
        raise ValueError(
            "The train step runs on a mesh but ArrayLoader(on_device=True) has no "
            "sharding: each step would move the whole epoch onto the mesh. Pass "
            "ArrayLoader(..., sharding=pztrain.sharding.data_sharding(mesh))."
        )


def batch_source(
    data: StepLoader | SequentialData | Iterable[Any],
    start: int,
    steps_per_call: int,
    prefetch: int,
    sharding: Any = None,
) -> BatchSource:
    """The source for ``fit``'s ``train_data``, positioned at step ``start``.

    Host batches go straight to ``sharding`` (the step's batch sharding; else
    an `ArrayLoader`'s own), built from each process's rows across processes
    (`pztrain.data.put_batch`).
    """
    if isinstance(data, ArrayLoader) and data.on_device:
        check_placement(data, sharding)
        return DeviceEpochs(data, start, steps_per_call)
    if isinstance(data, StepLoader):
        own = data.fit_source(start, steps_per_call, prefetch, sharding)
        if own is not None:  # e.g. a GrainLoader's blocks of steps
            return own
        if sharding is None:
            sharding = data.batch_sharding(steps_per_call)
        items = ((b, False) for b in data.iter_from_step(start, steps_per_call))
    elif isinstance(data, SequentialData):
        items = data.items(steps_per_call)  # (batch, ends_pass, state)
    else:
        items = _passes(data, steps_per_call)
    put = functools.partial(_put_first, sharding=sharding)
    if prefetch:
        items = prefetch_to_device(items, prefetch, put=put)
    elif sharding is not None:  # a global array needs building even so
        items = map(put, items)
    if isinstance(data, SequentialData):
        items = data.track(items)
    return HostBatches(items, steps_per_call)


class HostBatches:
    """Batches from the host, one call each.

    Args:
      items: ``(batch, ends_pass)`` pairs, already grouped by ``steps_per_call``.
      steps_per_call: Steps per call.
    """

    def __init__(self, items: Iterator[tuple[Any, bool]], steps_per_call: int):
        self._items = items
        self._k = steps_per_call
        self.ended_pass = False
        self.ran_out = False

    def stretch(self, step: int, stop: float) -> Iterator[tuple[Any, int]]:
        self.ended_pass = False
        while step < stop and not self.ended_pass:
            item = next(self._items, None)
            if item is None:
                self.ran_out = True
                return
            batch, self.ended_pass = item
            yield batch, 1
            step += self._k

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:  # a generator: its prefetch thread stops
            close()


class DeviceEpochs:
    """An `ArrayLoader(on_device=True)`: each stretch lies in one epoch, whose
    `pztrain.data.IndexedBatches` every call takes its batch from.

    Raises:
      ValueError: unless the steps per epoch and the start step are multiples
        of ``steps_per_call`` (no call may span two epochs).
    """

    ended_pass = False
    ran_out = False

    def __init__(self, loader: ArrayLoader, start: int, steps_per_call: int):
        per_epoch = loader.steps_per_epoch
        if per_epoch % steps_per_call or start % steps_per_call:
            raise ValueError(
                f"ArrayLoader(on_device=True) with steps_per_call={steps_per_call} "
                f"needs the steps per epoch ({per_epoch}) and the start step "
                f"({start}) to be multiples of {steps_per_call}, so that no call "
                "spans two epochs."
            )
        self._loader = loader
        self._k = steps_per_call

    def stretch(self, step: int, stop: float) -> Iterator[tuple[Any, int]]:
        batches = self._loader.device_epoch(step // self._loader.steps_per_epoch)
        yield batches, int(stop - step) // self._k

    def close(self) -> None:
        pass


def one_shot_without_length(data: Any) -> bool:
    """Whether ``data`` is a one-shot iterator (its own ``iter()``) that says
    nothing of its length (no ``len``, no ``__length_hint__``): a generator.

    Its passes cannot be counted, so it has no epochs.

    Example:
      >>> one_shot_without_length(x for x in range(3))
      True
      >>> one_shot_without_length(iter([1, 2])), one_shot_without_length([1, 2])
      (False, False)
    """
    if isinstance(data, StepLoader) or not isinstance(data, Iterator):
        return False
    return operator.length_hint(data, -1) < 0


def check_epochs(data: Any, num_epochs: int | None) -> None:
    """Refuses ``num_epochs`` for data without epochs (`one_shot_without_length`).

    Raises:
      ValueError: naming ``num_epochs`` and suggesting ``num_steps``.
    """
    if num_epochs is not None and one_shot_without_length(data):
        raise ValueError(
            f"num_epochs={num_epochs!r} with train_data a one-shot "
            f"{type(data).__name__} that has no length: fit cannot tell where an "
            "epoch ends (an endless generator would never end one). Pass "
            "num_steps=... instead, or data with epochs (an ArrayLoader or a list "
            "of batch dicts)."
        )


def _passes(data: Iterable[Any], k: int) -> Iterator[tuple[Any, bool]]:
    """``(batch, ends_pass)``; re-iterable data restarts after each pass.

    Looking one batch ahead marks the last batch of each pass, so an epoch that
    ends on the run's last step still ends.
    """
    reiterable = iter(data) is not data
    while True:
        groups = _groups(iter(data), k)
        previous = next(groups, None)
        if previous is None:
            return
        for group in groups:
            yield previous, False
            previous = group
        yield previous, True
        if not reiterable:
            return


def _groups(source: Iterator[Any], k: int) -> Iterator[Any]:
    """Checked batches of one pass, stacked ``k`` at a time (a rest is dropped)."""
    group: list[Any] = []
    keys = None
    for batch in source:
        if keys is None:
            check_batch(batch)
            keys = set(batch)
        elif set(batch) != keys:
            check_batch(batch, keys)
            raise BatchError(
                f"Batch has unexpected key(s) {sorted(set(batch) - keys)}; "
                f"the first batch had {sorted(keys)}."
            )
        group.append(batch)
        if len(group) == k:
            yield group[0] if k == 1 else stack_batches(group)
            group = []


def _put_first(item: tuple, sharding: Any) -> tuple:
    """``item`` with its batch (first) on the devices of ``sharding`` (text,
    which no device takes, refused as the step refuses it: the same error in
    and out of `pztrain.fit`, whichever thread moves the batch)."""
    try:
        return put_batch(item[0], sharding), *item[1:]
    except Exception as err:
        refuse_text(item[0], "train_step(state, ...)", err)
        raise


class IteratorState(Callback):
    """Keeps the iterator state of sequential train data (`SequentialData`)
    with each checkpoint, under the key ``"data"`` (`pztrain.Checkpoints`
    stores ``state_key`` callbacks' states by that key, so a run whose
    callbacks change keeps it)."""

    state_key = "data"

    def __init__(self, data: SequentialData):
        self.data = data

    def state_dict(self) -> dict[str, Any] | None:
        return self.data.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.data.load_state_dict(saved)


def data_callbacks(train_data: Any) -> list[Callback]:
    """The callbacks ``train_data`` needs: an `IteratorState` for sequential
    data, none for the others."""
    if isinstance(train_data, SequentialData):
        return [IteratorState(train_data)]
    if isinstance(train_data, StepLoader) and train_data.data_order() is not None:
        return [DataOrder(train_data)]  # its shuffle, kept and checked on resume
    return []
