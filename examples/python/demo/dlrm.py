"""A small DLRM-like recommendation model with embedding tables sharded over the ranks (gloo, CPU).

- ``DenseArch`` (replicated on every rank, the part that is compiled): a bottom MLP over the dense
  features, the pairwise dot-product interaction of its output with the pooled embeddings, a top MLP.
  Its gradients are averaged over the ranks with one all-reduce per step.
- ``ShardedEmbeddings``: each rank holds the shards the sharding metadata gives it (row-wise tables: a
  block of rows on every rank; table-wise tables: the whole table on one rank) as ``nn.Embedding`` weights
  with sparse gradients.

The lookup is the simplest correct scheme for a few ranks: the ranks all-gather their ids; each rank looks
up the ids that fall into its own shards (for every sample of every rank) and puts zeros elsewhere; one
all-reduce sums the partial results, so every rank holds every sample's pooled embeddings and keeps its
own batch. Backward mirrors it: the ranks all-gather the gradients of their pooled embeddings and each
rank back-propagates the part that reaches its shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class DenseArch(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, dim: int, bottom: list, top: list):
        super().__init__()
        layers, width = [], num_dense
        for h in list(bottom) + [dim]:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.bottom = nn.Sequential(*layers)
        n = num_tables + 1
        li, lj = torch.triu_indices(n, n, offset=1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        layers, width = [], dim + n * (n - 1) // 2
        for h in top:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.top = nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """dense (B, num_dense), pooled (B, num_tables, dim) -> click logits (B,)."""
        x = self.bottom(dense)
        feats = torch.cat([x.unsqueeze(1), pooled], dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


@dataclass(frozen=True)
class LocalShard:
    table: str
    row_offset: int
    rows: int


class ShardedEmbeddings(nn.Module):
    """The shards of ``tables`` (in order) that live on this rank; ``shards`` from the sharding metadata."""

    def __init__(self, tables: list, shards: list, dim: int, seed: int):
        super().__init__()
        self.table_names = [t["name"] for t in tables]
        self.shards = {s.table: s for s in shards}
        self.emb = nn.ModuleDict()
        for t_index, name in enumerate(self.table_names):
            s = self.shards.get(name)
            if s is None or s.rows == 0:
                continue
            e = nn.Embedding(s.rows, dim, sparse=True, _weight=torch.empty(s.rows, dim))
            # Initialised from (seed, table, first row): the global table does not depend on the sharding.
            g = torch.Generator().manual_seed(seed * 1_000_003 + t_index * 10_007 + s.row_offset)
            with torch.no_grad():
                e.weight.normal_(0.0, 0.05, generator=g)
            self.emb[name] = e

    def lookup(self, global_ids: torch.Tensor) -> torch.Tensor:
        """global_ids (N, num_tables) -> this rank's partial pooled embeddings (N, num_tables, dim): the rows
        it owns, zeros for the others."""
        n = global_ids.shape[0]
        cols = []
        for t, name in enumerate(self.table_names):
            if name not in self.emb:  # not on this rank
                cols.append(None)
                continue
            e = self.emb[name]
            s = self.shards[name]
            ids = global_ids[:, t]
            mine = ((ids >= s.row_offset) & (ids < s.row_offset + s.rows)).nonzero().squeeze(1)
            rows = e(ids[mine] - s.row_offset)
            cols.append(torch.zeros(n, e.embedding_dim).index_copy(0, mine, rows))
        dim = next(iter(self.emb.values())).embedding_dim
        zeros = torch.zeros(n, dim)
        return torch.stack([c if c is not None else zeros for c in cols], dim=1)


class ShardedStep:
    """One training step of the sharded model over ``world`` ranks (collectives on the default group)."""

    def __init__(self, embeddings: ShardedEmbeddings, dense_params: list, rank: int, world: int):
        self.embeddings = embeddings
        self.dense_params = dense_params
        self.rank, self.world = rank, world

    def forward_embeddings(self, ids: dict) -> tuple:
        local = torch.stack([ids[name] for name in self.embeddings.table_names], dim=1)
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        partial = self.embeddings.lookup(torch.cat(gathered))
        summed = partial.detach().clone()
        dist.all_reduce(summed)
        b = local.shape[0]
        pooled = summed[self.rank * b : (self.rank + 1) * b].clone().requires_grad_()
        return partial, pooled

    def backward_embeddings(self, partial: torch.Tensor, pooled: torch.Tensor) -> None:
        grads = [torch.empty_like(pooled.grad) for _ in range(self.world)]
        dist.all_gather(grads, pooled.grad.contiguous())
        # Every rank's loss is a mean over its own batch: the global mean divides by the world size.
        partial.backward(torch.cat(grads) / self.world)

    def allreduce_dense_grads(self) -> None:
        grads = [p.grad for p in self.dense_params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
