"""`make demo`: the plain PyTorch way against ettkit, on one sharded recommendation job with one crash.

What happens (docs/demo.md):
  1. The driver writes synthetic click logs into OUT/data (once; reused while the config is unchanged).
  2. For each arm, torchrun starts examples/python/demo/train.py on 2 CPU ranks (gloo) with
     --max-restarts=1: a DLRM-like model whose embedding tables are sharded row-wise and table-wise,
     trained from the click logs through DataLoader workers, checkpointed every K steps. At a fixed step
     of the first attempt rank 1 SIGKILLs itself; torchrun restarts both ranks, which restore the last
     checkpoint and finish the job.
       baseline: all_gather_object shard metadata, serial start-up with torch.compile after the first
                 batch, synchronous torch.save checkpoints;
       ettkit:   ShardingPlan + local metadata build, overlapped_start with a CompileCache, AsyncCheckpointer.
     Both arms record their phases with the ETT recorder.
  3. `python -m ettkit report` turns each arm's ledgers into OUT/<arm>/report.json (the --json object),
     report.txt, trace.json (Chrome trace), ett.prom (Prometheus) and ett.png; the driver prints the two
     reports side by side.

    python examples/python/ett_demo.py --out build/demo            # the full demo (< 5 minutes on 2 cores)
    python examples/python/ett_demo.py --out /tmp/demo --quick     # the reduced size CI runs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import secrets
import shutil
import site
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "demo")
sys.path.insert(0, DEMO)

from clicklogs import write_click_logs
from save_calls import read as read_save_calls

ARMS = ("baseline", "ettkit")
# The ettkit arm runs a second job of the same model after the first, in OUT/ettkit-job2: its first start
# loads the graphs the first job compiled from the compile cache they share (OUT/compile-cache-shared).
SECOND_JOB = "ettkit-job2"

FULL = {
    "world_size": 2,
    "batch_size": 1024,
    "steps": 600,
    "ckpt_every": 100,
    "ckpt_every_memory": 20,  # the ettkit arm's memory tier, with --same-host-restart only
    "crash_at_step": 380,
    "crash_rank": 1,
    "embedding_dim": 32,
    "tables": [
        {"name": "user_id", "rows": 1_500_000, "sharding": "row_wise", "skew": 3.0, "signal": 0.8},
        {"name": "item_id", "rows": 1_000_000, "sharding": "row_wise", "skew": 3.0, "signal": 0.8},
        {"name": "ad_id", "rows": 400_000, "sharding": "row_wise", "skew": 3.0, "signal": 0.8},
        {
            "name": "campaign",
            "rows": 100_000,
            "sharding": "table_wise",
            "rank": 1,
            "skew": 3.0,
            "signal": 1.0,
        },
        {"name": "site", "rows": 20_000, "sharding": "table_wise", "rank": 0, "skew": 2.0, "signal": 1.0},
        {"name": "category", "rows": 2_000, "sharding": "table_wise", "rank": 1, "skew": 2.0, "signal": 1.2},
    ],
    "bottom_mlp": [256, 128],
    "top_mlp": [256, 128],
    "lr_embeddings": 0.05,
    "lr_dense": 0.005,
    "part_batches": 64,
    "shuffle_batches": 8,
    "num_workers": 1,
    "log_every": 50,
    "seed": 0,
    "fresh_node_per_attempt": True,
}

QUICK = copy.deepcopy(FULL)
QUICK.update(
    {
        "batch_size": 512,
        "steps": 200,
        "ckpt_every": 40,
        "ckpt_every_memory": 8,
        "crash_at_step": 150,
        "bottom_mlp": [64],
        "top_mlp": [64],
        "part_batches": 40,
        "shuffle_batches": 8,
        "log_every": 25,
    }
)
for _t, _rows in zip(QUICK["tables"], (200_000, 100_000, 50_000, 20_000, 5_000, 1_000)):
    _t["rows"] = _rows


def check_config(cfg: dict) -> None:
    assert cfg["part_batches"] % cfg["shuffle_batches"] == 0, "a shuffle block must not span two part files"
    assert 0 < cfg["crash_at_step"] < cfg["steps"] and cfg["crash_at_step"] % cfg["ckpt_every"] != 0
    assert cfg["bottom_mlp"] and cfg["embedding_dim"] > 0


def run_arm(
    arm: str, out: str, cfg_path: str, data_dir: str, cfg: dict, log, job: str | None = None, shared_dir=None
) -> dict:
    """Runs one job of ``arm`` under torchrun into OUT/<job> (``job`` defaults to the arm's name) and returns
    its report. ``shared_dir``: the ettkit arm's shared compile cache (its secret in the environment)."""
    job = job or arm
    arm_dir = os.path.join(out, job)
    t_prepare = time.time()
    load_before = os.getloadavg()[0]
    shutil.rmtree(arm_dir, ignore_errors=True)
    run_dir = os.path.join(arm_dir, "run")
    os.makedirs(run_dir)
    # A scheduler would hand the job its allocation; here the driver's preparation of the run directory
    # stands for it (hardware_setup). The report counts the time from there to each worker's exec as the
    # launcher's start-up (torchrun, rendezvous).
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        ETTKIT_LAUNCHER_PHASES=json.dumps({"hardware_setup": [t_prepare, time.time()]}),
    )
    # The workers must import the same ettkit as this process (e.g. a PYTHONPATH build).
    import ettkit

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(ettkit.__file__)))
    if pkg_root not in site.getsitepackages():
        env["PYTHONPATH"] = os.pathsep.join(
            [pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={cfg['world_size']}",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        os.path.join(DEMO, "train.py"),
        "--arm",
        arm,
        "--config",
        cfg_path,
        "--run-dir",
        run_dir,
        "--data-dir",
        data_dir,
    ]
    if shared_dir is not None:
        cmd += ["--shared-dir", shared_dir, "--job", job]
    log(
        f"demo: [{job}] torchrun, {cfg['world_size']} ranks, {cfg['steps']} steps; rank {cfg['crash_rank']} is "
        f"killed at step {cfg['crash_at_step']}"
    )
    t0 = time.time()
    log_path = os.path.join(arm_dir, "torchrun.log")
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        for line in proc.stdout:
            logf.write(line)
            # Progress: the trainer's own lines, and torchrun's notice of the failure.
            if line.startswith(("[baseline", "[ettkit")) or "exitcode" in line:
                log("  " + line.rstrip()[:160])
        rc = proc.wait()
    wall = time.time() - t0
    log(f"demo: [{job}] torchrun exited with {rc} after {wall:.1f} s (log: {log_path})")
    if rc != 0:
        with open(log_path) as f:
            sys.stderr.write(f.read()[-6000:])
        raise SystemExit(f"demo: the {job} job failed (exit code {rc})")

    report = [sys.executable, "-m", "ettkit", "report", run_dir]
    with open(os.path.join(arm_dir, "report.json"), "w") as f:
        subprocess.run(report + ["--json"], stdout=f, check=True, env=env)
    with open(os.path.join(arm_dir, "report.txt"), "w") as f:
        subprocess.run(
            report
            + ["--trace", os.path.join(arm_dir, "trace.json"), "--plot", os.path.join(arm_dir, "ett.png")]
            + ["--prometheus", os.path.join(arm_dir, "ett.prom")],
            stdout=f,
            check=True,
            env=env,
        )
    with open(os.path.join(arm_dir, "report.json")) as f:
        rep = json.load(f)
    rep["_wall_s"] = wall
    # The 1-minute load average before and after the job: a single save's wall time on a busy machine
    # includes waiting for a core, so the save rows read with it.
    rep["_load"] = (load_before, os.getloadavg()[0])
    rep["_env"] = env  # the environment `python -m ettkit` ran in (the comparison plot runs it again)
    rep["_save_blocking"] = save_blocking(os.path.join(run_dir, "ett", "rank-0.jsonl"))
    rep["_saves"] = len(rep["_save_blocking"])
    rep["_save_calls"] = read_save_calls(run_dir)
    return rep


def save_blocking(ledger: str) -> dict:
    """(attempt, step) -> seconds the save of that step blocked training, from rank 0's checkpoint_blocking
    records: the save() call and, when its copies were still running, the optimizer's pre-hook wait (a second
    record of the same step). The report's checkpoints.count counts records, not saves."""
    saves: dict = {}
    attempt = -1
    with open(ledger) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("t") == "attempt":
                attempt += 1
            # both tiers: a memory-tier save's record is "checkpoint_blocking/memory" (--same-host-restart)
            elif r.get("t") == "phase" and r.get("name", "").split("/")[0] == "checkpoint_blocking":
                key = (attempt, r.get("step"))
                saves[key] = saves.get(key, 0.0) + (r["e"] - r["b"]) / 1e6
    return saves


def _first_and_rest(values: dict) -> tuple[dict, list]:
    """{(attempt, step): value} -> ({attempt: its first save's value}, [every later save's value])."""
    firsts, rest = {}, []
    for (attempt, _), v in sorted(values.items()):
        if attempt in firsts:
            rest.append(v)
        else:
            firsts[attempt] = v
    return firsts, rest


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def first_saves_against_the_rest(saves: dict) -> str:
    """The first save of each attempt, and the median of the others, in ms of wall time (what training
    waited): whether the first save of an attempt blocks like the rest. On a busy machine a single save's
    wall time also counts the caller waiting for a core: first_save_cpu_against_the_rest tells that apart."""
    firsts, rest = _first_and_rest(saves)
    if not rest:
        return "-"
    med = statistics.median(rest)
    ratio = max(firsts.values()) / med if med > 0 else float("inf")
    return f"{', '.join(_ms(s) for s in firsts.values())} / {_ms(med)} ms ({ratio:.1f}x)"


def first_save_cpu_against_the_rest(calls: list) -> str:
    """The same first saves in the calling thread's CPU time (train.py's save-calls records), over the
    median of the later calls: the save's own work, which waiting for a core does not inflate, so a ratio
    near 1 here beside a high wall-clock one is a busy machine, not first-time work. "+N mod" when a first
    save imported modules."""
    cpu = {(c["attempt"], c["step"]): c["cpu_s"] for c in calls}
    firsts, rest = _first_and_rest(cpu)
    if not rest:
        return "-"
    med = statistics.median(rest)
    ratio = max(firsts.values()) / med if med > 0 else float("inf")
    mods = sum(c["modules"] for c in calls if (c["attempt"], c["step"]) in _first_keys(cpu))
    extra = f", +{mods} mod" if mods else ""
    return f"{', '.join(_ms(s) for s in firsts.values())} / {_ms(med)} ms ({ratio:.1f}x{extra})"


def _first_keys(values: dict) -> set:
    seen, keys = set(), set()
    for attempt, step in sorted(values):
        if attempt not in seen:
            seen.add(attempt)
            keys.add((attempt, step))
    return keys


def _fmt(v, unit="", digits=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def side_by_side(reps: dict) -> list:
    """The reports as columns, one row per figure: the baseline, the first ettkit job and, when it ran, the
    second ettkit job of the same model (its first start from the shared compile cache)."""
    from ettkit.ett import format_duration  # a sub-millisecond save reads 0.43 ms, not 0.000 s

    def ph(name):
        return lambda r: r["phases"].get(name, 0.0)

    def tts(i):
        return lambda r: r["attempts"][i]["time_to_start_s"] if len(r["attempts"]) > i else None

    def per_save(r):
        return (
            f"{r['_saves']} / {format_duration(r['checkpoint_blocking_s']['measured'] / max(r['_saves'], 1))}"
        )

    def ms(r):
        return r["steps"]["median_step_s"] * 1e3 if r["steps"]["median_step_s"] else None

    rows = [
        ("ETT %", lambda r: r["ett_pct"], "%", 2),
        ("idle %", lambda r: r["idle_pct"], "%", 2),
        ("failure %", lambda r: r["failure_pct"], "%", 2),
        ("unattributed %", lambda r: r["unattributed_pct"], "%", 2),
        ("E2E", lambda r: r["e2e_s"], " s", 1),
        ("effective training", lambda r: r["effective_s"], " s", 1),
        ("attempts / failures", lambda r: f"{len(r['attempts'])} / {r['failures']}", "", 0),
        ("Time to Start (attempt 0)", tts(0), " s", 1),
        ("Time to Start (restart)", tts(1), " s", 1),
        ("Time to Recover", lambda r: (r["time_to_recover_s"] or [None])[0], " s", 1),
        ("  detect_and_teardown", ph("detect_and_teardown"), " s", 2),
        ("compile (job timeline)", ph("compile"), " s", 1),
        ("  graphs of attempt 0 from", lambda r: _graph_source(r), "", 0),
        ("checkpoint_restore (job timeline)", ph("checkpoint_restore"), " s", 2),
        ("checkpoint blocking", lambda r: r["checkpoint_blocking_s"]["measured"], " s", 2),
        ("  saves / blocking per save", per_save, "", 0),
        (
            "  first save per attempt / median",
            lambda r: first_saves_against_the_rest(r["_save_blocking"]),
            "",
            0,
        ),
        (
            "  same, the caller's thread CPU",
            lambda r: first_save_cpu_against_the_rest(r.get("_save_calls", [])),
            "",
            0,
        ),
        ("  load average (1 min), job start / end", lambda r: "{:.2f} / {:.2f}".format(*r["_load"]), "", 0),
        ("  median durable latency", lambda r: r["checkpoints"]["durable_latency_median_s"], " s", 2),
        ("unsaved training (re-done)", lambda r: r["unsaved_training_s"]["measured"], " s", 1),
        (
            "steps effective / re-trained",
            lambda r: f"{r['steps']['effective']} / {r['steps']['retrained']}",
            "",
            0,
        ),
        ("median step", ms, " ms", 1),
        ("recommended interval", lambda r: r["recommended_interval_s"], " s", 1),
        ("  in steps", lambda r: (r["recommendation"] or {}).get("interval_steps"), "", 0),
        ("driver wall time (torchrun)", lambda r: r["_wall_s"], " s", 1),
    ]
    columns = [(COLUMN_TITLES.get(job, job), rep) for job, rep in reps.items()]
    cells = [[_fmt(value(rep), unit, digits) for _, rep in columns] for _, value, unit, digits in rows]
    width = max(16, *(len(title) for title, _ in columns), *(len(c) for row in cells for c in row))
    out = []
    w0 = max(len(r[0]) for r in rows)
    out.append(f"{'':{w0}}" + "".join(f"  {title:>{width}}" for title, _ in columns))
    out.append("-" * w0 + "".join("  " + "-" * width for _ in columns))
    for (name, *_), row in zip(rows, cells):
        out.append(f"{name:{w0}}" + "".join(f"  {c:>{width}}" for c in row))
    return out


COLUMN_TITLES = {"ettkit": "ettkit (job 1)", SECOND_JOB: "ettkit (job 2)"}


def _graph_source(rep: dict) -> str:
    """Where attempt 0's compiled graphs came from (the start's ``compile_cache`` note), shortened to fit a
    column: "compiled" for a miss, "precompiled (shared)" for the shared cache; "-" for the baseline."""
    note = rep["attempts"][0].get("notes", {}).get("compile_cache")
    if note is None:
        return "-"
    if note.startswith("precompiled (shared"):
        return "precompiled (shared)"
    return "compiled" if note == "miss" else note


def first_batch_s(out: str, job: str, rep: dict) -> float | None:
    """Attempt 0's time from its allocation to the moment every rank held its first real batch (the end of
    the latest get_first_batch_data of attempt 0 in the ranks' ledgers), on the report's Time to Start axis:
    the data pipeline's share of the start, which a start that compiles nothing cannot beat."""
    a0 = rep["attempts"][0]
    if a0["time_to_start_s"] is None or a0["first_training_us"] is None:
        return None
    ends = []
    for rank in rep["ranks"]:
        attempt = -1
        with open(os.path.join(out, job, "run", "ett", f"rank-{rank}.jsonl")) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by the kill
                if rec.get("t") == "attempt":
                    attempt += 1
                elif attempt == 0 and rec.get("t") == "phase" and rec.get("name") == "get_first_batch_data":
                    ends.append(rec["e"])
    if not ends:
        return None
    return a0["time_to_start_s"] - (a0["first_training_us"] - max(ends)) / 1e6


def second_job_verdict(out: str, reps: dict, cfg: dict) -> str:
    """The second ettkit job against the first: its ETT, its attempt-0 Time to Start against the arrival of
    its first real batch, where its graphs came from, and whether it trained bit for bit as the first."""
    first, second = reps["ettkit"], reps[SECOND_JOB]
    tts = second["attempts"][0]["time_to_start_s"]
    batch = first_batch_s(out, SECOND_JOB, second)
    same, why = bitwise_equal_losses(out, "ettkit", SECOND_JOB, cfg)
    ratio = f" = {tts / batch:.2f}x" if tts and batch else ""
    return (
        f"second ettkit job of the same model: ETT% {second['ett_pct']:.1f}% (the first job: "
        f"{first['ett_pct']:.1f}%); Time to Start {_fmt(tts, ' s')} (the first job: "
        f"{_fmt(first['attempts'][0]['time_to_start_s'], ' s')}) against its first real batch at "
        f"{_fmt(batch, ' s')}{ratio}; graphs: {second['attempts'][0]['notes'].get('compile_cache', '-')}; "
        f"losses {'bit-identical to' if same else 'DIFFER from'} the first job's ({why})"
    )


def bitwise_equal_losses(out: str, first: str, second: str, cfg: dict) -> tuple[bool, str]:
    """Whether two jobs trained the same: every rank's loss of every step (the last attempt's, for the steps
    a restart trained again) equal bit for bit, from the trainers' losses-rank-<r>.txt. Returns (equal, why)."""
    for rank in range(cfg["world_size"]):
        runs = [
            read_losses(os.path.join(out, job, "run", f"losses-rank-{rank}.txt")) for job in (first, second)
        ]
        for job, losses in zip((first, second), runs):
            missing = sorted(set(range(1, cfg["steps"] + 1)) - set(losses))
            if missing:
                return False, f"{job} rank {rank} has no loss for steps {missing[:5]}"
        for step in range(1, cfg["steps"] + 1):
            if runs[0][step] != runs[1][step]:
                return (
                    False,
                    f"rank {rank} step {step}: {runs[0][step]} in {first}, {runs[1][step]} in {second}",
                )
    return True, f"{cfg['steps']} steps x {cfg['world_size']} ranks bit-identical"


def read_losses(path: str) -> dict:
    """step -> loss (float.hex) of one rank's losses file; a later attempt's line for a step replaces an
    earlier one (the restart trained it again). A line torn by the kill is skipped."""
    losses = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and line.endswith("\n"):
                losses[int(parts[1])] = parts[2]
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/demo")
    p.add_argument("--quick", action="store_true", help="the reduced size (CI): smaller tables, fewer steps")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of baseline,ettkit")
    p.add_argument(
        "--one-ettkit-job",
        action="store_true",
        help="run the ettkit arm once (no second job of the same model from the shared compile cache)",
    )
    p.add_argument(
        "--same-host-restart",
        action="store_true",
        help="keep each rank's local Inductor cache across attempts (a restart on the same host)",
    )
    args = p.parse_args(argv)
    t_start = time.time()

    def log(msg):
        print(msg, flush=True)

    cfg = copy.deepcopy(QUICK if args.quick else FULL)
    cfg["fresh_node_per_attempt"] = not args.same_host_restart
    check_config(cfg)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    data_dir = os.path.join(out, "data")
    if not write_click_logs(data_dir, cfg, log=log):
        log(f"demo: reusing the click logs in {data_dir}")

    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"--arms: {', '.join(unknown)} is not an arm; valid: {', '.join(ARMS)}")
    jobs = []  # (arm, job): the ettkit arm runs twice, its second job warm from the first one's compile
    for arm in arms:
        jobs += [(arm, arm)] + ([(arm, SECOND_JOB)] if arm == "ettkit" and not args.one_ettkit_job else [])
    shared_dir = None
    if "ettkit" in arms:
        # The compile cache the ettkit jobs share, empty at the start so that the first job compiles. Its files
        # carry an HMAC keyed by a secret every job that uses it holds: this run's own, unless one is set.
        shared_dir = os.path.join(out, "compile-cache-shared")
        shutil.rmtree(shared_dir, ignore_errors=True)
        os.makedirs(shared_dir, mode=0o700)
        os.environ.setdefault("ETTKIT_COMPILE_CACHE_SECRET", secrets.token_hex(32))
    reps = {}
    for arm, job in jobs:
        reps[job] = run_arm(
            arm,
            out,
            cfg_path,
            data_dir,
            cfg,
            log,
            job=job,
            shared_dir=shared_dir if arm == "ettkit" else None,
        )
    if set(arms) != set(ARMS):
        return 0
    lines = side_by_side(reps)
    b, e = reps["baseline"]["ett_pct"], reps["ettkit"]["ett_pct"]
    rb, re_ = reps["baseline"], reps["ettkit"]
    verdict = [
        (
            f"verdict: ETT% {e:.1f}% with ettkit against {b:.1f}% the plain PyTorch way ({e - b:+.1f} points), "
            f"E2E {re_['e2e_s']:.1f} s against {rb['e2e_s']:.1f} s for the same {cfg['steps']} steps; "
            f"Time to Recover {re_['time_to_recover_s'][0]:.1f} s against {rb['time_to_recover_s'][0]:.1f} s, "
            f"checkpoint blocking {re_['checkpoint_blocking_s']['measured']:.1f} s against "
            f"{rb['checkpoint_blocking_s']['measured']:.1f} s"
        ),
    ]
    if SECOND_JOB in reps:
        verdict.append(second_job_verdict(out, reps, cfg))
    summary = "\n".join(
        ["", "ETT reports, side by side (python -m ettkit report <job>/run):", *lines, "", *verdict]
    )
    log(summary)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary.lstrip("\n") + "\n")
    # Both arms in one picture, on one time axis: the shorter E2E and each phase's length compare by eye.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ettkit",
            "report",
            os.path.join(out, "baseline", "run"),
            "--plot",
            os.path.join(out, "compare.png"),
            "--plot-with",
            os.path.join(out, "ettkit", "run"),
        ],
        stdout=subprocess.DEVNULL,
        check=True,
        env=reps["ettkit"]["_env"],
    )
    log(
        f"\ndemo: wrote {out}/<job>/report.json, report.txt, trace.json (open in https://ui.perfetto.dev) and "
        f"ett.png for {', '.join(reps)}, and {out}/compare.png (both arms on one time axis); "
        f"total {time.time() - t_start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
