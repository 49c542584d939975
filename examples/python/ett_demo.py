"""`make demo`: an instrumented 2-rank training job, killed once and restarted by torchrun, then its ETT report.

What happens:
  1. torchrun starts examples/python/ett_train.py on 2 CPU ranks (gloo DDP) with --max-restarts=1.
  2. At step --crash-at-step of the first attempt, rank 1 SIGKILLs itself. torchrun tears the job down and
     restarts both ranks, which resume from the last checkpoint and re-train the steps after it.
  3. `python -m ettkit report` turns the two ranks' ledgers into the ETT report: printed as a table here,
     and written as report.json, a Chrome trace, a Prometheus file and a timeline plot into --out.

    python examples/python/ett_demo.py --out build/demo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/demo")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--crash-at-step", type=int, default=220)
    p.add_argument("--step-sleep", type=float, default=0.02, help="extra seconds per step (a visible timeline)")
    args = p.parse_args()

    t_prepare = time.time()
    out = os.path.abspath(args.out)
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    # A scheduler would hand the job its queue and allocation times; this demo has no scheduler, so it
    # reports its own preparation (clearing the run directory) as hardware setup. The report then counts the
    # time from there to each worker's exec as the launcher's start-up (worker_spawn: torchrun, rendezvous).
    env = dict(os.environ, OMP_NUM_THREADS="1",
               ETTKIT_LAUNCHER_PHASES=json.dumps({"hardware_setup": [t_prepare, time.time()]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
           "--max-restarts=1", "--monitor-interval=0.2", os.path.join(HERE, "ett_train.py"), "--run-dir", run_dir,
           "--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every), "--crash-at-step",
           str(args.crash_at_step), "--crash-rank", "1", "--step-sleep", str(args.step_sleep)]
    print(f"demo: training {args.steps} steps on 2 ranks; rank 1 is killed at step {args.crash_at_step} "
          f"(checkpoints every {args.ckpt_every}); torchrun restarts the job once", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(out, "torchrun.log"), "w") as f:
        f.write(proc.stdout)
    print(f"demo: torchrun finished with exit code {proc.returncode} in {time.time() - t0:.1f} s "
          f"(log: {os.path.join(out, 'torchrun.log')})", flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
        return proc.returncode

    report_cmd = [sys.executable, "-m", "ettkit", "report", run_dir, "--trace", os.path.join(out, "trace.json"),
                  "--prometheus", os.path.join(out, "ett.prom"), "--plot", os.path.join(out, "ett.png")]
    subprocess.run(report_cmd, check=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        subprocess.run([sys.executable, "-m", "ettkit", "report", run_dir, "--json"], stdout=f, check=True)
    print(f"\ndemo: wrote {out}/report.json, trace.json (open in https://ui.perfetto.dev), ett.prom, ett.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
