"""ETT recorder overhead: cost per recorded event from C++ and from Python, and report time for a
ledger of 1,000,000 records. Baselines in the same run: the bare clock reads an event cannot avoid, and
the naive recorder many projects start with (one JSON line written per event).

    python benchmarks/ett_overhead.py [--quick] [--json FILE] [--device cuda]

Targets (issue 2): <= 100 ns per event in C++, <= 2 us from Python, report <= 5 s for 1M records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import median_of, print_table, timed, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_binary() -> str:
    dirs = [os.environ.get("ETTKIT_BUILD_DIR", ""), "build/py", "build/cpp"]
    candidates = [os.path.join(REPO, d, "benchmarks", "cpp", "ett_event_bench") for d in dirs if d]
    binary = next((c for c in candidates if os.path.exists(c)), None)
    if binary is None:
        raise SystemExit("ett_event_bench not built; run `make build` (it builds the C++ benchmarks)")
    return binary


def _run_cpp(repeats: int, min_time: str, bench_filter: str = ".") -> dict:
    out = subprocess.run([_bench_binary(), "--benchmark_format=json", f"--benchmark_repetitions={repeats}",
                          f"--benchmark_min_time={min_time}", "--benchmark_report_aggregates_only=true",
                          f"--benchmark_filter={bench_filter}"],
                         capture_output=True, text=True, check=True).stdout
    medians = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") == "median":
            medians[b["run_name"]] = b["real_time"]  # ns (time_unit defaults to ns)
    return medians


def cpp_event_ns(repeats: int, min_time: str) -> dict:
    """Medians from the google-benchmark binary built next to the library (make build)."""
    medians = _run_cpp(repeats, min_time, "BM_Step|BM_ScopedPhase$")
    return {"phase": medians["BM_ScopedPhase"], "step": medians["BM_Step"]}


def gpu_main(args) -> None:
    """--device cuda: the CUDA-event timer's cost per timed phase (C++) against its floor and against host
    timing with a stream synchronisation, NVTX ranges' cost, and the timer's agreement with host time around
    a synchronised chain of matrix products (Python binding)."""
    import torch

    from ettkit import ett

    if not torch.cuda.is_available():
        raise SystemExit("ett_overhead --device cuda: torch sees no CUDA device")
    if not hasattr(ett, "CudaEventTimer"):
        raise SystemExit("ett_overhead --device cuda: ettkit was built without CUDA (no ett.CudaEventTimer)")
    repeats = 3 if args.quick else 7
    cpp = _run_cpp(repeats, "0.2" if args.quick else "0.5",
                   "BM_ScopedPhase|BM_CudaEventTimer|BM_CudaEventRecordPair|BM_HostTimerWithStreamSync")
    if "BM_CudaEventTimer" not in cpp:
        raise SystemExit("ett_event_bench registered no CUDA benchmark: built without CUDA, or it sees no GPU")
    tmp = tempfile.mkdtemp(prefix="ettkit-bench-gpu-")
    agreement = []
    try:
        with ett.Recorder(os.path.join(tmp, "run"), rank=0, world_size=1, fsync="never") as rec:
            timer = ett.CudaEventTimer(rec, "gpu_matmul")
            size, chain = 4096, 20
            a = torch.randn(size, size, device="cuda")
            for _ in range(2 + repeats):
                x = a.clone()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                timer.start()
                for _ in range(chain):
                    x = (x @ a).div_(size)
                timer.stop()
                torch.cuda.synchronize()
                host_ms = (time.perf_counter() - t0) * 1e3
                gpu_ms = timer.resolve()
                agreement.append((gpu_ms, host_ms))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    agreement = agreement[2:]  # two warm-ups
    gpu_ms = statistics.median(g for g, _ in agreement)
    host_ms = statistics.median(h for _, h in agreement)
    case = f"size=4096,chain={chain}"
    results = {
        "cuda_timer_ns_per_phase": {"ettkit": cpp["BM_CudaEventTimer"], "event_record_pair": cpp["BM_CudaEventRecordPair"],
                                    "host_timer_with_stream_sync": cpp["BM_HostTimerWithStreamSync"]},
        "event_ns": {"cpp": cpp["BM_ScopedPhase"], "cpp_nvtx": cpp.get("BM_ScopedPhaseNvtx")},
        f"matmul_ms[{case}]": {"cuda_event_timer": gpu_ms, "host_synchronised": host_ms},
        f"timer_vs_host_pct[{case}]": {"ettkit": 100 * gpu_ms / host_ms},
    }
    print_table("ETT on the GPU (medians)", results)
    print(f"\nCUDA-event timer vs host time around a synchronised matmul chain: {100 * gpu_ms / host_ms:.1f} % "
          "(the host span also holds the launches and the synchronisation)")
    if args.json:
        write_json(args.json, "ett_overhead", {"device": "cuda", "repeats": repeats, "quick": args.quick,
                                               "gpu": torch.cuda.get_device_name(0),
                                               "agreement_samples_ms": agreement}, results)


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
    # A queue that overflowed (the writer thread starved on a loaded machine) makes a dropped event cheaper
    # than a recorded one: reported with the figure, not a failure of the benchmark.
    res["dropped"] = rec.dropped
    return res


def live_scrape(run_dir: str, records: int, repeats: int, appended: int = 1000) -> tuple[float, float]:
    """The live metrics endpoint (ettkit.ett.live) on the ledger write_ledger wrote: seconds of the first
    scrape (the catch-up, which reads the whole ledger), then the median of `repeats` scrapes in ms, each after
    `appended` more step records. A scrape here is the endpoint's collect and text exposition, without HTTP."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ettkit.ett.live import LiveCollector, LiveLedger

    ledger = LiveLedger(run_dir)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(ledger))
    catchup_s = timed(lambda: generate_latest(registry))
    path = os.path.join(run_dir, "ett", "rank-0.jsonl")
    with open(path, "rb") as f:
        f.seek(-300, os.SEEK_END)
        last = json.loads(f.read().splitlines()[-1])
    t, n = last.get("e", last.get("ts")), ledger.figures()["last_step"]
    scrape_s = []
    for _ in range(repeats):
        lines = []
        for _ in range(appended):
            n += 1
            lines.append('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}' % (n, t, t + 10000))
            t += 10000
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
        scrape_s.append(timed(lambda: generate_latest(registry)))
    assert ledger.records == records + repeats * appended, "a scrape missed appended records"
    return catchup_s, statistics.median(scrape_s) * 1e3


MIN_SCRAPES = 3  # a served round scraped fewer times than this measured the endpoint's idle cost only


def live_step_ms(tmp: str, steps: int, rounds: int,
                 scrape_every_s: float = 0.05) -> tuple[float, float | None, list[int]]:
    """Median step time (ms) of a recorded training loop without and with the live endpoint of the same
    process (ett.serve_metrics) scraped over HTTP every `scrape_every_s` (300x Prometheus' usual 15 s), in
    alternating rounds, and the scrapes of each served round. A step is a fixed CPU workload (matmuls) and
    rec.step(n), as a trainer's. The served figure counts only rounds scraped at least MIN_SCRAPES times; it is
    None when none was (a --quick loop lasts ~80 ms on an idle machine: the scraper thread may not get a turn).
    A benchmark reports what it could not measure; it does not fail for it."""
    import threading
    import urllib.request

    import torch

    from ettkit import ett

    a = torch.randn(192, 192)

    def loop(run_dir: str, serve: bool) -> list[float]:
        times = []
        with ett.Recorder(run_dir) as rec:
            handle = ett.serve_metrics(0, run_dir=run_dir, rank=0) if serve else None
            stop = threading.Event()
            scrapes = [0]

            def scraper() -> None:
                while not stop.wait(scrape_every_s):
                    with urllib.request.urlopen(handle.url, timeout=10) as r:
                        r.read()
                    scrapes[0] += 1

            thread = threading.Thread(target=scraper, daemon=True) if serve else None
            if thread:
                thread.start()
            try:
                for n in range(steps):
                    t = time.perf_counter()
                    for _ in range(4):
                        a @ a
                    rec.step(n)
                    times.append(time.perf_counter() - t)
            finally:
                stop.set()
                if thread:
                    thread.join()
                if handle:
                    handle.close()
        return times, scrapes[0]

    without, with_, scraped = [], [], []
    for r in range(rounds):
        without += loop(os.path.join(tmp, f"live-off-{r}"), False)[0]
        times, n = loop(os.path.join(tmp, f"live-on-{r}"), True)
        scraped.append(n)
        if n >= MIN_SCRAPES:
            with_ += times
    return statistics.median(without) * 1e3, (statistics.median(with_) * 1e3 if with_ else None), scraped


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


FLEET_JOBS = 1000


def write_fleet_run(run_dir: str, job: int, steps: int = 100) -> None:
    """One small job of the fleet benchmark: launcher_init, compile, `steps` 1 s steps with a checkpoint
    every 20, shutdown; world size 1, 8, 64 or 512; every fifth job is killed once mid-run and restarts."""
    os.makedirs(os.path.join(run_dir, "ett"), exist_ok=True)
    t = 1_700_000_000_000_000 + job * 1_000_000
    world = (1, 8, 64, 512)[job % 4]

    def phase(name: str, b: int, e: int) -> str:
        return '{"v":1,"t":"phase","name":"%s","b":%d,"e":%d}' % (name, b, e)

    def attempt(n: int) -> str:
        return json.dumps({"v": 1, "t": "attempt", "attempt": n, "rank": 0, "world": world, "ts": t})

    lines = [attempt(0), phase("launcher_init", t, t + 20_000_000), phase("compile", t + 20_000_000, t + 80_000_000)]
    t += 80_000_000
    fail_at = steps // 2 + 7 if job % 5 == 0 else None
    n = 0
    while n < steps:
        n += 1
        lines.append('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}' % (n, t, t + 1_000_000))
        t += 1_000_000
        if n % 20 == 0:
            lines.append(phase("checkpoint_blocking", t, t + 2_000_000))
            t += 2_000_000
        if n == fail_at:  # killed: a heartbeat, 30 s of nothing, then a restart that restores the last save
            lines.append('{"v":1,"t":"hb","ts":%d}' % t)
            t += 30_000_000
            lines += [attempt(1), phase("launcher_init", t, t + 20_000_000),
                      phase("checkpoint_restore", t + 20_000_000, t + 25_000_000),
                      phase("compile", t + 25_000_000, t + 55_000_000)]
            t += 55_000_000
            n -= n % 20
            fail_at = None
    lines.append(phase("shutdown", t, t + 5_000_000))
    lines.append(json.dumps({"v": 1, "t": "end", "ts": t + 5_000_000, "status": "clean", "detail": ""}))
    with open(os.path.join(run_dir, "ett", "rank-0.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")


def fleet_seconds(jobs: int, repeats: int) -> float:
    """Median time of ett.fleet_report over `jobs` small run directories, written once."""
    from ettkit import ett

    tmp = tempfile.mkdtemp(prefix="ettkit-bench-fleet-")
    try:
        dirs = [os.path.join(tmp, f"job-{j:04d}") for j in range(jobs)]
        for j, d in enumerate(dirs):
            write_fleet_run(d, j)
        fleet = ett.fleet_report(dirs)
        assert fleet["jobs_read"] == jobs, "a benchmark job could not be read: the timing would be of errors"
        return median_of(lambda: timed(lambda: ett.fleet_report(dirs)), repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the CUDA-event timer and NVTX costs and the timer's agreement with host time")
    args = p.parse_args()
    if args.device == "cuda":
        gpu_main(args)
        return
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
        catchup_s, scrape_ms = live_scrape(run, records, repeats)  # after the reports: it appends to the ledger
        step_off_ms, step_on_ms, scraped = live_step_ms(tmp, 300 if args.quick else 1000, 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results = {
        "event_ns": {"cpp": cpp["phase"], "python": py["phase"]},
        "step_ns": {"cpp": cpp["step"], "python": py["step"]},
        "python_event_ns": {"ettkit": py["phase"], "perf_counter_floor": py["floor"], "naive_jsonl": py["naive_jsonl"],
                            "events_dropped": py["dropped"]},
        f"report_s[records={records}]": {"ettkit": report_s},
        f"report_with_timeline_s[records={records}]": {"ettkit": report_tl_s},
        f"catchup_s[records={records}]": {"ettkit": catchup_s},
        f"scrape_ms[records={records}]": {"ettkit": scrape_ms},
        "live_step_ms": {"not_served": step_off_ms, "served_scraped_every_50ms": step_on_ms},
        "live_scrapes_per_served_round": {"ettkit": scraped},
    }
    results[f"fleet_s[jobs={FLEET_JOBS}]"] = {"ettkit": fleet_seconds(FLEET_JOBS, repeats)}
    print_table("ETT recorder overhead (medians)", results)
    ok = cpp["phase"] <= 100 and py["phase"] <= 2000 and report_s <= 5
    print(f"\ntargets (<=100 ns C++, <=2 us Python, report <=5 s): {'met' if ok else 'MISSED'}")
    if py["dropped"]:
        print(f"measured with drops: {py['dropped']} Python events overflowed the queue (a loaded machine); the "
              "Python event cost above includes their cheaper path")
    if step_on_ms is None:
        print(f"not measured: the served step time (no served round was scraped {MIN_SCRAPES}+ times; scrapes "
              f"per round {scraped}; run without --quick for longer loops)")
    if args.json:
        write_json(args.json, "ett_overhead", {"repeats": repeats, "python_events": n, "records": records,
                                               "quick": args.quick}, results)


if __name__ == "__main__":
    main()
