"""#47 item 4: ``DataPosition`` with ``overlapped_start`` and a DataLoader with workers.

``overlapped_start`` promises ``iter(loader)`` on the calling thread, before any thread exists, so that the
workers fork safely and prefetch while the model compiles. A user's own generator around the loader broke it:
``iter(generator)`` starts nothing, so ``iter(loader)`` ran inside the first ``next()``, on a stage thread,
forking beside the compile (the user fell back to ``num_workers=0``). ``DataPosition.stream`` (all epochs)
and ``DataPosition.iterate`` (one) return an iterable whose ``iter()`` is the loader's, and a restart resumes
at the saved position: the batches after a restore are exactly the uninterrupted run's.

Every start compiles with the eager backend (the compile is not what is tested here: seconds, not tens).
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from ettkit.checkpoint import AsyncCheckpointer, DataPosition
from ettkit.errors import InvalidArgumentError
from ettkit.startup import BatchSpec, TensorSpec, overlapped_start
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ITEMS, BATCH, EPOCHS = 24, 4, 2
PER_EPOCH = ITEMS // BATCH


class Items(Dataset):
    """Item i: its index (to follow the order) and features derived from it."""

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        return {"x": torch.full((6,), float(i)), "idx": torch.tensor(i)}


class RecordingLoader(DataLoader):
    """A DataLoader that records the thread of every ``iter()`` and the kind of iterator it made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.iter_calls: list = []

    def __iter__(self):
        it = super().__iter__()
        self.iter_calls.append((threading.get_ident(), type(it).__name__))
        return it


SPEC = BatchSpec({"x": TensorSpec((BATCH, 6), torch.float32), "idx": TensorSpec((BATCH,), torch.int64)})


def loss_fn(out, batch):
    return out.square().mean()


def make_loader():
    # The epoch's order is a function of the epoch (set_epoch), as DataPosition requires.
    sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=7)
    loader = RecordingLoader(Items(), batch_size=BATCH, sampler=sampler, num_workers=2, drop_last=True,
                             multiprocessing_context="fork")
    return loader, sampler


class OnX(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 1)

    def forward(self, batch):
        return self.fc(batch["x"]).squeeze(1)


def start(pos: DataPosition, make_batches=None):
    """overlapped_start over ``pos.stream(...)`` (or ``make_batches(loader, sampler)``): returns (loader,
    compiled model, first batch, the rest)."""
    torch.manual_seed(0)
    loader, sampler = make_loader()
    if make_batches is None:
        batches = pos.stream(loader, EPOCHS, set_epoch=sampler.set_epoch)
    else:
        batches = make_batches(loader, sampler)
    compiled, first, _, rest = overlapped_start(
        OnX(), batches, SPEC, loss_fn, compile_kwargs={"backend": "eager"}, recorder=None
    )
    return loader, compiled, first, rest


def ids(batch) -> list:
    return batch["idx"].tolist()


def test_the_stream_forks_its_workers_on_the_calling_thread_and_runs_every_epoch():
    pos = DataPosition()
    loader, compiled, first, rest = start(pos)
    # The promise: iter(loader) on the calling thread (before the compile's thread exists), with workers.
    assert loader.iter_calls == [(threading.get_ident(), "_MultiProcessingDataLoaderIter")]
    seen = [ids(first)]
    epochs = [pos.epoch]
    for batch in rest:
        compiled(batch)
        seen.append(ids(batch))
        epochs.append(pos.epoch)
    assert len(seen) == EPOCHS * PER_EPOCH and epochs == [0] * PER_EPOCH + [1] * PER_EPOCH
    # Each epoch is a permutation of the dataset, in its own order (set_epoch ran before each epoch's iter).
    flat = [i for b in seen for i in b]
    assert sorted(flat[: ITEMS]) == sorted(flat[ITEMS:]) == list(range(ITEMS))
    assert flat[:ITEMS] != flat[ITEMS:]
    assert len(loader.iter_calls) == EPOCHS and (pos.epoch, pos.batches) == (EPOCHS, 0)


def reference() -> list:
    pos = DataPosition()
    _, _, first, rest = start(pos)
    return [ids(first)] + [ids(b) for b in rest]


@pytest.mark.parametrize("stop_after", [3, PER_EPOCH, PER_EPOCH + 2], ids=["mid-epoch", "epoch-end", "epoch-1"])
def test_a_restart_resumes_the_stream_at_the_saved_position_with_workers(tmp_path, stop_after):
    expected = reference()
    # The first run: trains `stop_after` batches, saving the position with each step, then stops (a crash
    # would lose only what came after the last save).
    pos = DataPosition()
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, preempt_signals=()) as ck:
        loader, compiled, first, rest = start(pos)
        before = []
        for step, batch in enumerate(itertools.chain([first], rest), start=1):
            compiled(batch)
            before.append(ids(batch))
            ck.save(step, {"data": pos})
            if step == stop_after:
                break
        ck.wait()
        rest.close()  # the workers of the interrupted epoch
    assert before == expected[:stop_after]

    # The restart: a new DataPosition restored from the checkpoint, a new loader, a new start.
    pos = DataPosition()
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, preempt_signals=()) as ck:
        assert ck.load_latest({"data": pos})[0] == stop_after
    # Saved after the step's batch was handed out: at an epoch's last batch the position is still in it.
    saved = {"epoch": 0, "batches": stop_after} if stop_after <= PER_EPOCH else \
        {"epoch": 1, "batches": stop_after - PER_EPOCH}
    assert {"epoch": pos.epoch, "batches": pos.batches} == saved
    loader, compiled, first, rest = start(pos)
    assert loader.iter_calls[0] == (threading.get_ident(), "_MultiProcessingDataLoaderIter")
    after = [ids(first)] + [ids(b) for b in rest]
    assert after == expected[stop_after:]  # nothing trained twice, nothing skipped
    assert (pos.epoch, pos.batches) == (EPOCHS, 0)


def test_iterate_one_epoch_also_starts_the_loader_on_the_calling_thread():
    # Before #47 iterate() was a generator: overlapped_start saw no workers (so no forking stage), and
    # iter(loader) ran inside the first next(), on the stage thread that fetches the first batch.
    pos = DataPosition(epoch=0, batches=2)
    loader, _, first, rest = start(pos, lambda loader, sampler: pos.iterate(loader))
    assert loader.iter_calls == [(threading.get_ident(), "_MultiProcessingDataLoaderIter")]
    assert 1 + len(list(rest)) == PER_EPOCH - 2 and (pos.epoch, pos.batches) == (1, 0)


def test_a_position_beyond_the_loader_is_refused_by_name_and_the_workers_stop():
    loader, sampler = make_loader()
    pos = DataPosition(epoch=0, batches=PER_EPOCH + 1)
    batches = pos.stream(loader, EPOCHS, set_epoch=sampler.set_epoch)
    with pytest.raises(InvalidArgumentError, match=f"saved after {PER_EPOCH + 1} batches, but the loader yields "
                                                   f"only {PER_EPOCH}"):
        next(iter(batches))
    with pytest.raises(StopIteration):
        next(batches)
    with pytest.raises(InvalidArgumentError, match="num_epochs=-1 must be >= 0"):
        pos.stream(loader, -1)
    with pytest.raises(InvalidArgumentError, match="set_epoch=3 must be callable"):
        pos.stream(loader, set_epoch=3)
