"""#47 item 2: the README's order (``AsyncCheckpointer.attach`` before ``overlapped_start`` with
``CompileCache(precompile=True)``) keeps the precompiled tier.

Before the fix, the checkpoint fences that attach() installs were traced into ``aot_compile``, whose artifact
then had to pickle the C++ checkpointer they close over: ``cannot pickle 'ettkit._C.checkpoint.
AsyncCheckpointer'``, no precompiled file, and every restart compiled cold. Each start here runs in a fresh
process (this file is also the child script) with its own empty Inductor cache dir, so only ettkit's file can
make the second one warm; both train with the fences attached, saving at every step, and the fences must
still run before every forward and every optimizer step.

The failure warning's "how to fix it" is tested too, on a hook of the user's own that cannot be pickled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 4


def child(cache_dir: str, ckpt_dir: str) -> None:
    """One start in the README's order, then STEPS fenced training steps with a save after each; prints a
    JSON line of what the test checks."""
    from ettkit.checkpoint import AsyncCheckpointer
    from ettkit.startup import CompileCache, overlapped_start
    from safetensors.torch import load_file
    from startup_helpers import TinyRec, declared_spec, loss_fn, make_batch

    torch.manual_seed(0)
    model = TinyRec(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = declared_spec(dynamic=False, batch=8)
    batches = [make_batch(8, 100 + i) for i in range(STEPS)]
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught, \
            AsyncCheckpointer(ckpt_dir, recorder=None, preempt_signals=(), keep_last=STEPS) as ck:
        warnings.simplefilter("always")
        ck.attach(model=model, optimizer=opt)  # the README's order: attached before the start
        cache = CompileCache(cache_dir, model=model, spec=spec, config={}, precompile=True)
        compiled, first, report, rest = overlapped_start(model, batches, spec, loss_fn, cache, recorder=None)

        class Counting:
            """Counts the fences' looks at the checkpointer: every fence run reads fence_pending once."""

            def __init__(self, c):
                self.c, self.looks = c, 0

            def __getattr__(self, name):
                if name == "fence_pending":
                    self.looks += 1
                return getattr(self.c, name)

        counting = ck._fences._c = Counting(ck._fences._c)
        losses, saved = [], {}
        for step, batch in enumerate([first, *rest], start=1):
            loss = loss_fn(compiled(batch), batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item().hex())
            handle = ck.save(step, {"model": model})  # returns before its copies: the next forward's fence
            saved[step] = model.bn.running_mean.clone()  # (BatchNorm's) must wait for them
        ck.wait()
        out.update(
            summary=report.summary(),
            precompiled_saved=None if report.precompiled_save is None else report.precompiled_save.written,
            type=type(compiled).__name__,
            origin=getattr(compiled, "origin", None),
            fallback_calls=getattr(compiled, "fallback_calls", None),
            looks=counting.looks,
            bn_hooks=len(model.bn._forward_pre_hooks),
            durable=handle.durable,
            refused=ck.saves_refused,
            losses=losses,
        )
    # Each step's file holds the statistics of its own step: the forward after a save waited for its copy.
    out["own_stats"] = [
        torch.equal(load_file(os.path.join(ckpt_dir, f"step-{s}", "rank-0.safetensors"))["model.bn.running_mean"],
                    saved[s])
        for s in range(1, STEPS + 1)
    ]
    # "the precompiled tier is not used", "the precompiled forward's guards reject this call"
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught if "precompiled" in str(w.message)]
    print(json.dumps(out))


def _start(tmp_path, tag: str) -> dict:
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{tag}"),  # empty: only ettkit's file can make it warm
        PYTHONPATH=os.pathsep.join([HERE] + sys.path),
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(tmp_path / "compile-cache"), str(tmp_path / f"ck-{tag}")],
        env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path), check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_attach_before_a_precompiled_start_writes_the_tier_and_a_new_process_loads_it_fenced(tmp_path):
    cold = _start(tmp_path, "cold")
    # Before the fix: precompile_fallback "aot_compile failed (TypeError: cannot pickle
    # 'ettkit._C.checkpoint.AsyncCheckpointer' object)", type OptimizedModule, no precompiled file.
    assert cold["summary"]["precompile_fallback"] is None, cold["summary"]
    assert cold["warnings"] == []
    assert cold["type"] == "PrecompiledModel" and cold["origin"] == "compiled"
    assert cold["precompiled_saved"] is True
    assert len(list((tmp_path / "compile-cache").glob("precompiled-*.bin"))) == 1

    warm = _start(tmp_path, "warm")  # a restart: a new process, the same order
    assert warm["summary"]["cache"] == "precompiled", warm["summary"]
    assert warm["origin"] == "loaded" and warm["summary"]["recompiles"] == 0
    assert warm["warnings"] == []

    for run in (cold, warm):
        # The fences still fire on the compiled model: BatchNorm's before every forward and the optimizer's
        # before every step (2 per step), and no call fell back to torch.compile because of them.
        assert run["looks"] == 2 * STEPS and run["fallback_calls"] == 0
        assert run["bn_hooks"] == 1  # the fence is back on the module after every call
        assert run["durable"] and run["refused"] == 0
        assert run["own_stats"] == [True] * STEPS
    assert warm["losses"] == cold["losses"]  # the loaded graph computes what the precompiled one did, bit for bit


class _LockedProbe:
    """A user's forward pre-hook that holds a lock: what aot_compile cannot pickle."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, module, args):
        return None


def test_a_precompile_that_fails_for_another_reason_says_why_and_how_to_fix_it(tmp_path):
    from ettkit.startup import CompileCache, overlapped_start
    from startup_helpers import TinyRec, declared_spec, loss_fn, make_batch

    torch.manual_seed(0)
    model = TinyRec(dropout=0.0)
    model.bn.register_forward_pre_hook(_LockedProbe())
    spec = declared_spec(dynamic=False, batch=8)
    cache = CompileCache(tmp_path / "cc", model=model, spec=spec, config={}, precompile=True)
    with pytest.warns(RuntimeWarning, match="precompiled tier is not used") as record:
        _, _, report, _ = overlapped_start(model, [make_batch(8, 1)], spec, loss_fn, cache, recorder=None,
                                           compile_kwargs={"backend": "eager"})  # eager: the fallback is cheap
    message = str(next(w.message for w in record if "precompiled tier" in str(w.message)))
    assert "cannot pickle '_thread.lock'" in message  # why
    assert "bn: forward_pre_hook _LockedProbe" in message  # which hook holds it
    assert "make the hook and what it holds picklable" in message and "precompile=False" in message  # the fix
    assert report.precompile_fallback.startswith("aot_compile failed (TypeError: cannot pickle")


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
