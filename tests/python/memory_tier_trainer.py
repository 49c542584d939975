"""One rank of a 2-rank gloo job that checkpoints to the memory tier, run by test_checkpoint_memory_tier.py.

python memory_tier_trainer.py RANK WORLD INIT RUN_DIR SHM_ROOT STEPS KILL_AT OUT_DIR

A model with BatchNorm (buffers written in forward) and Adam, attached to the checkpointer (overlapped
saves), gradients all-reduced over gloo. A memory-tier save every 2 steps, a disk save every 6. At step
KILL_AT (-1: never) the rank waits for that step's memory save to commit, writes what it saved to
OUT_DIR/expected-<rank>.pt, and dies by SIGKILL. A process that finds a checkpoint resumes from it and
writes OUT_DIR/resumed-<rank>.pt (step, tier, state); every run that reaches STEPS writes
OUT_DIR/final-<rank>.pt (state, and the loss of every step it trained). Each rank records its attempt into
RUN_DIR/ett (an ETT ledger), so the test can read the report's per-tier figures. With
ETTKIT_TEST_PEER_REPLICA=1 the checkpointer also keeps a peer replica (ranks_per_host=1: each rank is a
"node"), and OUT_DIR/replica-<rank>.pt records its counters at the end.
"""

import copy
import os
import signal
import sys

import torch
import torch.distributed as dist
from ettkit import ett
from ettkit.checkpoint import AsyncCheckpointer


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def snapshot(model, optimizer):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(optimizer.state_dict())}


def main() -> int:
    rank, world, init, run_dir, shm = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    steps, kill_at, out = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optimizer}
    losses = {}
    peer = os.environ.get("ETTKIT_TEST_PEER_REPLICA") == "1"
    with ett.Recorder(run_dir, rank=rank, world_size=world) as rec, \
            AsyncCheckpointer(os.path.join(run_dir, "ckpt"), recorder=rec, keep_last=2, memory_tier=shm,
                              job_id="memory-tier-test", peer_replica=peer, ranks_per_host=1 if peer else None) as ck:
        queued = ck.prefetch() if os.environ.get("ETTKIT_TEST_PREFETCH") == "1" else None
        ck.attach(model=model, optimizer=optimizer)
        restored = ck.load_latest(state)
        start = 1
        if restored is not None:
            start = restored[0] + 1
            torch.save({"step": restored[0], "tier": ck.restored_from, "from_rank": ck.restored_from_rank,
                        "prefetch_queued": queued, "prefetched": ck.restore_prefetched,
                        "extra": restored[1],
                        **snapshot(model, optimizer)}, os.path.join(out, f"resumed-{rank}.pt"))
        for step in range(start, steps + 1):
            x, y = batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            losses[step] = loss.item()
            rec.step(step)
            if step % 6 == 0:
                ck.save(step, state, extra={"step": step})
            elif step % 2 == 0:
                h = ck.save(step, state, extra={"step": step}, tier="memory")
                if step == kill_at:
                    h.wait()
                    torch.save({"step": step, **snapshot(model, optimizer)}, os.path.join(out, f"expected-{rank}.pt"))
                    dist.barrier()  # both ranks' memory snapshots of this step are committed
                    rec.flush()
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
    # After close(): every snapshot the other rank announced has been received (or refused) by then.
    torch.save(ck.replica_stats, os.path.join(out, f"replica-{rank}.pt"))
    torch.save({"losses": losses, **snapshot(model, optimizer)}, os.path.join(out, f"final-{rank}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
