"""Each save call's own cost, per rank, for the driver's "first save per attempt" rows (issue #65).

The ledger's ``checkpoint_blocking`` records give a save's wall time, which on a loaded machine includes the
time the calling thread waited for a core. Beside it this records, per call, what only the save's own work
moves: the calling thread's CPU time (``time.thread_time``), its minor page faults and involuntary context
switches (``getrusage(RUSAGE_THREAD)``), and the modules imported during the call. A first save whose CPU
time is the later saves' did no first-time work, whatever its wall time; one that imports or faults did.

One JSON line per save in ``RUN_DIR/save-calls-rank-R.jsonl``, every attempt appending (``attempt`` is
torchrun's restart count).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from contextlib import contextmanager


class SaveCalls:
    def __init__(self, run_dir: str, rank: int, attempt: int):
        self._path = os.path.join(run_dir, f"save-calls-rank-{rank}.jsonl")
        self._attempt = attempt

    @contextmanager
    def measure(self, step: int):
        # Read before and after the call only: nothing here runs inside the save.
        mods = len(sys.modules)
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        cpu, wall = time.thread_time(), time.perf_counter()
        yield
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        ru2 = resource.getrusage(resource.RUSAGE_THREAD)
        rec = {
            "attempt": self._attempt,
            "step": step,
            "wall_s": wall,
            "cpu_s": cpu,
            "minflt": ru2.ru_minflt - ru.ru_minflt,
            "nivcsw": ru2.ru_nivcsw - ru.ru_nivcsw,
            "modules": len(sys.modules) - mods,
        }
        with open(self._path, "a") as f:  # a line per save, after it: a crash loses at most the one it was in
            f.write(json.dumps(rec) + "\n")


def read(run_dir: str, rank: int = 0) -> list:
    """The records of `rank`, in order; [] when the file is absent (a run of an older trainer)."""
    path = os.path.join(run_dir, f"save-calls-rank-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line a killed rank left half written
                continue
    return out
