"""`DataOrder`: the callback that keeps a loader's shuffle with each checkpoint
and checks it when a run resumes.

A `pztrain.GrainLoader`'s batches are a function of the step, the seed, the
dataset's length and the shuffle itself (``order``). Up to pztrain 0.2 it
shuffled with grain's ``index_shuffle``; now with a Feistel permutation
computed a batch at a time. A run resumed with another shuffle than it
trained with would see other batches from its step on, silently: so the
shuffle's name goes into each checkpoint (under ``"data_order"``), and a
resumed run whose checkpoint holds another one, or none (saved before the
name was kept), is refused with the fix, unless the loader was given its
``order`` explicitly.

`pztrain.fit` adds one for train data whose `StepLoader.data_order` names a
shuffle. This module is imported by the loop only (it needs
`pztrain.Callback`, whose package imports the data package).
"""

from __future__ import annotations

from typing import Any

from pztrain.callbacks import Callback
from pztrain.data._batch import BatchError

__all__ = ["DataOrder"]


class DataOrder(Callback):
    """Keeps ``loader.data_order()`` with each checkpoint; checks it on resume.

    Args:
      loader: The run's train data (a `pztrain.data.StepLoader` with a
        ``data_order``).

    Raises:
      BatchError: on resume (`load_state_dict`, ``on_train_start``) when the
        loader shuffles in another order than the checkpoint's run did, or
        the checkpoint predates the record of it, naming the ``order`` to
        pass.
    """

    state_key = "data_order"

    def __init__(self, loader: Any):
        self.loader = loader
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.loader.data_order()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.loaded = True
        order, want = saved.get("order"), self.loader.data_order()
        if order == want or not self._checks():
            return
        raise BatchError(
            f"The checkpoint's run shuffled its data with order={order!r}; this "
            f"{type(self.loader).__name__} shuffles with order={want!r}, so the "
            f"resumed run would train on other batches. Pass order={order!r} to "
            f"resume in the run's own order (or order={want!r} explicitly to go on "
            "in this one)."
        )

    def on_train_start(self, state: Any, info: Any) -> None:
        """Refuses a resume from a checkpoint that holds no order (saved by
        pztrain 0.2, which shuffled with grain's ``index_shuffle``)."""
        del state
        if self.loaded or not self._checks() or not _resumed(info):
            return
        ckpts = info.checkpoints
        raise BatchError(
            f"Checkpoint {info.start_step} in {ckpts.directory} does not record "
            "its data order: pztrain 0.2 saved it, whose GrainLoader shuffled with "
            "grain's index_shuffle; this one shuffles with "
            f"order={self.loader.data_order()!r}, so the resumed run would train "
            "on other batches. Pass GrainLoader(..., order='grain') to resume in "
            "the run's own order (or order='feistel' to go on in the new one)."
        )

    def _checks(self) -> bool:
        """Whether the order matters and was left to its default."""
        return bool(self.loader.shuffle) and getattr(self.loader, "order", None) is None


def _resumed(info: Any) -> bool:
    """Whether the run starts from one of its checkpoints."""
    ckpts = info.checkpoints
    return (
        ckpts is not None
        and info.start_step > 0
        and bool(getattr(ckpts, "continues_run", False))
        and info.start_step in ckpts.steps()
    )
