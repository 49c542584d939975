"""The training thread's cost of a save, by tensor count (issue #65): what `save()` blocks for after `prepare()`.

    python benchmarks/save_call.py [--quick] [--saves 15] [--json FILE]

A checkpointer with `overlap=True` (as with `attach()`: `save()` returns once its copies are queued) saves
one state over and over; each save is waited for before the next, outside the timing. Figures:
- `save_call_ms[shape=S,tensors=N]:bound|walked`: the median wall time of the `save()` call. `bound`: the
  default (the state is bound at `prepare()` and checked at every save, docs/checkpoint.md "The bound
  save"); `walked`: the same checkpointer code with the binding turned off, so that every save walks the
  state in Python (what every save did before #65), measured in the same process, interleaved;
- `per_tensor_us[shape=S]:bound|walked`: the slope between the smallest and the largest state, in µs per
  added tensor (#65's target for `bound`: at most 0.05);
- `first_over_later[shape=S,tensors=N]:bound`: the first save after `prepare()` against the median of the
  later ones; `first_over_later_cpu[...]`: the same in the calling thread's CPU time (`time.thread_time`), which
  a busy machine's preemption does not inflate: the first save's own extra work (#65: on the loaded 2-vCPU VM
  the wall-clock ratio at 12 tensors, 4-50x, was the thread waiting for a core after `prepare()`'s burst of
  page faults, at ~1x CPU);
- `cpp_save_ms[shape=S,tensors=N]:bound|walked`: the share of the call spent in the C++
  `AsyncCheckpointer::save` (timed by a thin proxy around it); the rest is the Python side.
Shapes, 256 MB in all: `plain`, a dict of parameters and a dict of two Adam moments each
(tensors = 3 per parameter: 12, 2,001, 20,001); `module`, an `nn.Module` of Linear layers, AdamW (after one
step: two moments and a step count per parameter) and an LR scheduler, as `{"model": m, "optim": o,
"sched": s, "step": i}` built afresh at every save (what a training loop writes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import print_table, write_json  # noqa: E402

COUNTS = (12, 2001, 20001)


def plain_state(tensors: int, total: int) -> dict:
    n = max(1, tensors // 3)
    numel = max(1, total // 4 // (3 * n))
    params = {f"layer{i}.weight": torch.randn(numel) for i in range(n)}
    optim = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v)} for k, v in params.items()}
    return {"model": params, "optim": optim}


class Stack(torch.nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def module_state(tensors: int, total: int):
    """About `tensors` tensors: one weight per layer, AdamW's exp_avg, exp_avg_sq and step each (4 per layer)."""
    layers = max(1, tensors // 4)
    width = max(1, int((total // 4 // (3 * layers)) ** 0.5))
    model = Stack(layers, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with warnings.catch_warnings():  # the scheduler's step counter of the step above, not a misuse here
        warnings.simplefilter("ignore")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
    return model, opt, sched


class _TimedCore:
    """The C++ checkpointer with its save() timed: the split between the Python side and C++."""

    def __init__(self, core):
        self._core, self.times = core, []

    def __getattr__(self, name):
        return getattr(self._core, name)

    def save(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._core.save(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - t0)


def run(shape: str, tensors: int, total: int, saves: int, root: str) -> dict:
    from ettkit.checkpoint import AsyncCheckpointer

    if shape == "plain":
        st = plain_state(tensors, total)
        make = lambda i: st  # noqa: E731
    else:
        model, opt, sched = module_state(tensors, total)
        make = lambda i: {"model": model, "optim": opt, "sched": sched, "step": i}  # noqa: E731
    times: dict = {"bound": [], "walked": []}
    cpu: list = []  # the bound save's thread CPU time
    cks: dict = {}
    cpp: dict = {}
    try:
        for variant in times:
            d = os.path.join(root, f"{shape}-{tensors}-{variant}")
            cks[variant] = AsyncCheckpointer(d, keep_last=1, recorder=None, preempt_signals=(), overlap=True,
                                             unfenced_sync_max_bytes=0)
            cks[variant].prepare(make(0), wait=True)
            if variant == "walked":  # the binding off: every save walks (a private switch, for this baseline)
                cks[variant]._bound.drop()
                cks[variant]._bound.wait = 1 << 62
            cks[variant]._c = _TimedCore(cks[variant]._c)
        for i in range(1, saves + 1):
            order = list(times) if i % 2 else list(times)[::-1]
            for variant in order:
                state = make(i)
                if shape != "plain":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        sched.step()  # the LR changes at every save, as in training
                t0, c0 = time.perf_counter(), time.thread_time()
                h = cks[variant].save(i, state)
                times[variant].append(time.perf_counter() - t0)
                if variant == "bound":
                    cpu.append(time.thread_time() - c0)
                h.wait()
    finally:
        for ck in cks.values():
            if isinstance(ck._c, _TimedCore):
                cpp[id(ck)] = ck._c.times
                ck._c = ck._c._core
            ck.close()
    out = {}
    for variant, ts in times.items():
        out[f"save_call_ms[shape={shape},tensors={tensors}]:{variant}"] = statistics.median(ts[1:]) * 1e3
        out[f"cpp_save_ms[shape={shape},tensors={tensors}]:{variant}"] = (
            statistics.median(cpp[id(cks[variant])][1:]) * 1e3)
    out[f"first_over_later[shape={shape},tensors={tensors}]:bound"] = (
        times["bound"][0] / statistics.median(times["bound"][1:]))
    out[f"first_over_later_cpu[shape={shape},tensors={tensors}]:bound"] = cpu[0] / statistics.median(cpu[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 saves per figure (the same states: smaller ones "
                    "would be copied on the caller's thread, under sync_copy_max_bytes, and measure that)")
    ap.add_argument("--saves", type=int, default=15)
    ap.add_argument("--shapes", default="plain,module")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--json")
    a = ap.parse_args()
    total = 256 << 20
    saves = 5 if a.quick else a.saves
    if saves < 2:
        ap.error(f"--saves {saves}: at least 2 (the first save after prepare() and one later save to compare)")
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)  # a scratch directory named on the command line may be new
    root = tempfile.mkdtemp(prefix="ettkit-save-call-", dir=a.dir)
    figures: dict = {}
    try:
        for shape in a.shapes.split(","):
            for n in COUNTS:
                figures.update(run(shape, n, total, saves, root))
            for variant in ("bound", "walked"):
                lo = figures[f"save_call_ms[shape={shape},tensors={COUNTS[0]}]:{variant}"]
                hi = figures[f"save_call_ms[shape={shape},tensors={COUNTS[-1]}]:{variant}"]
                figures[f"per_tensor_us[shape={shape}]:{variant}"] = (hi - lo) * 1e3 / (COUNTS[-1] - COUNTS[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results: dict = {}
    for key, value in figures.items():
        metric, variant = key.rsplit(":", 1)
        results.setdefault(metric, {})[variant] = value
    print_table("save() call after prepare(), ms (overlap=True)", results)
    if a.json:
        write_json(a.json, "save_call", {"quick": a.quick, "saves": saves, "total_bytes": total}, results)


if __name__ == "__main__":
    main()
