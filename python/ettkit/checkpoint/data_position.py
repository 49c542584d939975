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

import contextlib
import operator
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = ["DataPosition", "PositionedBatches"]


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
        # The generators' states where the current epoch's iter(loader) drew from them (see _epoch_start):
        # {"torch": bytes, "loader": bytes | None}, or None before the first epoch began.
        self.epoch_rng: dict | None = None

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

    def iterate(self, loader: Iterable) -> PositionedBatches:
        """The current epoch's batches of ``loader`` that were not consumed yet; then the next epoch begins.
        ``iter()`` of the result calls ``iter(loader)`` (so it can be handed to ``overlapped_start``, which
        calls it on the calling thread); the skipping happens at the first ``next()``."""
        return PositionedBatches(self, loader, num_epochs=None, set_epoch=None, one_epoch=True)

    def stream(
        self,
        loader: Iterable,
        num_epochs: int | None = None,
        *,
        set_epoch: Callable[[int], Any] | None = None,
    ) -> PositionedBatches:
        """Every batch left, epoch after epoch, until ``num_epochs`` (forever when None): one iterable for
        ``overlapped_start`` (docs/startup.md, "With a data position"). Each epoch begins with
        ``set_epoch(epoch)`` (e.g. ``sampler.set_epoch``: the epoch's order from the epoch) and then
        ``iter(loader)``; the first epoch's both happen when ``iter()`` is called on the result, which
        ``overlapped_start`` does on the calling thread before any thread exists, so a DataLoader's workers
        fork safely and prefetch while the model compiles. After a restore the first ``next()`` skips the
        batches the saved step had consumed. ``pos.epoch`` tells the loop which epoch a batch came from."""
        if num_epochs is not None:
            num_epochs = self._count("num_epochs", num_epochs)
        if set_epoch is not None and not callable(set_epoch):
            raise InvalidArgumentError(f"DataPosition.stream set_epoch={set_epoch!r} must be callable, e.g. "
                                       "sampler.set_epoch")
        return PositionedBatches(self, loader, num_epochs=num_epochs, set_epoch=set_epoch, one_epoch=False)

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "batches": self.batches}
        if self.epoch_rng is not None:
            state["epoch_rng"] = dict(self.epoch_rng)
        # Remembered so that a checkpointer recognises this copy put in a state by value (and refuses it).
        old = getattr(self, "_handed_out", None)
        if old is not None:
            _owners.pop(id(old), None)
        self._handed_out = state
        _owners[id(state)] = self
        return state

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"epoch", "batches"} <= set(state) <= {"epoch", "batches", "epoch_rng"}:
            raise InvalidArgumentError(f"DataPosition.load_state_dict takes {{'epoch', 'batches'}} and optionally "
                                       f"'epoch_rng', got {_short(state)}")
        self.epoch = self._count("epoch", state["epoch"])
        self.batches = self._count("batches", state["batches"])
        self.epoch_rng = _checked_epoch_rng(state.get("epoch_rng"))

    @contextlib.contextmanager
    def _epoch_start(self, loader: Any, resumed: bool, starts_iterator: bool):
        """Where ``iter(loader)`` (and, after a restore, the skipping of the consumed batches) draws from the
        random generators. A DataLoader's iterator draws its workers' base seed from ``loader.generator``, or
        from torch's global generator when it has none; a ``RandomSampler`` draws its epoch's order the same way.
        Those draws must not move torch's global generator: ``load_latest`` restored it to where the save was,
        and dropout after the restore must draw from there, as it did after the save. So they draw from the
        epoch's start, remembered here and saved with the position: the same seeds and the same order as the
        run that saved it, and the global generator where it was. A fresh epoch remembers where it starts.

        ``starts_iterator``: the block runs ``iter(loader)``. The loader's own generator is set to the epoch's
        start only there: it is the loader's alone, and it goes on from the iterator's draws to the sampler's.
        torch's global generator is set to the epoch's start for each block and put back after it, as in the
        run that saved: there it was at the epoch's start when ``iter()`` ran (which draws without moving it)
        and when the first ``next()`` drew the sampler's order."""
        gen = getattr(loader, "generator", None)
        gen = gen if isinstance(gen, torch.Generator) else None
        now = torch.get_rng_state()
        if resumed and self.epoch_rng is not None:
            torch.set_rng_state(_state_tensor(self.epoch_rng["torch"]))
            if starts_iterator and gen is not None and self.epoch_rng.get("loader") is not None:
                gen.set_state(_state_tensor(self.epoch_rng["loader"]))
        elif starts_iterator:
            self.epoch_rng = {"torch": now.numpy().tobytes(),
                              "loader": gen.get_state().numpy().tobytes() if gen is not None else None}
        try:
            yield
        finally:
            torch.set_rng_state(now)

    def __repr__(self) -> str:
        return f"DataPosition(epoch={self.epoch}, batches={self.batches})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _state_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _checked_epoch_rng(value: Any) -> dict | None:
    if value is None:
        return None
    size = torch.get_rng_state().numel()
    ok = (isinstance(value, dict) and set(value) == {"torch", "loader"} and isinstance(value["torch"], bytes)
          and len(value["torch"]) == size and (value["loader"] is None or isinstance(value["loader"], bytes)))
    if ok:
        try:  # a state the generator takes, tried on a scratch one (a hostile position cannot fail later)
            for data in (value["torch"], value["loader"]):
                if data is not None:
                    torch.Generator().set_state(_state_tensor(data))
        except (RuntimeError, ValueError) as e:
            raise InvalidArgumentError(f"DataPosition epoch_rng is no generator state: {e}") from None
        return dict(value)
    raise InvalidArgumentError(f"DataPosition epoch_rng must be {{'torch': {size} bytes, 'loader': bytes or "
                               f"None}}, got {_short(value)}")


def _warn_unseeded_sampler(loader: Any) -> None:
    """The one source of a different order after a restore that the position can see but not fix: a
    ``RandomSampler`` without a generator in a loader without workers draws its order from torch's global
    generator at the first ``next()``, which ``overlapped_start`` runs on a stage thread while the compile may
    draw from the same generator."""
    sampler = getattr(loader, "sampler", None)
    if (isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None
            and getattr(loader, "num_workers", 0) == 0):
        warnings.warn("DataPosition: the loader's RandomSampler has no generator= and the loader no workers: its "
                      "order after this restore is exact only if nothing else draws from torch's global generator "
                      "meanwhile; pass DataLoader(..., generator=torch.Generator().manual_seed(seed)) or use "
                      "DistributedSampler", RuntimeWarning, stacklevel=4)


class PositionedBatches:
    """The batches :meth:`DataPosition.iterate` and :meth:`DataPosition.stream` hand out, counted as they go.

    An iterator whose ``iter()`` starts the loader (``set_epoch``, then ``iter(loader)``) where it is called:
    ``overlapped_start(model, pos.stream(loader, ...), ...)`` calls it on the calling thread, as it would
    ``iter(loader)``, and reads ``num_workers`` / ``multiprocessing_context`` from here to know that it forks.
    ``close()`` shuts the current epoch's worker processes down (a loop that stops early)."""

    def __init__(self, position: DataPosition, loader: Iterable, *, num_epochs: int | None,
                 set_epoch: Callable[[int], Any] | None, one_epoch: bool):
        self._pos = position
        self._loader = loader
        self._num_epochs = num_epochs
        self._set_epoch = set_epoch
        self._one_epoch = one_epoch
        self._it: Iterator | None = None
        self._epoch = 0
        self._skip = 0
        self._done = False

    # What overlapped_start reads from a loader to decide whether iter() forks (a DataLoader's attributes).
    @property
    def num_workers(self) -> int:
        return getattr(self._loader, "num_workers", 0)

    @property
    def multiprocessing_context(self) -> Any:
        return getattr(self._loader, "multiprocessing_context", None)

    def _begin_epoch(self) -> None:
        if self._it is not None or self._done:
            return
        if self._num_epochs is not None and self._pos.epoch >= self._num_epochs:
            self._done = True
            return
        self._epoch = self._pos.epoch
        self._skip = self._pos.batches
        if self._set_epoch is not None:
            self._set_epoch(self._epoch)
        with self._pos._epoch_start(self._loader, resumed=self._skip > 0, starts_iterator=True):
            self._it = iter(self._loader)
        if self._skip:
            _warn_unseeded_sampler(self._loader)

    def __iter__(self) -> PositionedBatches:
        self._begin_epoch()
        return self

    def __next__(self) -> Any:
        while True:
            self._begin_epoch()
            if self._done:
                raise StopIteration
            while self._skip:
                try:
                    # The first next() may draw the sampler's order.
                    with self._pos._epoch_start(self._loader, resumed=True, starts_iterator=False):
                        next(self._it)
                except StopIteration:
                    consumed = self._pos.batches
                    self.close()
                    raise InvalidArgumentError(
                        f"DataPosition: epoch {self._epoch} was saved after {consumed} batches, but the loader "
                        f"yields only {consumed - self._skip}: the dataset, batch size or sampler differs from "
                        "the run that saved it"
                    ) from None
                self._skip -= 1
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self._pos.epoch = self._epoch + 1
                self._pos.batches = 0
                if self._one_epoch:
                    self._done = True
                continue
            self._pos.batches += 1
            return batch

    def close(self) -> None:
        """Stops: the loader's iterator is dropped and its worker processes shut down."""
        it, self._it, self._done = self._it, None, True
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()

    def __repr__(self) -> str:
        return f"PositionedBatches({self._pos!r}, num_epochs={self._num_epochs})"
