"""A small training loop instrumented with the ETT recorder, resumable from its own checkpoints.

Runs alone (one process) or under torchrun (gloo DDP on CPU). ``--crash-at-step N`` makes rank
``--crash-rank`` SIGKILL itself at step N in the job's first attempt, so a restart (torchrun
``--max-restarts``, or running the script again) resumes from the last checkpoint and re-trains the steps
after it — which the ETT report shows as wasted training.

    python examples/python/ett_train.py --run-dir /tmp/run --steps 60 --ckpt-every 20 --crash-at-step 45
    python -m ettkit report /tmp/run
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from ettkit import ett


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--crash-at-step", type=int, default=-1, help="SIGKILL at this step in the first attempt")
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (slower demo)")
    return p.parse_args(argv)


def batch_for(step: int, batch: int, features: int):
    # Deterministic per step: a resumed run sees exactly the data the first attempt saw.
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, features, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return x, y


def main(argv=None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ckpt_dir = os.path.join(args.run_dir, "checkpoints")
    ckpt_path = os.path.join(ckpt_dir, "latest.pt")
    torch.set_num_threads(1)

    with ett.Recorder(args.run_dir, rank=rank, world_size=world, heartbeat_s=0.5) as rec:
        rec.set_config("checkpoint_interval_steps", args.ckpt_every)
        if world > 1:
            with rec.phase("process_group_init"):
                # torchrun reuses one store across restarts; a per-attempt prefix keeps the restarted
                # gloo group from reading the dead attempt's addresses.
                store, _, _ = next(dist.rendezvous("env://"))
                restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{restart}", store), rank=rank,
                                        world_size=world)
        with rec.phase("train_module_creation"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, args.hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(args.hidden, 1))
            if world > 1:
                model = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        start = 1
        if os.path.exists(ckpt_path):
            with rec.phase("checkpoint_restore"):
                state = torch.load(ckpt_path, weights_only=True)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                start = state["step"] + 1
        loss_fn = torch.nn.BCEWithLogitsLoss()
        for step in range(start, args.steps + 1):
            x, y = batch_for(step, args.batch, 32)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if rec.attempt == 0 and step == args.crash_at_step and rank == args.crash_rank:
                rec.flush()  # the steps before the crash are in the ledger; then a real, uncatchable kill
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.ckpt_every == 0:
                with rec.phase("checkpoint_blocking", step=step):
                    if rank == 0:
                        os.makedirs(ckpt_dir, exist_ok=True)
                        tmp = ckpt_path + ".tmp"
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                        os.replace(tmp, ckpt_path)  # a crash mid-save never leaves a torn checkpoint
                    if world > 1:
                        dist.barrier()
            rec.step(step)
        with rec.phase("shutdown"):
            if world > 1:
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
