"""The ETT report at scale: `python -m ettkit report` on a 10^6-step ledger (with --json, with --trace) and
on a ledger of many attempts, each run under /usr/bin/time -v for wall time and peak RSS.

The step ledger puts a 1 ms gap after every step, so that every step is a segment of its own on the rank
and on the job timeline (the worst case for the trace: 4 million events), with a heartbeat every 100 steps
and a checkpoint (blocking and persist) every 1,000. The attempts ledger has N attempts of 5 steps, each
killed, with a restore and a gap before the next.

  .venv/bin/python benchmarks/ett_report_scale.py [--steps N] [--attempts N] [--repeat N] [--baseline-pythonpath DIR]
      [--quick] [--json PATH]

--quick (what `make bench` runs): 100,000 steps and 2,000 attempts, a tenth of the default sizes.

Each case also runs with ETTKIT_LEDGER_FULL_PARSER=1 ("full parser": every ledger line through the full JSON
parser instead of the fast scanner). `--baseline-pythonpath` runs the same commands with another ettkit build first on PYTHONPATH (a copy of
an installed `ettkit` package), so that the baseline and this build are measured in one session.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

T0 = 1_700_000_000_000_000


def write_step_ledger(run_dir: str, steps: int) -> None:
    os.makedirs(os.path.join(run_dir, "ett"), exist_ok=True)
    t = T0
    lines = [json.dumps({"v": 1, "t": "attempt", "attempt": 0, "rank": 0, "world": 1, "ts": t})]
    for n in range(1, steps + 1):
        lines.append('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}' % (n, t, t + 9000))
        t += 10000
        if n % 100 == 0:
            lines.append('{"v":1,"t":"hb","ts":%d}' % t)
        if n % 1000 == 0:
            lines.append('{"v":1,"t":"phase","name":"checkpoint_blocking","b":%d,"e":%d,"step":%d}'
                         % (t - 2000, t, n))
            lines.append('{"v":1,"t":"bg","name":"checkpoint_persist","b":%d,"e":%d,"step":%d}'
                         % (t, t + 50000, n))
    lines.append('{"v":1,"t":"end","ts":%d,"status":"clean","detail":""}' % t)
    with open(os.path.join(run_dir, "ett", "rank-0.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")


def write_attempts_ledger(run_dir: str, attempts: int) -> None:
    os.makedirs(os.path.join(run_dir, "ett"), exist_ok=True)
    t, n, lines = T0, 0, []
    for a in range(attempts):
        lines.append(json.dumps({"v": 1, "t": "attempt", "attempt": a, "rank": 0, "world": 1, "ts": t}))
        lines.append('{"v":1,"t":"phase","name":"checkpoint_restore","b":%d,"e":%d}' % (t, t + 1000))
        t += 1000
        n = max(0, n - 2)  # re-trains the last two steps
        for _ in range(5):
            n += 1
            lines.append('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}' % (n, t, t + 10000))
            t += 10000
        lines.append('{"v":1,"t":"hb","ts":%d}' % (t + 500))
        t += 2000  # killed: no end record, then a gap (detect_and_teardown)
    with open(os.path.join(run_dir, "ett", "rank-0.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")


def timed_cli(args: list[str], pythonpath: str | None, extra_env: dict | None = None) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds (user + sys), peak RSS in MB) of `python -m ettkit report ARGS`, from
    /usr/bin/time -v. On a shared machine the CPU time is the steadier figure: wall time grows with load."""
    env = dict(os.environ, **(extra_env or {}))
    if pythonpath:
        import torch

        env["PYTHONPATH"] = pythonpath
        env["LD_LIBRARY_PATH"] = os.path.join(os.path.dirname(torch.__file__), "lib")
    p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "ettkit", "report", *args],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, check=True)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    h, m, sec = wall.groups()
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", p.stderr).group(1))
              for kind in ("User", "System"))
    return int(h or 0) * 3600 + int(m) * 60 + float(sec), cpu, rss_kb / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--attempts", type=int, default=20_000)
    p.add_argument("--baseline-pythonpath", metavar="DIR")
    p.add_argument("--repeat", type=int, default=1, help="runs per case and variant, alternating; medians shown")
    p.add_argument("--quick", action="store_true", help="a tenth of the default sizes (unless given)")
    p.add_argument("--json", help="also write the results here (make bench: build/bench/ett_report_scale.json)")
    args = p.parse_args()
    if args.quick:
        args.steps = args.steps if args.steps != p.get_default("steps") else 100_000
        args.attempts = args.attempts if args.attempts != p.get_default("attempts") else 2_000
    metrics: dict = {}
    with tempfile.TemporaryDirectory(prefix="ettkit-report-scale-") as tmp:
        steps_run, attempts_run = os.path.join(tmp, "steps"), os.path.join(tmp, "attempts")
        write_step_ledger(steps_run, args.steps)
        write_attempts_ledger(attempts_run, args.attempts)
        cases = [
            (f"{args.steps} steps, --json", [steps_run, "--json"]),
            (f"{args.steps} steps, --trace", [steps_run, "--trace", os.path.join(tmp, "trace.json")]),
            (f"{args.attempts} attempts, --json", [attempts_run, "--json"]),
        ]
        # "full parser": this build reading every ledger line with the full JSON parser (the fast scanner's
        # reference), measured beside it in the same run.
        variants = [("baseline", args.baseline_pythonpath, None)] if args.baseline_pythonpath else []
        variants += [("full parser", None, {"ETTKIT_LEDGER_FULL_PARSER": "1"}), ("this build", None, None)]
        print(f"{'case':<34} {'variant':<11} {'wall s':>7} {'CPU s':>7} {'peak RSS MB':>12}")
        for label, cli_args in cases:
            runs = {name: [] for name, _, _ in variants}
            for _ in range(args.repeat):
                for name, path, extra_env in variants:
                    runs[name].append(timed_cli(cli_args, path, extra_env))
            for name, results in runs.items():
                wall, cpu, rss = (statistics.median(col) for col in zip(*results))
                print(f"{label:<34} {name:<11} {wall:7.2f} {cpu:7.2f} {rss:12.0f}", flush=True)
                for metric, value in (("wall_s", wall), ("cpu_s", cpu), ("peak_rss_MB", rss)):
                    metrics.setdefault(f"{metric}[{label}]", {})[name] = value
    if args.json:
        write_json(args.json, "ett_report_scale", {"steps": args.steps, "attempts": args.attempts,
                                                   "repeat": args.repeat}, metrics)


if __name__ == "__main__":
    main()
