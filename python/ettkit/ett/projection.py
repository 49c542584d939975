"""What-if projection: the ETT% a long job would reach, from the costs one measured run shows
(docs/ett.md, "Projection").

Meta's ETT model (their Figure 7) with the run's own measurements: a job of ``days`` wall-clock days that
fails ``λ`` times a day pays, per failure, the measured mean Time to Recover ``R`` plus, on average, half a
checkpoint interval of unsaved work ``I/2``; it pays ``B`` per checkpoint, ``E/I`` checkpoints for ``E``
seconds of training; it starts up (``S``, the measured Time to Start) and shuts down (``D``) once; and the
rest of the run's non-training time (evaluation, data stalls, uninstrumented time, ...) recurs at the
measured rate ``ρ`` per second of training. The interval is Young's optimum, ``I* = √(2·B·MTBF)`` with
``MTBF = 86400/λ``, from the project's own advisor (``ett.recommend_interval``), never shorter than the
run's measured durable latency (the report's floor). Solving ``T = S + D + N·(R + I/2) + E·(1 + B/I + ρ)``
for ``E`` gives ``ETT% = 100·E/T``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from .advisor import recommend_interval
from .fleet import split_phases
from .table import _grid, _num, _sec, format_duration, shown

DAY_S = 86400.0
MAX_DAYS = 3650.0
#: Failure rates (per day) of the what-if table, Meta's Figure-7 range, when no per-device rate is given.
TABLE_FAILURES_PER_DAY = (0.5, 1.0, 2.0, 4.0)
#: World-size factors of the what-if table when the rate is given per 1,000 devices.
TABLE_WORLD_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
#: The waste components, in the order the table prints them.
COMPONENTS = ("startup", "shutdown", "checkpoint_blocking", "failure_recovery", "unsaved_work", "other_idle")


def _positive(name: str, value: Any, upper: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name}={value!r} must be a number")
    v = float(value)
    if not math.isfinite(v) or v <= 0 or v > upper:
        bound = f"in (0, {upper:g}]" if math.isfinite(upper) else "a positive, finite number"
        raise InvalidArgumentError(f"{name}={value!r} must be {bound}")
    return v


def _field(report: Mapping, path: str) -> Any:
    value: Any = report
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise InvalidArgumentError(f"report has no {path!r}: pass the dict of ett.build_report(run_dir)")
        value = value[key]
    return value


def measured_inputs(report: Mapping) -> dict[str, Any]:
    """The run's costs the projection holds fixed (seconds), with where each came from.

    ``blocking_s`` (B, the disk tier's mean checkpoint blocking), ``floor_s`` (its median durable latency,
    or None), ``restart_s`` (R, the mean Time to Recover of the recovered failures; without one, the mean
    Time to Start of the run's attempts, a lower bound that leaves out detection and requeue:
    ``restart_source`` says which), ``startup_s`` (S, attempt 0's Time to Start), ``shutdown_s`` (D, the
    idle ``shutdown`` time), ``other_idle_per_training_s`` (ρ), ``recovery_breakdown_s`` (mean seconds per
    phase of a recovery, or None), ``world_size`` and ``current_interval_s``. Raises
    ``InvalidArgumentError`` naming the report field the run lacks.
    """
    if not isinstance(report, Mapping):
        raise InvalidArgumentError(f"report must be the dict of ett.build_report(run_dir), not {type(report).__name__}")
    blocking = _field(report, "checkpoints.blocking_mean_s")
    if blocking is None or blocking <= 0:
        raise InvalidArgumentError("report has no checkpoint blocking (checkpoints.blocking_mean_s is "
                                   f"{blocking!r}): the run saved no checkpoint, so there is no cost per "
                                   "checkpoint to project; measure a run that checkpoints")
    effective = float(_field(report, "effective_s") or 0.0)
    if effective <= 0:
        raise InvalidArgumentError("report has no training (effective_s is 0): nothing to project from")
    attempts = _field(report, "attempts")
    startup = attempts[0].get("time_to_start_s") if attempts else None
    if startup is None:
        raise InvalidArgumentError("report's first attempt never trained (attempts[0].time_to_start_s is null): "
                                   "the run measured no Time to Start")
    recovered = [r for r in _field(report, "recoveries") if r.get("recovered")]
    if recovered:
        restart = sum(float(r["total_s"]) for r in recovered) / len(recovered)
        source = f"mean time to recover of {len(recovered)} recovered failure(s)"
        breakdown: dict[str, float] | None = {}
        for r in recovered:
            for name, seconds in (r.get("breakdown") or {}).items():
                breakdown[name] = breakdown.get(name, 0.0) + float(seconds) / len(recovered)
    else:
        starts = [float(s) for s in _field(report, "time_to_start_s")]
        restart = sum(starts) / len(starts)
        source = "no recovered failure: mean time to start (a lower bound: no detection, no requeue)"
        breakdown = None
    idle = split_phases(dict(report))["idle"]
    shutdown = idle.get("shutdown", 0.0)
    tiers = (report["checkpoints"].get("tiers") or {})
    disk_blocking = float((tiers.get("disk") or {}).get("blocking_s")
                          or _field(report, "checkpoint_blocking_s.measured") or 0.0)
    # Everything else that is neither training nor failure recurs with training: eval, data stalls,
    # uninstrumented time, restarts after clean attempts. Start-up's unattributed part is inside S already.
    other = float(_field(report, "idle_s")) + float(_field(report, "unattributed_s")) - startup - shutdown - disk_blocking
    return {
        "blocking_s": float(blocking),
        "floor_s": report["checkpoints"].get("durable_latency_median_s"),
        "restart_s": restart,
        "restart_source": source,
        "startup_s": float(startup),
        "shutdown_s": shutdown,
        "other_idle_per_training_s": max(0.0, other) / effective,
        "recovery_breakdown_s": breakdown,
        "world_size": int(report.get("world_size") or 1),
        "current_interval_s": report["checkpoints"].get("interval_s"),
    }


def _scenario(m: dict, days: float, failures_per_day: float, interval_s: float | None = None) -> dict[str, Any]:
    """One projected job: ETT% and seconds per waste component, for λ failures a day."""
    total = days * DAY_S
    failures = failures_per_day * days
    mtbf = DAY_S / failures_per_day
    if interval_s is None:
        optimum = recommend_interval(m["blocking_s"], mtbf, method="young")
        interval = max(optimum, m["floor_s"] or 0.0)
    else:
        interval = interval_s
    B, R, S, D, rho = m["blocking_s"], m["restart_s"], m["startup_s"], m["shutdown_s"], m["other_idle_per_training_s"]
    per_failure = R + interval / 2.0
    left = total - S - D - failures * per_failure
    effective = max(0.0, left) / (1.0 + B / interval + rho)
    if left > 0:
        parts = {"startup": S, "shutdown": D, "checkpoint_blocking": effective * B / interval,
                 "failure_recovery": failures * R, "unsaved_work": failures * interval / 2.0,
                 "other_idle": rho * effective}
    else:  # failures eat everything after start-up: what is left is failure time, recovery first
        lost = total - S - D
        recovery = min(lost, failures * R)
        parts = {"startup": S, "shutdown": D, "checkpoint_blocking": 0.0, "failure_recovery": recovery,
                 "unsaved_work": lost - recovery, "other_idle": 0.0}
    waste = total - effective
    dominant = max(COMPONENTS, key=lambda c: parts[c])
    return {
        "failures_per_day": failures_per_day,
        "failures": failures,
        "mtbf_h": mtbf / 3600.0,
        "interval_s": interval,
        "effective_s": effective,
        "ett_pct": 100.0 * effective / total,
        "idle_pct": 100.0 * (parts["startup"] + parts["shutdown"] + parts["checkpoint_blocking"]
                             + parts["other_idle"]) / total,
        "failure_pct": 100.0 * (parts["failure_recovery"] + parts["unsaved_work"]) / total,
        "waste_s": parts,
        "dominant": dominant,
        "dominant_share_pct": 100.0 * parts[dominant] / waste if waste > 0 else None,
        "progress": left > 0,
    }


def project(report: Mapping, days: float = 30, failures_per_day: float | None = None, *,
            mtbf_h: float | None = None, failures_per_1000_per_day: float | None = None,
            world_size: int | None = None) -> dict[str, Any]:
    """Projects ETT% for a ``days``-day job from the measured ``report`` (docs/ett.md, "Projection").

    Give the failure rate exactly one way: ``failures_per_day`` (the whole job's), ``mtbf_h`` (the job's
    mean time between failures, hours) or ``failures_per_1000_per_day`` (per 1,000 devices: the job's
    rate is that × ``world_size``/1000, failures being independent per device). ``world_size`` defaults to
    the run's; the measured costs are held at their measured values whatever the world size. Returns the
    inputs, the projection at Young's interval (``ett_pct``, ``waste_s`` per component, the ``dominant``
    one and, when it is failure recovery, its ``dominant_phase``), the same at the run's current interval
    when it has one, and a what-if ``table`` over failure rates (or over world sizes, for a per-device
    rate). Raises ``ettkit.InvalidArgumentError`` naming the bad argument and its valid range, or the
    report field the run lacks.
    """
    days = _positive("days", days, MAX_DAYS)
    given = [n for n, v in (("failures_per_day", failures_per_day), ("mtbf_h", mtbf_h),
                            ("failures_per_1000_per_day", failures_per_1000_per_day)) if v is not None]
    if len(given) != 1:
        raise InvalidArgumentError("give exactly one of failures_per_day, mtbf_h, failures_per_1000_per_day "
                                   f"(got {', '.join(given) if given else 'none'})")
    m = measured_inputs(report)
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError(f"world_size={world_size!r} must be a positive integer (devices)")
    world = world_size if world_size is not None else m["world_size"]
    per_1000 = None
    if failures_per_day is not None:
        rate = _positive("failures_per_day", failures_per_day)
    elif mtbf_h is not None:
        rate = 24.0 / _positive("mtbf_h", mtbf_h)
    else:
        per_1000 = _positive("failures_per_1000_per_day", failures_per_1000_per_day)
        rate = per_1000 * world / 1000.0
    if days * DAY_S <= m["startup_s"] + m["shutdown_s"]:
        raise InvalidArgumentError(f"days={days!r} is shorter than the run's start-up and shutdown "
                                   f"({m['startup_s'] + m['shutdown_s']:.1f} s): project a longer job")

    def row(r: float, w: int) -> dict[str, Any]:
        s = _scenario(m, days, r)
        s["world_size"] = w
        s["accelerator_h"] = w * days * 24.0
        s["lost_accelerator_h"] = w * (days * DAY_S - s["effective_s"]) / 3600.0
        return s

    result = row(rate, world)
    if result["dominant"] == "failure_recovery" and m["recovery_breakdown_s"]:
        phase, seconds = max(m["recovery_breakdown_s"].items(), key=lambda kv: (kv[1], kv[0]))
        result["dominant_phase"] = {"phase": phase, "share_of_recovery_pct": 100.0 * seconds / m["restart_s"]}
    else:
        result["dominant_phase"] = None
    current = None
    if m["current_interval_s"]:
        c = _scenario(m, days, rate, interval_s=float(m["current_interval_s"]))
        current = {"interval_s": c["interval_s"], "ett_pct": c["ett_pct"],
                   "ett_gain_pct": result["ett_pct"] - c["ett_pct"]}
    if per_1000 is None:
        table = [row(r, world) for r in sorted({*TABLE_FAILURES_PER_DAY, rate})]
    else:
        sizes = sorted({max(1, round(world * f)) for f in TABLE_WORLD_FACTORS} | {world})
        table = [row(per_1000 * w / 1000.0, w) for w in sizes]
    return {
        "days": days,
        "world_size": world,
        "failures_per_1000_per_day": per_1000,
        "inputs": m,
        **result,
        "at_current_interval": current,
        "table": [{k: t[k] for k in ("failures_per_day", "world_size", "mtbf_h", "interval_s", "ett_pct",
                                     "idle_pct", "failure_pct", "dominant", "lost_accelerator_h")} for t in table],
    }


def format_projection(p: Mapping, run_dir: str | None = None) -> str:
    """The projection as plain text (what ``python -m ettkit project`` prints). What came from the ledger or the
    command line (the run directory, phase names) is printed through :func:`.table.shown`: escaped."""
    m = p["inputs"]
    lines = [
        f"ETT projection{f' from {shown(run_dir)}' if run_dir else ''}: {p['days']:g} days, world size {p['world_size']}, "
        f"{p['failures_per_day']:.3g} failures/day (MTBF {p['mtbf_h']:.3g} h)",
        f"  measured      recovery R {format_duration(m['restart_s'])} ({shown(m['restart_source'])})",
        f"                blocking B {format_duration(m['blocking_s'])} per checkpoint, start-up S {format_duration(m['startup_s'])}, "
        f"shutdown D {format_duration(m['shutdown_s'])}, other idle {_num(100 * m['other_idle_per_training_s'], 2, '%')} "
        "of training",
        f"  interval      {format_duration(p['interval_s'])} (Young: sqrt(2 B MTBF)"
        + (f", floor {format_duration(m['floor_s'])}" if m["floor_s"] else "") + ")",
        f"  ETT%          {_num(p['ett_pct'], 2, '%')}   Idle% {_num(p['idle_pct'], 2, '%')}   "
        f"Failure% {_num(p['failure_pct'], 2, '%')}",
        f"  lost          {p['lost_accelerator_h']:.1f} of {p['accelerator_h']:.1f} accelerator-hours",
    ]
    if not p["progress"]:
        lines.append("  the job makes no progress: its failures cost more than the time between them")
    cur = p.get("at_current_interval")
    if cur:
        lines.append(f"  at the run's interval {format_duration(cur['interval_s'])}: ETT% {_num(cur['ett_pct'], 2, '%')} "
                     f"({_num(cur['ett_gain_pct'], 2)} points below the recommended interval's)")
    dom = f"  dominant      {shown(p['dominant'])} ({_num(p['dominant_share_pct'], 1, '%')} of the waste)"
    if p.get("dominant_phase"):
        dom += (f"; mostly {shown(p['dominant_phase']['phase'])} "
                f"({_num(p['dominant_phase']['share_of_recovery_pct'], 1, '%')} of a recovery)")
    lines += [dom, "", "Waste (s)",
              *_grid(["component", "seconds", "% of job"],
                     [[c, _sec(p["waste_s"][c]), _num(100 * p["waste_s"][c] / (p["days"] * DAY_S), 2, "%")]
                      for c in COMPONENTS], [False, True, True]),
              "", "What-if" + (" (failure rate per 1,000 devices per day "
                                f"{p['failures_per_1000_per_day']:g})" if p["failures_per_1000_per_day"] else ""),
              *_grid(["failures/day", "world", "MTBF h", "interval s", "ETT%", "Idle%", "Failure%", "dominant",
                      "lost accel-h"],
                     [[f"{t['failures_per_day']:.3g}", str(t["world_size"]), f"{t['mtbf_h']:.3g}",
                       _sec(t["interval_s"]), _num(t["ett_pct"], 2, "%"), _num(t["idle_pct"], 2, "%"),
                       _num(t["failure_pct"], 2, "%"), shown(t["dominant"]), f"{t['lost_accelerator_h']:.1f}"]
                      for t in p["table"]], [True, True, True, True, True, True, True, False, True])]
    return "\n".join(lines) + "\n"
