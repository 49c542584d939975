"""Where a training job is in its data stream, saved with its checkpoint so a restart resumes the stream
without re-reading or skipping data (docs/checkpoint.md, "The data position").

The best position is the loader's own state: torchdata's ``StatefulDataLoader`` has ``state_dict()`` /
``load_state_dict()``, so it goes into the saved state like a model (``{"loader": loader}``) and restores
mid-epoch, with its workers' state; the epochs after that one come out right only when their order is a
function of the epoch (see the docs: torchdata 0.11's ``shuffle=True`` generator is not in its state).
:class:`DataPosition` is the fallback for a
loader that has no state of its own (a plain ``torch.utils.data.DataLoader``): it counts epochs and the
batches consumed in the current epoch, and after a restore it skips the batches the job already trained
on. Skipping re-reads them (the loader has no way to seek), so it costs their loading time but never their
training; and it is exact only when the epoch's order is a function of the epoch (a sampler seeded per
epoch: ``DistributedSampler.set_epoch``, or a generator seeded with ``seed + epoch``).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["DataPosition"]


# id of the state dict each DataPosition handed out last -> that DataPosition, which keeps the dict alive (so
# the id names that dict while the entry exists): checkpoint/_flatten.py refuses such a copy put in a state by
# value, since it could neither keep it current at each save nor restore the DataPosition from it.
_owners: "weakref.WeakValueDictionary[int, DataPosition]" = weakref.WeakValueDictionary()


def handed_out_by(d: Any) -> "DataPosition | None":
    """The DataPosition whose latest ``state_dict()`` returned ``d`` (the same object), else None."""
    pos = _owners.get(id(d))
    return pos if pos is not None and pos._handed_out is d else None


class DataPosition:
    """``(epoch, batches)``: the epoch the job is in and how many of its batches were consumed.

    A Stateful: put it in the state you save (``ck.save(step, {"model": m, "data": pos})``) and
    ``load_latest`` restores it. Iterate every epoch through :meth:`iterate`, which counts each batch as it
    is handed out, skips the already consumed ones after a restore, and starts the next epoch when the
    loader is exhausted::

        pos = DataPosition()
        ck.load_latest({"model": model, "optim": opt, "data": pos})   # a restart: pos is where the save was
        for epoch in pos.epochs(num_epochs):
            sampler.set_epoch(epoch)                                   # the epoch's order from the epoch
            for batch in pos.iterate(loader):
                train_step(batch)

    A batch counts as consumed when it is handed out, so a save after the step that trained on it records
    it, and the restart begins with the next one.
    """

    def __init__(self, epoch: int = 0, batches: int = 0):
        self.epoch = self._count("epoch", epoch)
        self.batches = self._count("batches", batches)

    @staticmethod
    def _count(field: str, value: Any) -> int:
        try:
            value = operator.index(value)
        except TypeError:
            raise InvalidArgumentError(f"DataPosition {field}={value!r} must be an int >= 0") from None
        if value < 0:
            raise InvalidArgumentError(f"DataPosition {field}={value} must be >= 0")
        return value

    def epochs(self, num_epochs: int | None = None) -> Iterator[int]:
        """The epochs left: from the current one to ``num_epochs - 1`` (forever when None)."""
        while num_epochs is None or self.epoch < num_epochs:
            yield self.epoch

    def iterate(self, loader: Iterable) -> Iterator[Any]:
        """The current epoch's batches of ``loader`` that were not consumed yet; then the next epoch begins."""
        epoch = self.epoch
        skip = self.batches
        it = iter(loader)
        for skipped in range(skip):
            try:
                next(it)
            except StopIteration:
                raise InvalidArgumentError(
                    f"DataPosition: epoch {epoch} was saved after {skip} batches, but the loader yields only "
                    f"{skipped}: the dataset, batch size or sampler differs from the run that saved it"
                ) from None
        for batch in it:
            self.batches += 1
            yield batch
        self.epoch = epoch + 1
        self.batches = 0

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "batches": self.batches}
        # Remembered so that a checkpointer recognises this copy put in a state by value (and refuses it).
        old = getattr(self, "_handed_out", None)
        if old is not None:
            _owners.pop(id(old), None)
        self._handed_out = state
        _owners[id(state)] = self
        return state

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"epoch", "batches"}:
            raise InvalidArgumentError(f"DataPosition.load_state_dict takes {{'epoch', 'batches'}}, got {state!r}")
        self.epoch = self._count("epoch", state["epoch"])
        self.batches = self._count("batches", state["batches"])

    def __repr__(self) -> str:
        return f"DataPosition(epoch={self.epoch}, batches={self.batches})"
