"""Child process of test_startup_precompile: starts TinyRec with overlapped_start and trains 10 steps.

Usage: startup_precompile_script.py MODE CACHE_DIR [SPEC]
- MODE "ettkit": overlapped_start with CompileCache(precompile=True) (cold the first time, precompiled after);
  "jit": overlapped_start with CompileCache(precompile=False) (torch.compile, the spec's dims marked dynamic);
  "plain": torch.compile(model) and the same steps, no ettkit.
- SPEC "static" (batch 8, the default) or "dynamic" (Dim batch 2..256; the steps then use two batch sizes).
Point TORCHINDUCTOR_CACHE_DIR at a fresh directory so that only the ettkit file can make a start warm. With
ETTKIT_TEST_FAIL_ON_RECOMPILE=1 the 10 steps run under torch.compiler.set_stance("fail_on_recompile").
With ETTKIT_TEST_STORE=<path> (and ETTKIT_TEST_RANK, ETTKIT_TEST_WORLD) the ranks share one precompile through
a FileStore at that path (compile once per job), signed with $ETTKIT_COMPILE_SHARE_SECRET, which CompileCache
reads itself. With ETTKIT_TEST_SHARED_DIR=<dir> (and ETTKIT_TEST_JOB) the cache also uses that shared compile
cache, its files signed with $ETTKIT_COMPILE_CACHE_SECRET.
Prints one JSON line: the report, and every loss and gradient as exact hex floats.
"""

from __future__ import annotations

import json
import os
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402
from ettkit.startup import CompileCache, overlapped_start  # noqa: E402
from startup_helpers import TinyRec, declared_spec, loss_fn, make_batch  # noqa: E402


class Loader:
    """A loader of fixed batches (no workers: the batches are the test's, not a dataset's)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def main(mode: str, cache_dir: str, spec_kind: str) -> None:
    torch.manual_seed(0)
    model = TinyRec()
    spec = declared_spec(dynamic=spec_kind == "dynamic")
    sizes = [8, 8, 8, 8, 8, 8, 8, 8, 8, 8] if spec_kind == "static" else [8, 8, 8, 8, 8, 16, 16, 16, 16, 16]
    batches = [make_batch(n, seed=100 + i) for i, n in enumerate(sizes)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"mode": mode}
    if mode == "plain":
        compiled = torch.compile(model)
        first, rest = batches[0], iter(batches[1:])
    else:
        store, rank = None, 0
        if os.environ.get("ETTKIT_TEST_STORE"):
            import torch.distributed as dist

            rank = int(os.environ["ETTKIT_TEST_RANK"])
            store = dist.FileStore(os.environ["ETTKIT_TEST_STORE"], int(os.environ["ETTKIT_TEST_WORLD"]))
        cache = CompileCache(
            cache_dir, model=model, spec=spec, config={}, precompile=mode == "ettkit", store=store, rank=rank,
            shared_dir=os.environ.get("ETTKIT_TEST_SHARED_DIR"), job=os.environ.get("ETTKIT_TEST_JOB"),
        )
        compiled, first, report, rest = overlapped_start(
            model, Loader(batches), spec, loss_fn, cache, recorder=None
        )
        out["summary"] = report.summary()
        out["precompiled_reason"] = None if report.precompiled is None else report.precompiled.reason
        out["stages"] = {k: round(v.duration_s, 3) for k, v in report.stages.stages.items()}
        out["saved"] = None if report.precompiled_save is None else report.precompiled_save.written
        out["shared_saved"] = None if report.shared_save is None else report.shared_save.written
        out["type"] = type(compiled).__name__
        out["origin"] = getattr(compiled, "origin", None)
        out["time_to_start_s"] = report.time_to_start_s
        out["compile_s"] = report.compile_s
    losses, grads = [], []
    stance = os.environ.get("ETTKIT_TEST_FAIL_ON_RECOMPILE") == "1"
    if stance:
        torch.compiler.set_stance("fail_on_recompile")
    for batch in [first, *rest]:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(compiled(batch), batch)
        loss.backward()
        losses.append(loss.item().hex())
        grads.append([float(p.grad.double().sum()).hex() for p in model.parameters()])
        opt.step()
    if stance:
        torch.compiler.set_stance("default")
    out["losses"] = losses
    out["grads"] = grads
    out["bn_mean"] = [float(v).hex() for v in model.bn.running_mean]
    out["fallback_calls"] = getattr(compiled, "fallback_calls", None)
    out["process_s"] = time.perf_counter() - T0
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "static")
