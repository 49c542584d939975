"""Saves one state over and over to one tier, for a profiler to watch: where a save's CPU goes.

    mkfifo /tmp/perf.ctl
    perf record -g -D -1 --control fifo:/tmp/perf.ctl -o memory.data -- \
        python tools/profile_save.py --tier memory --perf-control /tmp/perf.ctl
    perf report -i memory.data --no-children --sort dso    # kernel / xxHash / memcpy (libc) shares

With --perf-control, perf starts disabled (-D -1) and records only the measured saves: this script writes
"enable" into perf's control FIFO before the first and "disable" after the last (not the interpreter's
start, the state's allocation or the warm-up saves).

The state is --gib GiB in --tensors float32 tensors, filled with torch.full (cheap, so the profile is the
saves'); the checkpointer is prepared and two saves are made before the --saves measured ones. Prints each
measured save's wall time and this process's CPU time (getrusage, every thread), medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

import torch


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _perf(fifo: str, command: str) -> None:
    with open(fifo, "w") as f:  # perf reads one command per line
        f.write(command + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", choices=("memory", "disk"), required=True)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--dir", help="scratch directory for the disk tier (default: a new temporary one)")
    ap.add_argument("--perf-control", help="perf record's control FIFO (--control fifo:PATH): record the saves only")
    a = ap.parse_args()
    if a.gib <= 0 or a.tensors < 1 or a.saves < 1:
        ap.error("--gib must be > 0, --tensors and --saves >= 1")
    from ettkit.checkpoint import AsyncCheckpointer

    numel = int(a.gib * (1 << 30)) // 4 // a.tensors
    state = {f"t{i}": torch.full((numel,), float(i)) for i in range(a.tensors)}
    root = tempfile.mkdtemp(prefix="ettkit-profile-", dir=a.dir)
    walls, cpus = [], []
    try:
        with AsyncCheckpointer(root, keep_last=2, recorder=None, preempt_signals=(), memory_tier="/dev/shm",
                               job_id=f"profile-save-{os.getpid()}") as ck:
            ck.prepare(state, wait=True)
            for step in range(1, a.saves + 3):
                if step == 3 and a.perf_control:
                    _perf(a.perf_control, "enable")
                c0, t0 = _cpu_s(), time.perf_counter()
                ck.save(step, state, tier=a.tier).wait()
                if step > 2:
                    walls.append(time.perf_counter() - t0)
                    cpus.append(_cpu_s() - c0)
            if a.perf_control:
                _perf(a.perf_control, "disable")
            ck.close(discard_memory_tier=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{a.tier} tier, {a.gib:g} GiB in {a.tensors} tensors: save -> committed {statistics.median(walls):.3f} s, "
          f"CPU {statistics.median(cpus):.3f} s (medians of {a.saves})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
