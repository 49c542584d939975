"""Shared pieces of the start-up tests: a tiny recommendation-style model, its batches and a dataset.

Importable by the tests, by their subprocess scripts and by DataLoader workers (fork).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ettkit.startup import BatchSpec, Dim, TensorSpec
from torch.utils.data import Dataset

VOCAB = 50
IDS = 3
DENSE = 6


class TinyRec(torch.nn.Module):
    """Embedding + MLP with BatchNorm (buffers) and Dropout (RNG): everything a warm-up could disturb."""

    def __init__(self, dropout: float = 0.2):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.fc1 = torch.nn.Linear(8 + DENSE, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, batch):
        x = torch.cat([self.emb(batch["ids"]).sum(1), batch["dense"]], dim=1)
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))).squeeze(1)


def loss_fn(out, batch):
    return F.binary_cross_entropy_with_logits(out, batch["label"])


def make_batch(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, VOCAB, (n, IDS), generator=g),
        "dense": torch.randn(n, DENSE, generator=g),
        "label": torch.randint(0, 2, (n,), generator=g).float(),
    }


def declared_spec(dynamic: bool = True, batch: int = 8) -> BatchSpec:
    b = Dim("batch", min=2, max=256) if dynamic else batch
    return BatchSpec(
        {
            "ids": TensorSpec((b, IDS), torch.int64, value_range=(0, VOCAB - 1)),
            "dense": TensorSpec((b, DENSE), torch.float32),
            "label": TensorSpec((b,), torch.float32, value_range=(0, 1)),
        }
    )


def megacache_blob(artifacts: dict) -> bytes:
    """A MegaCache blob in torch's layout (torch/compiler/_cache.py over AppendingByteSerializer), written
    here independently of torch: ``{type: {key: content bytes}}``. For the file-format tests (no compile), and
    for hostile blobs whose keys torch's own recorder would never produce."""
    import base64
    import zlib

    def u64(n):
        return n.to_bytes(8, "big")

    def text(s):
        raw = base64.b64encode(s.encode())
        return u64(len(raw)) + raw

    body = u64(1)  # encoding version
    for kind, entries in artifacts.items():
        body += text(kind) + u64(len(entries))
        for key, content in entries.items():
            body += text(key) + u64(len(content)) + content
    return zlib.crc32(body).to_bytes(4, "big") + body


def train_steps(model, optimizer, batches):
    for b in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(b), b).backward()
        optimizer.step()


class RecDataset(Dataset):
    """Samples of TinyRec's batch. With ``gate`` (a ``multiprocessing`` Event, inherited by forked workers),
    every worker's first sample waits (up to ``gate_timeout_s``) until the gate is set: the test sets it from
    inside the warm compile, so the first batch can only arrive while the compile runs, which proves that
    the two overlap (run one after the other, they would wait out the timeout)."""

    def __init__(self, n: int, gate=None, gate_timeout_s: float = 30.0, dense_dtype=torch.float32):
        self.n = n
        self.gate = gate
        self.gate_timeout_s = gate_timeout_s
        self.dense_dtype = dense_dtype
        self._waited = False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.gate is not None and not self._waited:
            self._waited = True
            self.gate.wait(self.gate_timeout_s)
        g = torch.Generator().manual_seed(1000 + i)
        return {
            "ids": torch.randint(0, VOCAB, (IDS,), generator=g),
            "dense": torch.randn(DENSE, generator=g).to(self.dense_dtype),
            "label": torch.randint(0, 2, (), generator=g).float(),
        }


def static_spec() -> BatchSpec:
    """declared_spec's static form (batch 8) as a zero-argument factory: what `ettkit precompile --spec` calls."""
    return declared_spec(dynamic=False)


def fake_precompiled_serialization(monkeypatch) -> list:
    """torch's serialization of a precompiled forward replaced (the file-level tests need no compile): the
    artifact is b"artifact-bytes", and what is deserialized is appended to the returned list, so that a test
    can show that nothing was unpickled. No compiled CPU kernels are bundled."""
    from ettkit.startup import cache as cache_module
    from ettkit.startup import precompiled

    loaded = []
    monkeypatch.setattr(precompiled, "serialize", lambda fn: b"artifact-bytes")

    def deserialize(data):
        if data != b"artifact-bytes":
            raise RuntimeError("unpickling failed")
        loaded.append(data)
        return "loaded-fn"

    monkeypatch.setattr(precompiled, "deserialize", deserialize)
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", list)
    return loaded
