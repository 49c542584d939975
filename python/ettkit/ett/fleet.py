"""The fleet report: ETT over many jobs, weighted by what each job cost (docs/ett.md, "Fleet report").

One job's report says where that job's time went; an operator running hundreds of jobs needs the same
answer for the accelerators: a 512-device job that idles 10 % wastes more than a 1-device job that idles
50 %. So every aggregate here is weighted by **accelerator-seconds**, ``world_size × seconds``, and ETT% of
the fleet is ``Σ w·effective_s / Σ w·e2e_s`` (the same as ``Σ ett_pct/100·w·e2e_s / Σ w·e2e_s``).

Each run directory is reported by the C++ report (:func:`ettkit.ett.build_report`, without timelines): the
ledgers are never parsed here, so the fleet numbers are sums of exactly what ``ettkit report`` prints for
each job. A directory that cannot be reported is listed with the reason and never stops the others.

Phases whose time fell in more than one bucket (``phase_buckets`` = ``"mixed"``, e.g. ``compile`` that is
idle at the first start and failure in a recovery) are split with the job's own failure windows: the
failure part is what the job's ``recoveries[].breakdown`` attribute to the phase, the rest goes to the
phase's bucket outside a recovery window (docs/ett.md §3). A job whose split does not add up to its bucket
totals keeps those phases whole under ``top_causes.mixed`` instead of a guessed split.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from .. import errors
from .report import build_report
from .table import MISSING, _grid, _num, _sec, shown

#: Version of the fleet JSON's schema: within a version the keys and their meaning are stable.
FORMAT_VERSION = 1

FINISHED, RUNNING, FAILED_TO_READ = "finished", "running", "failed_to_read"
TRAINING, PRECOMPILE = "training", "precompile"  # jobs[].kind
BUCKETS = ("effective", "idle", "failure", "unattributed")
PERCENTILES = (50, 90, 99)

#: The bucket of a phase's time outside any recovery window (docs/ett.md §3); inside one it is failure.
_OUTSIDE_BUCKET = {"training": "effective", "unattributed": "unattributed", "wasted_training": "failure",
                   "lost_in_flight": "failure", "peer_teardown": "failure",
                   "detect_and_teardown": "failure"}


def find_run_dirs(roots: Iterable[str | os.PathLike], pattern: str | None = None) -> list[str]:
    """The run directories to report on, in a stable order, each once.

    Without ``pattern`` each root is a run directory itself. With it, each root is a parent and the run
    directories are its sub-directories matching the glob ``pattern`` (relative to the root, e.g.
    ``"job-*"`` or ``"*/*"``), sorted. A root under which nothing matches is returned as itself, so the
    report lists it as unreadable (with the reason) instead of dropping it silently. Duplicates (by real
    path) are kept once, at their first position.
    """
    found: list[str] = []
    for root in roots:
        root = os.fspath(root)
        if pattern is None:
            found.append(root)
            continue
        matches = sorted(p for p in glob.glob(os.path.join(glob.escape(root), pattern)) if os.path.isdir(p))
        found.extend(matches or [root])
    seen: set[str] = set()
    unique = []
    for d in found:
        key = os.path.realpath(d)
        if key not in seen:
            seen.add(key)
            unique.append(d)
    return unique


def split_phases(report: dict) -> dict[str, dict[str, float]]:
    """A job's phase seconds by bucket: ``{"effective"|"idle"|"failure"|"unattributed"|"mixed": {phase: s}}``.

    Phases of one bucket go there whole. A ``mixed`` phase's failure part is the seconds its job's
    recovery windows attribute to it (``recoveries[].breakdown``, capped at the phase's total); the rest
    goes to its bucket outside a recovery window (``training``: effective, ``unattributed``: unattributed,
    any other phase: idle). When the split of the job's mixed phases does not reproduce its ``idle_s`` and
    ``failure_s``, they stay whole under ``"mixed"``: an unexplained split would be a guess.
    """
    phases = report.get("phases") or {}
    buckets = report.get("phase_buckets") or {}
    out: dict[str, dict[str, float]] = {b: {} for b in (*BUCKETS, "mixed")}
    in_recovery: dict[str, float] = {}
    for rec in report.get("recoveries") or []:
        for name, seconds in (rec.get("breakdown") or {}).items():
            in_recovery[name] = in_recovery.get(name, 0.0) + float(seconds)
    split: dict[str, dict[str, float]] = {b: {} for b in BUCKETS}
    for name, seconds in phases.items():
        seconds = float(seconds)
        bucket = buckets.get(name)
        if bucket in BUCKETS:
            out[bucket][name] = seconds
        elif bucket == "mixed":
            failure = min(seconds, in_recovery.get(name, 0.0))
            outside = _OUTSIDE_BUCKET.get(name, "idle")
            split["failure"][name] = failure
            split[outside][name] = split[outside].get(name, 0.0) + seconds - failure
        else:  # an unknown bucket name (a newer report): keep it visible rather than guess
            out["mixed"][name] = seconds
    # The split must add up to the report's own bucket totals, or it is not the report's attribution.
    tol = 1e-6 * max(1.0, float(report.get("e2e_s") or 0.0))
    consistent = all(
        math.isclose(sum(out[b].values()) + sum(split[b].values()), float(report.get(f"{b}_s") or 0.0),
                     rel_tol=0.0, abs_tol=tol)
        for b in BUCKETS)
    if consistent:
        for b in BUCKETS:
            for name, seconds in split[b].items():
                if seconds > 0:
                    out[b][name] = out[b].get(name, 0.0) + seconds
    else:
        for name, seconds in phases.items():
            if buckets.get(name) == "mixed":
                out["mixed"][name] = float(seconds)
    return out


def percentiles(values: Sequence[float]) -> dict[str, Any]:
    """``count``, ``p50``, ``p90``, ``p99``, ``mean`` and ``max`` of ``values`` (None when empty).

    Percentiles interpolate linearly between the closest ranks, numpy.percentile's default, so the
    figures match what an analyst computes from the JSON.
    """
    xs = sorted(float(v) for v in values)
    out: dict[str, Any] = {"count": len(xs)}
    for p in PERCENTILES:
        out[f"p{p}"] = None
        if xs:
            pos = (len(xs) - 1) * p / 100.0
            lo = math.floor(pos)
            hi = min(lo + 1, len(xs) - 1)
            out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["max"] = xs[-1] if xs else None
    return out


def _job_row(run_dir: str, report: dict | None, reason: str | None) -> dict[str, Any]:
    if report is None:
        row: dict[str, Any] = {"run_dir": run_dir, "status": FAILED_TO_READ, "reason": reason}
        for key in ("kind", "device", "world_size", "e2e_s", "accelerator_h", "ett_pct", "idle_pct", "failure_pct",
                    "unattributed_pct", "failures", "failures_by_category", "attempts", "last_attempt_status",
                    "time_to_start_s", "time_to_recover_s", "unrecovered_failures", "corrupt_lines",
                    "torn_lines"):
            row[key] = None
        return row
    attempts = report.get("attempts") or []
    recoveries = report.get("recoveries") or []
    ledger = report.get("ledger") or {}
    world = int(report.get("world_size") or 1)
    e2e = float(report.get("e2e_s") or 0.0)
    notes = (attempts[0].get("notes") or {}) if attempts else {}
    return {
        "run_dir": run_dir,
        "status": RUNNING if any(a.get("status") == "running" for a in attempts) else FINISHED,
        "reason": None,
        # "precompile" for a `python -m ettkit precompile --run-dir` run (its ledger's job_kind note), which
        # trains nothing: its whole E2E is compile time spent for the jobs that start from the shared cache.
        "kind": PRECOMPILE if notes.get("job_kind") == PRECOMPILE else TRAINING,
        "device": notes.get("device"),
        "world_size": world,
        "e2e_s": e2e,
        "accelerator_h": world * e2e / 3600.0,
        "ett_pct": report.get("ett_pct"),
        "idle_pct": report.get("idle_pct"),
        "failure_pct": report.get("failure_pct"),
        "unattributed_pct": report.get("unattributed_pct"),
        "failures": int(report.get("failures") or 0),
        "failures_by_category": dict(report.get("failures_by_category") or {}),
        "attempts": len(attempts),
        "last_attempt_status": attempts[-1].get("status") if attempts else None,
        "time_to_start_s": list(report.get("time_to_start_s") or []),
        # A window that ended at the next failure (or the end of the run) measured no recovery.
        "time_to_recover_s": [float(r["total_s"]) for r in recoveries if r.get("recovered")],
        "unrecovered_failures": sum(1 for r in recoveries if not r.get("recovered")),
        "corrupt_lines": int(ledger.get("corrupt_lines") or 0),
        "torn_lines": int(ledger.get("torn_lines") or 0),
    }


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _read(run_dir: str, include_initial_queue: bool) -> tuple[dict | None, str | None]:
    try:
        return build_report(run_dir, include_initial_queue=include_initial_queue, include_timeline=False), None
    except Exception as e:  # noqa: BLE001 - whatever one directory does, it must not stop the others
        return None, _reason(e)


class _FleetTotals:
    """The fleet's running totals, each job weighted by its accelerator-seconds (``world_size × seconds``)."""

    def __init__(self) -> None:
        self.bucket_acc = dict.fromkeys(BUCKETS, 0.0)
        # bucket -> phase -> [accelerator-seconds, wall seconds, jobs]
        self.causes: dict[str, dict[str, list[float]]] = {"idle": {}, "failure": {}, "mixed": {}}
        self.tts: list[float] = []
        self.ttr: list[float] = []
        self.unrecovered = 0
        self.categories: dict[str, int] = {}
        self.badput_s: dict[str, float] = {}
        self.badput_acc: dict[str, float] = {}
        self.badput_jobs = 0

    def add(self, row: dict, report: dict, bucket_s: dict, parts: dict) -> None:
        w = row["world_size"]
        for b in BUCKETS:
            self.bucket_acc[b] += w * bucket_s[b]
        for b in ("idle", "failure", "mixed"):
            for name, seconds in parts[b].items():
                if seconds <= 0:
                    continue
                entry = self.causes[b].setdefault(name, [0.0, 0.0, 0])
                entry[0] += w * seconds
                entry[1] += seconds
                entry[2] += 1
        self.tts.extend(row["time_to_start_s"])
        self.ttr.extend(row["time_to_recover_s"])
        self.unrecovered += row["unrecovered_failures"]
        for cat, n in row["failures_by_category"].items():
            self.categories[cat] = self.categories.get(cat, 0) + int(n)
        badput = report.get("badput")
        if isinstance(badput, dict):
            self.badput_jobs += 1
            for cat, seconds in badput.items():
                # Only numeric categories are seconds; anything else is a shape this version does not know.
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                    self.badput_s[cat] = self.badput_s.get(cat, 0.0) + float(seconds)
                    self.badput_acc[cat] = self.badput_acc.get(cat, 0.0) + w * float(seconds)

    def pct(self, x: float) -> float | None:
        total_acc = sum(self.bucket_acc.values())
        return 100.0 * x / total_acc if total_acc > 0 else None

    def ranked(self, bucket: str) -> list[dict[str, Any]]:
        total = sum(e[0] for e in self.causes[bucket].values())
        items = sorted(self.causes[bucket].items(), key=lambda kv: (-kv[1][0], kv[0]))
        return [{"phase": name, "accelerator_h": acc / 3600.0, "seconds": wall,
                 "share_pct": 100.0 * acc / total if total > 0 else None, "jobs": n}
                for name, (acc, wall, n) in items]

    def report(self, jobs: list[dict]) -> dict:
        read = [j for j in jobs if j["status"] != FAILED_TO_READ]
        bucket_acc, pct = self.bucket_acc, self.pct
        ttr_stats = percentiles(self.ttr)
        ttr_stats["unrecovered"] = self.unrecovered
        return {
            "format_version": FORMAT_VERSION,
            "jobs_total": len(jobs),
            "jobs_read": len(read),
            "jobs_running": sum(1 for j in read if j["status"] == RUNNING),
            "jobs_failed_to_read": len(jobs) - len(read),
            "accelerator_h": sum(bucket_acc.values()) / 3600.0,
            "buckets_accelerator_h": {b: bucket_acc[b] / 3600.0 for b in BUCKETS},
            "ett_pct": pct(bucket_acc["effective"]),
            "idle_pct": pct(bucket_acc["idle"]),
            "failure_pct": pct(bucket_acc["failure"]),
            "unattributed_pct": pct(bucket_acc["unattributed"]),
            "top_causes": {"idle": self.ranked("idle"), "failure": self.ranked("failure"),
                           "mixed": self.ranked("mixed")},
            "time_to_start_s": percentiles(self.tts),
            "time_to_recover_s": ttr_stats,
            "failures": sum(j["failures"] for j in read),
            "failures_by_category": dict(sorted(self.categories.items())),
            "corrupt_lines": sum(j["corrupt_lines"] for j in read),
            "torn_lines": sum(j["torn_lines"] for j in read),
            "badput": None if not self.badput_jobs else {
                "jobs": self.badput_jobs,
                "seconds": dict(sorted(self.badput_s.items())),
                "accelerator_h": {k: v / 3600.0 for k, v in sorted(self.badput_acc.items())},
                "pct": {k: pct(v) for k, v in sorted(self.badput_acc.items())},
            },
            # Precompile runs' hours, also inside every total above (as idle: compile), by the device they used.
            "precompile": _precompile_hours([j for j in read if j["kind"] == PRECOMPILE]),
            "jobs": jobs,
        }


def _precompile_hours(precompiles: list[dict]) -> dict | None:
    if not precompiles:
        return None
    by_device: dict[str, float] = {}
    for j in precompiles:
        device = j["device"] or "unknown"
        by_device[device] = by_device.get(device, 0.0) + j["accelerator_h"]
    return {
        "jobs": len(precompiles),
        "accelerator_h": sum(j["accelerator_h"] for j in precompiles),
        "by_device_h": dict(sorted(by_device.items())),
    }


def fleet_report(run_dirs: Iterable[str | os.PathLike], *, include_initial_queue: bool = False) -> dict:
    """The fleet report of ``run_dirs`` (keys documented in docs/ett.md, "Fleet report").

    Every directory is reported with :func:`ettkit.ett.build_report`; one that cannot be (missing, empty,
    no ledger, unreadable, a newer ledger format, any error at all) becomes a ``failed_to_read`` row with
    the reason and adds nothing to the totals, and a job whose last attempt is still running is included
    as ``running`` (its E2E so far). Aggregates are weighted by accelerator-seconds (``world_size ×
    seconds``). ``include_initial_queue`` is passed to each report. Raises ``ettkit.InvalidArgumentError``
    when ``run_dirs`` is empty.
    """
    dirs = [os.fspath(d) for d in run_dirs]
    if not dirs:
        raise errors.InvalidArgumentError("run_dirs is empty: give at least one run directory")
    # Serial on purpose: a small ledger's report takes well under a millisecond, and on 2 cores neither two
    # threads (the C++ report releases the GIL, the JSON decode holds it) nor a process pool (each worker
    # imports torch, seconds) was faster for 1,000 jobs (docs/benchmarks.md, "Fleet report").
    jobs = []
    totals = _FleetTotals()
    for run_dir in dirs:
        report, reason = _read(run_dir, include_initial_queue)
        try:
            # Everything taken from the report is read here, before any fleet total changes: a directory
            # whose report cannot be used is a failed_to_read row and adds nothing.
            row = _job_row(run_dir, report, reason)
            if report is not None:
                bucket_s = {b: float(report.get(f"{b}_s") or 0.0) for b in BUCKETS}
                parts = split_phases(report)
        except Exception as e:  # noqa: BLE001 - one bad directory never stops the others
            report, row = None, _job_row(run_dir, None, _reason(e))
        jobs.append(row)
        if report is not None:
            totals.add(row, report, bucket_s, parts)
    return totals.report(jobs)


def _hours(value: float | None) -> str:
    return MISSING if value is None else f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def _causes_table(title: str, items: list[dict], top: int) -> list[str]:
    rows = [[c["phase"], _hours(c["accelerator_h"]), _num(c["share_pct"], 1, "%"), _sec(c["seconds"]),
             str(c["jobs"])] for c in items[:top]]
    more = len(items) - top
    lines = [title, *_grid(["phase", "accel-h", "share", "wall s (sum)", "jobs"], rows,
                           [False, True, True, True, True])]
    if more > 0:
        lines.append(f"  ... {more} more in --json")
    return lines


def _dist(name: str, d: dict) -> list[str]:
    return [name, _num(d.get("p50"), 1), _num(d.get("p90"), 1), _num(d.get("p99"), 1), _num(d.get("mean"), 1),
            _num(d.get("max"), 1), str(d.get("count", 0))]


def format_fleet(fleet: dict, top: int = 5) -> str:
    """The fleet report as aligned plain text (what ``python -m ettkit fleet`` prints); ``top`` causes each."""
    cats = ", ".join(f"{shown(k)} {v}" for k, v in (fleet.get("failures_by_category") or {}).items())
    corrupt_jobs = sum(1 for j in fleet["jobs"] if j.get("corrupt_lines"))
    lines = [
        f"ETT fleet report: {fleet['jobs_total']} run directories "
        f"({fleet['jobs_read']} read, {fleet['jobs_running']} of them running; "
        f"{fleet['jobs_failed_to_read']} failed to read)",
        f"  Accelerator-h  {_hours(fleet.get('accelerator_h'))} (world size x E2E, summed)",
        f"  ETT%           {_num(fleet.get('ett_pct'), 2, '%')} (weighted by accelerator-hours)",
        f"  Idle%          {_num(fleet.get('idle_pct'), 2, '%')}",
        f"  Failure%       {_num(fleet.get('failure_pct'), 2, '%')}",
        f"  Unattributed%  {_num(fleet.get('unattributed_pct'), 2, '%')}",
        f"  Failures       {fleet.get('failures', 0)}" + (f" ({cats})" if cats else ""),
        f"  Corrupt lines  {fleet.get('corrupt_lines', 0)} in {corrupt_jobs} job(s), "
        f"torn lines {fleet.get('torn_lines', 0)}",
        "",
        *_causes_table("Top causes of idle time", fleet["top_causes"]["idle"], top),
        "",
        *_causes_table("Top causes of failure time", fleet["top_causes"]["failure"], top),
    ]
    if fleet["top_causes"]["mixed"]:
        lines += ["", *_causes_table("Mixed phases left unsplit (their split did not add up)",
                                     fleet["top_causes"]["mixed"], top)]
    ttr = fleet["time_to_recover_s"]
    lines += ["", "Distributions over all attempts / recoveries (s)",
              *_grid(["", "p50", "p90", "p99", "mean", "max", "count"],
                     [_dist("time to start", fleet["time_to_start_s"]), _dist("time to recover", ttr)],
                     [False, True, True, True, True, True, True])]
    if ttr.get("unrecovered"):
        lines.append(f"  {ttr['unrecovered']} failure(s) not (yet) recovered are not in the time to recover")
    pre = fleet.get("precompile")
    if pre:
        devices = ", ".join(f"{shown(d)} {_hours(h)}" for d, h in pre["by_device_h"].items())
        lines += ["", (f"Precompile runs (ettkit precompile): {pre['jobs']}, {_hours(pre['accelerator_h'])} h "
                       f"({devices}), counted above as idle time (compile)")]
    badput = fleet.get("badput")
    if badput:
        rows = [[k, _sec(v), _hours(badput["accelerator_h"].get(k)), _num(badput["pct"].get(k), 2, "%")]
                for k, v in badput["seconds"].items()]
        lines += ["", f"Badput (Google's categories, summed over the {badput['jobs']} job(s) whose report has it)",
                  *_grid(["category", "wall s (sum)", "accel-h", "% of accel-h"], rows, [False, True, True, True])]
    rows = []
    for j in fleet["jobs"]:
        if j["status"] == FAILED_TO_READ:
            continue
        tts = j["time_to_start_s"]
        ttr_j = j["time_to_recover_s"]
        name = j["run_dir"] + (" (precompile)" if j["kind"] == PRECOMPILE else "")
        rows.append([name, j["status"] + ("" if j["status"] == RUNNING else f" ({j['last_attempt_status']})"),
                     str(j["world_size"]), _sec(j["e2e_s"]), _num(j["ett_pct"], 2, "%"), str(j["failures"]),
                     _sec(tts[0]) if tts else MISSING, _sec(sum(ttr_j) / len(ttr_j)) if ttr_j else MISSING,
                     str(j["corrupt_lines"])])
    lines += ["", "Jobs", *_grid(["run dir", "status", "world", "E2E s", "ETT%", "failures", "first TTS s",
                                   "mean TTR s", "corrupt lines"], rows,
                                  [False, False, True, True, True, True, True, True, True])]
    bad = [j for j in fleet["jobs"] if j["status"] == FAILED_TO_READ]
    if bad:
        lines += ["", "Failed to read"] + [f"  {shown(j['run_dir'])}: {shown(j['reason'])}" for j in bad]
    return "\n".join(lines) + "\n"


def write_fleet_plot(fleet: dict, path: str | os.PathLike, max_jobs: int = 40) -> None:
    """Writes stacked bars (effective / idle / failure / unattributed, % of each job's E2E) atomically.

    The top bar is the fleet, weighted by accelerator-hours; under it the ``max_jobs`` largest jobs by
    accelerator-hours (more bars would not be readable), running ones marked. Raises ``ValueError`` when
    no job was read (there is nothing to draw) or ``max_jobs`` < 1.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from .plot import COLORS, save_figure

    if max_jobs < 1:
        raise errors.InvalidArgumentError(f"max_jobs={max_jobs!r} must be at least 1")
    read = [j for j in fleet["jobs"] if j["status"] != FAILED_TO_READ]
    if not read:
        raise errors.InvalidArgumentError("the fleet report has no job that could be read: nothing to plot")
    shown = sorted(read, key=lambda j: -j["accelerator_h"])[:max_jobs]
    keys = ["ett_pct" if b == "effective" else f"{b}_pct" for b in BUCKETS]
    bars = [("fleet (accelerator-hour weighted)", [fleet.get(k) or 0.0 for k in keys])]
    for j in shown:
        label = os.path.basename(os.path.normpath(j["run_dir"])) or j["run_dir"]
        label += f" (x{j['world_size']})" + (" [running]" if j["status"] == RUNNING else "")
        bars.append((label, [j.get(k) or 0.0 for k in keys]))
    fig = Figure(figsize=(11, 1.2 + 0.28 * len(bars)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ys = list(range(len(bars)))[::-1]  # the fleet bar on top
    for y, (_, values) in zip(ys, bars):
        left = 0.0
        for b, v in zip(BUCKETS, values):
            ax.barh(y, v, left=left, color=COLORS[b], height=0.8 if y != ys[0] else 0.95,
                    edgecolor="black" if y == ys[0] else COLORS[b], linewidth=0.8 if y == ys[0] else 0)
            left += v
    ax.set_yticks(ys, [label for label, _ in bars], fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of E2E")
    title = (f"ETT fleet: {_num(fleet.get('ett_pct'), 1, '%')} over {_hours(fleet.get('accelerator_h'))} "
             f"accelerator-hours; {len(read)} jobs read ({fleet['jobs_running']} running), "
             f"{fleet['jobs_failed_to_read']} not read")
    if len(read) > len(shown):
        title += f"; the {len(shown)} largest shown"
    ax.set_title(title, fontsize=9, loc="left")
    fig.legend(handles=[Patch(color=COLORS[b], label=b) for b in BUCKETS], loc="outside right upper",
               fontsize=8, frameon=False)
    save_figure(fig, path, dpi=100)
