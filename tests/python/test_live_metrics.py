"""The live ETT metrics endpoint (ettkit.ett.serve_metrics, python -m ettkit serve): exact figures of
hand-written ledgers as they grow, torn and corrupt lines, a rank file that appears later, a killed attempt
and its recovery, agreement with build_report, incremental reads (a spy counts the lines and bytes each
refresh touches), a real 2-rank gloo job scraped over HTTP, the bind address, port errors and the CLI."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import urllib.request

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ledger_script import worked_example
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ettkit
from ettkit import ett
from ettkit.ett import live_ledger
from ettkit.ett.live import LiveCollector, LiveLedger

T0 = 1_700_000_000_000_000  # epoch µs; every hand-written time below is whole µs, so sums are exact


def us(seconds: float) -> int:
    return T0 + round(seconds * 1_000_000)


class Ledger:
    """Appends records to RUN_DIR/ett/rank-<r>.jsonl as the Recorder's writer does: whole lines, or raw
    bytes for torn and corrupt cases."""

    def __init__(self, run_dir, rank: int = 0) -> None:
        self.path = os.path.join(run_dir, "ett", f"rank-{rank}.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.rank = rank

    def raw(self, data: bytes | str) -> None:
        with open(self.path, "ab") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    def rec(self, t: str, **fields) -> None:
        self.raw(json.dumps({"v": 1, "t": t, **fields}) + "\n")

    def attempt(self, n: int, ts: float) -> None:
        self.rec("attempt", attempt=n, rank=self.rank, world=2, pid=1, host="h", ts=us(ts), proc_start=None)

    def phase(self, name: str, b: float, e: float, step: int | None = None) -> None:
        self.rec("phase", name=name, b=us(b), e=us(e), **({} if step is None else {"step": step}))

    def step(self, n: int, b: float, e: float) -> None:
        self.rec("step", n=n, b=us(b), e=us(e))


class Scraper:
    """A LiveLedger behind the endpoint's collector; scrape() is one Prometheus scrape (the exposition text,
    parsed back with prometheus_client's parser)."""

    def __init__(self, run_dir, **options) -> None:
        self.ledger = LiveLedger(run_dir, **options)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(LiveCollector(self.ledger))

    def scrape(self) -> dict:
        return parse(generate_latest(self.registry).decode())


def parse(text: str) -> dict:
    """{(sample name, sorted labels): value} of an exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_steps_and_a_checkpoint_give_exact_seconds_that_move_as_the_ledger_grows(tmp_path):
    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    led.phase("compile", 0.0, 2.0)
    led.step(1, 2.0, 3.0)   # 1.0 s
    led.step(2, 3.0, 5.0)   # 2.0 s
    led.step(3, 5.0, 5.5)   # 0.5 s
    s = Scraper(tmp_path)
    m = s.scrape()
    assert value(m, "ettkit_effective_seconds") == 3.5
    assert value(m, "ettkit_phase_seconds", phase="compile") == 2.0
    assert value(m, "ettkit_idle_seconds") == 2.0 and value(m, "ettkit_failure_seconds") == 0.0
    assert value(m, "ettkit_e2e_seconds") == 5.5
    assert value(m, "ettkit_effective_training_ratio") == pytest.approx(3.5 / 5.5, rel=1e-12)
    assert value(m, "ettkit_last_step") == 3
    assert value(m, "ettkit_ledger_records_total") == 5 and value(m, "ettkit_ledger_corrupt_lines_total") == 0
    assert value(m, "ettkit_badput_seconds", category="PROGRAM_STARTUP") == 2.0
    assert value(m, "ettkit_time_to_start_seconds", attempt="0") == 2.0
    assert value(m, "ettkit_latest_time_to_start_seconds") == 2.0
    assert value(m, "ettkit_attempts") == 1 and ("ettkit_failures_total", ()) not in m

    # Step 4 (1.5 s) blocks 0.25 s on a checkpoint inside it: the phase takes that time from training.
    led.phase("checkpoint_blocking", 6.0, 6.25, step=4)
    led.step(4, 5.5, 7.0)
    m = s.scrape()
    assert value(m, "ettkit_effective_seconds") == 4.75
    assert value(m, "ettkit_checkpoint_blocking_seconds", kind="measured") == 0.25
    assert value(m, "ettkit_checkpoint_tier_saves", tier="disk") == 1
    assert value(m, "ettkit_checkpoint_tier_blocking_seconds", tier="disk") == 0.25
    assert value(m, "ettkit_badput_seconds", category="UNPRODUCTIVE_CHECKPOINT_SAVE_TIME") == 0.25
    assert value(m, "ettkit_e2e_seconds") == 7.0 and value(m, "ettkit_last_step") == 4
    assert value(m, "ettkit_ledger_records_total") == 7
    assert s.ledger.figures(now_s=us(10.0) / 1e6)["seconds_since_last_record"] == {0: 3.0}


def test_a_torn_last_line_counts_only_once_its_newline_arrives(tmp_path):
    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    led.step(1, 0.0, 1.0)
    s = Scraper(tmp_path)
    assert value(s.scrape(), "ettkit_last_step") == 1
    line = json.dumps({"v": 1, "t": "step", "n": 2, "b": us(1.0), "e": us(3.0)}) + "\n"
    led.raw(line[:17])  # a writer's batch still arriving (or a process killed mid-write)
    m = s.scrape()
    assert value(m, "ettkit_last_step") == 1 and value(m, "ettkit_effective_seconds") == 1.0
    assert value(m, "ettkit_ledger_corrupt_lines_total") == 0 and value(m, "ettkit_ledger_records_total") == 2
    led.raw(line[17:])
    m = s.scrape()
    assert value(m, "ettkit_last_step") == 2 and value(m, "ettkit_effective_seconds") == 3.0
    # An end record torn inside a two-byte character: neither half is a character, the line is still whole.
    end = json.dumps({"v": 1, "t": "end", "ts": us(3.5), "status": "exception",
                      "detail": "ValueError: café"}, ensure_ascii=False).encode() + b"\n"
    cut = end.index("é".encode()) + 1
    led.raw(end[:cut])
    assert value(s.scrape(), "ettkit_e2e_seconds") == 3.0
    led.raw(end[cut:])
    m = s.scrape()
    assert value(m, "ettkit_failures_total", category="exception:ValueError") == 1
    assert value(m, "ettkit_phase_seconds", phase="lost_in_flight") == 0.5
    assert value(m, "ettkit_ledger_corrupt_lines_total") == 0


def test_corrupt_lines_are_counted_and_skipped(tmp_path):
    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    led.step(1, 0.0, 1.0)
    s = Scraper(tmp_path)
    s.scrape()
    led.raw("this is not json\n")
    led.rec("step", n=2, b=us(3.0), e=us(2.0))         # ends before it begins
    led.raw(b'{"v":1,"t":"phase","name":"\xff\xfe","b":1,"e":2}\n')  # not UTF-8
    led.rec("step", n=2, b=us(1.0), e=us(2.0))
    m = s.scrape()
    assert value(m, "ettkit_ledger_corrupt_lines_total") == 3
    assert value(m, "ettkit_last_step") == 2 and value(m, "ettkit_effective_seconds") == 2.0
    warnings = s.ledger.figures()["ledger"]["warnings"]
    assert any(w.endswith("rank-0.jsonl:3: corrupt record skipped") for w in warnings)
    assert any("rank-0.jsonl:4: corrupt record skipped (ends before it begins)" in w for w in warnings)


def test_a_rank_file_that_appears_later_is_picked_up_and_the_lowest_rank_is_followed(tmp_path):
    one = Ledger(tmp_path, rank=1)
    one.attempt(0, ts=0.0)
    one.step(7, 0.0, 2.0)
    s = Scraper(tmp_path)
    m = s.scrape()
    assert value(m, "ettkit_ledger_files") == 1 and value(m, "ettkit_live_rank") == 1
    assert value(m, "ettkit_last_step") == 7 and value(m, "ettkit_effective_seconds") == 2.0
    zero = Ledger(tmp_path, rank=0)
    zero.attempt(0, ts=0.0)
    zero.step(1, 0.0, 1.0)
    zero.phase("eval", 1.0, 1.5)
    m = s.scrape()
    assert value(m, "ettkit_ledger_files") == 2 and value(m, "ettkit_live_rank") == 0
    assert value(m, "ettkit_last_step") == 1 and value(m, "ettkit_effective_seconds") == 1.0
    assert value(m, "ettkit_phase_seconds", phase="eval") == 0.5
    assert value(m, "ettkit_badput_seconds", category="CUSTOM_BADPUT_EVENTS") == 0.5
    assert {labels for name, labels in m if name == "ettkit_seconds_since_last_record"} == {
        (("rank", "0"),), (("rank", "1"),)}


def test_a_second_attempt_after_a_killed_one_counts_a_failure_and_its_recovery(tmp_path):
    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    for n in range(1, 5):
        led.step(n, n - 1.0, float(n))
    led.rec("hb", ts=us(4.5))
    s = Scraper(tmp_path)
    m = s.scrape()
    # Without an end record and without a later attempt, the attempt is still running: no failure yet.
    assert value(m, "ettkit_attempts") == 1 and ("ettkit_failures_total", (("category", "killed"),)) not in m
    assert value(m, "ettkit_unattributed_seconds") == 0.5
    # Attempt 1 (killed at 4.5 s, back at 6 s) restores step 2, re-trains steps 3-4, trains step 5.
    led.attempt(1, ts=6.0)
    led.phase("checkpoint_restore", 6.0, 6.5, step=2)
    m = s.scrape()
    assert value(m, "ettkit_failures_total", category="killed") == 1
    # Still recovering: from the failure point (the end of step 4, at 4 s) to the latest record.
    assert value(m, "ettkit_latest_time_to_recover_seconds") == 2.5
    for n, b in ((3, 7.0), (4, 8.0), (5, 9.0)):
        led.step(n, b, b + 1.0)
    led.rec("end", ts=us(10.0), status="clean", detail="")
    m = s.scrape()
    assert value(m, "ettkit_attempts") == 2 and value(m, "ettkit_failures_total", category="killed") == 1
    # Recovered: to the first training of attempt 1 (re-training step 3, at 7 s).
    assert value(m, "ettkit_time_to_recover_seconds", failure="0") == 3.0
    assert value(m, "ettkit_latest_time_to_recover_seconds") == 3.0
    assert value(m, "ettkit_time_to_start_seconds", attempt="1") == 1.0
    assert value(m, "ettkit_effective_seconds") == 5.0  # steps 1-4 and 5; 3-4 again are waste
    # lost 0.5 + teardown 1.5 + restore 0.5 + the uncovered 0.5 before step 3 + re-training 2
    assert value(m, "ettkit_failure_seconds") == 5.0
    assert value(m, "ettkit_phase_seconds", phase="unattributed") == 0.5
    assert value(m, "ettkit_phase_seconds", phase="wasted_training") == 2.0
    assert value(m, "ettkit_phase_seconds", phase="detect_and_teardown") == 1.5
    assert value(m, "ettkit_badput_seconds", category="WASTED_PROGRESS_FROM_DISRUPTION") == 2.5
    assert value(m, "ettkit_badput_seconds", category="INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION") == 1.5
    assert value(m, "ettkit_badput_seconds", category="UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME") == 0.5
    assert value(m, "ettkit_badput_seconds", category="OTHER") == 0.5
    report = ett.build_report(tmp_path, include_timeline=False)
    assert report["ett_pct"] == 50.0 and value(m, "ettkit_effective_training_ratio") == 0.5


@pytest.mark.parametrize("window", [16, 1024])
def test_the_worked_example_fed_in_pieces_matches_the_report(tmp_path, window):
    # docs/ett.md's worked example (595 records, a killed attempt, a requeue): written at once, then
    # appended to a live ledger in pieces that cut lines anywhere. A window of 16 settles time dozens of
    # times; the figures must not depend on it.
    whole = tmp_path / "whole"
    data = open(worked_example(str(whole)).save(), "rb").read()
    report = ett.build_report(whole, include_timeline=False)
    grown = tmp_path / "grown"
    led = Ledger(grown)
    s = Scraper(grown, window_records=window)
    rng = random.Random(window)
    pos = 0
    while pos < len(data):
        size = rng.randint(1, 4000)
        led.raw(data[pos:pos + size])
        pos += size
        s.ledger.refresh()
    f = s.ledger.figures()
    for key in ("e2e_s", "effective_s", "idle_s", "failure_s", "unattributed_s", "ett_pct", "failure_pct"):
        assert f[key] == pytest.approx(report[key], abs=1e-9), key
    assert f["phases"] == pytest.approx(report["phases"], abs=1e-9)
    assert f["badput"] == pytest.approx(report["badput"], abs=1e-9)
    assert list(f["time_to_start_s"].values()) == report["time_to_start_s"] == [1380.0, 1020.0]
    assert f["time_to_recover_s"] == report["time_to_recover_s"] == [2040.0]
    assert f["failures_by_category"] == report["failures_by_category"] == {"killed": 1}
    assert f["checkpoints"]["disk"]["count"] == report["checkpoints"]["count"] == 15
    assert f["ledger"]["records"] == report["ledger"]["records"] and f["ledger"]["late_records"] == 0


def test_nested_and_overlapping_records_settle_as_the_report_owns_them(tmp_path):
    # Concurrent start-up stages, checkpoints nested in steps (written before their step, as the Recorder
    # does), and a stall that runs past a step's mark into the next step: records that straddle the time a
    # 16-record window settles. Live and report must own every instant alike.
    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    led.phase("compile", 0.0, 0.8)
    led.phase("get_first_batch_data", 0.3, 1.1)   # outlives compile, which keeps 0.3-0.8
    t = 1.1
    blocked = stalled = 0.0
    for n in range(1, 301):
        if n % 5 == 0:
            led.phase("checkpoint_blocking", t + 0.25, t + 0.5, step=n)
            blocked += 0.25
        led.step(n, t, t + 1.0)
        if n % 7 == 0:
            led.phase("data_stall", t + 0.9, t + 1.2)  # 0.1 s into step n, 0.2 s into step n + 1
            stalled += 0.3
        t += 1.0
    led.rec("end", ts=us(t), status="clean", detail="")
    report = ett.build_report(tmp_path, include_timeline=False)
    ledger = LiveLedger(tmp_path, window_records=16)
    ledger.refresh()
    f = ledger.figures()
    assert blocked == 15.0 and stalled == pytest.approx(12.6)
    assert f["effective_s"] == pytest.approx(272.4, abs=1e-9)
    assert report["effective_s"] == pytest.approx(272.4, abs=1e-9)
    assert f["phases"]["compile"] == 0.8 and f["phases"]["launcher_init"] == 0.3  # compile started first
    assert f["phases"] == pytest.approx(report["phases"], abs=1e-9)
    assert f["idle_s"] == pytest.approx(report["idle_s"], abs=1e-9) and f["ledger"]["late_records"] == 0


def test_a_refresh_reads_and_parses_only_what_was_appended(tmp_path, monkeypatch):
    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    # The Recorder's own spelling (the reader's fast path) for these, json.dumps' for the appended ones.
    led.raw("".join('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}\n' % (n, us(n - 1), us(n))
                    for n in range(1, 5001)))
    parsed, read = [], []
    real_parse, real_feed = live_ledger._parse, LiveLedger._feed
    monkeypatch.setattr(live_ledger, "_parse", lambda line: parsed.append(line) or real_parse(line))
    monkeypatch.setattr(LiveLedger, "_feed",
                        lambda self, rf, chunk: read.append(len(chunk)) or real_feed(self, rf, chunk))
    s = Scraper(tmp_path, window_records=64)
    s.scrape()
    assert len(parsed) == 5001 and sum(read) == os.path.getsize(led.path)
    parsed.clear()
    read.clear()
    assert value(s.scrape(), "ettkit_last_step") == 5000
    assert parsed == [] and read == []  # nothing appended: nothing read
    appended = "".join(json.dumps({"v": 1, "t": "step", "n": n, "b": us(n - 1), "e": us(n)}) + "\n"
                       for n in range(5001, 5011))
    led.raw(appended)
    m = s.scrape()
    assert len(parsed) == 10 and sum(read) == len(appended)
    assert value(m, "ettkit_last_step") == 5010 and value(m, "ettkit_effective_seconds") == 5010.0


def test_a_finished_recorded_run_agrees_with_the_report(tmp_path):
    with ett.serve_metrics(0, tmp_path) as handle:  # before the Recorder: it serves the ledger as it appears
        with ett.Recorder(tmp_path, rank=0, world_size=1, launcher_phases_from_env=False,
                          flush_interval_s=0.01) as rec:
            with rec.phase("compile"):
                torch.ones(64, 64).matmul(torch.ones(64, 64))
            for n in range(1, 31):
                torch.ones(32, 32).sum()
                if n % 10 == 0:
                    with rec.phase("checkpoint_blocking", step=n):
                        torch.zeros(1000).clone()
                rec.step(n)
            rec.flush()
            mid = parse(urllib.request.urlopen(handle.url, timeout=60).read().decode())
            assert value(mid, "ettkit_last_step") == 30
            assert value(mid, "ettkit_checkpoint_tier_saves", tier="disk") == 3
            assert ("ettkit_failures_total", (("category", "killed"),)) not in mid  # running, not killed
            with rec.phase("shutdown"):
                pass
        final = parse(urllib.request.urlopen(handle.url, timeout=60).read().decode())
        figures = handle.ledger.figures()
    report = ett.build_report(tmp_path, include_timeline=False)
    # One rank with a clean end: the live view owns each instant by the report's rule and sums the same
    # integer microseconds, so only the final float division may differ (an ulp, far below 1e-12).
    ratio = value(final, "ettkit_effective_training_ratio")
    assert ratio == pytest.approx(report["ett_pct"] / 100, abs=1e-12)
    assert value(final, "ettkit_e2e_seconds") == pytest.approx(report["e2e_s"], abs=1e-9)
    assert value(final, "ettkit_e2e_seconds") > value(mid, "ettkit_e2e_seconds")
    assert figures["phases"] == pytest.approx(report["phases"], abs=1e-9)
    assert figures["badput"] == pytest.approx(report["badput"], abs=1e-9)


def test_the_endpoint_binds_loopback_by_default_and_names_a_bad_port(tmp_path, monkeypatch):
    with ett.serve_metrics(0, tmp_path) as handle:
        assert handle.host == "127.0.0.1" and handle._server.server_address[0] == "127.0.0.1"
        assert handle.port > 0 and handle.url == f"http://127.0.0.1:{handle.port}/metrics"
        m = parse(urllib.request.urlopen(handle.url, timeout=60).read().decode())
        assert value(m, "ettkit_ledger_files") == 0  # no Recorder has written yet: counters only
    handle.close()  # idempotent
    for port in (70000, -1, "9400", True, 1.5):
        with pytest.raises(ettkit.InvalidArgumentError, match=f"port={port!r}"):
            ett.serve_metrics(port, tmp_path)
    assert ett.serve_metrics(0, tmp_path, rank=1) is None
    monkeypatch.setenv("RANK", "3")
    assert ett.serve_metrics(0, tmp_path) is None
    with pytest.raises(ValueError, match="no run_dir given and no ETT recorder is open"):
        ett.serve_metrics(0, rank=0)


def test_the_cli_serves_until_sigterm_and_rejects_a_bad_port(tmp_path, capsys):
    from ettkit.__main__ import main

    led = Ledger(tmp_path)
    led.attempt(0, ts=0.0)
    led.step(1, 0.0, 2.0)
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2
    assert "port=70000 is not a TCP port" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    env = dict(os.environ, RANK="1")  # a side-car serves whatever rank its environment names
    # `serve`, and `report --serve`, which prints the report first and then serves the same way.
    for command in (["serve", str(tmp_path), "--port", "0"], ["report", str(tmp_path), "--serve", "0"]):
        proc = subprocess.Popen([sys.executable, "-m", "ettkit", *command], stdout=subprocess.PIPE, text=True,
                                env=env)
        try:
            printed = []
            while not printed or " on http://" not in printed[-1]:
                ready, _, _ = select.select([proc.stdout], [], [], 120)
                assert ready, f"ettkit {command[0]} printed no address within 120 s: {printed}"
                printed.append(proc.stdout.readline())
                assert printed[-1], f"ettkit {command[0]} exited before serving: {printed}"
            if command[0] == "report":
                assert any("ETT" in line for line in printed[:-1])  # the report's table came first
            url = printed[-1].rsplit(" on ", 1)[1].split()[0]
            assert url.startswith("http://127.0.0.1:")
            m = parse(urllib.request.urlopen(url, timeout=60).read().decode())
            assert value(m, "ettkit_effective_seconds") == 2.0 and value(m, "ettkit_last_step") == 1
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert main(["report", str(tmp_path), "--serve", "-1"]) == 2
    assert "port=-1 is not a TCP port" in capsys.readouterr().err


# ---- a real 2-rank gloo job, scraped over HTTP while it trains --------------------------------------------
def _live_worker(rank: int, run_dir: str, init_file: str, messages, go) -> None:
    os.environ["RANK"] = str(rank)  # serve_metrics reads the rank as a launcher sets it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    handle = None
    try:
        with ett.Recorder(run_dir, rank=rank, world_size=2, launcher_phases_from_env=False,
                          flush_interval_s=0.01) as rec:
            handle = ett.serve_metrics(0, run_dir)
            messages.put(("url", handle.url) if rank == 0 else ("rank 1 serves", handle is not None))
            t = torch.ones(4)
            for round_no, last in enumerate((3, 6)):
                for n in range(last - 2, last + 1):
                    dist.all_reduce(t)
                    rec.step(n)
                rec.flush()
                dist.barrier()  # both ranks' steps are in their files
                if rank == 0:
                    messages.put(("steps", last))
                if not go[round_no].wait(timeout=120):
                    raise TimeoutError(f"rank {rank}: the test did not scrape round {round_no} within 120 s")
            dist.barrier()
    finally:
        if handle is not None:
            handle.close()
        dist.destroy_process_group()


def test_a_two_rank_gloo_job_is_scraped_live_on_rank_0(tmp_path):
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    go = [ctx.Event(), ctx.Event()]
    run_dir, init_file = str(tmp_path / "run"), str(tmp_path / "init")
    procs = [ctx.Process(target=_live_worker, args=(r, run_dir, init_file, messages, go)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict = {}

    def wait_for(key, expected=None):
        # The ranks' messages may arrive in any order (each queue has its own feeder thread).
        while key not in got or (expected is not None and got[key] != expected):
            k, v = messages.get(timeout=180)
            got[k] = v
        return got[key]

    try:
        assert wait_for("rank 1 serves") is False  # serve_metrics returned None on rank 1
        url = wait_for("url")
        scrapes = []
        for round_no, last in enumerate((3, 6)):
            wait_for("steps", last)
            m = parse(urllib.request.urlopen(url, timeout=60).read().decode())
            assert value(m, "ettkit_last_step") == last and value(m, "ettkit_ledger_files") == 2
            assert {labels for name, labels in m if name == "ettkit_seconds_since_last_record"} == {
                (("rank", "0"),), (("rank", "1"),)}
            scrapes.append(m)
            go[round_no].set()
        assert value(scrapes[1], "ettkit_e2e_seconds") > value(scrapes[0], "ettkit_e2e_seconds")
        assert value(scrapes[1], "ettkit_effective_seconds") > value(scrapes[0], "ettkit_effective_seconds")
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for e in go:
            e.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
