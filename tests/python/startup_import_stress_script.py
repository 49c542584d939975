"""Child process of test_startup_import_stress: one start-up whose user init stage imports from torch's compile stack
while the compile stage loads a precompiled forward (or precompiles it, the first time).

Usage: startup_import_stress_script.py CACHE_DIR ORDER
ORDER picks what the user stage imports, and in which order (the modules that deadlocked CPython against the
compile stage's imports on main): each process of the stress runs one order, so the interleavings vary.
Prints one JSON line: {"ok": bool, "tier": ..., "error": "..."}; exits 0 either way (the test reads the line).
"""

from __future__ import annotations

import importlib
import json
import sys

import torch
from ettkit.startup import CompileCache, StageGraph, overlapped_start
from startup_helpers import TinyRec, declared_spec, loss_fn, make_batch

ORDERS = [
    ["torch._inductor.runtime.cache_dir_utils", "torch._dynamo"],
    ["torch._dynamo", "torch._inductor.runtime.cache_dir_utils"],
    ["torch._inductor.config", "torch._inductor.select_algorithm"],
    ["torch._inductor.codecache", "torch._dynamo.eval_frame"],
    ["torch._functorch.aot_autograd", "torch._inductor.runtime.cache_dir_utils"],
]


def main(cache_dir: str, order: int) -> None:
    torch.manual_seed(0)
    model = TinyRec()
    spec = declared_spec(dynamic=False)
    cache = CompileCache(cache_dir, model=model, spec=spec, config={}, precompile=True)
    graph = StageGraph(max_workers=4, recorder=None)
    imported = []

    def user_init():  # a user's init stage that touches the compile stack (a config tweak, a library)
        for name in ORDERS[order % len(ORDERS)]:
            imported.append(importlib.import_module(name).__name__)
        return len(imported)

    graph.add("train_module_creation", user_init)
    out = {"ok": False, "tier": None, "error": None}
    try:
        _, first, report, _ = overlapped_start(
            model, [make_batch(8, seed=1)], spec, loss_fn, cache, graph=graph
        )
        out.update(ok=graph.results["train_module_creation"] == 2, tier=report.cache_tier)
    except Exception as exc:  # noqa: BLE001 - what the test counts
        cause = exc.__cause__
        out["error"] = f"{type(exc).__name__}: {exc}" + (f" <- {type(cause).__name__}: {cause}" if cause else "")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
