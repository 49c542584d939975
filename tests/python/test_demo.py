"""`make demo` in its reduced size: both arms run under torchrun (2 gloo ranks), lose rank 1 to a SIGKILL,
restart once and finish; their ETT reports are consistent, and the ettkit arm blocks less per save and
restarts with a warm compile. The ettkit arm then runs a second job of the same model, whose first start
loads the first job's graphs from the compile cache the two jobs share and trains bit for bit as it.

About 3 minutes on the 2-core CI machine: the baseline compiles its dense part cold in both attempts, the
first ettkit job cold then warm from its own cache, the second ettkit job warm in both attempts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMS = ("baseline", "ettkit")
JOBS = ("baseline", "ettkit", "ettkit-job2")  # OUT/<job>: the second ettkit job starts from the shared cache


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "python", "ett_demo.py"),
            "--quick",
            "--out",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out / "config.json") as f:
        cfg = json.load(f)
    reports = {}
    for job in JOBS:
        with open(out / job / "report.json") as f:
            reports[job] = json.load(f)
    return out, cfg, reports, proc.stdout


@pytest.mark.parametrize("arm", JOBS)
def test_report_is_consistent(demo, arm):
    out, cfg, reports, _ = demo
    r = reports[arm]
    assert r["format_version"] == 1 and r["world_size"] == 2 and r["ranks"] == [0, 1]
    assert abs(r["ett_pct"] + r["idle_pct"] + r["failure_pct"] + r["unattributed_pct"] - 100) <= 0.01
    assert abs(r["effective_s"] + r["idle_s"] + r["failure_s"] + r["unattributed_s"] - r["e2e_s"]) <= 1e-3
    assert abs(sum(r["phases"].values()) - r["e2e_s"]) <= 1e-3
    # One injected failure (rank 1's SIGKILL), two attempts, and the job finished.
    assert len(r["attempts"]) == 2
    assert r["failures"] == 1 and r["failures_by_category"] == {"killed": 1}
    assert r["attempts"][0]["status"] == "killed"
    assert r["attempts"][1]["status"] == "clean"
    assert all(t is not None and t > 0 for t in r["time_to_start_s"]) and len(r["time_to_start_s"]) == 2
    assert len(r["time_to_recover_s"]) == 1 and r["recoveries"][0]["recovered"]
    assert "checkpoint_restore" in r["recoveries"][0]["breakdown"]
    # Every step consumed new data once; the steps after the restored checkpoint were trained twice.
    assert r["steps"]["effective"] == cfg["steps"] and r["steps"]["max_step"] == cfg["steps"]
    every, crash = cfg["ckpt_every"], cfg["crash_at_step"]
    restored = crash // every * every  # the last checkpoint before the kill
    assert r["attempts"][1]["first_step"] == restored + 1
    # Rank 1 flushes its ledger and dies after step `crash`'s all-reduce, before it records that step. Rank 0
    # records it only if it gets there before torchrun tears it down, and a torn-down rank 0 loses what its
    # recorder had not flushed yet (up to flush_interval_s of records; CI saw its last two steps missing). So
    # the step counts, which come from rank 0, are checked against rank 0's own ledger: the report must
    # agree with what the ledger holds, whichever way the race went.
    last_before_kill = r["attempts"][0]["last_step"]  # the highest step any rank recorded
    assert last_before_kill in (crash - 1, crash), last_before_kill
    rank0_high = _high_water_of_attempt_0(out / arm / "run" / "ett" / "rank-0.jsonl")
    assert restored < rank0_high <= last_before_kill, (rank0_high, last_before_kill)
    assert r["steps"]["retrained"] == rank0_high - restored, (r["steps"], rank0_high)
    assert r["unsaved_training_s"]["measured"] == pytest.approx(r["phases"]["wasted_training"])
    assert r["checkpoint_blocking_s"]["measured"] > 0 and r["checkpoints"]["count"] >= cfg["steps"] // every
    assert r["recommended_interval_s"] is not None and r["recommended_interval_s"] > 0
    assert r["unattributed_pct"] < 2.0  # every phase of the trainer is instrumented
    for name in ("report.txt", "trace.json", "ett.png", "ett.prom", "torchrun.log"):
        assert (out / arm / name).stat().st_size > 0, name
    with open(out / arm / "trace.json") as f:
        trace = json.load(f)
    assert any(e.get("name") == "compile" for e in trace["traceEvents"])


def test_arms_differ_only_in_the_runtime(demo):
    out, _, reports, _ = demo
    assert (out / "compare.png").stat().st_size > 0  # both arms on one time axis
    b, e = reports["baseline"], reports["ettkit"]
    assert b["checkpoints"]["interval_source"] == e["checkpoints"]["interval_source"] == "configured_steps"
    assert "compile" in b["phases"] and "compile" in e["phases"]
    # The ettkit arm's saves are asynchronous: only they have a background persist track.
    assert b["checkpoints"]["durable_latency_median_s"] is None
    assert e["checkpoints"]["durable_latency_median_s"] is not None


def _high_water_of_attempt_0(ledger) -> int:
    """The highest step one rank's ledger holds for attempt 0."""
    high, attempt = -1, None
    with open(ledger) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by the kill
            if rec.get("t") == "attempt":
                attempt = rec.get("attempt")
            elif rec.get("t") == "step" and attempt == 0:
                high = max(high, rec["n"])
    return high


def _saves(ledger) -> dict:
    """step -> (blocking intervals, persist interval) of one rank's ledger: the save() call and any later
    wait for its copies (checkpoint_blocking), and the background track from the save() call to durable."""
    saves: dict = {}
    with open(ledger) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("name") == "checkpoint_blocking" and rec.get("t") == "phase":
                saves.setdefault(rec["step"], [[], None])[0].append((rec["b"], rec["e"]))
            elif rec.get("name") == "checkpoint_persist" and rec.get("t") == "bg":
                saves.setdefault(rec["step"], [[], None])[1] = (rec["b"], rec["e"])
    return saves


def test_ettkit_arm_loses_less_time_where_the_runtime_acts(demo):
    """Not `ettkit ETT% > baseline ETT%`, and no ratio of one arm's durations to the other's: the arms run one
    after the other, so CPU contention can land on one arm only (a 21x blocking ratio measured quiet was 1.9x
    under a load of 5 on 2 cores, where the copy threads yield). Checked instead: facts of each run's own
    ledger that hold under any load."""
    out, _, reports, stdout = demo
    b, e = reports["baseline"], reports["ettkit"]
    assert b["checkpoints"]["count"] == e["checkpoints"]["count"] > 0

    # Saves: the ettkit arm's save() returns before its data is written. Per save, from rank 0's ledger: the
    # save() call (its first blocking interval) returns before the save is durable; in all, the blocking (the
    # calls, then the optimizer's waits for the copies) is less than the time the saves took to be durable,
    # since the write and the commit run off the training thread. The baseline writes inside its blocking
    # phase and has no background track (test above).
    saves = _saves(out / "ettkit" / "run" / "ett" / "rank-0.jsonl")
    assert len(saves) == e["checkpoints"]["count"], saves
    blocked = durable = 0
    for step, (blocks, persist) in saves.items():
        assert blocks and persist is not None, (step, blocks, persist)
        assert persist[0] == blocks[0][0], (step, blocks, persist)  # both from the save() call
        assert blocks[0][1] < persist[1], (step, blocks, persist)
        blocked += sum(end - begin for begin, end in blocks)
        durable += persist[1] - persist[0]
    assert blocked < durable, (blocked, durable)
    per_save = {arm: r["checkpoint_blocking_s"]["measured"] / r["checkpoints"]["count"] for arm, r in reports.items()}
    print(f"blocking per save: {per_save} (quiet: 0.015 s against 0.312 s)")

    # The restart: the ettkit arm loads the forward and backward its first attempt precompiled (the
    # CompileCache's precompiled tier) and compiles nothing. Which tier a start took is a fact of the run,
    # not a duration, so load cannot flip it. (Rank 0's lines.)
    log = (out / "ettkit" / "torchrun.log").read_text()
    tiers = re.findall(r"start-up done: .*\bcache (\w+);", log)
    assert tiers == ["miss", "precompiled"], log[-3000:]
    assert "precompiled tier is not used" not in log, log[-3000:]
    assert "ETT %" in stdout and "verdict:" in stdout


def _losses(path) -> dict:
    """step -> loss (float.hex) of one rank's losses file, the last attempt's line winning for the steps a
    restart trained again; a line cut short by the kill is skipped."""
    losses = {}
    for line in path.read_text().splitlines(keepends=True):
        parts = line.split()
        if line.endswith("\n") and len(parts) == 3:
            losses[int(parts[1])] = parts[2]
    return losses


def test_a_second_job_of_the_model_starts_from_the_first_jobs_compile_and_trains_the_same(demo):
    """The second ettkit job runs with its own (empty) compile cache and Inductor directories, as on other
    nodes: its first start loads the graphs the first job compiled from the cache they share, compiles
    nothing, and trains every step of every rank bit for bit as the first job, which compiled cold. Facts of
    the runs, not durations: load cannot flip them."""
    out, cfg, reports, stdout = demo
    first, second = reports["ettkit"], reports["ettkit-job2"]
    host = os.uname().nodename
    # A start that failed has no compile_cache note: the assertion then shows how each attempt ended and the
    # failed stage (notes["start_failed"]) instead of a KeyError.
    def tier(report, attempt):
        a = report["attempts"][attempt]
        return a["notes"].get("compile_cache", f"no note: {a['status']} {a.get('exception_type')} {a['notes']}")

    assert tier(first, 0) == "miss"
    assert tier(second, 0) == f"precompiled (shared, job ettkit on {host})"
    assert tier(second, 1) == "precompiled"  # its restart: its own copy
    log = (out / "ettkit-job2" / "torchrun.log").read_text()
    assert re.findall(r"start-up done: .*\bcache (\w+);", log) == ["precompiled", "precompiled"], log[-3000:]
    assert re.findall(r"recompiles after the first real steps: (\d+)", log) == ["0", "0"], log[-3000:]
    assert "compile/precompile" not in second["substages"], second["substages"]  # nothing compiled
    assert first["substages"].get("compile/precompile", 0) > 0
    for rank in range(cfg["world_size"]):  # each rank's own copy, which its restart loaded
        own = list((out / "ettkit-job2" / "run" / "compile-cache" / f"rank-{rank}").glob("precompiled-*.bin"))
        assert len(own) == 1, own
    shared = list((out / "compile-cache-shared").iterdir())
    assert [p.suffix for p in shared] == [".shared"], shared  # the first job's file, and nothing else
    for rank in range(cfg["world_size"]):
        runs = [_losses(out / job / "run" / f"losses-rank-{rank}.txt") for job in ("ettkit", "ettkit-job2")]
        for losses in runs:
            assert sorted(losses) == list(range(1, cfg["steps"] + 1)), rank
        assert runs[0] == runs[1], rank  # every bit of every step
    assert "second ettkit job of the same model: ETT% " in stdout and "bit-identical" in stdout, stdout[-3000:]


@pytest.mark.parametrize("job", ("ettkit", "ettkit-job2"))
def test_every_save_call_is_measured_and_no_first_save_of_an_attempt_imports_a_module(demo, job):
    """#65: the table's first-save rows read with a thread-CPU column (train.py's save-calls records); one
    record per save of rank 0, each attempt's included, and no ettkit save, the first of an attempt
    included, imports a module (a lazy import is first-time work every attempt pays). Counts, not times."""
    out, _, _, stdout = demo
    calls = [json.loads(line) for line in (out / job / "run" / "save-calls-rank-0.jsonl").read_text().splitlines()]
    steps = sorted(_saves(out / job / "run" / "ett" / "rank-0.jsonl"))
    assert [c["step"] for c in calls] == steps and steps, (calls, steps)
    assert sorted({c["attempt"] for c in calls}) == [0, 1], calls  # the restart's saves too
    assert all(c["cpu_s"] >= 0 and c["wall_s"] >= 0 for c in calls), calls
    assert [c for c in calls if c["modules"]] == [], calls
    assert "same, the caller's thread CPU" in stdout and "load average (1 min), job start / end" in stdout
