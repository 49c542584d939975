"""save() blocking with whole-state capture: state dicts captured once against Statefuls (a fresh
state_dict() at every save), for a model of many small tensors.

    python benchmarks/checkpoint_whole_state.py [--quick] [--json FILE] [--dir DIR] [--saves N]

The model: P parameter tensors (5,000; --quick 1,000) of 4,352 float32 (17 KB, as the 256MB_small case of
benchmarks/checkpoint.py) in a ParameterList, and Adam, stepped once: 4 P tensors in the state (20,000).
Three checkpointers, each with the model attached (so save() returns once its copies are queued), saved in
turn in the same loop so that the machine's load falls on all alike; each save is made durable before the
next one, outside the timed call. Variants:

- `state_dicts`: ``{"model": model.state_dict(), "optim": opt.state_dict()}`` captured after the first step,
  only the model attached: what save() did before whole-state capture (one walk over plain dicts);
- `captured_attached`: the same dicts with the optimizer attached too: save() recognises the optimizer's
  dict, takes ``opt.state_dict()`` and refreshes the dict (README code written the older way);
- `objects`: ``{"model": model, "optim": opt}``: ``model.state_dict(keep_vars=True)`` and
  ``opt.state_dict()`` at every save (the recommended form).

save_call_ms is the wall time of the save() call, median over --saves saves per variant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import print_table, write_json  # noqa: E402

from ettkit.checkpoint import AsyncCheckpointer  # noqa: E402


class ManyTensors(torch.nn.Module):
    def __init__(self, n: int, numel: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--dir", help="checkpoint directory (default: a temporary one, in /dev/shm when present)")
    ap.add_argument("--saves", type=int, default=None)
    ap.add_argument("--params", type=int, default=None)
    ap.add_argument("--numel", type=int, default=4352)
    args = ap.parse_args()
    n = args.params or (1000 if args.quick else 5000)
    saves = args.saves or (5 if args.quick else 9)
    base = args.dir or tempfile.mkdtemp(prefix="ettkit-whole-state-",
                                        dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model = ManyTensors(n, args.numel)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # Adam's lazy state exists from here on
    variants = {
        "state_dicts": ({"model": model.state_dict(), "optim": opt.state_dict()}, dict(model=model)),
        "captured_attached": ({"model": model.state_dict(), "optim": opt.state_dict()},
                              dict(model=model, optimizer=opt)),
        "objects": ({"model": model, "optim": opt}, dict(model=model, optimizer=opt)),
    }
    cks = {}
    times: dict = {v: [] for v in variants}
    try:
        for name, (state, attach) in variants.items():
            cks[name] = AsyncCheckpointer(os.path.join(base, name), keep_last=1, recorder=None)
            cks[name].attach(**attach)
            cks[name].save(0, state).wait()  # plan, arena and names: the first save is not measured
        for step in range(1, saves + 1):
            for name, (state, _) in variants.items():
                t = time.perf_counter()
                h = cks[name].save(step, state)
                times[name].append(time.perf_counter() - t)
                h.wait()
        tensors = {name: len(cks[name]._names) for name in variants}
    finally:
        for ck in cks.values():
            ck.close()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    case = f"tensors={tensors['objects']}"
    results = {f"save_call_ms[{case}]": {v: statistics.median(ts) * 1e3 for v, ts in times.items()},
               f"save_call_ms_min[{case}]": {v: min(ts) * 1e3 for v, ts in times.items()},
               f"tensors[{case}]": tensors}
    print_table(f"checkpoint_whole_state: save() blocking, {n} parameters, medians of {saves} saves", results)
    if args.json:
        write_json(args.json, "checkpoint_whole_state",
                   {"params": n, "numel": args.numel, "saves": saves, "quick": args.quick}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
