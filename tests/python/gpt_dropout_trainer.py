"""Child of test_checkpoint_exact_resume_torchrun: a 2-rank GPT-style trainer with dropout, written the README's
way (nothing but the state {"model", "optim", "sched", "data"} saved), killed by SIGKILL and restarted by
torchrun. Usage: gpt_dropout_trainer.py RUN_DIR STEPS KILL_AT (-1: no kill). Each rank appends
"attempt step loss.hex()" lines to RUN_DIR/losses-rank-<r>.txt."""

from __future__ import annotations

import math
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ettkit
from ettkit.checkpoint import AsyncCheckpointer, DataPosition

VOCAB, CTX, DIM = 64, 16, 32


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, two causal self-attention blocks with dropout 0.1 (attention, residual,
    MLP and embedding), a tied LM head: GPT-2's shape, small."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(CTX, DIM)
        self.drop = torch.nn.Dropout(0.1)
        layer = torch.nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(DIM)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(CTX)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))
        x = self.norm(self.blocks(x, mask=self.mask, is_causal=True))
        return x @ self.tok.weight.T


def main(run_dir: str, steps: int, kill_at: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    ettkit.init_process_group("gloo", timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    tokens = torch.randint(0, VOCAB, (256, CTX + 1), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)  # 16 batches an epoch per rank
    pos = DataPosition()
    out = open(os.path.join(run_dir, f"losses-rank-{rank}.txt"), "a", buffering=1)
    with AsyncCheckpointer(os.path.join(run_dir, "ckpt"), every=5, keep_last=2, recorder=None) as ck:
        state = {"model": model, "optim": opt, "sched": sched, "data": pos}
        ck.attach(model=model, optimizer=opt)
        restored = ck.load_latest(state)
        step = restored[0] if restored else 0
        for (batch,) in pos.stream(loader, set_epoch=sampler.set_epoch):
            if step >= steps:
                break
            step += 1
            opt.zero_grad(set_to_none=True)
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            out.write(f"{attempt} {step} {loss.item().hex()}\n")
            if ck.should_save(step):
                ck.save(step, state)
            if attempt == 0 and step == kill_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
