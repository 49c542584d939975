"""Checkpoint blocking, step inflation, time to durable and persist bandwidth: ettkit vs torch.save and DCP.

    python benchmarks/checkpoint.py [--quick] [--json FILE] [--dir DIR]

Same run, same state dicts, training steps between saves: a matmul "forward/backward" calibrated to
--fwd-bwd-ms (default 200 ms: short for a model of this size - a real forward/backward over 10^8
parameters takes far longer - but longer than the optimizer step, as in real training; --fwd-bwd-ms 10
leaves the staging copy exposed) and an in-place foreach "optimizer step" on every saved tensor. Loop per save: optimizer step, save, the next step's
forward/backward, wait until the save is staged (ettkit's pre-step hook; DCP's staging_completion),
optimizer step.

blocking_ms = time the loop waits because of a save = save_call_ms + pre_step_wait_ms (the wait before
the next optimizer step); step_inflation_pct = mean step time while the save persists vs. without saves;
time_to_durable_s = save call -> durable (fsynced; for ettkit: committed); persist_GBps = bytes /
time_to_durable beside disk_seq_GBps (sequential 64 MiB writes + one fsync of the same bytes, same disk,
before and after the variants); rss_growth_MB = RSS after the last save - after the first;
persist_idle_GBps = the same save -> committed throughput with no training beside it (the RSS loop),
next to a disk probe taken just before it.

Integrity is always on. `ettkit` overlaps its saves (overlap=True, unfenced_sync_max_bytes=0: this loop
fences its only writer, the optimizer step, with the pre-step wait, and has no BatchNorm); `ettkit_unfenced` is what a loop gets without attach(): save()
returns once the copies are done. torn_commits[in_backward_sparse] trains an EmbeddingBag updated inside
backward (optimizer-in-backward) with attach(model=..., optimizer=...) and counts committed steps whose
bytes (read back with safetensors) differ from the state at save() (must be 0), beside refused saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import print_table, write_json  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_state(case: str, quick: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    if case == "1GB_large":
        total = (128 if quick else 1024) << 20
        n = 4
        params = {f"layer{i}.weight": torch.randn(total // 4 // n // 3, generator=g) for i in range(n)}
    else:
        total = (32 if quick else 256) << 20
        n = 1000 if quick else 5000
        params = {f"emb{i}.weight": torch.randn(total // 4 // n // 3, generator=g) for i in range(n)}
    # Adam-like optimizer state: two moments per parameter.
    optim = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v), "step": torch.tensor(0.0)}
             for k, v in params.items()}
    return {"model": params, "optim": optim}


def tensors_of(state):
    out = list(state["model"].values())
    for s in state["optim"].values():
        out += [s["exp_avg"], s["exp_avg_sq"]]
    return out


def nbytes(state) -> int:
    return sum(t.nbytes for t in tensors_of(state))


class Trainer:
    """A stand-in training step: ``compute()`` is the forward/backward (``matmuls`` 512x512 matrix products,
    calibrated to a target step time), ``optimizer_step()`` an in-place foreach update of every saved
    tensor (as Adam mutates parameters and both moments)."""

    def __init__(self, state, matmuls: int = 4):
        self.tensors = tensors_of(state)
        self.a = torch.randn(512, 512)
        self.matmuls = matmuls

    def compute(self):
        for _ in range(self.matmuls):
            self.a = torch.tanh(self.a @ self.a)

    def optimizer_step(self):
        torch._foreach_add_(self.tensors, 1e-3)

    def calibrate(self, fwd_bwd_ms: float) -> None:
        """Sets ``matmuls`` so that compute() (the forward/backward) takes about ``fwd_bwd_ms``."""
        self.matmuls = 1
        one = statistics.median(_timed(self.compute) for _ in range(5))
        self.matmuls = max(1, round(fwd_bwd_ms / 1e3 / one))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


BEST_OPTIONS: dict = {}
# DCP StagingOptions, best first: (use_pinned_memory, use_shared_memory, use_async_staging,
# use_non_blocking_copy). Pinned memory and non-blocking copies need an accelerator; shared memory opens
# one file descriptor per tensor and fails past the open-files limit (10^4 tensors).
DCP_CANDIDATES = ((True, True, True, True), (False, True, True, False), (False, False, True, False))
DCP_OPTION_NAMES = ("use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy")


def disk_seq_GBps(directory: str, size: int) -> float:
    buf = memoryview(bytearray(64 << 20))
    path = os.path.join(directory, "disk_probe.bin")
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            n = min(left, len(buf))
            f.write(buf[:n])
            left -= n
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    os.unlink(path)
    return size / dt / 1e9


def run_variant(variant: str, state, directory: str, saves: int, base_step_s: float, matmuls: int,
                dcp_options=None) -> dict:
    import torch.distributed.checkpoint as dcp

    tr = Trainer(state, matmuls)
    calls, waits, durable, inflation = [], [], [], []
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    ck = stager = None
    if variant == "ettkit":
        from ettkit.checkpoint import AsyncCheckpointer

        ck = AsyncCheckpointer(directory, keep_last=2, recorder=None, preempt_signals=(), overlap=True,
                               unfenced_sync_max_bytes=0)
    elif variant == "ettkit_unfenced":
        from ettkit.checkpoint import AsyncCheckpointer

        ck = AsyncCheckpointer(directory, keep_last=2, recorder=None, preempt_signals=())
    elif variant == "dcp_async_best":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(*dcp_options))
    rss0 = None
    prev = None
    try:
        for i in range(1, saves + 1):
            tr.compute()
            t0 = time.perf_counter()
            path = os.path.join(directory, f"step-{i}")
            if variant.startswith("ettkit"):
                h = ck.save(i, state)
                is_durable = lambda: h.durable  # noqa: E731
                wait_staged = ck.wait_staged
            elif variant == "torch_save":
                torch.save(state, path + ".pt")
                is_durable = lambda: True  # noqa: E731
                wait_staged = lambda: None  # noqa: E731
            elif variant == "dcp_save":
                dcp.save(state, checkpoint_id=path, no_dist=True)
                is_durable = lambda: True  # noqa: E731
                wait_staged = lambda: None  # noqa: E731
            else:
                if prev is not None:
                    prev.result()  # DCP needs the previous async save finished before the next
                if variant == "dcp_async":
                    fut = dcp.async_save(state, checkpoint_id=path, no_dist=True)
                    up, staging = getattr(fut, "upload_completion", fut), None
                else:
                    resp = dcp.async_save(state, checkpoint_id=path, no_dist=True, async_stager=stager)
                    up, staging = getattr(resp, "upload_completion", resp), getattr(resp, "staging_completion", None)
                prev = up
                is_durable = up.done
                wait_staged = (lambda: staging.result()) if staging is not None else (lambda: None)
            t1 = time.perf_counter()
            tr.compute()  # the next step's forward/backward overlaps the staging copies
            tw = time.perf_counter()
            wait_staged()  # the pre-step hook: the optimizer must not mutate unstaged tensors
            t2 = time.perf_counter()
            tr.optimizer_step()
            calls.append(t1 - t0)
            waits.append(t2 - tw)
            # Training steps while the save persists.
            steps = []
            while not is_durable() and len(steps) < 50:
                s0 = time.perf_counter()
                tr.compute()
                tr.optimizer_step()
                steps.append(time.perf_counter() - s0)
            if variant.startswith("ettkit"):
                h.wait()
            elif prev is not None:
                prev.result()
            durable.append(time.perf_counter() - t0)
            if steps:
                inflation.append(statistics.mean(steps) / base_step_s - 1.0)
            if i == 1:
                rss0 = rss_bytes()
    finally:
        if ck is not None:
            ck.close()
        if stager is not None:
            stager.close()
    rss_growth = rss_bytes() - rss0 if rss0 is not None else 0
    size = nbytes(state)
    blocking = [c + w for c, w in zip(calls, waits)]
    return {
        "blocking_ms": statistics.median(blocking) * 1e3,
        "save_call_ms": statistics.median(calls) * 1e3,
        "pre_step_wait_ms": statistics.median(waits) * 1e3,
        "step_inflation_pct": (statistics.mean(inflation) * 100) if inflation else 0.0,
        "time_to_durable_s": statistics.median(durable),
        "persist_GBps": size / statistics.median(durable) / 1e9,
        "rss_growth_MB": rss_growth / 1e6,
    }


def run_dcp_best(state, directory: str, saves: int, base_step_s: float, matmuls: int, case: str) -> dict:
    """DCP async_save with the best StagingOptions this torch and this machine accept for this state."""
    errors = []
    for i, opts in enumerate(DCP_CANDIDATES):
        try:
            # A fresh directory per attempt: a failed attempt's background upload may still be writing.
            r = run_variant("dcp_async_best", state, f"{directory}-{i}", saves, base_step_s, matmuls, opts)
        except Exception as e:  # noqa: BLE001 - an unsupported option set: try the next best
            errors.append(f"{dict(zip(DCP_OPTION_NAMES, opts))}: {type(e).__name__}: {str(e)[:120]}")
            continue
        BEST_OPTIONS[case] = {"options": dict(zip(DCP_OPTION_NAMES, opts)), "rejected": errors}
        return r
    raise RuntimeError("no DCP StagingOptions worked: " + "; ".join(errors))


def torn_commits_in_backward(directory: str, quick: bool) -> dict:
    """An EmbeddingBag updated inside backward, saved every other step with attach(model, optimizer)."""
    from safetensors.torch import load_file

    from ettkit import TornSnapshotError
    from ettkit.checkpoint import AsyncCheckpointer

    rows = 100_000 if quick else 500_000
    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(rows, 128, mode="sum", sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)

    def hook(p):
        opt.step()
        opt.zero_grad()

    emb.weight.register_post_accumulate_grad_hook(hook)
    shutil.rmtree(directory, ignore_errors=True)
    expected, handles = {}, []
    with AsyncCheckpointer(directory, keep_last=0, recorder=None, preempt_signals=()) as ck:
        ck.attach(model=emb, optimizer=opt)
        state = {"emb": emb.state_dict()}
        for step in range(1, (8 if quick else 20) * 2 + 1):
            idx = torch.arange(rows)
            emb(idx, torch.arange(0, rows, 64)).sum().backward()
            if step % 2 == 0:
                expected[step] = emb.weight.detach().clone()
                handles.append(ck.save(step, state))
        refused = 0
        for h in handles:
            try:
                h.wait()
            except TornSnapshotError:
                refused += 1
    torn = 0
    for p in os.listdir(directory):
        if p.startswith("step-"):
            got = load_file(os.path.join(directory, p, "rank-0.safetensors"))["emb.weight"]
            torn += int(not torch.equal(got, expected[int(p[5:])]))
    shutil.rmtree(directory, ignore_errors=True)
    return {"torn_commits": torn, "refused_saves": refused, "saves": len(handles)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--dir", default="/tmp/ettkit_bench_ckpt")
    ap.add_argument("--saves", type=int, default=None)
    ap.add_argument("--cases", default="1GB_large,256MB_small")
    ap.add_argument("--fwd-bwd-ms", type=float, default=200.0,
                    help="target time of one step's forward/backward (the optimizer step comes on top)")
    ap.add_argument("--rss-saves", type=int, default=None)
    ap.add_argument("--variants", default="ettkit,ettkit_unfenced,torch_save,dcp_save,dcp_async,dcp_async_best")
    args = ap.parse_args()
    saves = args.saves or (3 if args.quick else 5)
    rss_saves = args.rss_saves or (10 if args.quick else 50)
    results: dict = {}
    for case in args.cases.split(","):
        state = make_state(case, args.quick)
        tr = Trainer(state)
        for _ in range(3):
            tr.compute()
            tr.optimizer_step()
        tr.calibrate(args.fwd_bwd_ms)
        base = statistics.median([_timed_step(tr) for _ in range(5)])
        os.makedirs(args.dir, exist_ok=True)
        disk = disk_seq_GBps(args.dir, nbytes(state))
        results.setdefault(f"disk_seq_GBps[state={case}]", {})["disk"] = disk
        results.setdefault(f"state_MB[state={case}]", {})["all"] = nbytes(state) / 1e6
        results.setdefault(f"tensors[state={case}]", {})["all"] = len(tensors_of(state)) + len(state["optim"])
        results.setdefault(f"step_ms[state={case}]", {})["no_save"] = base * 1e3
        print(f"{case}: {nbytes(state) / 1e6:.0f} MB, disk {disk:.3f} GB/s, step {base * 1e3:.1f} ms "
              f"({tr.matmuls} matmuls)", flush=True)
        for v in args.variants.split(","):
            d = os.path.join(args.dir, v)
            if v == "dcp_async_best":
                r = run_dcp_best(state, d, saves, base, tr.matmuls, case)
            else:
                r = run_variant(v, state, d, saves, base, tr.matmuls)
            for leftover in [d] + [f"{d}-{i}" for i in range(len(DCP_CANDIDATES))]:
                shutil.rmtree(leftover, ignore_errors=True)
            for metric, value in r.items():
                results.setdefault(f"{metric}[state={case}]", {})[v] = value
            print(f"{case} {v}: " + ", ".join(f"{k}={x:.4g}" for k, x in r.items()), flush=True)
        # The disk again, after the variants: the figure persist_GBps is read against.
        disk2 = disk_seq_GBps(args.dir, nbytes(state))
        results[f"disk_seq_GBps[state={case}]"]["disk_after"] = disk2
        print(f"{case}: disk after the variants {disk2:.3f} GB/s", flush=True)
        if "ettkit" in args.variants:
            # RSS over many saves: one arena allocated once, reused.
            from ettkit.checkpoint import AsyncCheckpointer

            # The same loop, with no training beside it, also gives the writer's own throughput
            # (save call -> committed) next to the disk probe taken just before.
            d = os.path.join(args.dir, "rss")
            shutil.rmtree(d, ignore_errors=True)
            idle_disk = disk_seq_GBps(args.dir, nbytes(state))
            with AsyncCheckpointer(d, keep_last=1, recorder=None, preempt_signals=()) as ck:
                ck.save(0, state).wait()
                r0 = rss_bytes()
                durations = []
                for i in range(1, rss_saves + 1):
                    t0 = time.perf_counter()
                    ck.save(i, state).wait()
                    durations.append(time.perf_counter() - t0)
                results.setdefault(f"rss_growth_over_saves_MB[state={case}]", {})["ettkit"] = (rss_bytes() - r0) / 1e6
                results.setdefault(f"persist_idle_GBps[state={case}]", {})["ettkit"] = \
                    nbytes(state) / statistics.median(durations) / 1e9
                results[f"persist_idle_GBps[state={case}]"]["disk"] = idle_disk
                print(f"{case}: no training beside it, ettkit save -> committed "
                      f"{nbytes(state) / statistics.median(durations) / 1e9:.3f} GB/s, disk {idle_disk:.3f} GB/s",
                      flush=True)
                results.setdefault(f"arena_MB[state={case}]", {})["ettkit"] = ck.arena_bytes / 1e6
                results.setdefault(f"arena_allocations[state={case}]", {})["ettkit"] = ck.arena_allocations
                results.setdefault(f"rss_saves[state={case}]", {})["ettkit"] = rss_saves
            shutil.rmtree(d, ignore_errors=True)
        del state, tr
    if "ettkit" in args.variants:
        t = torn_commits_in_backward(os.path.join(args.dir, "torn"), args.quick)
        for metric, value in t.items():
            results.setdefault(f"{metric}[in_backward_sparse]", {})["ettkit"] = value
        print(f"in-backward sparse update: {t}", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    print_table("checkpoint", results)
    if args.json:
        write_json(args.json, "checkpoint", {"quick": args.quick, "saves": saves, "torch": torch.__version__,
                                             "fwd_bwd_ms_target": args.fwd_bwd_ms,
                                             "dcp_async_best_options": BEST_OPTIONS}, results)


def _timed_step(tr) -> float:
    t = time.perf_counter()
    tr.compute()
    tr.optimizer_step()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
