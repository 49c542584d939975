"""The names the documentation's Python blocks assume a trainer already has (doc_snippets.py, ``env trainer``).

A small real job on CPU: a recommendation-style model (embedding + dense features + BatchNorm) trained
with Adam and an LR scheduler on dict batches. ``train_step()`` takes a real optimizer step, and the
checkpoint helpers a plain trainer would write save and load real state, so a snippet that resumes or
records phases does so on real values.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn

num_embeddings = 100
BATCH = 256  # a real batch size: the snippets that compile use it as the fast batch's size hint


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(num_embeddings, 8, mode="sum")
        self.dense = nn.Linear(13, 8)
        self.norm = nn.BatchNorm1d(16)  # a buffer written in every training forward
        self.out = nn.Linear(16, 1)

    def forward(self, batch):
        x = torch.cat([self.emb(batch["ids"]), self.dense(batch["dense"])], dim=1)
        return self.out(torch.relu(self.norm(x))).squeeze(-1)


def make_batch(n: int = BATCH, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, num_embeddings, (n, 8), generator=g),
            "dense": torch.randn(n, 13, generator=g),
            "label": torch.randint(0, 2, (n,), generator=g).float()}


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return make_batch(BATCH, seed=i)


def loss_fn(out, batch):
    return nn.functional.binary_cross_entropy_with_logits(out, batch["label"])


def namespace(workdir: str, rank: int = 0) -> dict:
    """Fresh objects for one snippet, with files under ``workdir`` (the process's working directory)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1)
    batches = itertools.cycle([make_batch(BATCH, seed=i) for i in range(4)])
    run_dir = os.path.join(workdir, "run")
    saved = os.path.join(workdir, "plain-checkpoint.pt")

    def train_step(*_):
        model.train()
        batch = next(batches)
        optimizer.zero_grad()
        loss = loss_fn(model(batch), batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()

    def build_model():
        return model, optimizer

    def checkpoint_exists():
        return os.path.exists(saved)

    def save_checkpoint(*args):
        step = next((a for a in args if isinstance(a, int)), 0)
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, saved)

    def load_checkpoint(*_):
        if not os.path.exists(saved):
            return 0
        sd = torch.load(saved)
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        return sd["step"]

    def warm_up(m):
        m(make_batch())

    from ettkit import ett, sharding, startup

    ns = dict(
        ett=ett, startup=startup, sharding=sharding, n=1,
        spec=startup.BatchSpec.from_batch(make_batch(), dynamic_dims={"*": 0}),
        torch=torch, nn=nn, dist=dist, os=os, json=json, time=time, itertools=itertools, pathlib=pathlib,
        Net=Net, make_batch=make_batch, loss_fn=loss_fn, num_embeddings=num_embeddings,
        model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, sample_batch=make_batch(),
        train_step=train_step, build_model=build_model, checkpoint_exists=checkpoint_exists,
        save_checkpoint=save_checkpoint, load_checkpoint=load_checkpoint, warm_up=warm_up,
        steps=4, total_steps=4, epoch=0, rank=rank, run_dir=run_dir, ckpt_dir=pathlib.Path(workdir) / "ckpt",
        sd={"model": model.state_dict()}, path=os.path.join(workdir, "dcp"),
        init_pg=lambda: None, restore_checkpoint=lambda: load_checkpoint(),
        compile_fn=lambda: model, env=dict(os.environ), t_prepare=time.time(),
    )
    return ns
