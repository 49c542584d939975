"""ETT recorder overhead: cost per recorded event from C++ and from Python, and report time for a
ledger of 1,000,000 records. Baselines in the same run: the bare clock reads an event cannot avoid, and
the naive recorder many projects start with (one JSON line written per event).

    python benchmarks/ett_overhead.py [--quick] [--json FILE]

Targets (issue 2): <= 100 ns per event in C++, <= 2 us from Python, report <= 5 s for 1M records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import median_of, print_table, timed, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpp_event_ns(repeats: int, min_time: str) -> dict:
    """Medians from the google-benchmark binary built next to the library (make build)."""
    candidates = [os.path.join(REPO, d, "benchmarks", "cpp", "ett_event_bench") for d in ("build/py", "build/cpp")]
    binary = next((c for c in candidates if os.path.exists(c)), None)
    if binary is None:
        raise SystemExit("ett_event_bench not built; run `make build` (it builds the C++ benchmarks)")
    out = subprocess.run([binary, "--benchmark_format=json", f"--benchmark_repetitions={repeats}",
                          f"--benchmark_min_time={min_time}", "--benchmark_report_aggregates_only=true"],
                         capture_output=True, text=True, check=True).stdout
    medians = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") == "median":
            medians[b["run_name"]] = b["real_time"]  # ns (time_unit defaults to ns)
    return {"phase": medians["BM_ScopedPhase"], "step": medians["BM_Step"]}


def python_event_ns(n: int, repeats: int, tmp: str) -> dict:
    from ettkit import ett

    rec = ett.Recorder(os.path.join(tmp, "py"), rank=0, world_size=1, queue_capacity=1 << 20, fsync="never")
    pid = rec.phase_id("checkpoint_blocking")
    phase = rec.phase

    def phases() -> float:
        t = time.perf_counter_ns()
        for _ in range(n):
            with phase(pid):
                pass
        dt = (time.perf_counter_ns() - t) / n
        rec.flush()  # drained outside the timed loop: measures the accepted path, not drops
        return dt

    step = rec.step

    def steps() -> float:
        t = time.perf_counter_ns()
        for i in range(n):
            step(i)
        dt = (time.perf_counter_ns() - t) / n
        rec.flush()
        return dt

    pc = time.perf_counter_ns

    def floor() -> float:  # two clock reads and a loop iteration: what any timer pays
        t = pc()
        for _ in range(n):
            pc()
            pc()
        return (pc() - t) / n

    path = os.path.join(tmp, "naive.jsonl")

    def naive() -> float:  # a synchronous JSON line per event
        with open(path, "a") as f:
            t = pc()
            for i in range(n // 10):
                b = time.time()
                e = time.time()
                f.write(json.dumps({"t": "phase", "name": "checkpoint_blocking", "b": b, "e": e}) + "\n")
                f.flush()
            return (pc() - t) / (n // 10)

    res = {"phase": median_of(phases, repeats), "step": median_of(steps, repeats),
           "floor": median_of(floor, repeats), "naive_jsonl": median_of(naive, repeats)}
    rec.close()
    assert rec.dropped == 0, "the queue overflowed: the measurement would include drops"
    return res


def write_ledger(run_dir: str, records: int) -> None:
    """One rank, `records` lines in the recorder's format: steps, a heartbeat every 100, a checkpoint every 1000."""
    os.makedirs(os.path.join(run_dir, "ett"), exist_ok=True)
    t = 1_700_000_000_000_000
    lines = [json.dumps({"v": 1, "t": "attempt", "attempt": 0, "rank": 0, "world": 1, "ts": t})]
    for i in range(1, records):
        if i % 1000 == 0:
            lines.append('{"v":1,"t":"phase","name":"checkpoint_blocking","b":%d,"e":%d,"step":%d}' % (t, t + 5000, i))
            t += 5000
        elif i % 100 == 0:
            lines.append('{"v":1,"t":"hb","ts":%d}' % t)
        else:
            lines.append('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}' % (i, t, t + 10000))
            t += 10000
    with open(os.path.join(run_dir, "ett", "rank-0.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    repeats = 3 if args.quick else 7
    n = 100_000 if args.quick else 300_000
    records = 1_000_000
    from ettkit import ett

    tmp = tempfile.mkdtemp(prefix="ettkit-bench-")
    try:
        cpp = cpp_event_ns(repeats, "0.2" if args.quick else "0.5")
        py = python_event_ns(n, repeats, tmp)
        run = os.path.join(tmp, "report")
        write_ledger(run, records)
        report_s = median_of(lambda: timed(lambda: ett.build_report(run, include_timeline=False)), 3)
        report_tl_s = median_of(lambda: timed(lambda: ett.build_report(run, include_timeline=True)), 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results = {
        "event_ns": {"cpp": cpp["phase"], "python": py["phase"]},
        "step_ns": {"cpp": cpp["step"], "python": py["step"]},
        "python_event_ns": {"ettkit": py["phase"], "perf_counter_floor": py["floor"], "naive_jsonl": py["naive_jsonl"]},
        f"report_s[records={records}]": {"ettkit": report_s},
        f"report_with_timeline_s[records={records}]": {"ettkit": report_tl_s},
    }
    print_table("ETT recorder overhead (medians)", results)
    ok = cpp["phase"] <= 100 and py["phase"] <= 2000 and report_s <= 5
    print(f"\ntargets (<=100 ns C++, <=2 us Python, report <=5 s): {'met' if ok else 'MISSED'}")
    if args.json:
        write_json(args.json, "ett_overhead", {"repeats": repeats, "python_events": n, "records": records,
                                               "quick": args.quick}, results)


if __name__ == "__main__":
    main()
