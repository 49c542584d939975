"""The FSDP2 case of benchmarks/checkpoint.py: a ``fully_shard`` model and AdamW on gloo ranks, ettkit against
DCP in the same run.

    python benchmarks/checkpoint_fsdp2.py [--quick] [--dir DIR] [--json PATH]   (or: checkpoint.py --cases fsdp2)

Saved by SAVE_WORLD ranks, each save of ``{"model": model, "optim": optimizer}`` after an optimizer step:
ettkit attached (``attach(model=..., optimizer=...)``: the save returns once its copies are queued, the
wait before the next optimizer step is the fence) against ``dcp.async_save`` of the same state dict with
its default stager (its background write on a gloo group of its own, as DCP's docs advise: on the training
group its planning collectives would interleave with FSDP2's), alternating, each into its own directory. blocking_ms = the save call + the waits the
save costs the loop before the next step (ettkit: its fence before the optimizer step; DCP: waiting for the
previous save's future, as DCP requires before the next async_save). Loaded by LOAD_WORLD ranks (another
world size, so both reshard): a fresh model and a fresh AdamW, ettkit ``load_latest`` (checksums verified)
against ``dcp.load`` of DCP's own checkpoint of the same step into the same tensors, alternating, files
in the page cache for both. Each figure is the slowest rank's (the job waits for it), the median over the
saves or rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

SAVE_WORLD, LOAD_WORLD = 2, 3


def build(world: int, vocab: int, dim: int):
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, 1)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = torch.relu(block(h))
            return self.head(self.norm(h)).squeeze(-1)

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def forward_backward(model, step: int, rank: int, vocab: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randint(0, vocab, (256,), generator=g), torch.randn(256, generator=g)
    ((model(x) - y) ** 2).mean().backward()


def save_worker(rank: int, world: int, base: str, saves: int, vocab: int, dim: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import AsyncCheckpointer

    model, optimizer = build(world, vocab, dim)
    state = {"model": model, "optim": optimizer}
    step = 0

    def train_to_step():
        nonlocal step
        step += 1
        forward_backward(model, step, rank, vocab)

    ettkit_ms, dcp_ms = [], []
    dcp_group = dist.new_group(backend="gloo")
    with AsyncCheckpointer(os.path.join(base, "ettkit"), recorder=None, keep_last=1, preempt_signals=()) as ck:
        ck.attach(model=model, optimizer=optimizer)
        train_to_step()
        optimizer.step()
        optimizer.zero_grad()
        future = None
        for i in range(2 * saves + 2):  # alternating; the first save of each is a warm-up
            t0 = time.perf_counter()
            if i % 2 == 0:
                ck.save(step, state)
                call = time.perf_counter() - t0
                train_to_step()
                t1 = time.perf_counter()
                ck.wait_staged()  # what the attached pre-step fence waits
                blocked = call + time.perf_counter() - t1
                (ettkit_ms if i >= 2 else []).append(blocked * 1e3)
            else:
                if future is not None:
                    future.result()  # DCP: the previous save must be done before the next async_save
                sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                future = dcp.async_save(sd, checkpoint_id=os.path.join(base, "dcp", f"step-{step}"),
                                        process_group=dcp_group)
                last_dcp = step
                blocked = time.perf_counter() - t0
                train_to_step()
                (dcp_ms if i >= 2 else []).append(blocked * 1e3)
            optimizer.step()
            optimizer.zero_grad()
        future.result()
        ck.wait()
    import torch

    state_bytes = sum(p.to_local().nbytes for p in model.parameters())
    state_bytes += sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                       for st in optimizer.state.values() for v in st.values())
    return {"ettkit_ms": ettkit_ms, "dcp_ms": dcp_ms, "bytes": state_bytes, "dcp_step": last_dcp,
            "torch": torch.__version__}


def load_worker(rank: int, world: int, base: str, rounds: int, vocab: int, dim: int, dcp_step: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import AsyncCheckpointer

    model, optimizer = build(world, vocab, dim)
    ettkit_s, dcp_s = [], []
    with AsyncCheckpointer(os.path.join(base, "ettkit"), recorder=None, read_only=True) as ck:
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            ck.load_latest({"model": model, "optim": optimizer})
            ettkit_s.append(time.perf_counter() - t0)
            resharded_from = ck.resharded_from
            dist.barrier()
            sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            t0 = time.perf_counter()
            dcp.load(sd, checkpoint_id=os.path.join(base, "dcp", f"step-{dcp_step}"))
            optimizer.load_state_dict(sd["optim"])
            dcp_s.append(time.perf_counter() - t0)
    return {"ettkit_s": ettkit_s, "dcp_s": dcp_s, "resharded_from": resharded_from}


def _spawn(mode: str, world: int, base: str, args: list) -> list:
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode, str(r), str(world),
                               f"file://{base}/rdv-{mode}", base, *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"fsdp2 {mode} worker failed ({p.returncode}):\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def run(directory: str, quick: bool) -> dict:
    """Results keyed like checkpoint.py's: ``<metric>[fsdp2,...]`` -> {"ettkit": ..., "dcp": ...}."""
    vocab, dim = (8192, 256) if quick else (65536, 256)
    saves, rounds = (3, 3) if quick else (5, 5)
    base = os.path.join(directory, "fsdp2")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    try:
        saved = _spawn("save", SAVE_WORLD, base, [saves, vocab, dim])
        loaded = _spawn("load", LOAD_WORLD, base, [rounds, vocab, dim, saved[0]["dcp_step"]])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    worst = [max(per) for per in zip(*(r["ettkit_ms"] for r in saved))]
    worst_dcp = [max(per) for per in zip(*(r["dcp_ms"] for r in saved))]
    load_e = [max(per) for per in zip(*(r["ettkit_s"] for r in loaded))]
    load_d = [max(per) for per in zip(*(r["dcp_s"] for r in loaded))]
    assert all(r["resharded_from"] == SAVE_WORLD for r in loaded), loaded
    case = f"fsdp2,save_world={SAVE_WORLD},load_world={LOAD_WORLD}"
    return {
        f"state_MB[{case}]": {"all": sum(r["bytes"] for r in saved) / 1e6},
        f"blocking_ms[{case}]": {"ettkit": statistics.median(worst), "dcp_async": statistics.median(worst_dcp)},
        f"blocking_ms_max[{case}]": {"ettkit": max(worst), "dcp_async": max(worst_dcp)},
        f"reshard_load_s[{case}]": {"ettkit": statistics.median(load_e), "dcp_load": statistics.median(load_d)},
    }


def _worker(argv: list) -> None:
    import torch.distributed as dist

    mode, rank, world, init, base = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    rest = [int(a) for a in argv[5:]]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if mode == "save":
        result = save_worker(rank, world, base, *rest)
    else:
        result = load_worker(rank, world, base, *rest)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default="/tmp/ettkit_bench_ckpt")
    ap.add_argument("--json", help="also write the results here (make bench: build/bench/checkpoint_fsdp2.json)")
    args = ap.parse_args()
    results = run(args.dir, args.quick)
    for metric, values in results.items():
        print(f"{metric}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
    if args.json:
        write_json(args.json, "checkpoint_fsdp2", {"quick": args.quick, "save_world": SAVE_WORLD,
                                                   "load_world": LOAD_WORLD}, results)


if __name__ == "__main__":
    main()
