"""Processes of test_export_hf.py and benchmarks/export_hf.py: a GPT-2 (``GPT2LMHeadModel`` from a
``GPT2Config``, nothing downloaded) trained and saved by ettkit.

python export_hf_worker.py fsdp2 RANK WORLD INIT CKPT_DIR OUT_DIR [N_LAYER N_EMBD VOCAB]

Every rank builds the same model (seed 0), shards it with FSDP2 (``fully_shard`` per block and at the root, a
1-D gloo mesh), trains two AdamW steps on fixed tokens and saves ``{"model": model, "optim": optimizer}``
with an ``AsyncCheckpointer`` (each rank its shards), waiting until it is durable. Then every rank runs the
trained model in eval mode on fixed tokens; rank 0 writes the logits to OUT_DIR/logits.pt and the config to
OUT_DIR/config.json. WORLD 1 runs without FSDP2 and without a process group (a plain, unsharded save).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from ettkit.checkpoint import AsyncCheckpointer

SEQ = 16


def config(n_layer: int = 2, n_embd: int = 64, vocab: int = 256) -> GPT2Config:
    # Dropout off: the logits compared are the eval-mode ones anyway; the training steps are then the same
    # on every rank whatever their generator states.
    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab, n_positions=SEQ,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tokens(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, SEQ), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    mode, rank, world, init, ckpt, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    sizes = [int(a) for a in sys.argv[7:10]]
    assert mode == "fsdp2", mode
    cfg = config(*sizes)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        batch = tokens(cfg.vocab_size, step)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with AsyncCheckpointer(ckpt, recorder=None) as ck:
        ck.save(2, {"model": model, "optim": optimizer}).wait()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens(cfg.vocab_size, 99)).logits
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(logits, os.path.join(out, "logits.pt"))
        cfg.to_json_file(os.path.join(out, "config.json"))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
