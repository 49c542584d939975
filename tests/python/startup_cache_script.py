"""Child process of test_startup_cache: compiles a small MLP with Inductor through a CompileCache.

Usage: startup_cache_script.py CACHE_DIR. Point TORCHINDUCTOR_CACHE_DIR at a fresh directory so that only
the CompileCache file can make the compile warm. Prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from ettkit.startup import BatchSpec, CompileCache, TensorSpec, warm_compile


def loss_fn(out, batch):
    return F.mse_loss(out, batch["y"])


def main(cache_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1), torch.nn.Flatten(0)
    )
    spec = BatchSpec({"x": TensorSpec((4, 6)), "y": TensorSpec((4,))})
    cache = CompileCache(cache_dir, model=model, spec=spec, config={"backend": "inductor"})
    loaded = cache.load()
    compiled = torch.compile(model, backend="inductor")
    t0 = time.perf_counter()
    warm = warm_compile(compiled, spec.fast_batch(), loss_fn, forward=lambda m, b: m(b["x"]))
    compile_s = time.perf_counter() - t0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = spec.fast_batch(seed=1)
    opt.zero_grad()
    loss_fn(compiled(batch["x"]), batch).backward()
    opt.step()
    saved = cache.save()
    print(
        json.dumps(
            {
                "load": loaded.status,
                "load_reason": loaded.reason,
                "artifacts_loaded": dict(loaded.artifacts),
                "saved": saved.written,
                "save_reason": saved.reason,
                "artifacts_saved": dict(saved.artifacts),
                "stats": cache.stats(),
                "compile_s": compile_s,
                "graphs": warm.graphs,
                "path": str(cache.path),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
