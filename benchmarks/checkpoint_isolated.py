"""One save at a time, nothing beside it: the cost of ettkit's save() call and of a disk-tier persist.

    python benchmarks/checkpoint_isolated.py [--quick] [--saves 25] [--json FILE]

benchmarks/checkpoint.py measures a save beside a training loop (a thread of matmuls on the same cores), three
saves per variant in --quick: the figure a user sees, but on a 2-core machine its blocking time is mostly
which thread the scheduler ran, and a few milliseconds move from run to run. This benchmark takes the
scheduler out, to tell a change in ettkit's own code from that noise (tools/compare_revisions.py runs it
for old and new in one run):
- `save_call_ms[tensors=N,mib=M]:disk|memory`: the wall time of `save()` (argument checks, staging copy into
  the warmed arena, queueing), each save waited for before the next, median of --saves after 5 warm-up saves;
- `persist_ms[...]:disk|memory|memcpy` and `persist_cpu_ms[...]`: `save(...).wait()` on each tier (staging,
  writing, hashing, fsync, commit) as wall time and as this process's CPU time (getrusage, every thread),
  the tiers' saves alternating in one checkpointer, beside `memcpy`: a copy of the same tensors into one
  preallocated buffer after each pair; `persist_cpu_over_memcpy[...]:disk|memory` and
  `memory_over_disk[...]:persist_ms` are the ratios issue #45 sets targets for. `memory_copy` is a second
  checkpointer in the same loop whose `memory_budget_bytes` fits one arena only: its memory saves copy the
  arena into the tier (the path every memory save took before the arenas became the tier's files), the
  baseline measured beside the new path;
- `host_over_state[...]:memory|memory_copy`: the most host memory the arenas and the memory tier held together
  after any memory save of that loop (distinct files under the tier, an arena and the step that links it
  counted once, plus anonymous arenas), over the state's bytes (issue #45's target: at most 2).
- `first_save_ms[...]:prepared|unprepared` and `first_over_later[...]`: the first save of a fresh
  checkpointer (the save() call and the wait until its copies are done: a training loop's blocking) against
  the median of its next 4, with `prepare(state)` before it (waited for: it runs beside other start-up
  work in a trainer) or without; the median over --rounds fresh checkpointers.
- `memory_1t`: a third checkpointer with `copy_threads=1`; `memcpy` is the copy on one thread, `memcpy_2t` the
  same bytes copied by two threads at once (half the tensors each), and `persist_cpu_over_memcpy_2t[...]:memory`
  compares the default memory save (two copy threads) with the latter: the same parallelism;
- `persist_user_cpu_over_memcpy[...]:disk`: the disk tier's user-space CPU against the memcpy's (the issue's
  disk target is "2x a memcpy plus the kernel's write", and the write is system time).
Two shapes: 2,001 small tensors (32 MiB; per-tensor costs) and 12 large ones (128 MiB; per-byte costs).

OpenMP's threads wait passively here (OMP_WAIT_POLICY=PASSIVE unless set): by default torch's OpenMP workers
spin for a while after each parallel op (the `_touch` and the memcpy), and getrusage counted that spinning in
whatever came next; measured on 2026-11-29, a quarter of a 128 MiB memory save's CPU (21 against 16 ms) was
torch's workers spinning (`perf`: 32% of the samples in libgomp), not ettkit.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see above)

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common

WARMUP = 5


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _user_s() -> float:
    """User-space CPU only: a disk save's CPU less the kernel's (its write into the page cache, above all)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def _state(total_bytes: int, tensors: int):
    import torch

    return {f"t{i}": torch.randn(total_bytes // 4 // tensors) for i in range(tensors)}


def _touch(state) -> None:
    for t in state.values():  # what a training step does to every tensor between saves
        t.add_(1.0)


def _host_bytes(ck) -> int:
    """The arenas and the memory tier together: every distinct file under the tier (an arena and the memory
    step that links it count once), plus the arenas when they are anonymous memory."""
    seen, total, file_arenas = set(), 0, False
    for dirpath, _, files in os.walk(ck.memory_tier_directory):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            file_arenas = file_arenas or f.startswith(".arena-")
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total + (0 if file_arenas else ck.arena_bytes * ck.num_arenas)


def measure(total_bytes: int, tensors: int, saves: int, root: str) -> dict:
    from ettkit.checkpoint import AsyncCheckpointer

    state = _state(total_bytes, tensors)
    out = {}
    for tier in ("disk", "memory"):
        kw = dict(keep_last=2, recorder=None, preempt_signals=(), overlap=True, unfenced_sync_max_bytes=0)
        if tier == "memory":
            kw.update(memory_tier="/dev/shm", job_id=f"bench-isolated-{os.getpid()}")
        calls = []
        with AsyncCheckpointer(os.path.join(root, f"call-{tier}"), **kw) as ck:
            for step in range(1, WARMUP + saves + 1):
                _touch(state)
                t0 = time.perf_counter()
                handle = ck.save(step, state, tier=tier)
                calls.append(time.perf_counter() - t0)
                handle.wait()
        out[f"save_call_ms:{tier}"] = statistics.median(calls[WARMUP:]) * 1e3
    # Both tiers in one checkpointer, saves alternating, and a memcpy of the same bytes after each pair, so
    # that a change of the machine's load falls on all three (issue #45's baseline for its targets).
    import torch

    dst = torch.empty(sum(t.numel() for t in state.values()))
    views, at = [], 0
    for t in state.values():
        views.append(dst[at: at + t.numel()])
        at += t.numel()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    variants = ("disk", "memory", "memory_copy", "memory_1t", "memcpy", "memcpy_2t")
    walls: dict = {k: [] for k in variants}
    cpus: dict = {k: [] for k in variants}
    users: dict = {"disk": [], "memcpy": []}
    host = {"memory": 0, "memory_copy": 0}
    pairs = list(zip(views, state.values()))
    halves = (pairs[0::2], pairs[1::2])
    threads = torch.get_num_threads()

    def copy(part) -> None:
        for v, t in part:
            v.copy_(t)

    common = dict(keep_last=2, recorder=None, preempt_signals=(), memory_tier="/dev/shm")
    pid = os.getpid()
    with AsyncCheckpointer(os.path.join(root, "persist"), job_id=f"bench-isolated-{pid}", **common) as ck, \
            AsyncCheckpointer(os.path.join(root, "persist-copy"), job_id=f"bench-isolated-copy-{pid}",
                              memory_budget_bytes=state_bytes + (8 << 20), **common) as ck_copy, \
            AsyncCheckpointer(os.path.join(root, "persist-1t"), job_id=f"bench-isolated-1t-{pid}", copy_threads=1,
                              **common) as ck_1t, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        for step in range(1, WARMUP + saves + 1):
            order = ("disk", "memory", "memory_copy", "memory_1t")
            for variant in order if step % 2 else reversed(order):
                _touch(state)
                which = {"memory_copy": ck_copy, "memory_1t": ck_1t}.get(variant, ck)
                tier = "disk" if variant == "disk" else "memory"
                c0, u0, t0 = _cpu_s(), _user_s(), time.perf_counter()
                which.save(2 * step + (tier == "memory"), state, tier=tier).wait()
                walls[variant].append(time.perf_counter() - t0)
                cpus[variant].append(_cpu_s() - c0)
                if variant in users:
                    users[variant].append(_user_s() - u0)
                if variant in host:
                    host[variant] = max(host[variant], _host_bytes(which))
            # The memcpy on one thread (the least CPU that moving these bytes takes), and on two threads at once
            # (what ettkit's two copy threads do: on the 2-vCPU VM two concurrent copies share the memory
            # bandwidth, and each stalled cycle is CPU time).
            torch.set_num_threads(1)
            try:
                c0, u0, t0 = _cpu_s(), _user_s(), time.perf_counter()
                copy(pairs)
                walls["memcpy"].append(time.perf_counter() - t0)
                cpus["memcpy"].append(_cpu_s() - c0)
                users["memcpy"].append(_user_s() - u0)
                c0, t0 = _cpu_s(), time.perf_counter()
                list(pool.map(copy, halves))
                walls["memcpy_2t"].append(time.perf_counter() - t0)
                cpus["memcpy_2t"].append(_cpu_s() - c0)
            finally:
                torch.set_num_threads(threads)
        for c in (ck, ck_copy, ck_1t):
            c.close(discard_memory_tier=True)
    for k in walls:
        out[f"persist_ms:{k}"] = statistics.median(walls[k][WARMUP:]) * 1e3
        out[f"persist_cpu_ms:{k}"] = statistics.median(cpus[k][WARMUP:]) * 1e3
    for k in ("disk", "memory", "memory_copy", "memory_1t"):
        out[f"persist_cpu_over_memcpy:{k}"] = out[f"persist_cpu_ms:{k}"] / out["persist_cpu_ms:memcpy"]
    out["persist_cpu_over_memcpy_2t:memory"] = out["persist_cpu_ms:memory"] / out["persist_cpu_ms:memcpy_2t"]
    # The disk tier's target is "2x a memcpy plus the kernel's write": its user-space CPU against the
    # memcpy's (getrusage's ticks are coarse at this size: read it over several runs).
    out["persist_user_cpu_over_memcpy:disk"] = (statistics.median(users["disk"][WARMUP:])
                                                / statistics.median(users["memcpy"][WARMUP:]))
    out["memory_over_disk:persist_ms"] = out["persist_ms:memory"] / out["persist_ms:disk"]
    out["memory_copy_over_disk:persist_ms"] = out["persist_ms:memory_copy"] / out["persist_ms:disk"]
    for k, held in host.items():
        out[f"host_over_state:{k}"] = held / state_bytes
    return out


def first_saves(total_bytes: int, tensors: int, rounds: int, root: str) -> dict:
    """The first save of a fresh checkpointer against its next four, with and without prepare(), rounds
    interleaved so that a change of the machine's load falls on both."""
    from ettkit.checkpoint import AsyncCheckpointer

    state = _state(total_bytes, tensors)
    firsts: dict = {"prepared": [], "unprepared": []}
    ratios: dict = {"prepared": [], "unprepared": []}
    for r in range(rounds):
        for variant in ("unprepared", "prepared") if r % 2 else ("prepared", "unprepared"):
            with AsyncCheckpointer(os.path.join(root, f"first-{variant}-{r}"), keep_last=2, recorder=None,
                                   preempt_signals=(), overlap=True, unfenced_sync_max_bytes=0) as ck:
                if variant == "prepared":
                    ck.prepare(state)
                    ck.wait_prepared()
                blocking = []
                for step in range(1, 6):
                    _touch(state)
                    t0 = time.perf_counter()
                    handle = ck.save(step, state)
                    ck.wait_staged()  # the optimizer's pre-step wait for the copies
                    blocking.append(time.perf_counter() - t0)
                    handle.wait()
            firsts[variant].append(blocking[0])
            ratios[variant].append(blocking[0] / statistics.median(blocking[1:]))
    out = {}
    for variant, seconds in firsts.items():
        out[f"first_save_ms:{variant}"] = statistics.median(seconds) * 1e3
        out[f"first_over_later:{variant}"] = statistics.median(ratios[variant])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 measured saves per figure instead of --saves")
    ap.add_argument("--saves", type=int, default=25, help="measured saves per figure (after 5 warm-up saves)")
    ap.add_argument("--rounds", type=int, default=7, help="fresh checkpointers per first-save figure (3 in --quick)")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.quick:
        a.saves, a.rounds = 10, 3
    if a.saves < 1:
        ap.error(f"--saves must be at least 1, got {a.saves}")
    results: dict = {}
    for mib, tensors in ((32, 2001), (128, 12)):
        root = tempfile.mkdtemp(prefix="ettkit-isolated-", dir=a.dir)
        try:
            figures = measure(mib << 20, tensors, a.saves, root)
            figures.update(first_saves(mib << 20, tensors, a.rounds, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for key, value in figures.items():
            metric, variant = key.split(":")
            results.setdefault(f"{metric}[tensors={tensors},mib={mib}]", {})[variant] = value
    bench_common.print_table("one save at a time (medians, milliseconds)", results)
    if a.json:
        bench_common.write_json(a.json, "checkpoint_isolated", {k: v for k, v in vars(a).items() if k != "json"},
                                results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
