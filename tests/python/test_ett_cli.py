"""`python -m ettkit report`: the table, --json keys, the exporters read back by real readers, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ledger_script import LedgerWriter, us, worked_example

REQUIRED_KEYS = {"e2e_s", "ett_pct", "idle_pct", "failure_pct", "time_to_start_s", "time_to_recover_s", "failures",
                 "phases", "unsaved_training_s", "checkpoint_blocking_s", "recommended_interval_s"}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "ettkit", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_json_output(tmp_path):
    worked_example(tmp_path).save()
    p = cli("report", tmp_path, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert REQUIRED_KEYS <= r.keys()
    assert r["ett_pct"] == pytest.approx(90.46, abs=0.005)
    assert set(r["unsaved_training_s"]) == {"measured", "estimated"}
    assert "timeline" not in r


def test_table_and_exporters(tmp_path):
    run = tmp_path / "run"
    worked_example(run).save()
    out = tmp_path / "out"
    out.mkdir()
    p = cli("report", run, "--trace", out / "trace.json", "--prometheus", out / "ett.prom", "--plot",
            out / "ett.png", "--tensorboard", out / "tb", "--job", "demo")
    assert p.returncode == 0, p.stderr
    assert "90.46" in p.stdout and "2040" in p.stdout and "Recommendation" in p.stdout

    trace = json.loads((out / "trace.json").read_text())
    compile_events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "compile" and e["pid"] == 0]
    assert sorted(e["dur"] for e in compile_events) == [300e6, 900e6]

    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families((out / "ett.prom").read_text())}
    ratio = families["ettkit_effective_training_ratio"].samples[0]
    assert ratio.value == pytest.approx(0.9046, abs=5e-5) and ratio.labels["job"] == "demo"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert acc.Scalars("ett/ett_pct")[0].value == pytest.approx(90.46, abs=0.005)

    from PIL import Image

    with Image.open(out / "ett.png") as im:
        assert im.format == "PNG" and im.size[0] > 400


def test_plot_with_draws_two_runs_and_names_a_bad_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    worked_example(a).save()
    worked_example(b).save()
    p = cli("report", a, "--plot", tmp_path / "both.png", "--plot-with", b)
    assert p.returncode == 0, p.stderr
    one = cli("report", a, "--plot", tmp_path / "one.png")
    assert one.returncode == 0, one.stderr
    from PIL import Image

    with Image.open(tmp_path / "both.png") as both, Image.open(tmp_path / "one.png") as single:
        assert both.size[0] == single.size[0] and both.size[1] > 1.6 * single.size[1]  # a second run's panels

    bad = cli("report", a, "--plot", tmp_path / "x.png", "--plot-with", tmp_path / "nowhere")
    assert bad.returncode == 2 and "--plot-with" in bad.stderr and "nowhere" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "x.png").exists()
    alone = cli("report", a, "--plot-with", b)
    assert alone.returncode == 2 and "--plot-with needs --plot" in alone.stderr


@pytest.mark.parametrize("setup,message", [
    ("missing", "does not exist"),
    ("empty", "no 'ett/' ledger folder"),
    ("newer", "format version 2"),
])
def test_errors_are_clear(tmp_path, setup, message):
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "newer":
        (run / "ett").mkdir()
        (run / "ett" / "rank-0.jsonl").write_text('{"v":2,"t":"attempt","attempt":0,"ts":1}\n')
    p = cli("report", run)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


def test_stray_files_and_extreme_times_print_a_table_with_warnings(tmp_path):
    """Regression: a stray rank-99999999999.jsonl crashed the report (std::stoi), and times at the int64
    limits gave a negative E2E that the table could not print."""
    w = LedgerWriter(tmp_path)
    w.attempt(0, ts=0)
    w.phase("compile", 0, 5)
    w.step(1, 5, 10)
    w.rec("hb", ts=2**63 - 1)
    w.rec("phase", name="compile", b=-(2**63) + 1, e=us(5))
    w.rec("end", ts=us(10), status="clean", detail="")
    w.save()
    (tmp_path / "ett" / "rank-99999999999.jsonl").write_text(w.lines[0] + "\n")
    p = cli("report", tmp_path)
    assert p.returncode == 0, p.stderr
    assert "E2E           0:00:10 (10.0 s)" in p.stdout
    assert "corrupt lines 2" in p.stdout
    assert "rank-99999999999.jsonl: skipped" in p.stdout
    r = json.loads(cli("report", tmp_path, "--json").stdout)
    assert r["e2e_s"] == 10.0 and r["ledger"]["files"] == 1
    assert sum(r["phases"].values()) == pytest.approx(10.0)


def test_the_latest_time_a_ledger_may_hold_prints_as_a_date(tmp_path):
    w = LedgerWriter(tmp_path)
    w.attempt(0, ts=0)
    w.step(1, 0, 10)
    w.rec("hb", ts=253_402_300_799_000_000)  # 9999-12-31T23:59:59Z, the last second the reader accepts
    w.save()
    p = cli("report", tmp_path)
    assert p.returncode == 0, p.stderr
    assert "9999-12-31T23:59:59Z" in p.stdout


def test_streamed_trace_is_the_python_exporters_trace(tmp_path):
    """--trace is written by the C++ report as it is built (no timeline in memory); it must be the very
    trace that ettkit.ett.trace.write_chrome_trace writes from a report dict."""
    from ettkit import ett
    from ettkit.ett import trace

    worked_example(tmp_path / "run", rank=0, world=2).save()
    worked_example(tmp_path / "run", rank=1, world=2, offset_s=-2.0).save()
    p = cli("report", tmp_path / "run", "--trace", tmp_path / "streamed.json")
    assert p.returncode == 0, p.stderr
    trace.write_chrome_trace(ett.build_report(tmp_path / "run"), tmp_path / "python.json")
    streamed = json.loads((tmp_path / "streamed.json").read_text())
    python = json.loads((tmp_path / "python.json").read_text())
    assert streamed["traceEvents"] == python["traceEvents"]
    assert streamed["otherData"] == python["otherData"] and streamed["displayTimeUnit"] == "ms"
    assert len([e for e in streamed["traceEvents"] if e["ph"] == "X"]) > 100
    assert not list(tmp_path.glob(".*.tmp"))


MEMORY_SCRIPT = """
import resource, sys
from ettkit import ett
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ett.build_report(sys.argv[1], include_timeline=False, trace_path=sys.argv[2])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_trace_of_200k_steps_needs_no_timeline_in_memory(tmp_path):
    """Regression (issue 12 item 8): the trace went through the timeline as JSON, then as Python dicts, about
    7 KB per step (6.97 GB for 10^6 steps; 1.3 GB for 200,000). Streamed, it costs what the analysis
    costs: about 100 MB for 200,000 steps. Memory, unlike time, does not depend on the machine's load."""
    steps = 200_000
    t = T0_US = 1_700_000_000_000_000
    lines = ['{"v":1,"t":"attempt","attempt":0,"rank":0,"world":1,"ts":%d}' % T0_US]
    for n in range(1, steps + 1):  # a gap after each step: every step is a segment of its own
        lines.append('{"v":1,"t":"step","n":%d,"b":%d,"e":%d}' % (n, t, t + 9000))
        t += 10000
    lines.append('{"v":1,"t":"end","ts":%d,"status":"clean","detail":""}' % t)
    (tmp_path / "run" / "ett").mkdir(parents=True)
    (tmp_path / "run" / "ett" / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    p = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, tmp_path / "run", tmp_path / "t.json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    extra_mb = int(p.stdout.split()[-1])
    assert extra_mb < 250, f"the report with a trace took {extra_mb} MB beyond the interpreter and torch"
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X" and e["name"] == "training") == 2 * steps  # rank + job



def test_version_matches_the_package_and_its_metadata():
    import importlib.metadata

    import ettkit

    p = cli("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"ettkit {ettkit.__version__}"
    assert ettkit.__version__ == importlib.metadata.version("ettkit")


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_a_reader_that_closed_the_pipe_ends_the_report_quietly(tmp_path, fmt):
    # `python -m ettkit report RUN | head -1`, made deterministic: the pipe's read end is closed before the
    # report starts, so its first write meets a closed pipe (EPIPE; CPython ignores SIGPIPE).
    worked_example(tmp_path).save()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        p = subprocess.run([sys.executable, "-m", "ettkit", "report", str(tmp_path), *fmt], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == 141, p.stderr  # 128 + SIGPIPE, as a C tool killed by SIGPIPE reports
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr and p.stderr == ""


def test_report_into_head_prints_the_first_lines(tmp_path):
    worked_example(tmp_path).save()
    p = subprocess.run(f"{sys.executable} -m ettkit report {tmp_path} | head -n 2", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 2
    assert "Traceback" not in p.stderr
