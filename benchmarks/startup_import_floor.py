"""Where a precompiled start's compile stage goes (issue #62): importing torch's compile stack against loading
the precompiled forward and backward.

A warm start with ``CompileCache(precompile=True)`` compiles nothing, yet its compile stage still took 2.1–2.3 s
in ``make demo``, longer than the first real batch. This splits it in fresh processes (a module is imported once
per process): ``import torch``; then the modules ``load_precompiled`` needs (``torch._dynamo``,
``torch._inductor``, ``torch._inductor.compile_fx``, ``torch._functorch.aot_autograd``); then
``CompileCache.load_precompiled()`` with those already imported. The first process precompiles (a cold start)
and is not counted. Prints the medians and writes every process's figures with ``--json``.

    python benchmarks/startup_import_floor.py [--runs 5] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import importlib, json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
for name in ("torch._dynamo", "torch._inductor", "torch._inductor.compile_fx", "torch._functorch.aot_autograd"):
    importlib.import_module(name)
t2 = time.perf_counter()
from ettkit import startup
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, batch):
        return self.seq(batch["x"])


torch.manual_seed(0)
model = Net()
spec = startup.BatchSpec({"x": startup.TensorSpec((8, 16), torch.float32)})
cache = startup.CompileCache(sys.argv[1], model=model, spec=spec, config={}, precompile=True)
t3 = time.perf_counter()
if sys.argv[2] == "cold":
    loss = lambda out, batch: out.sum()
    _, _, report, _ = startup.overlapped_start(model, [spec.fast_batch(1)], spec, loss, cache, recorder=None)
    status = "cold" if report.precompiled_save is not None and report.precompiled_save.written else "not saved"
else:
    result, fn = cache.load_precompiled()
    status = result.status
t4 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "import_compile_stack_s": t2 - t1, "load_precompiled_s": t4 - t3,
                  "status": status}))
"""


def run_child(cache_dir: str, mode: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"))
    out = subprocess.run([sys.executable, "-c", CHILD, cache_dir, mode], capture_output=True, text=True,
                         env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="warm processes measured (default 5)")
    p.add_argument("--quick", action="store_true", help="2 warm processes")
    p.add_argument("--json", help="write every process's figures here")
    args = p.parse_args()
    runs = 2 if args.quick else args.runs
    with tempfile.TemporaryDirectory(prefix="ettkit-import-floor-") as d:
        cache_dir = os.path.join(d, "compile-cache")
        cold = run_child(cache_dir, "cold")
        if cold["status"] != "cold":
            raise SystemExit(f"the cold start did not save a precompiled file: {cold}")
        warm = [run_child(cache_dir, "warm") for _ in range(runs)]
    bad = [w["status"] for w in warm if w["status"] != "precompiled"]
    if bad:
        raise SystemExit(f"a warm process did not load the precompiled file: {bad}")
    med = {k: statistics.median(w[k] for w in warm) for k in ("import_torch_s", "import_compile_stack_s",
                                                            "load_precompiled_s")}
    stage = med["import_compile_stack_s"] + med["load_precompiled_s"]
    print(f"median of {runs} fresh processes: import torch {med['import_torch_s']:.2f} s; compile stage "
          f"{stage:.2f} s = compile-stack imports {med['import_compile_stack_s']:.2f} s "
          f"({med['import_compile_stack_s'] / stage:.0%}) + loading the precompiled file "
          f"{med['load_precompiled_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold": cold, "warm": warm, "median": med, "when": time.time()}, f, indent=1)


if __name__ == "__main__":
    main()
