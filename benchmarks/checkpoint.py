"""Checkpoint blocking, step inflation, time to durable and persist bandwidth: ettkit vs torch.save and DCP.

    python benchmarks/checkpoint.py [--quick] [--json FILE] [--dir DIR] [--device cuda]

--device cuda (tools/gpu_check.sh): the state on the GPU, 1 GB in 12 large tensors and 256 MB in 20,001
tensors; ettkit against DCP async_save with DefaultStager (pinned memory, non-blocking copies) and, for the
staging throughput, against plain pinned cudaMemcpyAsync of the same tensors (and of the same bytes in one
buffer). Metrics keyed [state=...,device=cuda]: host_blocking_ms (target <= 1 ms), step_inflation_pct while
the save persists (<= 2 %), staging_GBps and staging_vs_pinned_memcpy_pct (>= 90 %), save_step_overhead_ms,
time_to_durable_s, persist_GBps. The CPU mode below is unchanged.

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
first_blocking_ms = the first save's blocking, first_over_later = it over the median of the later saves'
(the ettkit variants call prepare(state) when they start, beside the first step's compute, so the arena is
faulted in before the first save; `--variants ettkit_unprepared` is `ettkit` without it);
first_beside_prepare = 1 when prepare() was still backing an arena at the first save (the memory tier's
second file), 0 when it had ended; second_over_later = the second save (the memory tier's first into its
second arena) over the median of the saves after it; *_cpu = the same ratios in the calling thread's CPU time
(time.thread_time over the call and the wait), which a busy machine's preemption does not inflate;
persist_idle_GBps = the same save -> committed throughput with no training beside it (the RSS loop),
next to a disk probe taken just before it. restore_s = load_latest of a committed step into the state's
tensors (verified, unverified, cold cache) beside dcp.load, torch.load(mmap=True) + copy_ and a memcpy of
the same bytes, interleaved in one run; restore_vs_memcpy = each over the memcpy.

fsdp2 (benchmarks/checkpoint_fsdp2.py): a fully_shard model and AdamW saved by 2 gloo ranks, ettkit attached
against dcp.async_save (blocking_ms), and loaded by 3 ranks, ettkit load_latest against dcp.load
(reshard_load_s), in the same run.

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


def _evict(directory: str) -> None:
    """Drops a checkpoint's (fsynced, hence clean) pages from the page cache: the next read is cold."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def memory_root(directory: str) -> str:
    """Where the memory tier lives: /dev/shm (tmpfs) when the machine has it."""
    if os.path.isdir("/dev/shm"):
        return "/dev/shm"
    root = os.path.join(directory, "shm")
    os.makedirs(root, exist_ok=True)
    return root


def restore_times(state, directory: str, rounds: int) -> dict:
    """restore_s: seconds to bring a committed checkpoint of ``state`` back into its tensors, in place.
    ``ettkit`` (load_latest, checksums verified), ``ettkit_unverified`` (verify_on_load=False),
    ``ettkit_cold`` (verified, the files evicted from the page cache first; ``disk_cold_read``: the same files
    read sequentially after the same eviction), ``dcp_load`` (dcp.load of DCP's
    own checkpoint of the same state), ``torch_load_mmap`` (torch.load(mmap=True) of a torch.save file, then
    copy_ into the state), ``memory_tier`` / ``memory_tier_unverified`` (load_latest of a memory-tier
    snapshot in /dev/shm, checksums verified / not), ``memcpy`` (one copy_ of the same number of bytes,
    memory to memory: the floor). ``*_prefetched``: load_latest after prefetch() ended (what is left on a
    restart's critical path when the prefetch overlaps its other start-up work: the copy, and the check
    that nothing changed), with ``*_prefetch_background`` the prefetch's own seconds (off that path).
    Rounds interleave the variants; medians."""
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import AsyncCheckpointer

    shutil.rmtree(directory, ignore_errors=True)
    ck_dir, dcp_dir, pt = (os.path.join(directory, x) for x in ("ettkit", "dcp", "state.pt"))
    with AsyncCheckpointer(ck_dir, keep_last=1, recorder=None, preempt_signals=()) as ck:
        ck.save(1, state).wait()
    dcp.save(state, checkpoint_id=dcp_dir)
    torch.save(state, pt)
    total = nbytes(state)
    src, dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
    readers = {v: AsyncCheckpointer(ck_dir, read_only=True, recorder=None, preempt_signals=(), verify_on_load=v)
               for v in (True, False)}
    # The memory tier: one snapshot per reader (each checkpointer holds its own directory and tier), left
    # by a writer that did not close cleanly (what a killed process leaves).
    mem_readers = {}
    for v in (True, False):
        d = os.path.join(directory, f"memory-{v}")
        w = AsyncCheckpointer(d, recorder=None, preempt_signals=(), memory_tier=memory_root(directory),
                              job_id=f"bench-restore-{os.getpid()}")
        w.save(1, state, tier="memory").wait()
        w.close(discard_memory_tier=False)
        mem_readers[v] = AsyncCheckpointer(d, recorder=None, preempt_signals=(), verify_memory_tier=v,
                                           memory_tier=memory_root(directory), job_id=f"bench-restore-{os.getpid()}")

    def memory_load(v):
        assert mem_readers[v].load_latest(state)[0] == 1 and mem_readers[v].restored_from == "memory"

    background: dict = {"memory_tier_prefetch_background": [], "ettkit_prefetch_background": [],
                        "ettkit_cold_prefetch_background": []}

    def prefetched(reader, name, tier):
        # The prefetch runs to its end first (as when it overlaps a restart's other work); then the load.
        assert reader.prefetch() == [1]
        assert reader.wait_prefetch()
        background[name].append(reader.prefetch_figures["seconds"])
        t = _timed(lambda: reader.load_latest(state))
        assert reader.restore_prefetched is not None and reader.restored_from == tier
        return t

    def torch_load_mmap():
        loaded = torch.load(pt, mmap=True)
        for mine, theirs in zip(tensors_of(state), tensors_of(loaded)):
            mine.copy_(theirs)

    variants = {"ettkit": lambda: _timed(lambda: readers[True].load_latest(state)),
                "ettkit_unverified": lambda: _timed(lambda: readers[False].load_latest(state)),
                "dcp_load": lambda: _timed(lambda: dcp.load(state, checkpoint_id=dcp_dir)),
                "torch_load_mmap": lambda: _timed(torch_load_mmap),
                "memory_tier": lambda: _timed(lambda: memory_load(True)),
                "memory_tier_unverified": lambda: _timed(lambda: memory_load(False)),
                "memory_tier_prefetched": lambda: prefetched(mem_readers[True], "memory_tier_prefetch_background",
                                                             "memory"),
                "ettkit_prefetched": lambda: prefetched(readers[True], "ettkit_prefetch_background", "disk"),
                "memcpy": lambda: _timed(lambda: dst.copy_(src))}
    times: dict = {v: [] for v in variants}
    for v in variants:  # one warm-up each: the files in the page cache, the code paths loaded
        variants[v]()
    for v in background:
        background[v].clear()  # the warm-ups' prefetches
    for _ in range(rounds):
        for v, fn in variants.items():
            times[v].append(fn())
    # Cold last: on this VM, warm reads of a file that was evicted and read back run slower afterwards
    # (0.19-0.21 s instead of 0.13 s for 1 GiB, verified), which would skew the warm figures above.
    # disk_cold_read: the same files read sequentially in 64 MiB preads after the same eviction: the
    # disk's sequential read speed that ettkit_cold is held against.
    files = [os.path.join(root, f) for root, _, names in os.walk(ck_dir) for f in names]
    buf = bytearray(64 << 20)

    def read_all():
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while n := os.preadv(fd, [buf], off):
                    off += n
            finally:
                os.close(fd)

    times["ettkit_cold"], times["disk_cold_read"], times["ettkit_cold_prefetched"] = [], [], []
    for _ in range(rounds):
        _evict(ck_dir)
        times["ettkit_cold"].append(_timed(lambda: readers[True].load_latest(state)))
        _evict(ck_dir)
        times["disk_cold_read"].append(_timed(read_all))
        _evict(ck_dir)
        times["ettkit_cold_prefetched"].append(prefetched(readers[True], "ettkit_cold_prefetch_background", "disk"))
    times.update(background)
    for r in readers.values():
        r.close()
    for r in mem_readers.values():
        r.close()  # a clean end: the memory tier is removed
    shutil.rmtree(directory, ignore_errors=True)
    return {v: statistics.median(t) for v, t in times.items()}


def run_variant(variant: str, state, directory: str, saves: int, base_step_s: float, matmuls: int,
                dcp_options=None) -> dict:
    import torch.distributed.checkpoint as dcp

    tr = Trainer(state, matmuls)
    calls, waits, durable, inflation = [], [], [], []
    cpus = []  # the calling thread's CPU time in each save call and pre-step wait (preemption does not inflate it)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    ck = stager = None
    if variant in ("ettkit", "ettkit_unprepared"):
        from ettkit.checkpoint import AsyncCheckpointer

        ck = AsyncCheckpointer(directory, keep_last=2, recorder=None, preempt_signals=(), overlap=True,
                               unfenced_sync_max_bytes=0)
    elif variant == "ettkit_memory":
        from ettkit.checkpoint import AsyncCheckpointer

        ck = AsyncCheckpointer(directory, keep_last=2, recorder=None, preempt_signals=(), overlap=True,
                               unfenced_sync_max_bytes=0, memory_tier=memory_root(directory), job_id="bench")
    elif variant == "ettkit_unfenced":
        from ettkit.checkpoint import AsyncCheckpointer

        ck = AsyncCheckpointer(directory, keep_last=2, recorder=None, preempt_signals=())
    elif variant == "dcp_async_best":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(*dcp_options))
    if ck is not None and variant != "ettkit_unprepared":
        # The arena is sized, allocated and faulted in beside the first step's compute, as a trainer does
        # once its state exists; ettkit_unprepared leaves that to the first save (first_over_later shows it).
        ck.prepare(state)
    rss0 = None
    prev = None
    beside_prepare = None
    try:
        for i in range(1, saves + 1):
            tr.compute()
            if i == 1 and ck is not None and variant != "ettkit_unprepared":
                # Whether the first save came while prepare() was still backing an arena (the memory tier's
                # two files take longer than one step): first_over_later is then read beside that work.
                beside_prepare = ck.wait_prepared(timeout=0) is None
            c0 = time.thread_time()
            t0 = time.perf_counter()
            path = os.path.join(directory, f"step-{i}")
            if variant.startswith("ettkit"):
                h = ck.save(i, state, tier="memory" if variant == "ettkit_memory" else "disk")
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
            t1, c1 = time.perf_counter(), time.thread_time()
            tr.compute()  # the next step's forward/backward overlaps the staging copies
            tw, cw = time.perf_counter(), time.thread_time()
            wait_staged()  # the pre-step hook: the optimizer must not mutate unstaged tensors
            t2 = time.perf_counter()
            cpus.append(c1 - c0 + time.thread_time() - cw)  # the call's and the wait's, not the compute's
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
    first = {}
    if len(blocking) > 1:  # the first save of a run against the others: what a fresh arena (or first plan) costs
        first = {"first_blocking_ms": blocking[0] * 1e3,
                 "first_over_later": blocking[0] / statistics.median(blocking[1:]),
                 "first_over_later_cpu": cpus[0] / max(statistics.median(cpus[1:]), 1e-9)}
    if len(blocking) > 2:  # the second save: the memory tier's first into its second arena
        first["second_over_later"] = blocking[1] / statistics.median(blocking[2:])
        first["second_over_later_cpu"] = cpus[1] / max(statistics.median(cpus[2:]), 1e-9)
        if beside_prepare is not None:
            first["first_beside_prepare"] = float(beside_prepare)
    return {
        "blocking_ms": statistics.median(blocking) * 1e3,
        **first,
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


def in_backward_sparse(directory: str, quick: bool, batch_rows: int | None = None, every: int = 2) -> dict:
    """An EmbeddingBag updated inside backward (SGD in a post-accumulate-grad hook), saved every ``every`` steps:
    ettkit with attach(model, optimizer) against dcp.async_save of the same state, in the same run.

    A save's blocking is what the loop waits for it: for ettkit the save() call plus the fences' waits in
    the next backward (the checkpointer's own blocking account, which records both), for DCP the
    async_save call (it copies the state before it returns) plus the wait for the previous save's upload
    (``dcp_async_call``: the call alone).
    Torn commits: committed steps whose bytes (read back with safetensors) differ from the state at save().
    step_ms: the median forward/backward of each loop, a check that no wait hides outside the account.
    ``batch_rows``: each step looks up that many random rows (bags of 64) instead of every row, so the
    backward and its update come sooner after save() than the copy of the whole table can finish.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from ettkit import TornSnapshotError
    from ettkit.checkpoint import AsyncCheckpointer

    rows = 100_000 if quick else 500_000
    pairs = 8 if quick else 20
    gen = torch.Generator().manual_seed(1)
    idx = torch.arange(rows) if batch_rows is None else torch.randint(rows, (batch_rows,), generator=gen)
    offsets = torch.arange(0, len(idx), 64)

    def model():
        torch.manual_seed(0)
        emb = torch.nn.EmbeddingBag(rows, 128, mode="sum", sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)

        def hook(p):
            opt.step()
            opt.zero_grad()

        emb.weight.register_post_accumulate_grad_hook(hook)
        return emb, opt

    shutil.rmtree(directory, ignore_errors=True)
    emb, opt = model()
    expected, handles, blocking = {}, [], []
    steps = {"ettkit": [], "dcp_async": []}  # forward/backward times (ettkit's include its fence waits)
    with AsyncCheckpointer(os.path.join(directory, "ettkit"), keep_last=0, recorder=None,
                           preempt_signals=()) as ck:
        ck.attach(model=emb, optimizer=opt)
        state = {"emb": emb.state_dict()}
        ck.prepare(state, wait=True)
        count = 0

        def blocked() -> float:  # seconds every save so far has blocked (save calls and fence waits)
            return ck.mean_blocking_s * count

        for step in range(1, pairs * every + 1):
            t0 = time.perf_counter()
            emb(idx, offsets).sum().backward()  # the fences of the previous save wait in here
            steps["ettkit"].append(time.perf_counter() - t0)
            if step % every == 0:
                if handles:
                    blocking.append(blocked() - before)
                expected[step] = emb.weight.detach().clone()
                before = blocked()
                handles.append(ck.save(step, state))
                count += 1
        emb(idx, offsets).sum().backward()
        blocking.append(blocked() - before)
        refused = 0
        for h in handles:
            try:
                h.wait()
            except TornSnapshotError:
                refused += 1
    torn = 0
    root = os.path.join(directory, "ettkit")
    for p in os.listdir(root):
        if p.startswith("step-"):
            got = load_file(os.path.join(root, p, "rank-0.safetensors"))["emb.weight"]
            torn += int(not torch.equal(got, expected[int(p[5:])]))
    del expected

    emb, opt = model()
    state = {"emb": emb.state_dict()}
    dcp_blocking, dcp_calls, prev = [], [], None
    for step in range(1, pairs * every + 1):
        t0 = time.perf_counter()
        emb(idx, offsets).sum().backward()
        steps["dcp_async"].append(time.perf_counter() - t0)
        if step % every == 0:
            t0 = time.perf_counter()
            if prev is not None:
                prev.result()  # DCP needs the previous async save finished before the next
            t1 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=os.path.join(directory, "dcp", f"step-{step}"), no_dist=True)
            dcp_blocking.append(time.perf_counter() - t0)
            dcp_calls.append(time.perf_counter() - t1)
            prev = getattr(fut, "upload_completion", fut)
    prev.result()
    shutil.rmtree(directory, ignore_errors=True)
    ours, theirs = statistics.median(blocking) * 1e3, statistics.median(dcp_blocking) * 1e3
    return {"torn_commits": torn, "refused_saves": refused, "saves": len(handles),
            "blocking_ms": {"ettkit": ours, "dcp_async": theirs,
                            "dcp_async_call": statistics.median(dcp_calls) * 1e3},
            "blocking_vs_dcp": ours / theirs,
            "step_ms": {k: statistics.median(v) * 1e3 for k, v in steps.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--dir", default="/tmp/ettkit_bench_ckpt")
    ap.add_argument("--saves", type=int, default=None)
    ap.add_argument("--cases", default=None,
                    help="default: 1GB_large,256MB_small,fsdp2 (CPU; fsdp2: checkpoint_fsdp2.py), "
                         "1GB_large,256MB_small (--device cuda)")
    ap.add_argument("--fwd-bwd-ms", type=float, default=200.0,
                    help="target time of one step's forward/backward (the optimizer step comes on top)")
    ap.add_argument("--rss-saves", type=int, default=None)
    ap.add_argument("--variants",
                    default="ettkit,ettkit_memory,ettkit_unfenced,torch_save,dcp_save,dcp_async,dcp_async_best")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the state on the GPU, ettkit against DCP's DefaultStager (pinned, non-blocking) "
                         "and plain pinned cudaMemcpyAsync (tools/gpu_check.sh)")
    args = ap.parse_args()
    args.fwd_bwd_ms_given = any(a.startswith("--fwd-bwd-ms") for a in sys.argv[1:])
    if args.cases is None:
        args.cases = "1GB_large,256MB_small" + (",fsdp2" if args.device == "cpu" else "")
    if args.device == "cuda":
        gpu_main(args)
        return
    saves = args.saves or (3 if args.quick else 5)
    rss_saves = args.rss_saves or (10 if args.quick else 50)
    results: dict = {}
    for case in filter(None, args.cases.split(",")):  # --cases "": the in-backward cases alone
        if case == "fsdp2":
            # An FSDP2 model on gloo ranks, its own processes: attached save blocking against DCP's
            # async_save, and the load at another world size against dcp.load (checkpoint_fsdp2.py).
            from checkpoint_fsdp2 import run as run_fsdp2

            for metric, values in run_fsdp2(args.dir, args.quick).items():
                results[metric] = values
                print(f"{metric}: " + ", ".join(f"{v}={x:.4g}" for v, x in values.items()), flush=True)
            continue
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
            rs = restore_times(state, os.path.join(args.dir, "restore"), rounds=3 if args.quick else 5)
            results[f"restore_s[state={case}]"] = rs
            results[f"restore_vs_memcpy[state={case}]"] = {v: t / rs["memcpy"] for v, t in rs.items()}
            print(f"{case}: restore " + ", ".join(f"{v}={t:.3f}s ({t / rs['memcpy']:.2f}x memcpy)"
                                                 for v, t in rs.items()), flush=True)
        del state, tr
    if "ettkit" in args.variants:
        # Every row looked up and updated each step, saved every other step (the case of issue #11), and a
        # batch of 8,192 random rows saved every 40 steps: its backward reaches the fence a few ms after save().
        for case, kwargs in (("in_backward_sparse", {}),
                             ("in_backward_sparse_batch8k", {"batch_rows": 8192, "every": 40})):
            t = in_backward_sparse(os.path.join(args.dir, "in_backward"), args.quick, **kwargs)
            for metric, value in t.items():
                results.setdefault(f"{metric}[{case}]", {}).update(
                    value if isinstance(value, dict) else {"ettkit": value})
            print(f"{case}: {t}", flush=True)
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


# ---- GPU mode (--device cuda): state on the GPU, staged into pinned host memory ----------------------------------
GPU_CASES = {  # name: (bytes, GPU tensors); quick: the same shapes, smaller
    "1GB_large": (1 << 30, 12),
    "256MB_small": (256 << 20, 20_001),
}
GPU_CASES_QUICK = {"1GB_large": (128 << 20, 12), "256MB_small": (32 << 20, 2001)}
# DCP's DefaultStager as the issue asks: pinned memory, no shared memory, async staging, non-blocking copies;
# then without async staging if this torch refuses it.
DCP_GPU_CANDIDATES = ((True, False, True, True), (True, False, False, True))


def make_gpu_state(total: int, tensors: int) -> dict:
    """Parameters and two Adam moments each (tensors // 3 parameters) on the GPU, plus Adam's step counters,
    which torch keeps on the CPU."""
    n = max(1, tensors // 3)
    numel = max(1, total // 4 // (3 * n))
    g = torch.Generator(device="cuda").manual_seed(0)
    params = {f"p{i}.weight": torch.randn(numel, device="cuda", generator=g) for i in range(n)}
    optim = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v), "step": torch.tensor(0.0)}
             for k, v in params.items()}
    torch.cuda.synchronize()
    return {"model": params, "optim": optim}


class GpuTrainer(Trainer):
    """Trainer on the GPU: compute() is a chain of 4096x4096 products, optimizer_step() a foreach update of
    every saved GPU tensor. Steps are timed to the end of their GPU work (a synchronize), as a loop that
    reads its loss each step sees them."""

    def __init__(self, state, matmuls: int = 4):
        self.tensors = [t for t in tensors_of(state) if t.is_cuda]
        self.a = torch.randn(4096, 4096, device="cuda")
        self.b = self.a.clone()
        self.matmuls = matmuls

    def compute(self):
        for _ in range(self.matmuls):
            self.b = torch.tanh(self.b @ self.a)

    def calibrate(self, fwd_bwd_ms: float) -> None:
        self.matmuls = 1
        one = statistics.median(_timed_gpu(self.compute) for _ in range(5))
        self.matmuls = max(1, round(fwd_bwd_ms / 1e3 / one))


def _timed_gpu(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def staging_throughput(variant: str, state, directory: str, repeats: int, dcp_options=None) -> float:
    """GB/s from the start of staging to the host seeing every copy in pinned host memory, the median of
    ``repeats`` after one warm-up (the arenas and pinned buffers are allocated then). No training beside it."""
    size = nbytes(state)
    gpu = [t for t in tensors_of(state) if t.is_cuda]
    times = []
    if variant in ("pinned_memcpy", "pinned_memcpy_per_tensor"):
        # The plain way: one cudaMemcpyAsync of all the bytes from one GPU buffer (the copy engine's ceiling),
        # or one per tensor from Python, into page-locked memory allocated up front, then one synchronize.
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in gpu]) if variant == "pinned_memcpy" else None
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if flat is not None:
                host[: flat.numel()].copy_(flat, non_blocking=True)
            else:
                off = 0
                for t in gpu:
                    b = t.reshape(-1).view(torch.uint8)
                    host[off: off + b.numel()].copy_(b, non_blocking=True)
                    off += b.numel()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        size = sum(t.nbytes for t in gpu)
    elif variant in ("ettkit", "ettkit_gather"):
        from ettkit.checkpoint import AsyncCheckpointer

        shutil.rmtree(directory, ignore_errors=True)
        # ettkit_gather: the opt-in gather kernel for tensors up to 1 MiB (cuda_gather_max_bytes).
        gather = 1 << 20 if variant == "ettkit_gather" else 0
        with AsyncCheckpointer(directory, keep_last=1, recorder=None, preempt_signals=(),
                               cuda_gather_max_bytes=gather) as ck:
            for i in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = ck.save(i, state)
                h.wait_staged()
                times.append(time.perf_counter() - t0)
                h.wait()  # one arena: the next save would wait for this one's write anyway
    else:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(*dcp_options))
        try:
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                staged = stager.stage(state)
                if hasattr(staged, "result"):
                    staged = staged.result()
                if hasattr(stager, "synchronize_staging"):
                    stager.synchronize_staging()
                times.append(time.perf_counter() - t0)
                del staged
        finally:
            stager.close()
    shutil.rmtree(directory, ignore_errors=True)
    return size / statistics.median(times[1:]) / 1e9


def run_gpu_variant(variant: str, state, directory: str, saves: int, base_step_s: float, matmuls: int,
                    dcp_options=None) -> dict:
    """The training loop of run_variant() on the GPU. Per save: the step's forward/backward, save(), the next
    forward/backward, the pre-step wait (ettkit: wait_staged(), the compute stream waits for the copy event;
    DCP: staging_completion), the optimizer step; then steps while the save persists."""
    import torch.distributed.checkpoint as dcp

    tr = GpuTrainer(state, matmuls)
    calls, waits, save_steps, durable, inflation = [], [], [], [], []
    persist_steps = 0
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    ck = stager = None
    if variant in ("ettkit", "ettkit_gather"):
        from ettkit.checkpoint import AsyncCheckpointer

        ck = AsyncCheckpointer(directory, keep_last=2, recorder=None, preempt_signals=(), overlap=True,
                               unfenced_sync_max_bytes=0,
                               cuda_gather_max_bytes=1 << 20 if variant == "ettkit_gather" else 0)
    else:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(*dcp_options))
    prev = None
    try:
        for i in range(1, saves + 1):
            tr.compute()
            tr.optimizer_step()
            torch.cuda.synchronize()
            tr.compute()  # this step's forward/backward, queued
            t0 = time.perf_counter()
            path = os.path.join(directory, f"step-{i}")
            if ck is not None:
                h = ck.save(i, state)
                is_durable = lambda: h.durable  # noqa: E731
                wait_staged = ck.wait_staged
            else:
                if prev is not None:
                    prev.result()
                resp = dcp.async_save(state, checkpoint_id=path, no_dist=True, async_stager=stager)
                up, staging = getattr(resp, "upload_completion", resp), getattr(resp, "staging_completion", None)
                prev = up
                is_durable = up.done
                wait_staged = (lambda: staging.result()) if staging is not None else (lambda: None)
            t1 = time.perf_counter()
            tr.compute()  # the next step's forward/backward overlaps the staging copies
            tw = time.perf_counter()
            wait_staged()
            t2 = time.perf_counter()
            tr.optimizer_step()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            calls.append(t1 - t0)
            waits.append(t2 - tw)
            save_steps.append(t3 - t0)
            steps = []
            while not is_durable() and len(steps) < 50:
                steps.append(_timed_gpu(lambda: (tr.compute(), tr.optimizer_step())))
            if ck is not None:
                h.wait()
            else:
                prev.result()
            durable.append(time.perf_counter() - t0)
            if steps:
                inflation.append(statistics.mean(steps) / base_step_s - 1.0)
                persist_steps += len(steps)
    finally:
        if ck is not None:
            ck.close()
        if stager is not None:
            stager.close()
    size = nbytes(state)
    blocking = [c + w for c, w in zip(calls, waits)]
    return {
        "host_blocking_ms": statistics.median(blocking) * 1e3,
        "save_call_ms": statistics.median(calls) * 1e3,
        "pre_step_wait_ms": statistics.median(waits) * 1e3,
        # The step that holds the save (its forward/backward already queued before save(), the next one, the
        # wait and the optimizer step) against two plain steps: what the save cost the GPU timeline.
        "save_step_overhead_ms": (statistics.median(save_steps) - 2 * base_step_s) * 1e3,
        "step_inflation_pct": (statistics.mean(inflation) * 100) if inflation else 0.0,
        "steps_while_persisting": persist_steps,
        "time_to_durable_s": statistics.median(durable),
        "persist_GBps": size / statistics.median(durable) / 1e9,
    }


def gpu_main(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("checkpoint --device cuda: torch sees no CUDA device")
    cases = GPU_CASES_QUICK if args.quick else GPU_CASES
    saves = args.saves or 3
    repeats = 3
    results: dict = {}
    best: dict = {}
    done: list = []
    fwd_bwd_ms = args.fwd_bwd_ms if args.fwd_bwd_ms_given else 50.0
    for case in args.cases.split(","):
        total, count = cases[case]
        state = make_gpu_state(total, count)
        tr = GpuTrainer(state)
        for _ in range(3):
            tr.compute()
            tr.optimizer_step()
        tr.calibrate(fwd_bwd_ms)
        base = statistics.median(_timed_gpu(lambda: (tr.compute(), tr.optimizer_step())) for _ in range(5))
        key = f"state={case},device=cuda"
        gpu_tensors = sum(1 for t in tensors_of(state) if t.is_cuda)
        results[f"state_MB[{key}]"] = {"all": nbytes(state) / 1e6}
        results[f"gpu_tensors[{key}]"] = {"all": gpu_tensors}
        results[f"step_ms[{key}]"] = {"no_save": base * 1e3}
        print(f"{case}: {nbytes(state) / 1e6:.0f} MB in {gpu_tensors} GPU tensors, step {base * 1e3:.1f} ms "
              f"({tr.matmuls} products of 4096x4096)", flush=True)
        # Staging throughput, with nothing else running: ettkit, DCP's DefaultStager, and the plain copies.
        dcp_opts, rejected = None, []
        for opts in DCP_GPU_CANDIDATES:
            try:
                r = staging_throughput("dcp", state, os.path.join(args.dir, "dcp-stage"), repeats, opts)
            except Exception as e:  # noqa: BLE001 - this torch refuses the option set: try the next
                rejected.append(f"{dict(zip(DCP_OPTION_NAMES, opts))}: {type(e).__name__}: {str(e)[:120]}")
                continue
            dcp_opts = opts
            results.setdefault(f"staging_GBps[{key}]", {})["dcp_async_best"] = r
            break
        best[case] = {"options": dict(zip(DCP_OPTION_NAMES, dcp_opts)) if dcp_opts else None, "rejected": rejected}
        for v in ("ettkit", "ettkit_gather", "pinned_memcpy", "pinned_memcpy_per_tensor"):
            results.setdefault(f"staging_GBps[{key}]", {})[v] = staging_throughput(
                v, state, os.path.join(args.dir, "stage"), repeats)
        st = results[f"staging_GBps[{key}]"]
        results[f"staging_vs_pinned_memcpy_pct[{key}]"] = {
            "ettkit": 100 * st["ettkit"] / st["pinned_memcpy"],
            "dcp_async_best": 100 * st["dcp_async_best"] / st["pinned_memcpy"] if "dcp_async_best" in st else None}
        print(f"{case} staging GB/s: " + ", ".join(f"{k}={x:.3g}" for k, x in st.items()), flush=True)
        variants = ["ettkit", "ettkit_gather"] + (["dcp_async_best"] if dcp_opts else [])
        for v in variants:
            d = os.path.join(args.dir, v)
            r = run_gpu_variant(v, state, d, saves, base, tr.matmuls, dcp_opts)
            shutil.rmtree(d, ignore_errors=True)
            for metric, value in r.items():
                results.setdefault(f"{metric}[{key}]", {})[v] = value
            print(f"{case} {v}: " + ", ".join(f"{k}={x:.4g}" for k, x in r.items()), flush=True)
        del state, tr
        torch.cuda.empty_cache()
        done.append(case)
        write_gpu_json(args, done, results, best, saves, repeats, fwd_bwd_ms, cases)  # what a time-out leaves
    shutil.rmtree(args.dir, ignore_errors=True)
    print_table("checkpoint (GPU)", results)
    targets = write_gpu_json(args, done, results, best, saves, repeats, fwd_bwd_ms, cases)
    print("\ntargets")
    for name, value, target, ok in targets:
        print(f"  {name:<50} {value:10.3f}  {target:<8} {'met' if ok else 'MISSED'}")


def write_gpu_json(args, done, results, best, saves, repeats, fwd_bwd_ms, cases) -> list:
    targets = []
    for case in done:
        key = f"state={case},device=cuda"
        targets.append((f"host blocking per save [{case}]", results[f"host_blocking_ms[{key}]"]["ettkit"], "<= 1 ms",
                        results[f"host_blocking_ms[{key}]"]["ettkit"] <= 1.0))
        targets.append((f"step inflation while persisting [{case}]", results[f"step_inflation_pct[{key}]"]["ettkit"],
                        "<= 2 %", results[f"step_inflation_pct[{key}]"]["ettkit"] <= 2.0))
        targets.append((f"staging vs pinned cudaMemcpyAsync [{case}]",
                        results[f"staging_vs_pinned_memcpy_pct[{key}]"]["ettkit"], ">= 90 %",
                        results[f"staging_vs_pinned_memcpy_pct[{key}]"]["ettkit"] >= 90.0))
    if args.json:
        write_json(args.json, "checkpoint", {
            "device": "cuda", "quick": args.quick, "saves": saves, "staging_repeats": repeats,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "fwd_bwd_ms_target": fwd_bwd_ms,
            "cases": {c: {"bytes": cases[c][0], "gpu_tensors": cases[c][1]} for c in args.cases.split(",")},
            "cases_done": list(done), "dcp_async_best_options": best,
            "targets": {name: {"value": value, "target": target, "met": ok} for name, value, target, ok in targets},
        }, results)
    return targets


if __name__ == "__main__":
    main()
