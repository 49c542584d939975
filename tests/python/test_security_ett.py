"""Report, fleet and live endpoint against hostile run directories and clients (issue #39 items 5 and 6,
docs/security.md): symbolic-link loops and links out of the run directory, unreadable files, an 8 MB line
of '[', a 512 MB sparse file, deep nesting, a 64 MB unterminated line fed to the live view, and 300 idle
connections to the endpoint. Each asserts that the attack fails (a one-line error, an unreadable row, a
skipped line, a bounded thread count or peak RSS) and that the good directories and lines beside it are
reported exactly as before."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import tracemalloc
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ettkit import errors, ett
from ettkit.ett.fleet import FAILED_TO_READ, fleet_report
from ettkit.ett.live import MetricsServer
from ettkit.ett.live_ledger import LiveLedger

T0 = 1_700_000_000_000_000
MiB = 1 << 20
# The bound: no single hostile input costs 100 MB of peak RSS above a good directory's.
RSS_BOUND_MIB = 100


def good_lines(rank: int = 0) -> list[str]:
    """Attempt 0 with two one-second steps and a clean end: 4 records, 2 s effective."""
    t = [T0 + s * 1_000_000 for s in range(3)]
    return [json.dumps({"v": 1, "t": "attempt", "attempt": 0, "rank": rank, "world": 1, "ts": t[0]}),
            '{"v":1,"t":"step","n":1,"b":%d,"e":%d}' % (t[0], t[1]),
            '{"v":1,"t":"step","n":2,"b":%d,"e":%d}' % (t[1], t[2]),
            json.dumps({"v": 1, "t": "end", "ts": t[2], "status": "clean"})]


def make_run(run_dir, rank: int = 0, inject: bytes | None = None) -> str:
    """A run directory whose rank file holds the good lines, with ``inject`` (a whole line, newline
    included) after the attempt record."""
    os.makedirs(os.path.join(run_dir, "ett"), exist_ok=True)
    lines = [(line + "\n").encode() for line in good_lines(rank)]
    path = os.path.join(run_dir, "ett", f"rank-{rank}.jsonl")
    with open(path, "wb") as f:
        f.write(lines[0] + (inject or b"") + b"".join(lines[1:]))
    return path


def cli(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "ettkit", *args], capture_output=True, text=True,
                          timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess, command: str, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"ettkit {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---- item 5: links, entries that are no file, paths the OS refuses ----------------------------------------
def test_a_link_loop_in_ett_leaves_the_report_working_and_a_lone_one_is_a_one_line_error(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    os.symlink("loop", run / "ett" / "loop")                  # any other name: never looked at
    os.symlink("rank-1.jsonl", run / "ett" / "rank-1.jsonl")  # a ledger name: skipped, with a warning
    proc = cli("report", str(run), "--json")  # before: an uncaught "filesystem error", exit 1
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ranks"] == [0] and report["effective_s"] == 2.0 and report["ledger"]["records"] == 4
    assert any("rank-1.jsonl: skipped; it is a symbolic link" in w for w in report["ledger"]["warnings"])

    lone = tmp_path / "lone"
    os.makedirs(lone / "ett")
    os.symlink("rank-0.jsonl", lone / "ett" / "rank-0.jsonl")
    assert_one_line_error(cli("report", str(lone)), "report", "has no ledger files",
                          f"Skipped: {lone}/ett/rank-0.jsonl (it is a symbolic link")

    linked = tmp_path / "linked"
    os.makedirs(linked)
    os.symlink(run / "ett", linked / "ett")  # before: the report read the folder through the link
    assert_one_line_error(cli("report", str(linked)), "report",
                          f"ledger folder '{linked}/ett' is a symbolic link")
    os.symlink("looping", tmp_path / "looping")
    assert_one_line_error(cli("report", str(tmp_path / "looping")), "report",
                          f"cannot open run directory '{tmp_path}/looping'", "symbolic links")


def test_fleet_reports_both_good_directories_beside_a_bad_one(tmp_path, monkeypatch):
    good_a, bad, good_b, linked = tmp_path / "a", tmp_path / "bad", tmp_path / "b", tmp_path / "linked"
    make_run(good_a)
    make_run(good_b)
    os.makedirs(bad / "ett")
    os.symlink("rank-0.jsonl", bad / "ett" / "rank-0.jsonl")  # its only ledger file: a link to itself
    os.makedirs(linked)
    os.symlink(good_a / "ett", linked / "ett")  # a link where the ledger folder belongs
    dirs = [str(good_a), str(bad), str(good_b), str(linked)]
    proc = cli("fleet", *dirs, "--json")  # before: a traceback at `bad`, no report at all
    assert proc.returncode == 0, proc.stderr
    fleet = json.loads(proc.stdout)
    assert (fleet["jobs_read"], fleet["jobs_failed_to_read"]) == (2, 2)
    assert [j["status"] for j in fleet["jobs"]] == ["finished", FAILED_TO_READ, "finished", FAILED_TO_READ]
    assert fleet["jobs"][1]["reason"].startswith(
        f"InvalidArgumentError: run directory '{bad}' has no ledger files")
    assert f"Skipped: {bad}/ett/rank-0.jsonl (it is a symbolic link" in fleet["jobs"][1]["reason"]
    assert fleet["jobs"][3]["reason"].startswith(f"IoError: ledger folder '{linked}/ett' is a symbolic link")
    assert [j["e2e_s"] for j in fleet["jobs"]] == [2.0, None, 2.0, None] and fleet["ett_pct"] == 100.0
    text = cli("fleet", *dirs)
    assert text.returncode == 0 and f"{linked}: IoError: ledger folder" in text.stdout

    # Whatever a directory's report raises, and whatever a report that cannot be used holds, it is one
    # unreadable row: the others are summed as if it were not there.
    from ettkit.ett import fleet as fleet_module

    real = fleet_module.build_report

    def hostile(run_dir, **kw):
        if os.fspath(run_dir) == str(bad):
            raise RecursionError("maximum recursion depth exceeded")
        if os.fspath(run_dir) == str(good_b):
            return {**real(run_dir, **kw), "idle_s": "not a number"}
        return real(run_dir, **kw)

    monkeypatch.setattr(fleet_module, "build_report", hostile)
    fleet = fleet_report([good_a, bad, good_b])
    assert [j["status"] for j in fleet["jobs"]] == ["finished", FAILED_TO_READ, FAILED_TO_READ]
    assert fleet["jobs"][1]["reason"] == "RecursionError: maximum recursion depth exceeded"
    assert fleet["jobs"][2]["reason"].startswith("ValueError: could not convert string to float")
    assert fleet["accelerator_h"] == pytest.approx(2.0 / 3600) and fleet["ett_pct"] == 100.0


def _without_dac_override() -> tuple[str, ...]:
    """A command prefix under which permission bits apply: root reads a file of mode 0000 otherwise."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no way to make a mode-0000 file unreadable")
    prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search")
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP)")
    return prefix


def test_an_unreadable_ledger_file_is_a_one_line_io_error_and_an_unreadable_fleet_row(tmp_path):
    prefix = _without_dac_override()
    good, locked = tmp_path / "good", tmp_path / "locked"
    make_run(good)
    path = make_run(locked)
    os.chmod(path, 0)
    try:
        assert_one_line_error(cli("report", str(locked), prefix=prefix), "report",
                              f"cannot read ledger file '{path}': Permission denied")
        proc = cli("fleet", str(good), str(locked), "--json", prefix=prefix)
        assert proc.returncode == 0, proc.stderr
        fleet = json.loads(proc.stdout)
        assert fleet["jobs_read"] == 1
        assert fleet["jobs"][1]["reason"] == f"IoError: cannot read ledger file '{path}': Permission denied"
    finally:
        os.chmod(path, 0o600)


# ---- item 5: lines that cost memory ------------------------------------------------------------------------
_MEASURED_REPORT = r"""
import json, sys
from ettkit.__main__ import main
status = main(sys.argv[1:])
sys.stdout.flush()
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("\n" + json.dumps({"status": status, "hwm_kib": hwm}), file=sys.stderr)
"""


def measured(*args: str) -> tuple[int, dict | None, int]:
    """Runs ``python -m ettkit ARGS --json`` in a child: its exit status, its JSON and its peak RSS (KiB)."""
    proc = subprocess.run([sys.executable, "-c", _MEASURED_REPORT, *args, "--json"], capture_output=True,
                          text=True, timeout=600)
    # The last line that is the child's own record: ettkit's log lines (a warning naming the skipped lines) may
    # reach stderr after it, from the logging bridge.
    tail = next(json.loads(line) for line in reversed(proc.stderr.splitlines()) if line.startswith('{"status"'))
    return tail["status"], json.loads(proc.stdout) if proc.stdout.strip() else None, tail["hwm_kib"]


def test_huge_deep_and_sparse_lines_leave_report_and_fleet_working_in_bounded_memory(tmp_path):
    good = tmp_path / "good"
    make_run(good)
    status, base, base_kib = measured("report", str(good))
    assert status == 0 and base["ledger"]["records"] == 4
    brackets, deep, sparse = tmp_path / "brackets", tmp_path / "deep", tmp_path / "sparse"
    make_run(brackets, inject=b"[" * (8 * MiB) + b"\n")  # before: about 1.2 GB of RSS
    make_run(deep, inject=b'{"v":1,"t":"note","key":"k","value":' + b"[" * 400_000 + b"]" * 400_000 + b"}\n")
    os.truncate(make_run(sparse), 512 * MiB)  # before: the 512 MB line was held whole (1.5 GB)
    assert os.stat(sparse / "ett" / "rank-0.jsonl").st_blocks * 512 < MiB  # a hole, not 512 MB of disk
    grew = {}
    for run, why in ((brackets, "longer than 1048576 bytes"), (deep, "nested deeper than 64 levels"),
                     (sparse, "longer than 1048576 bytes")):
        status, report, kib = measured("report", str(run))
        assert status == 0
        assert (report["ledger"]["records"], report["ledger"]["corrupt_lines"]) == (4, 1)
        assert report["effective_s"] == 2.0 and report["ett_pct"] == base["ett_pct"]
        warnings = report["ledger"]["warnings"]
        assert any(f"corrupt record skipped ({why}" in w for w in warnings), warnings
        grew[run.name] = (kib - base_kib) / 1024
    status, fleet, kib = measured("fleet", str(good), str(brackets), str(deep), str(sparse),
                                  str(good / "missing"))
    assert status == 0 and fleet["jobs_read"] == 4 and fleet["corrupt_lines"] == 3
    assert [j["e2e_s"] for j in fleet["jobs"]] == [2.0, 2.0, 2.0, 2.0, None]
    grew["fleet"] = (kib - base_kib) / 1024
    print("peak RSS above a good directory's (MiB):", {k: round(v, 1) for k, v in grew.items()})
    assert max(grew.values()) < RSS_BOUND_MIB, grew


# ---- item 5: the live view ---------------------------------------------------------------------------------
def test_live_ledger_fed_a_64_mb_unterminated_line_holds_at_most_a_line_bound(tmp_path):
    path = make_run(tmp_path)
    ledger = LiveLedger(tmp_path)
    ledger.refresh()
    assert ledger.records == 4
    chunk = b"x" * (64 << 10)
    tracemalloc.start()
    try:
        with open(path, "ab") as f:
            for _ in range(1024):  # 64 MB in 64 KB appends, a refresh after each (a scraped endpoint's view)
                f.write(chunk)
                f.flush()
                ledger.refresh()
                held = len(ledger._files["rank-0.jsonl"].partial)
                assert held <= MiB + len(chunk)  # the line bound, plus the chunk that crossed it
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Before: the partial line was copied whole on every chunk (64 MB held, 32 GB copied in all).
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert ledger.corrupt_lines == 0  # unterminated: not a line yet
    with open(path, "ab") as f:
        f.write(b"\n" + b'{"v":1,"t":"step","n":3,"b":%d,"e":%d}\n' % (T0 + 2_000_000, T0 + 3_000_000))
    ledger.refresh()
    assert (ledger.corrupt_lines, ledger.records) == (1, 5)
    assert any("corrupt record skipped (longer than 1048576 bytes" in w for w in ledger.warnings)
    assert ledger.figures()["last_step"] == 3


def test_live_ledger_skips_a_sparse_file_and_deep_nesting_in_bounded_memory(tmp_path):
    deep = b'{"v":1,"t":"hb","ts":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    make_run(tmp_path / "deep", inject=deep)
    ledger = LiveLedger(tmp_path / "deep")
    ledger.refresh()  # before: json raised RecursionError out of the refresh
    assert (ledger.records, ledger.corrupt_lines) == (4, 1)
    assert any("(nested deeper than 64 levels)" in w for w in ledger.warnings)

    path = make_run(tmp_path / "sparse")
    with open(path, "ab") as f:
        f.truncate(512 * MiB)
        f.seek(0, os.SEEK_END)
        f.write(b"\n" + b'{"v":1,"t":"step","n":3,"b":%d,"e":%d}\n' % (T0 + 2_000_000, T0 + 3_000_000))
    ledger = LiveLedger(tmp_path / "sparse")
    tracemalloc.start()
    try:
        ledger.refresh()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (ledger.records, ledger.corrupt_lines) == (5, 1) and ledger.figures()["last_step"] == 3
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB"


def test_live_ledger_refuses_links_as_the_report_does(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    outside = make_run(tmp_path / "outside", rank=1)
    os.symlink(outside, run / "ett" / "rank-1.jsonl")
    os.symlink("loop", run / "ett" / "rank-2.jsonl")
    ledger = LiveLedger(run)
    ledger.refresh()
    assert ledger.figures()["ranks"] == [0] and ledger.records == 4
    assert sum("is a symbolic link" in w for w in ledger.warnings) == 2
    linked = tmp_path / "linked"
    os.makedirs(linked)
    os.symlink(run / "ett", linked / "ett")
    with pytest.raises(errors.IoError, match="ledger folder '.*/linked/ett' is a symbolic link"):
        LiveLedger(linked).refresh()


# ---- item 6: the live endpoint ----------------------------------------------------------------------------
def scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def threads_now() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/task"))


def test_300_idle_connections_add_no_thread_and_a_scrape_still_succeeds(tmp_path):
    make_run(tmp_path)
    before = threads_now()
    with ett.serve_metrics(0, tmp_path) as handle:
        assert handle.caught_up.wait(60)
        idle = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", handle.port), timeout=60)
                idle.append(s)
                try:
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
                except OSError:
                    pass  # closed already to make room for a newer one
            # Before: prometheus_client's server ran a thread per connection (303 threads).
            during = threads_now()
            status, text = scrape(handle.url)  # while they hang: the oldest are closed to make room
            assert status == 200 and samples(text)[("ettkit_last_step", ())] == 2
            assert during[0] <= before[0] + 2 and during[1] <= before[1] + 2, (before, during)
            assert handle._server.open_connections <= 64
        finally:
            for s in idle:
                s.close()


def test_a_half_sent_request_is_closed_after_the_timeout_and_the_oldest_gives_way(tmp_path):
    make_run(tmp_path)
    server = MetricsServer(LiveLedger(tmp_path), "127.0.0.1", 0, request_timeout_s=0.5, max_connections=4)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert slow.recv(1) == b""  # closed by the server once its 0.5 s passed, not by our 60 s
        slow.close()
    finally:
        server.close()
    server = MetricsServer(LiveLedger(tmp_path), "127.0.0.1", 0, request_timeout_s=600, max_connections=4)
    try:
        conns = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(5)]
        assert conns[0].recv(1) == b""  # the fifth closed the oldest; nothing waits 600 s
        status, _ = scrape(server.url)
        assert status == 200
        for c in conns:
            c.close()
    finally:
        server.close()


def test_a_scrape_storm_computes_the_figures_once_until_the_ledger_grows(tmp_path):
    path = make_run(tmp_path)
    server = MetricsServer(LiveLedger(tmp_path), "127.0.0.1", 0, max_age_s=3600)
    computed = []
    real = server.ledger.figures
    server.ledger.figures = lambda *a, **kw: computed.append(1) or real(*a, **kw)
    try:
        bodies = {scrape(server.url)[1] for _ in range(20)}
        assert len(computed) == 1 and len(bodies) == 1
        with open(path, "ab") as f:
            f.write(b'{"v":1,"t":"step","n":3,"b":%d,"e":%d}\n' % (T0 + 2_000_000, T0 + 3_000_000))
        status, text = scrape(server.url)
        assert status == 200 and samples(text)[("ettkit_last_step", ())] == 3 and len(computed) == 2
    finally:
        server.close()


def test_the_endpoint_answers_a_bad_directory_with_a_500_and_keeps_serving(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_run(good)
    os.symlink("loop", good / "ett" / "loop")  # before: every scrape of this good directory was a 500
    os.makedirs(bad)
    os.symlink(good / "ett", bad / "ett")
    with ett.serve_metrics(0, good) as ok, ett.serve_metrics(0, bad) as refused:
        assert scrape(ok.url)[0] == 200
        for _ in range(2):
            status, text = scrape(refused.url)
            assert status == 500 and "symbolic link" in text and f"{bad}/ett" in text
        os.unlink(bad / "ett")  # repaired: the same endpoint serves it
        make_run(bad)
        status, text = scrape(refused.url)
        assert status == 200 and samples(text)[("ettkit_effective_seconds", ())] == 2.0


def test_the_endpoint_answers_only_get_and_head_of_its_path(tmp_path):
    make_run(tmp_path)
    with ett.serve_metrics(0, tmp_path) as handle:

        def raw(request: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", handle.port), timeout=60) as s:
                s.sendall(request)
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
                return out

        get = raw(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert get.startswith(b"HTTP/1.1 200 OK\r\n") and b"ettkit_last_step 2.0" in get
        head = raw(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        assert raw(b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert raw(b"GET /../../etc/passwd HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
        assert raw(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10_000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
        assert raw(b"\x16\x03\x01 not http\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        openmetrics = raw(b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n"
                          b"\r\n")
        assert b"Content-Type: application/openmetrics-text" in openmetrics
        assert openmetrics.endswith(b"# EOF\n")
        # prometheus_client raises for this header: answered in the text format instead.
        odd = raw(b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=abc\r\n\r\n")
        assert odd.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Type: text/plain" in odd


def test_binding_beyond_loopback_warns_that_there_is_no_authentication(tmp_path, caplog):
    make_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ettkit"):
        with ett.serve_metrics(0, tmp_path):
            pass
        assert not [r for r in caplog.records if "no authentication" in r.getMessage()]
        with ett.serve_metrics(0, tmp_path, host="0.0.0.0") as handle:
            assert scrape(f"http://127.0.0.1:{handle.port}/metrics")[0] == 200
    warned = [r.getMessage() for r in caplog.records if "no authentication" in r.getMessage()]
    assert len(warned) == 1 and f"0.0.0.0:{handle.port}" in warned[0]


# ---- names read from a ledger reach a terminal as text, never as control sequences ---------------------------
def test_escape_sequences_and_newlines_in_a_ledger_are_printed_escaped_by_report_and_fleet(tmp_path):
    from ettkit.ett.fleet import format_fleet
    from ettkit.ett.table import format_report

    hostile = "\x1b]0;owned\x07cuda\x1b[2J\nETT%           99.00%\u202e"
    note = json.dumps({"v": 1, "t": "note", "key": "device\r", "value": hostile}) + "\n"
    note += json.dumps({"v": 1, "t": "note", "key": "job_kind", "value": "precompile"}) + "\n"
    run = str(tmp_path / "run\x1b[31m")
    make_run(run, inject=note.encode())
    report = ett.build_report(run)
    assert report["attempts"][0]["notes"]["device\r"] == hostile  # the report's data keeps the bytes as read
    fleet = fleet_report([run])
    for text in (format_report(report), format_fleet(fleet)):
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text and "\u202e" not in text, text
        assert not any(line.startswith("ETT%") for line in text.splitlines())  # no line of the report forged
    assert r"\x1b]0;owned\x07cuda\x1b[2J\nETT%           99.00%\u202e" in format_report(report)
    assert r"run\x1b[31m" in format_fleet(fleet)
    fleet["jobs"][0]["device"] = hostile  # the precompile line names the device a precompile run used
    fleet["precompile"] = {"jobs": 1, "accelerator_h": 0.0, "by_device_h": {hostile: 0.0}}
    assert r"\x1b]0;owned" in format_fleet(fleet) and "\x1b" not in format_fleet(fleet)


def test_escape_sequences_in_a_ledger_are_printed_escaped_by_project(tmp_path, capsys):
    # Issue #61 item 7: `ettkit project` printed the dominant recovery phase's name raw.
    import sys

    from ettkit.__main__ import main

    sys.path.insert(0, os.path.dirname(__file__))
    from ledger_script import worked_example

    run = tmp_path / "run\x1b[31m"
    worked_example(run).save()
    ledger = run / "ett" / "rank-0.jsonl"
    hostile = "\x1b]0;owned\x07sched\x1b[2J\nETT%           99.00%\u202e"
    ledger.write_text(ledger.read_text().replace('"scheduling"', json.dumps(hostile)))
    assert main(["project", str(run), "--mtbf-hours", "12"]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, text
    assert not any(line.startswith("ETT%") for line in text.splitlines())
    assert r"mostly \x1b]0;owned\x07sched\x1b[2J\nETT%           99.00%\u202e (44.1% of a recovery)" in text
    assert r"from " + str(tmp_path) + r"/run\x1b[31m" in text
    assert main(["project", str(run / "missing\x1b[2J"), "--mtbf-hours", "12"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and r"missing\x1b[2J" in err
