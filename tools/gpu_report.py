"""The last step of tools/gpu_check.sh: gpu.json and summary.md from the steps' records and the benchmarks' JSON.

    python tools/gpu_report.py --work build/gpu-work --out "$OUT" --wall-s 312

gpu.json has the benchmarks' JSON layout (docs/benchmarks.md): {"benchmark": "gpu_check", "machine": {...}, "config": {...},
"results": {"<benchmark>.<metric>[<case>]": {"<variant>": value}}}; config.steps holds each step's status,
seconds and limit, config.benchmarks each benchmark's own config. Standard library only: it must run even
when the build did not.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform


def read_steps(work: str) -> list[dict]:
    steps = []
    path = os.path.join(work, "steps.tsv")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    steps.append({"step": parts[0], "status": parts[1], "seconds": float(parts[2]),
                                  "limit_s": int(parts[3]), "note": parts[4] if len(parts) > 4 else ""})
    return steps


def log_of(work: str, step: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(work, "logs", f"*-{step}.log")))
    return hits[0] if hits else None


def tail(path: str | None, n: int = 30) -> str:
    if not path or not os.path.exists(path):
        return "(no log)"
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:]).rstrip()


def fmt(x) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.4g}"
    return str(x)


def targets_from(benches: dict) -> list[tuple[str, str, str, str]]:
    """(what, value, target, verdict) rows for the targets of issue #13 that the benchmarks measured."""
    rows = []
    ck = benches.get("checkpoint", {})
    for name, t in ck.get("config", {}).get("targets", {}).items():
        rows.append((f"checkpoint: {name}", fmt(t["value"]), t["target"], "met" if t["met"] else "MISSED"))
    st = benches.get("startup", {}).get("results", {})
    comp = st.get("compile_s[device=cuda]")
    if comp and comp.get("cold"):
        gain = 100 * (1 - comp["warm"] / comp["cold"])
        rows.append(("startup: warm compile (Triton kernels from the cache) vs cold", f"{gain:.1f} % faster",
                     ">= 50 %", "met" if gain >= 50 else "MISSED"))
    rec = st.get("recompiles[device=cuda]")
    if rec is not None:
        rows.append(("startup: recompiles in the first 10 real steps", fmt(rec.get("ettkit")), "0",
                     "met" if rec.get("ettkit") == 0 else "MISSED"))
    ett = benches.get("ett_overhead", {}).get("results", {})
    for key, v in ett.items():
        if key.startswith("timer_vs_host_pct"):
            pct = v["ettkit"]
            rows.append((f"ett: CUDA-event time / host time around a synchronised matmul chain {key[key.index('['):]}",
                         f"{pct:.1f} %", "90-100 %", "met" if 90 <= pct <= 100.5 else "MISSED"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wall-s", type=float, default=0.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    steps = read_steps(args.work)
    probe = {}
    if os.path.exists(os.path.join(args.work, "probe.json")):
        with open(os.path.join(args.work, "probe.json")) as f:
            probe = json.load(f)
    benches = {}
    for path in sorted(glob.glob(os.path.join(args.work, "bench", "*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
            name = doc.get("benchmark", os.path.basename(path)[:-5])
            # A second run of one benchmark (checkpoint_batched.json: ETTKIT_CUDA_COPY=batched) by its file name.
            benches[name if name not in benches else os.path.basename(path)[:-5]] = doc
        except (OSError, ValueError) as e:
            benches[os.path.basename(path)[:-5]] = {"error": str(e)}

    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    machine.update({k: v for k, v in probe.items() if k != "executable"})
    results = {}
    for name, doc in benches.items():
        for metric, variants in doc.get("results", {}).items():
            results[f"{name}.{metric}"] = variants
    ok = bool(steps) and all(s["status"] == "passed" for s in steps)
    doc = {
        "benchmark": "gpu_check",
        "machine": machine,
        "config": {"steps": steps, "passed": ok, "wall_s": args.wall_s,
                   "benchmarks": {n: d.get("config", {}) for n, d in benches.items()},
                   "benchmark_machines": {n: d.get("machine", {}) for n, d in benches.items()}},
        "results": results,
    }
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True, default=str)
        f.write("\n")

    gpu = probe.get("gpu") or "no CUDA device"
    lines = [
        f"# ettkit GPU check: {'PASSED' if ok else 'FAILED'}",
        "",
        f"- device: {gpu}" + (f" (capability {probe.get('capability')}, {probe.get('memory_GiB')} GiB, "
                              f"NCCL {probe.get('nccl')})" if probe.get("gpu") else ""),
        f"- torch {probe.get('torch', '?')} (CUDA {probe.get('torch_cuda', '?')}), Python {probe.get('python', '?')}, "
        f"{machine['platform']}, {machine['cpus']} CPUs",
        f"- wall time {args.wall_s:.0f} s",
        "",
        "## Steps",
        "",
        "| step | status | seconds | limit | note |",
        "|---|---|---|---|---|",
    ]
    for s in steps:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']:.1f} | {s['limit_s']} | {s['note']} |")
    rows = targets_from(benches)
    if rows:
        lines += ["", "## Targets", "", "| what | value | target | verdict |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    if results:
        lines += ["", "## Benchmark results", "", "| metric | variants |", "|---|---|"]
        for metric, variants in results.items():
            cells = ", ".join(f"{k}={fmt(v)}" for k, v in variants.items()) if isinstance(variants, dict) else fmt(variants)
            lines.append(f"| `{metric}` | {cells} |")
    failed = [s for s in steps if s["status"] != "passed"]
    if failed:
        lines += ["", "## What failed", ""]
        for s in failed:
            lines += [f"### {s['step']}: {s['status']} {s['note']}", "", "```",
                      tail(log_of(args.work, s["step"])), "```", ""]
    lines += ["", "Every step's full log, the benchmarks' JSON and the CMake and JUnit files: logs.tar.gz."]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"gpu_report: {os.path.join(args.out, 'gpu.json')}, {os.path.join(args.out, 'summary.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
