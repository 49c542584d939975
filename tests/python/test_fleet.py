"""The fleet report (docs/ett.md, "Fleet report") over 50 run directories: 45 scripted ledgers whose every
number is set by hand (one with garbage lines appended), two written by real Recorders in a child process
(one failed and recovered), one whose Recorder is still open in that live child (running), one empty
directory and one path that does not exist.

Scripted job i (times in seconds; world size (1, 2, 4, 8)[i % 4], compile C = 100 + 10·(i % 5)):
  attempt 0: hardware_setup 60, launcher_init 15, compile C, then 10 s steps with a 3 s checkpoint after
             every 10th step;
  clean (i % 3 != 0):  steps 1..60, shutdown 20, end clean.
                       E2E = 75 + C + 600 + 6·3 + 20 = 713 + C; effective 600; idle 113 + C; failure 0.
  failed (i % 3 == 0): steps 1..25, then killed (i % 6 == 0) or an exception end record (i % 6 == 3);
                       F = 75 + C + 250 + 2·3 = 331 + C. 35 s later attempt 1: scheduling 60,
                       hardware_setup 30, launcher_init 15, checkpoint_restore 20, compile 45, steps 21..60
                       (21..25 re-trained: 50 s), checkpoints at 30..60 (4·3 s), shutdown 20.
                       TTR = 35 + 60 + 30 + 15 + 20 + 45 = 205; TTS of attempt 1 = 205 − 95 = 110;
                       E2E = F + 205 + 400 + 12 + 20 = 968 + C; effective 600; failure 205 + 50 = 255;
                       idle 113 + C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ettkit import ett
from ettkit.__main__ import main
from ettkit.ett.fleet import find_run_dirs, format_fleet, split_phases, write_fleet_plot
from ledger_script import LedgerWriter, us, worked_example

SCRIPTED = 45          # job-00 .. job-44; job-44 also gets garbage lines
STEP = 10.0
CKPT = 3.0

RECORDER_CHILD = """
import sys
from ettkit import ett
failed, clean, running = sys.argv[1:4]
kw = dict(rank=0, world_size=1, launcher_phases_from_env=False)
rec = ett.Recorder(failed, **kw)
with rec.phase("compile"):
    pass
for n in range(1, 4):
    rec.step(n)
rec.close(status="exception", detail="RuntimeError: injected")
with ett.Recorder(failed, **kw) as rec:
    with rec.phase("checkpoint_restore", step=2):
        pass
    for n in range(3, 6):
        rec.step(n)
with ett.Recorder(clean, **kw) as rec:
    for n in range(1, 4):
        rec.step(n)
rec = ett.Recorder(running, heartbeat_s=3600, flush_interval_s=3600, **kw)
rec.step(1)
rec.flush()
print("ready", flush=True)
sys.stdin.readline()  # open, so its attempt is running, until the tests are done
rec.close()
"""


def world(i: int) -> int:
    return (1, 2, 4, 8)[i % 4]


def compile_s(i: int) -> float:
    return 100.0 + 10.0 * (i % 5)


def fails(i: int) -> bool:
    return i % 3 == 0


def write_job(run_dir, i: int, raw_tail: str = "") -> None:
    w = LedgerWriter(run_dir, rank=0, world=world(i))
    w.attempt(0, ts=60)
    w.phase("hardware_setup", 0, 60)
    w.phase("launcher_init", 60, 75)
    t = w.phase("compile", 75, 75 + compile_s(i))

    def train(first: int, last: int, t: float) -> float:
        for n in range(first, last + 1):
            t = w.step(n, t, t + STEP)
            if n % 10 == 0:
                t = w.phase("checkpoint_blocking", t, t + CKPT, step=n)
        return t

    if fails(i):
        t = train(1, 25, t)
        if i % 6 == 0:
            w.rec("hb", ts=us(t))                       # killed: no end record
        else:
            w.rec("end", ts=us(t), status="exception", detail="RuntimeError: boom")
        b = t + 35
        w.attempt(1, ts=b + 60)
        w.phase("scheduling", b, b + 60)
        w.phase("hardware_setup", b + 60, b + 90)
        w.phase("launcher_init", b + 90, b + 105)
        w.phase("checkpoint_restore", b + 105, b + 125, step=20)
        t = w.phase("compile", b + 125, b + 170)
        t = train(21, 60, t)
    else:
        t = train(1, 60, t)
    t = w.phase("shutdown", t, t + 20)
    w.rec("end", ts=us(t), status="clean", detail="")
    w.save(raw_tail)


@pytest.fixture(scope="module")
def fleet_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    dirs = []
    for i in range(SCRIPTED):
        d = root / f"job-{i:02d}"
        write_job(d, i, raw_tail="not json at all\n{\"v\": 1, \"t\": \n" if i == SCRIPTED - 1 else "")
        dirs.append(str(d))
    failed, clean, running = (str(root / f"job-{i:02d}") for i in (45, 46, 47))
    child = subprocess.Popen([sys.executable, "-c", RECORDER_CHILD, failed, clean, running],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        (root / "job-48").mkdir()                          # empty
        dirs += [failed, clean, running, str(root / "job-48"), str(root / "job-49")]  # job-49 does not exist
        yield root, dirs
    finally:
        if child.poll() is None:
            child.stdin.write("\n")
            child.stdin.flush()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


@pytest.fixture(scope="module")
def fleet(fleet_dirs):
    return ett.fleet_report(fleet_dirs[1])


@pytest.fixture(scope="module")
def reports(fleet_dirs):
    """Each readable job's own report: what the fleet must add up."""
    return {d: ett.build_report(d, include_timeline=False) for d in fleet_dirs[1][:48]}


def test_scripted_jobs_report_the_hand_computed_values(reports, fleet_dirs):
    for i in (0, 1, 3):
        r = reports[fleet_dirs[1][i]]
        c = compile_s(i)
        e2e = 968 + c if fails(i) else 713 + c
        assert r["e2e_s"] == pytest.approx(e2e) and r["effective_s"] == pytest.approx(600)
        assert r["idle_s"] == pytest.approx(113 + c) and r["failure_s"] == pytest.approx(255 if fails(i) else 0)
        assert r["world_size"] == world(i)
        assert r["time_to_start_s"] == pytest.approx([75 + c, 110] if fails(i) else [75 + c])
        assert r["time_to_recover_s"] == pytest.approx([205] if fails(i) else [])


def test_weighted_ett_is_the_accelerator_hour_weighted_mean(fleet, reports):
    jobs = list(reports.values())
    weights = [r["world_size"] * r["e2e_s"] for r in jobs]
    expected = 100 * sum(r["ett_pct"] / 100 * w for r, w in zip(jobs, weights)) / sum(weights)
    assert fleet["ett_pct"] == pytest.approx(expected, rel=1e-12)
    assert fleet["accelerator_h"] == pytest.approx(sum(weights) / 3600, rel=1e-12)
    for key in ("idle", "failure", "unattributed"):
        want = 100 * sum(r[f"{key}_pct"] / 100 * w for r, w in zip(jobs, weights)) / sum(weights)
        assert fleet[f"{key}_pct"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert fleet["ett_pct"] + fleet["idle_pct"] + fleet["failure_pct"] + fleet["unattributed_pct"] == \
        pytest.approx(100)
    # The scripted jobs alone, by hand: effective 600 s each, E2E 713 + C or 968 + C.
    scripted = [(world(i), 968 + compile_s(i) if fails(i) else 713 + compile_s(i)) for i in range(SCRIPTED)]
    by_hand = 100 * sum(w * 600 for w, _ in scripted) / sum(w * e for w, e in scripted)
    only = ett.fleet_report(list(reports)[:SCRIPTED])
    assert only["ett_pct"] == pytest.approx(by_hand, rel=1e-12)
    # A plain mean of ETT% would differ: the 8-device jobs weigh 8 times as much.
    assert abs(only["ett_pct"] - np.mean([reports[d]["ett_pct"] for d in list(reports)[:SCRIPTED]])) > 1e-3


def test_job_rows_cover_every_directory_with_status_and_reason(fleet, fleet_dirs, reports):
    root, dirs = fleet_dirs
    assert [j["run_dir"] for j in fleet["jobs"]] == dirs
    assert (fleet["jobs_total"], fleet["jobs_read"], fleet["jobs_running"], fleet["jobs_failed_to_read"]) == \
        (50, 48, 1, 2)
    rows = {os.path.basename(j["run_dir"]): j for j in fleet["jobs"]}
    j0 = rows["job-00"]
    assert j0["status"] == "finished" and j0["last_attempt_status"] == "clean" and j0["world_size"] == 1
    assert j0["e2e_s"] == pytest.approx(1068) and j0["ett_pct"] == pytest.approx(100 * 600 / 1068)
    assert j0["failures"] == 1 and j0["failures_by_category"] == {"killed": 1}
    assert j0["time_to_start_s"] == pytest.approx([175, 110]) and j0["time_to_recover_s"] == pytest.approx([205])
    assert j0["accelerator_h"] == pytest.approx(1068 / 3600)
    assert rows["job-03"]["failures_by_category"] == {"exception:RuntimeError": 1} and rows["job-03"]["world_size"] == 8
    assert rows["job-44"]["corrupt_lines"] == 2 and rows["job-44"]["status"] == "finished"
    assert rows["job-44"]["ett_pct"] == pytest.approx(reports[dirs[44]]["ett_pct"])
    assert rows["job-45"]["failures_by_category"] == {"exception:RuntimeError": 1}
    assert rows["job-47"]["status"] == "running" and rows["job-47"]["failures"] == 0
    assert rows["job-48"]["status"] == "failed_to_read" and "no 'ett/' ledger folder" in rows["job-48"]["reason"]
    assert rows["job-49"]["status"] == "failed_to_read" and "does not exist" in rows["job-49"]["reason"]
    assert rows["job-49"]["ett_pct"] is None and rows["job-49"]["world_size"] is None
    assert fleet["corrupt_lines"] == 2


def test_failures_summed_by_category(fleet):
    killed = sum(1 for i in range(SCRIPTED) if i % 6 == 0)
    raised = sum(1 for i in range(SCRIPTED) if i % 6 == 3) + 1     # + the Recorder job's RuntimeError
    assert fleet["failures_by_category"] == {"exception:RuntimeError": raised, "killed": killed}
    assert fleet["failures"] == killed + raised == 16


def test_tts_and_ttr_percentiles_over_all_attempts(fleet, reports):
    tts = [t for r in reports.values() for t in r["time_to_start_s"]]
    ttr = [rec["total_s"] for r in reports.values() for rec in r["recoveries"] if rec["recovered"]]
    n_failed = sum(1 for i in range(SCRIPTED) if fails(i))
    assert len(tts) == SCRIPTED + n_failed + 3 + 1          # every attempt trained; Recorder jobs: 2 + 1 + 1
    assert len(ttr) == n_failed + 1
    for name, values in (("time_to_start_s", tts), ("time_to_recover_s", ttr)):
        d = fleet[name]
        assert d["count"] == len(values)
        for p in (50, 90, 99):
            assert d[f"p{p}"] == pytest.approx(float(np.percentile(values, p)), rel=1e-12)
        assert d["max"] == pytest.approx(max(values)) and d["mean"] == pytest.approx(np.mean(values))
    # By hand: 15 scripted recoveries of 205 s and one of the Recorder job (milliseconds), so p50 = 205.
    assert fleet["time_to_recover_s"]["p50"] == pytest.approx(205) and fleet["time_to_recover_s"]["unrecovered"] == 0


def test_top_causes_are_ranked_by_accelerator_hours(fleet):
    idle = [c["phase"] for c in fleet["top_causes"]["idle"]]
    failure = [c["phase"] for c in fleet["top_causes"]["failure"]]
    # Per job: compile 100..140 > hardware_setup 60 > shutdown 20 > checkpoint blocking 18 > launcher_init 15.
    assert idle[:5] == ["compile", "hardware_setup", "shutdown", "checkpoint_blocking", "launcher_init"]
    # Per failure: scheduling 60 > re-training 50 > compile 45 > detection 35 > hardware 30 > restore 20 > init 15.
    assert failure[:7] == ["scheduling", "wasted_training", "compile", "detect_and_teardown", "hardware_setup",
                           "checkpoint_restore", "launcher_init"]
    assert fleet["top_causes"]["mixed"] == []
    by = {(b, c["phase"]): c for b in ("idle", "failure") for c in fleet["top_causes"][b]}
    failing = [i for i in range(SCRIPTED) if fails(i)]
    # hardware_setup is mixed in a failed job: 60 s idle at the start, 30 s failure in the recovery.
    assert by["idle", "hardware_setup"]["accelerator_h"] == pytest.approx(sum(world(i) * 60 for i in range(SCRIPTED)) / 3600)
    assert by["failure", "hardware_setup"]["accelerator_h"] == pytest.approx(sum(world(i) * 30 for i in failing) / 3600)
    assert by["failure", "scheduling"]["seconds"] == pytest.approx(60 * len(failing))
    assert by["failure", "scheduling"]["jobs"] == len(failing)
    total_failure_h = sum(c["accelerator_h"] for c in fleet["top_causes"]["failure"])
    assert total_failure_h == pytest.approx(fleet["buckets_accelerator_h"]["failure"], rel=1e-9)
    assert by["failure", "scheduling"]["share_pct"] == pytest.approx(
        100 * by["failure", "scheduling"]["accelerator_h"] / total_failure_h)


def test_mixed_phases_split_by_the_failure_windows(tmp_path):
    worked_example(tmp_path).save()
    r = ett.build_report(tmp_path, include_timeline=False)
    parts = split_phases(r)
    # compile: 900 s at the first start (idle), 300 s in the recovery (its breakdown says so).
    assert parts["idle"]["compile"] == pytest.approx(900) and parts["failure"]["compile"] == pytest.approx(300)
    assert parts["idle"]["launcher_init"] == pytest.approx(180) and parts["failure"]["launcher_init"] == pytest.approx(180)
    assert sum(parts["idle"].values()) == pytest.approx(r["idle_s"])
    assert sum(parts["failure"].values()) == pytest.approx(r["failure_s"])
    # A split that does not add up to the job's buckets is not made: the phase stays whole under "mixed".
    r["recoveries"][0]["breakdown"]["compile"] = 100.0
    parts = split_phases(r)
    assert parts["mixed"] == pytest.approx({"compile": 1200, "hardware_setup": 600, "launcher_init": 360})
    assert "compile" not in parts["idle"] and "compile" not in parts["failure"]


def test_badput_is_summed_when_reports_have_it(fleet, reports):
    # Every report of this build has a badput object: one without it is a regression, not a reason to skip.
    assert [name for name, r in reports.items() if "badput" not in r] == []
    cats = {c for r in reports.values() for c in r["badput"]}
    assert cats, "no report has any badput category: the sums below would check nothing"
    assert fleet["badput"]["jobs"] == len(reports)
    for c in cats:
        assert fleet["badput"]["seconds"][c] == pytest.approx(sum(r["badput"].get(c, 0) for r in reports.values()))
        assert fleet["badput"]["accelerator_h"][c] == pytest.approx(
            sum(r["world_size"] * r["badput"].get(c, 0) for r in reports.values()) / 3600)


def test_json_round_trip_and_the_cli(fleet, fleet_dirs, tmp_path):
    root, dirs = fleet_dirs
    assert json.loads(json.dumps(fleet)) == fleet
    assert set(fleet) == {"format_version", "jobs_total", "jobs_read", "jobs_running", "jobs_failed_to_read",
                          "accelerator_h", "buckets_accelerator_h", "ett_pct", "idle_pct", "failure_pct",
                          "unattributed_pct", "top_causes", "time_to_start_s", "time_to_recover_s", "failures",
                          "failures_by_category", "corrupt_lines", "torn_lines", "badput", "precompile",
                          "jobs"}
    png = tmp_path / "fleet.png"
    out = subprocess.run([sys.executable, "-m", "ettkit", "fleet", *dirs, "--json", "--plot", str(png)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == fleet
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_a_png(fleet, tmp_path):
    path = tmp_path / "bars.png"
    write_fleet_plot(fleet, path, max_jobs=10)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="max_jobs=0"):
        write_fleet_plot(fleet, path, max_jobs=0)


def test_cli_exit_codes_glob_and_table(fleet_dirs, capsys):
    root, dirs = fleet_dirs
    assert main(["fleet", str(root), "--glob", "job-*"]) == 0
    text = capsys.readouterr().out
    assert "49 run directories (48 read, 1 of them running; 1 failed to read)" in text  # job-49 never existed
    assert "Top causes of idle time" in text and "job-48: InvalidArgumentError" in text
    assert main(["fleet", dirs[48], dirs[49]]) == 2
    captured = capsys.readouterr()
    assert "none of the 2 run directories could be read" in captured.err
    assert main(["fleet", dirs[0], "--top", "0"]) == 2
    assert "--top 0 must be at least 1" in capsys.readouterr().err
    # A parent under which the pattern matches nothing is listed, not silently dropped.
    assert find_run_dirs([root], "nothing-*") == [str(root)]
    assert find_run_dirs([dirs[0], dirs[0] + "/"]) == [dirs[0]]


def test_a_newer_ledger_format_is_listed_not_fatal(tmp_path, fleet_dirs):
    newer = tmp_path / "newer" / "ett"
    newer.mkdir(parents=True)
    (newer / "rank-0.jsonl").write_text('{"v": 2, "t": "attempt", "attempt": 0, "rank": 0, "world": 1, "ts": 1}\n')
    f = ett.fleet_report([tmp_path / "newer", fleet_dirs[1][1]])
    assert f["jobs_read"] == 1 and f["jobs"][0]["status"] == "failed_to_read"
    assert "UnsupportedError" in f["jobs"][0]["reason"] and "format version 2" in f["jobs"][0]["reason"]
    with pytest.raises(ValueError, match="run_dirs is empty"):
        ett.fleet_report([])


def test_a_precompile_runs_hours_count_in_the_fleet_by_its_device(tmp_path, fleet_dirs):
    """`ettkit precompile --run-dir` writes a ledger with the job_kind and device notes: the fleet counts its
    time (idle: compile) in every total, like any job's, and names it apart, by the device it compiled on."""
    pre = tmp_path / "precompile-gpu"
    w = LedgerWriter(pre, rank=0, world=1)
    w.attempt(0, ts=0)
    w.rec("note", key="job_kind", value="precompile")
    w.rec("note", key="device", value="cuda")
    w.phase("launcher_init", 0, 20)
    t = w.phase("compile", 20, 920)
    w.rec("end", ts=us(t), status="clean", detail="")
    w.save()
    train = fleet_dirs[1][0]
    fleet = ett.fleet_report([train, str(pre)])
    alone = ett.fleet_report([train])
    rows = {row["run_dir"]: row for row in fleet["jobs"]}
    assert rows[str(pre)]["kind"] == "precompile" and rows[str(pre)]["device"] == "cuda"
    assert rows[train]["kind"] == "training" and rows[train]["device"] is None
    assert fleet["precompile"] == {"jobs": 1, "accelerator_h": pytest.approx(920 / 3600),
                                   "by_device_h": {"cuda": pytest.approx(920 / 3600)}}
    assert alone["precompile"] is None
    # Inside the totals: 920 accelerator-seconds more, all idle, and the compile cause grows by as much.
    assert fleet["accelerator_h"] == pytest.approx(alone["accelerator_h"] + 920 / 3600)
    assert fleet["buckets_accelerator_h"]["idle"] == pytest.approx(alone["buckets_accelerator_h"]["idle"] + 920 / 3600)
    compile_h = {f["phase"]: f["accelerator_h"] for f in fleet["top_causes"]["idle"]}["compile"]
    alone_h = {f["phase"]: f["accelerator_h"] for f in alone["top_causes"]["idle"]}["compile"]
    assert compile_h == pytest.approx(alone_h + 900 / 3600)
    text = format_fleet(fleet)
    assert "Precompile runs (ettkit precompile): 1, 0.256 h (cuda 0.256), counted above as idle time" in text, text
    assert f"{pre} (precompile)" in text
