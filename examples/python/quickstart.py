"""The README's trainer, complete: one path that works, in the order that works.

An EmbeddingBag + MLP + BatchNorm + dropout model, Adam and StepLR, a DistributedSampler over a plain DataLoader, the
ETT recorder, an AsyncCheckpointer saving every 10 steps with the data position, and a compile that
overlaps the first batch with a precompiled compile cache, so a restart loads instead of compiling.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/python/quickstart.py --run-dir RUN
    python -m ettkit report RUN

``--kill-at-step N`` makes rank ``--kill-rank`` SIGKILL itself after step N of the first attempt (a crash for
torchrun to restart). Each rank appends its per-step losses (exact, as float hex) and a few wall-clock
instants to ``RUN/quickstart/rank-<r>.jsonl``, so that a test can compare runs bit for bit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import ettkit
from ettkit import ett, startup
from ettkit.checkpoint import AsyncCheckpointer, DataPosition

VOCAB, BAG, DIM, DENSE, BATCH, SAMPLES = 1000, 4, 16, 8, 16, 512


class ClickDataset(Dataset):
    """Synthetic click logs, the same on every rank and in every attempt (seeded)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, BAG), generator=g)
        self.dense = torch.randn(SAMPLES, DENSE, generator=g)
        self.label = (self.dense[:, 0] + 0.1 * torch.randn(SAMPLES, generator=g) > 0).float()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"ids": self.ids[i], "dense": self.dense[i], "label": self.label[i]}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum")
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM + DENSE, 32), torch.nn.BatchNorm1d(32),
                                       torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        return self.mlp(torch.cat([self.emb(batch["ids"]), batch["dense"]], dim=1)).squeeze(1)


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, batch["label"])


def allreduce_grads(model: torch.nn.Module) -> None:
    """Data parallelism by hand (one flat all-reduce), so that the compiled module is the plain model."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch.nn.utils.vector_to_parameters(flat, grads)  # copies the averaged values back into each grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at-step", type=int, default=-1, help="SIGKILL after this step of attempt 0")
    p.add_argument("--kill-rank", type=int, default=1)
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)

    rec = ett.init(args.run_dir)                                  # this attempt's ledger; records how it ends
    ettkit.init_process_group("gloo", timeout=60)                 # rejoinable after a torchrun restart
    rank, world = dist.get_rank(), dist.get_world_size()
    log_path = os.path.join(args.run_dir, "quickstart", f"rank-{rank}.jsonl")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = open(log_path, "a", buffering=1)

    def note(**fields) -> None:
        log.write(json.dumps({"attempt": attempt, **fields}) + "\n")

    torch.manual_seed(0)                                          # the same initial model on every rank
    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)
    dataset = ClickDataset(seed=1)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=2)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    position = DataPosition()

    ck = AsyncCheckpointer(os.path.join(args.run_dir, "ckpt"), every=10, keep_last=2)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "data": position}  # objects, not dicts
    ck.attach(model=model, optimizer=optimizer)                   # fences its writers: save() overlaps training
    restored = ck.load_latest(state)                              # in place, random generators too; None at first
    step = restored[0] if restored else 0
    # Every epoch from the saved position on, each epoch's order a function of the epoch (set_epoch).
    batches = position.stream(loader, set_epoch=sampler.set_epoch)

    spec = startup.BatchSpec({
        "ids": startup.TensorSpec((BATCH, BAG), torch.int64, value_range=(0, VOCAB - 1)),
        "dense": startup.TensorSpec((BATCH, DENSE), torch.float32),
        "label": startup.TensorSpec((BATCH,), torch.float32, value_range=(0, 1)),
    })
    cache = startup.CompileCache(os.path.join(args.run_dir, "compile-cache"), model=model, spec=spec,
                                 precompile=True)
    compiled, first, report, rest = startup.overlapped_start(model, batches, spec, loss_fn, cache)  # saves the cache
    note(event="start", restored=step, cache=report.cache_tier)

    note(event="train_begin", t=time.time())
    for batch in itertools.chain([first], rest):
        if step >= args.steps:
            break
        step += 1
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(compiled(batch), batch)
        loss.backward()
        allreduce_grads(model)
        optimizer.step()
        scheduler.step()
        note(step=step, loss=loss.item().hex())
        if ck.should_save(step):
            ck.save(step, state)                                  # blocking: the hand-over, not the write
        rec.step(step)
        if attempt == 0 and step == args.kill_at_step and rank == args.kill_rank:
            rec.flush()                                           # the steps so far are in the ledger
            note(event="kill", t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)                  # a real, uncatchable crash
    ck.close()                                                    # waits until the last save is durable
    dist.destroy_process_group()
    log.close()


if __name__ == "__main__":
    main()
