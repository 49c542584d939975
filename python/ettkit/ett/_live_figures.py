"""The live figures from what :class:`ettkit.ett.live_ledger.LiveLedger` folded: the job view of each
attempt over every rank (failed or not, its failure point and category), and the lowest rank's owned time
summed into buckets, phases, badput, Time to Start, Time to Recover and checkpoint counts, with the
report's keys (docs/ett.md "Live metrics" lists where the two differ).

The attempts are duck-typed: whatever has the fields of ``live_ledger._Attempt`` (number, status, has_end,
activity_end, ...) and, for the owned time, a callable that gives an attempt's (pre, post, first_training).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from .. import _C
from ._ownership import LOST, PHASE, TRAINING, UNATTRIBUTED, WASTED, cause_of_failure, failure_category

EFFECTIVE, IDLE, FAILURE, UNATTRIBUTED_BUCKET = "effective", "idle", "failure", "unattributed"
_BASE_BUCKET = {PHASE: IDLE, TRAINING: EFFECTIVE, WASTED: FAILURE, UNATTRIBUTED: UNATTRIBUTED_BUCKET,
                LOST: FAILURE}
_TIERS = ("disk", "memory")

# An attempt's owned time: (µs per (name, kind) before its first training, from it on, the first training).
Owned = tuple[dict, dict, Optional[int]]


@functools.lru_cache(maxsize=4096)
def top_level_phase(name: str) -> str:
    """The top-level phase ``name`` rolls up into, as the report groups phases (the C++ rule,
    ``ettkit::ett::top_level_phase``): ``"parent/child"`` -> ``"parent"``, a launcher_init sub-stage ->
    ``"launcher_init"``, any other name -> itself. Cached: a ledger has few distinct names."""
    return _C.ett.top_level_phase(name)


@functools.lru_cache(maxsize=4096)
def _badput_category(name: str) -> str:
    from .badput import badput_category  # the C++ mapping; imported on first use, as the exporters do

    return badput_category(name)


def checkpoint_tier(name: str, phase: str) -> Optional[str]:
    """``"disk"`` or ``"memory"`` for a record of checkpoint phase ``phase`` (report.cpp checkpoint_tier):
    ``<phase>/memory`` is the memory tier's, the phase itself and its other sub-stages the disk tier's."""
    if name == phase:
        return "disk"
    if not name.startswith(phase + "/"):
        return None
    return "memory" if name[len(phase):] == "/memory" else "disk"


def rank_failed(a: Any, latest_attempt: Optional[int]) -> bool:
    """Whether one rank's attempt ``a`` failed. Without an end record an attempt is killed once any rank has
    a later attempt (``latest_attempt``); before that it runs."""
    return a.status != "clean" if a.has_end else a.number < latest_attempt


def job_failure(files: Iterable[Any], number: int,
                latest_attempt: Optional[int]) -> tuple[bool, Optional[int]]:
    """Whether attempt ``number`` failed on any rank of ``files``, and the job's failure point (the
    earliest failed rank's, see :func:`job_view`)."""
    failed, point = False, None
    for rf in files:
        for a in rf.attempts:
            if a.number == number and rank_failed(a, latest_attempt):
                p = a.failure_point()
                failed, point = True, p if point is None else min(point, p)
    return failed, point


def job_cause(files: Iterable[Any], number: int, latest_attempt: Optional[int]) -> Any:
    """The attempt record of the rank that names attempt ``number``'s failure (:func:`cause_of_failure`), or
    None when no rank failed in it."""
    failed = [(a.failure_point(), rf.rank, a) for rf in files for a in rf.attempts
              if a.number == number and rank_failed(a, latest_attempt)]
    return cause_of_failure(failed) if failed else None


def job_view(files: Iterable[Any], latest_attempt: Optional[int]) -> dict[int, dict]:
    """The job view of each attempt number over every rank file of ``files``: failed (any rank failed in
    it), its failure point (the earliest failed rank's last activity) and category, as report_timeline.cpp
    decides them (:func:`ettkit.ett._ownership.cause_of_failure`)."""
    jobs: dict[int, dict] = {}
    failed_ranks: dict[int, list] = {}  # attempt -> (failure point, rank, attempt) of its failed ranks
    for rf in sorted(files, key=lambda r: r.rank):
        for a in rf.attempts:
            job = jobs.setdefault(a.number, {"failed": False, "failure_point": None, "category": None})
            if not rank_failed(a, latest_attempt):
                continue
            point = a.failure_point()
            if not job["failed"] or point < job["failure_point"]:
                job["failure_point"] = point
            job["failed"] = True
            failed_ranks.setdefault(a.number, []).append((point, rf.rank, a))
    for number, failed in failed_ranks.items():
        jobs[number]["category"] = failure_category(cause_of_failure(failed))
    return jobs


def add_failures(jobs: dict[int, dict], out: dict) -> list[tuple[int, int]]:
    """Writes the attempt and failure counts of ``jobs`` into ``out``; returns the failures as
    (failure point, attempt number), in failure-point order."""
    out["attempts"] = len(jobs)
    failed = sorted((j["failure_point"], n) for n, j in jobs.items() if j["failed"])
    by_category: dict[str, int] = {}
    for _, n in failed:
        by_category[jobs[n]["category"]] = by_category.get(jobs[n]["category"], 0) + 1
    out["failures"] = len(failed)
    out["failures_by_category"] = by_category
    return failed


class _Totals:
    """Owned time summed by bucket, top-level phase, badput category and checkpoint tier."""

    def __init__(self) -> None:
        self.buckets = {EFFECTIVE: 0, IDLE: 0, FAILURE: 0, UNATTRIBUTED_BUCKET: 0}
        self.phases: dict[str, int] = {}
        self.badput: dict[str, int] = {}
        self.tier_blocking = {"disk": 0, "memory": 0}

    def account(self, name: str, us: int, bucket: str) -> None:
        self.buckets[bucket] += us
        top = top_level_phase(name)
        self.phases[top] = self.phases.get(top, 0) + us
        if bucket != EFFECTIVE:
            c = _badput_category(name)
            c = "OTHER" if c == "GOODPUT" else c  # "training" while the job still recovered
            self.badput[c] = self.badput.get(c, 0) + us
        tier = checkpoint_tier(name, "checkpoint_blocking")
        if tier is not None:
            self.tier_blocking[tier] += us


def add_timeline_figures(attempts: Sequence[Any], jobs: dict[int, dict], failed: list[tuple[int, int]],
                         owned: Callable[[Any, bool, Optional[int]], Owned], out: dict) -> None:
    """Writes the figures of one rank's ``attempts`` (the lowest rank's, in file order) into ``out``: E2E,
    bucket seconds and shares, phases, badput, Time to Start and to Recover, checkpoints and steps.
    ``owned(a, failed, point)`` gives attempt ``a``'s owned time given the job's view of it."""
    totals = _Totals()
    numbers = sorted(jobs)
    index = {n: i for i, n in enumerate(numbers)}
    first_training: dict[int, int] = {}
    tts: dict[int, float] = {}
    ended = None  # the latest end of the rank's attempts so far
    previous = None
    saves = {"disk": 0, "memory": 0}
    for a in attempts:
        job = jobs[a.number]
        pre, post, first = owned(a, job["failed"], job["failure_point"])
        if ended is not None and a.begin > ended:
            # No record of the rank covers the gap between two of its attempts.
            prev_failed = jobs[previous.number]["failed"]
            totals.account("detect_and_teardown" if prev_failed else "restart_gap", a.begin - ended,
                           FAILURE if prev_failed else IDLE)
        i = index[a.number]
        recovery = i > 0 and jobs[numbers[i - 1]]["failed"]
        for (name, kind), us in pre.items():
            totals.account(name, us, FAILURE if recovery else _BASE_BUCKET[kind])
        for (name, kind), us in post.items():
            totals.account(name, us, _BASE_BUCKET[kind])
        if first is not None:
            first_training[a.number] = first
            tts[a.number] = (first - a.alloc_begin) / 1e6
        for tier in saves:
            saves[tier] += len(a.timeline.blocked_steps[tier]) + a.timeline.unnumbered[tier]
        ended = a.last_ts if ended is None else max(ended, a.last_ts)
        previous = a

    buckets, phases = totals.buckets, totals.phases
    e2e_us = sum(buckets.values())
    out["e2e_s"] = e2e_us / 1e6
    for bucket, us in buckets.items():
        out[f"{bucket}_s"] = us / 1e6
    for bucket, key in ((EFFECTIVE, "ett_pct"), (IDLE, "idle_pct"), (FAILURE, "failure_pct"),
                        (UNATTRIBUTED_BUCKET, "unattributed_pct")):
        out[key] = 100.0 * buckets[bucket] / e2e_us if e2e_us > 0 else None
    out["phases"] = {name: us / 1e6 for name, us in sorted(phases.items())}
    from .badput import BADPUT_CATEGORIES

    out["badput"] = {c: totals.badput.get(c, 0) / 1e6 for c in BADPUT_CATEGORIES}
    out["time_to_start_s"] = tts
    out["time_to_recover_s"] = time_to_recover(failed, numbers, first_training, ended)
    out["checkpoint_blocking_s"] = phases.get("checkpoint_blocking", 0) / 1e6
    out["checkpoints"] = {tier: {"count": saves[tier], "blocking_s": totals.tier_blocking[tier] / 1e6}
                          for tier in _TIERS
                          if tier == "disk" or saves[tier] or totals.tier_blocking[tier]}
    out["last_step"] = next((a.last_step for a in reversed(attempts) if a.last_step is not None), None)
    out["max_step"] = max((a.max_step for a in attempts if a.max_step is not None), default=None)


def time_to_recover(failed: list[tuple[int, int]], numbers: list[int], first_training: dict[int, int],
                    end: int) -> list[float]:
    """Time to Recover per failure in failure-point order (docs/ett.md §7): to the first training of the
    first later attempt that trains after the failure point, cut at the next failure; still growing (to
    the latest record ``end``) while the job has not trained again."""
    out = []
    for k, (f, attempt) in enumerate(failed):
        stop = end
        for n in numbers:
            if n > attempt and first_training.get(n, -1) > f:
                stop = first_training[n]
                break
        if k + 1 < len(failed) and failed[k + 1][0] < stop:
            stop = failed[k + 1][0]
        out.append(max(stop - f, 0) / 1e6)
    return out
