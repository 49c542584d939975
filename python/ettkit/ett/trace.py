"""The ETT report's timeline as a Chrome Trace Event Format JSON file.

The file loads in Perfetto (ui.perfetto.dev) and chrome://tracing. Layout:

* one process per rank (`pid` = rank, named "rank <r>"); thread 0 "phases" holds the rank's timeline
  segments as complete events, thread 1 "background" holds checkpoint persistence. Background work
  overlaps training, and Perfetto only draws events on one thread that nest perfectly, hence its own
  thread;
* one process "job" (`pid` = world_size) with the job-level timeline (earliest start / latest end across
  ranks) and an "ETT%" counter at the end of the run;
* instant events mark where each attempt begins and ends, on every rank of the attempt and on "job".

Timestamps are microseconds since the report's `e2e_begin_us`, so the run starts at 0; a segment that
precedes it (the initial queue) has a negative `ts`.

This module writes the trace of a report dict that holds the timelines. `python -m ettkit report --trace`
(`build_report(..., trace_path=...)`) does not come through here: the C++ report streams the same events
while it is built (`stream_chrome_trace` in src/ett/report.cpp), so a million-step trace never exists in
memory. Change the layout in both places; test_ett_cli.py::test_streamed_trace_is_the_python_exporters_trace
checks that the two event lists are equal.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

NO_TIMELINE = "report has no timeline; build it with include_timeline=True"

PHASES_TID = 0
BACKGROUND_TID = 1


def _metadata(pid: int, name: str, threads: dict[int, str]) -> list[dict[str, Any]]:
    events = [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}},
        # Without a sort index Perfetto orders processes by pid as strings ("rank 10" before "rank 2").
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
    ]
    for tid, thread in threads.items():
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}})
    return events


def _complete(segment: dict, pid: int, tid: int, origin_us: int, cat: str) -> dict[str, Any]:
    args = {"attempt": segment.get("attempt"), "bucket": segment.get("bucket")}
    if segment.get("step") is not None:
        args["step"] = segment["step"]
    return {
        "ph": "X", "name": segment["name"], "cat": cat, "pid": pid, "tid": tid,
        "ts": segment["begin_us"] - origin_us,
        "dur": max(0, segment["end_us"] - segment["begin_us"]),
        "args": args,
    }


def _attempt_markers(attempt: dict, pids: list[int], origin_us: int) -> list[dict[str, Any]]:
    index = attempt.get("attempt")
    marks = [(attempt.get("begin_us"), f"attempt {index} begin", {"attempt": index})]
    marks.append((attempt.get("end_us"), f"attempt {index} end ({attempt.get('status')})", {
        "attempt": index, "status": attempt.get("status"),
        "exception_type": attempt.get("exception_type"), "detail": attempt.get("detail"),
    }))
    return [
        {"ph": "i", "s": "p", "name": name, "cat": "attempt", "pid": pid, "tid": PHASES_TID,
         "ts": us - origin_us, "args": args}
        for us, name, args in marks if us is not None
        for pid in pids
    ]


def build_trace_events(report: dict) -> list[dict[str, Any]]:
    """Returns the trace events for `report`; raises ValueError if it was built without a timeline."""
    if "timeline" not in report or "job_timeline" not in report:
        raise ValueError(NO_TIMELINE)
    origin = report["e2e_begin_us"]
    ranks = list(report.get("ranks") or sorted({s["rank"] for s in report["timeline"]}))
    job_pid = report.get("world_size") or (max(ranks, default=-1) + 1)

    events: list[dict[str, Any]] = []
    for rank in ranks:
        events += _metadata(rank, f"rank {rank}", {PHASES_TID: "phases", BACKGROUND_TID: "background"})
    events += _metadata(job_pid, "job", {PHASES_TID: "phases"})

    # Sorted by start so that each track reads in time order even if the report lists segments otherwise.
    for segment in sorted(report["timeline"], key=lambda s: (s["rank"], s["begin_us"])):
        events.append(_complete(segment, segment["rank"], PHASES_TID, origin, segment.get("bucket") or ""))
    for segment in sorted(report.get("background") or [], key=lambda s: (s["rank"], s["begin_us"])):
        events.append(_complete(segment, segment["rank"], BACKGROUND_TID, origin, "background"))
    for segment in sorted(report["job_timeline"], key=lambda s: s["begin_us"]):
        events.append(_complete(segment, job_pid, PHASES_TID, origin, segment.get("bucket") or ""))

    for attempt in report.get("attempts") or []:
        events += _attempt_markers(attempt, [*(attempt.get("ranks") or ranks), job_pid], origin)

    if report.get("ett_pct") is not None:
        end_us = report.get("e2e_end_us", origin)
        events.append({"ph": "C", "name": "ETT%", "pid": job_pid, "tid": PHASES_TID,
                       "ts": end_us - origin, "args": {"value": report["ett_pct"]}})
    return events


def write_chrome_trace(report: dict, path: str | os.PathLike) -> None:
    """Writes the trace JSON to `path` atomically: readers see the old file or the complete new one."""
    document = {
        "traceEvents": build_trace_events(report),
        "displayTimeUnit": "ms",
        "otherData": {"run_dir": report.get("run_dir"), "e2e_begin_us": report.get("e2e_begin_us"),
                      "ett_pct": report.get("ett_pct")},
    }
    path = os.path.abspath(os.fspath(path))
    # Same directory, so os.replace is a rename on one filesystem; pid and thread keep concurrent writers
    # apart. A plain open (not mkstemp) keeps the user's umask instead of mode 0600.
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(document, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
