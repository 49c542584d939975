"""The ETT report as a plain-text table for a terminal.

`format_report` is what `python -m ettkit report RUN_DIR` prints. It takes the report dict (the parsed JSON
report) and returns text only: no colours, because the output often ends up in CI logs and ticket
comments, and no I/O, so callers decide where it goes. Every value the report may lack prints as "-".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

MISSING = "-"


def _num(value: Any, decimals: int, suffix: str = "") -> str:
    if value is None:
        return MISSING
    return f"{value:.{decimals}f}{suffix}"


def _significant(value: float, digits: int = 2) -> str:
    """`value` in plain decimals with `digits` significant digits (0.00043313 -> "0.00043"), never in
    exponent notation and without trailing zeros."""
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".")


def _sec(value: float | None) -> str:
    """Seconds for a column headed "s": tenths are enough for hour-long jobs, a short run or a blocking save
    needs milliseconds, and below a millisecond two significant digits keep the value from reading 0.000."""
    if value is None:
        return MISSING
    if abs(value) >= 10:
        return f"{value:.1f}"
    if value == 0 or abs(value) >= 1e-3:
        return f"{value:.3f}"
    return _significant(value)


def format_duration(seconds: float | None) -> str:
    """A duration with its unit, as the report's prose prints one: "60.0 s", "4.500 s", and below a
    millisecond "0.43 ms" (two significant digits: a fast save's mean blocking is not "0.000 s")."""
    if seconds is None:
        return MISSING
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 1e-3:
        return f"{_sec(seconds)} s"
    return f"{_significant(seconds * 1e3)} ms"


def shown(value: Any) -> str:
    """``str(value)`` safe to print on a terminal: every character that is not printable (escape sequences,
    newlines, bidirectional overrides) as its Python escape. Ledgers are files, possibly another job's or
    another user's: a note, phase or exception name must not move the cursor, rewrite the screen or start
    a line that looks like the report's own."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _text(value: Any) -> str:
    return MISSING if value is None or value == "" else shown(value)


def _hms(seconds: float | None) -> str:
    if seconds is None:
        return MISSING
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _utc(us: int | None) -> str:
    if us is None:
        return MISSING
    return datetime.fromtimestamp(us / 1e6, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _grid(headers: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Aligns columns; `right` marks numeric columns, which read best right-aligned."""
    rows = [[shown(c) for c in r] for r in rows]  # cells may hold names read from a ledger
    if not rows:
        return ["  (none)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return ("  " + "  ".join(parts)).rstrip()

    return [line(headers), "  " + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _header(report: dict) -> list[str]:
    e2e = report.get("e2e_s")
    return [
        f"ETT report: {_text(report.get('run_dir'))}",
        f"  E2E           {_hms(e2e)} ({format_duration(e2e)})",
        f"  ETT%          {_num(report.get('ett_pct'), 2, '%')}",
        f"  Idle%         {_num(report.get('idle_pct'), 2, '%')}",
        f"  Failure%      {_num(report.get('failure_pct'), 2, '%')}",
        f"  Unattributed% {_num(report.get('unattributed_pct'), 2, '%')}",
        f"  Failures      {_text(report.get('failures'))}",
    ]


def _phases(report: dict) -> list[str]:
    e2e = report.get("e2e_s") or 0.0
    buckets = report.get("phase_buckets") or {}
    # Sub-stages are part of their phase's time; they are listed indented under it, never summed again.
    substages: dict[str, list[tuple[str, float]]] = {}
    for key, seconds in (report.get("substages") or {}).items():
        parent, _, child = key.partition("/")
        substages.setdefault(parent, []).append((child or key, seconds))

    def share(seconds: float | None) -> str:
        return _num(100.0 * seconds / e2e, 2, "%") if seconds is not None and e2e > 0 else MISSING

    rows = []
    phases = report.get("phases") or {}
    for name, seconds in sorted(phases.items(), key=lambda kv: -(kv[1] or 0.0)):
        rows.append([name, _sec(seconds), share(seconds), _text(buckets.get(name))])
        for child, child_s in sorted(substages.get(name, []), key=lambda kv: -(kv[1] or 0.0)):
            rows.append([f"  {child}", _sec(child_s), share(child_s), ""])
    return ["Phases", *_grid(["phase", "seconds", "% of E2E", "bucket"], rows, [False, True, True, False])]


def _attempts(report: dict) -> list[str]:
    rows = []
    for a in report.get("attempts") or []:
        first, last = a.get("first_step"), a.get("last_step")
        steps = MISSING if first is None and last is None else f"{_text(first)}..{_text(last)}"
        rows.append([
            _text(a.get("attempt")), _text(a.get("status")), _text(a.get("exception_type")),
            _sec(a.get("time_to_start_s")), steps, _utc(a.get("begin_us")), _utc(a.get("end_us")),
        ])
    headers = ["attempt", "status", "exception", "time to start s", "steps", "begin (UTC)", "end (UTC)"]
    lines = ["Attempts", *_grid(headers, rows, [True, False, False, True, False, False, False])]
    # Notes (Recorder.set_note: the compile path a start took, why it fell back), one line each.
    for a in report.get("attempts") or []:
        for key, value in sorted((a.get("notes") or {}).items()):
            lines.append(f"  attempt {_text(a.get('attempt'))} {shown(key)}: {shown(value)}")
    return lines


def _recoveries(report: dict) -> list[str]:
    rows = []
    for i, r in enumerate(report.get("recoveries") or []):
        resumed = r.get("resumed_attempt") if r.get("recovered", True) else None
        breakdown = " ".join(f"{k}={_sec(v)}" for k, v in (r.get("breakdown") or {}).items())
        rows.append([
            str(i), f"{_text(r.get('failed_attempt'))} -> {_text(resumed)}", _text(r.get("category")),
            _sec(r.get("total_s")), _sec(r.get("retraining_s")), _text(r.get("restored_from")),
            breakdown or MISSING,
        ])
    headers = ["failure", "attempts", "category", "total s", "retraining s", "restored from", "breakdown (s)"]
    return ["Failures / Time to Recover",
            *_grid(headers, rows, [True, False, False, True, True, False, False])]


def _checkpointing(report: dict) -> list[str]:
    blocking = report.get("checkpoint_blocking_s") or {}
    unsaved = report.get("unsaved_training_s") or {}
    ckpt = report.get("checkpoints") or {}
    source = ckpt.get("interval_source")
    return [
        "Checkpointing",
        f"  blocking          measured {format_duration(blocking.get('measured'))}, "
        f"estimated {format_duration(blocking.get('estimated'))}",
        f"  unsaved training  measured {format_duration(unsaved.get('measured'))}, "
        f"estimated {format_duration(unsaved.get('estimated'))}",
        f"  checkpoints       {_text(ckpt.get('count'))}, mean blocking {format_duration(ckpt.get('blocking_mean_s'))}, "
        f"median durable latency {format_duration(ckpt.get('durable_latency_median_s'))}"
        + (f", {ckpt['refused']} refused (torn snapshot)" if ckpt.get("refused") else "")
        + (f", {ckpt['failed']} FAILED, nothing committed (see the log)" if ckpt.get("failed") else ""),
        f"  interval in use   {format_duration(ckpt.get('interval_s'))}" + (f" ({shown(source)})" if source else ""),
        *_memory_tier(ckpt),
    ]


def _memory_tier(ckpt: dict) -> list[str]:
    """The memory tier's line; without one the lines above are all there is (they are the disk tier's)."""
    mem = (ckpt.get("tiers") or {}).get("memory")
    if not mem:
        return []
    source = mem.get("interval_source")
    restores = mem.get("restores") or 0
    return [
        f"  memory tier       {_text(mem.get('count'))} saves, mean blocking {format_duration(mem.get('blocking_mean_s'))}, "
        f"median time to committed {format_duration(mem.get('durable_latency_median_s'))}"
        + (f", {mem['refused']} refused (torn snapshot)" if mem.get("refused") else "")
        + (f", {mem['failed']} FAILED, nothing committed (see the log)" if mem.get("failed") else ""),
        f"                    interval {format_duration(mem.get('interval_s'))}" + (f" ({shown(source)})" if source else "")
        + f", recommended {format_duration(mem.get('recommended_interval_s'))}; {restores} "
        + ("restore" if restores == 1 else "restores") + f", re-trained {format_duration(mem.get('retraining_s'))} after them",
        "  (the checkpoint lines above and the recommendation below are the disk tier's)",
    ]


def _recommendation(report: dict) -> list[str]:
    rec = report.get("recommendation")
    mtbf = f"  MTBF              {format_duration(report.get('mtbf_s'))}"
    if report.get("mtbf_source"):
        mtbf += f" ({report['mtbf_source']})"
    if not rec:
        return ["Recommendation", f"  interval          {format_duration(report.get('recommended_interval_s'))}", mtbf]
    steps = rec.get("interval_steps")
    variants = " ".join(f"{k}={_sec(v)}" for k, v in (rec.get("variants") or {}).items())
    lines = [
        "Recommendation",
        f"  interval          {format_duration(rec.get('interval_s'))}"
        + (f" ({steps} steps)" if steps is not None else "") + f", method {_text(rec.get('method'))}",
        f"  current interval  {format_duration(rec.get('current_interval_s'))}",
        f"  waste             at current {format_duration(rec.get('waste_at_current_s'))}, "
        f"at recommended {format_duration(rec.get('waste_at_recommended_s'))}",
        f"  expected saving   {format_duration(rec.get('expected_saving_s'))}",
        f"  variants (s)      {variants or MISSING}",
        f"  floor             {format_duration(rec.get('floor_s'))}",
        mtbf,
    ]
    if rec.get("note"):
        lines.append(f"  note              {shown(rec['note'])}")
    return lines


def _skew(report: dict) -> list[str]:
    skew = report.get("rank_skew") or {}
    rows = [
        [name, _num(s.get("min"), 3), _num(s.get("median"), 3), _num(s.get("max"), 3), _num(s.get("skew_s"), 3)]
        for name, s in (skew.get("phases") or {}).items()
    ]
    lines = ["Per-rank skew", *_grid(["phase", "min s", "median s", "max s", "skew s"], rows,
                                     [False, True, True, True, True])]
    starts = skew.get("attempt_start_skew_s")
    if starts:
        lines.append("  attempt start skew (s): " + ", ".join(_num(s, 3) for s in starts))
    return lines


def _ledger(report: dict) -> list[str]:
    ledger = report.get("ledger") or {}
    lines = [
        "Ledger",
        f"  files {_text(ledger.get('files'))}, records {_text(ledger.get('records'))}, "
        f"corrupt lines {_text(ledger.get('corrupt_lines'))}, torn lines {_text(ledger.get('torn_lines'))}, "
        f"dropped events {_text(ledger.get('dropped_events'))}",
    ]
    warnings = ledger.get("warnings") or []
    lines.append(f"  warnings: {len(warnings)}")
    lines.extend(f"    - {shown(w)}" for w in warnings)  # they may quote a ledger's own bytes
    return lines


def format_report(report: dict) -> str:
    """Returns the report as aligned plain text, one section per part of the report."""
    sections = [_header, _phases, _attempts, _recoveries, _checkpointing, _recommendation, _skew, _ledger]
    return "\n\n".join("\n".join(section(report)) for section in sections) + "\n"
