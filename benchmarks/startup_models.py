"""The models of benchmarks/startup.py (``--model``), in a module of their own: a precompiled artifact refers
to its model's class by import path, so the class must be importable by the process that loads it."""

from __future__ import annotations

import torch


class RecModel(torch.nn.Module):
    """Embedding summed over the ids, the dense features, an MLP with BatchNorm, ReLU and Dropout, one logit."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.emb = torch.nn.Embedding(cfg["vocab"], cfg["emb_dim"])
        layers, width = [], cfg["emb_dim"] + cfg["dense"]
        for h in cfg["hidden"]:
            layers += [
                torch.nn.Linear(width, h),
                torch.nn.BatchNorm1d(h),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.1),
            ]
            width = h
        self.mlp = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, batch):
        x = torch.cat([self.emb(batch["ids"]).sum(1), batch["dense"]], dim=1)
        return self.head(self.mlp(x)).squeeze(1)


class TransformerModel(torch.nn.Module):
    """The ids as a sequence of tokens through a 2-layer transformer encoder, mean-pooled, with the dense
    features, to one logit."""

    def __init__(self, cfg: dict):
        super().__init__()
        d = max(16, cfg["emb_dim"])
        self.emb = torch.nn.Embedding(cfg["vocab"], d)
        self.pos = torch.nn.Parameter(torch.zeros(cfg["num_ids"], d))
        layer = torch.nn.TransformerEncoderLayer(
            d, nhead=4, dim_feedforward=2 * d, dropout=0.1, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d + cfg["dense"], 1)

    def forward(self, batch):
        x = self.encoder(self.emb(batch["ids"]) + self.pos).mean(1)
        return self.head(torch.cat([x, batch["dense"]], dim=1)).squeeze(1)


class DLRMModel(torch.nn.Module):
    """DLRM's shape: one table per id column (its own vocabulary slice), a bottom MLP over the dense
    features, pairwise dot products of all the vectors, a top MLP."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, t = cfg["emb_dim"], cfg["num_ids"]
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(cfg["vocab"], d, mode="sum") for _ in range(t)
        )
        self.bottom = torch.nn.Sequential(
            torch.nn.Linear(cfg["dense"], 64), torch.nn.ReLU(), torch.nn.Linear(64, d), torch.nn.ReLU()
        )
        pairs = (t + 1) * t // 2
        self.top = torch.nn.Sequential(
            torch.nn.Linear(d + pairs, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.register_buffer("tri", torch.triu_indices(t + 1, t + 1, offset=1), persistent=False)

    def forward(self, batch):
        dense = self.bottom(batch["dense"])
        ids = batch["ids"]
        vecs = [dense] + [table(ids[:, i : i + 1]) for i, table in enumerate(self.tables)]
        z = torch.stack(vecs, dim=1)  # (B, T + 1, d)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([dense, dots], dim=1)).squeeze(1)


def build_model(cfg: dict) -> torch.nn.Module:
    return {"rec": RecModel, "transformer": TransformerModel, "dlrm": DLRMModel}[cfg.get("model", "rec")](cfg)
