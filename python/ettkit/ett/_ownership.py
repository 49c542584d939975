"""The two rules the live view shares with the report's timeline passes (src/ett/report_timeline.cpp):
**who owns each instant** of a rank's attempt (report_timeline.cpp's flatten()), and **which failed rank
names a job's failure** (its cause_of_failure()).

They are written twice, in C++ for the report and here for :class:`ettkit.ett.live_ledger.LiveLedger`, which
applies them incrementally, so one corpus pins both copies: ``tests/data/ownership_rules.json`` is read by
``tests/cpp/ett/ownership_rules_test.cpp`` and ``tests/python/test_ownership_rules.py``; a change to
either side's rule fails its test. Change both, and the corpus, together.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Optional, Protocol

# What a piece of owned time is (report_passes.h Kind) and which record wins where records overlap (Layer).
PHASE, TRAINING, WASTED, UNATTRIBUTED, LOST = range(5)
FILLER, STEP, PHASE_LAYER = range(3)

# report_timeline.cpp kPeerClockSkewUs: how far an exception may be recorded before a dead peer's last sign of
# life and still count as that death's consequence.
PEER_CLOCK_SKEW_US = 5000

# An interval a rank recorded, as the rule ranks it: (begin µs, end µs, layer, seq, name, kind). ``seq`` is
# the file order, the last tie-break ("listed first").
Item = tuple[int, int, int, int, str, int]


def owner_spans(items: Sequence[Item], lo: int, hi: int) -> Iterator[tuple[int, int, Optional[Item]]]:
    """The owner of every instant of [lo, hi), as (p, q, owner) spans in time order (owner None where no
    item covers the span; consecutive spans may have the same owner). report_timeline.cpp's flatten(): the
    covering item of the highest layer (phase > step > filler); within a layer the one that ends first, then
    the one that began last, then the one listed first (lowest ``seq``). Items are ranked by their whole
    interval, not by the part inside [lo, hi), so owning [lo, T) and then [T, hi) gives what owning [lo, hi)
    at once would: that is what lets the live window settle time. The owner is yielded as
    (-layer, e, -b, seq, name, kind), the key it won by."""
    if hi <= lo:
        return
    live = sorted(it for it in items if it[1] > lo and it[0] < hi)
    points = {lo, hi}
    for it in live:
        if it[0] > lo:
            points.add(it[0])
        if it[1] < hi:
            points.add(it[1])
    points = sorted(points)
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    nxt, n = 0, len(live)
    p = points[0]
    for q in points[1:]:
        while nxt < n and live[nxt][0] <= p:
            b, e, layer, seq, name, kind = live[nxt]
            push(heap, (-layer, e, -b, seq, name, kind))
            nxt += 1
        # Lazy deletion, as in report_timeline.cpp: an ended item leaves the heap once it reaches the top.
        while heap and heap[0][1] <= p:
            pop(heap)
        yield p, q, (heap[0] if heap else None)
        p = q


def own(items: Sequence[Item], lo: int, hi: int, failed: bool, failure_point: int,
        first_training: Optional[int], pre: dict, post: dict, survivor: bool = False) -> Optional[int]:
    """Adds the time each item owns within [lo, hi) (:func:`owner_spans`) to ``pre`` / ``post`` (µs per
    (name, kind)), split at the attempt's first training; returns the first training (the begin of its
    first training time). Uncovered time is unattributed. In a failed attempt, whatever the rank does from
    the job's failure point on is lost_in_flight (``failure_point``; the job redoes it after the restore):
    its uncovered tail, the report's fillers there, and, when another rank failed first, its records
    after that. On a ``survivor`` (any rank but the one that names the failure)
    the uncovered time from that point on is peer_teardown instead: waiting for the dead peer, torn down."""
    lost_uncovered = ("peer_teardown", LOST) if survivor else ("lost_in_flight", LOST)
    for p0, q0, top in owner_spans(items, lo, hi):
        # A span that straddles the job's failure point is split there, as report_timeline.cpp splits a
        # segment: its part after the point is lost.
        cut = failed and p0 < failure_point < q0
        for p, q in ((p0, failure_point), (failure_point, q0)) if cut else ((p0, q0),):
            first_training = _own_span(p, q, top, failed, failure_point, first_training, pre, post,
                                       lost_uncovered)
    return first_training


def _own_span(p: int, q: int, top: Optional[tuple], failed: bool, failure_point: int,
              first_training: Optional[int], pre: dict, post: dict, lost_uncovered: tuple) -> Optional[int]:
    """One span of :func:`own`: its owner's key (or the failure's), added to ``pre`` or ``post``."""
    if top is not None:
        if first_training is None and (top[5] == TRAINING or top[5] == WASTED):
            first_training = p  # report_timeline.cpp: before the failure-point split
        key = ("lost_in_flight", LOST) if failed and p >= failure_point else (top[4], top[5])
    elif failed and p >= failure_point:
        key = lost_uncovered
    else:
        key = ("unattributed", UNATTRIBUTED)
    target = post if first_training is not None and p >= first_training else pre
    target[key] = target.get(key, 0) + (q - p)
    return first_training


class FailedAttempt(Protocol):
    """What :func:`cause_of_failure` reads of one rank's failed attempt (the AttemptLedger fields)."""

    has_end: bool  # it wrote its end record
    end_ts: int
    last_ts: int   # the latest time any of its records mentions (heartbeats included)
    status: str    # the end record's: "exception", "signal", ... (any, without an end record)
    detail: str


def died_from_outside(a: FailedAttempt) -> bool:
    """Killed (no end record) or by a signal: a cause from outside the job."""
    return not a.has_end or a.status == "signal"


def last_alive(a: FailedAttempt) -> int:
    """The last instant the rank is known to have been alive: its end record, else its latest record."""
    return a.end_ts if a.has_end else a.last_ts


def cause_of_failure(failed: Sequence[tuple[int, int, FailedAttempt]]) -> FailedAttempt:
    """The failed rank that names a job's failure, among ``failed`` (failure point, rank, attempt), which
    must not be empty. Within each group (deaths from outside; exceptions and other statuses) the rank that
    stopped making progress first, the lowest rank on a tie; then the death from outside wins over the
    exception (usually its consequence: "Connection reset by peer") unless the exception was recorded while
    the dead rank was demonstrably still alive, more than :data:`PEER_CLOCK_SKEW_US` before its last sign
    of life. It depends only on the records, never on the order of ``failed``."""
    outside = min((f for f in failed if died_from_outside(f[2])), key=lambda f: f[:2], default=None)
    other = min((f for f in failed if not died_from_outside(f[2])), key=lambda f: f[:2], default=None)
    if outside is None or other is None:
        return (outside or other)[2]
    dead, raised = outside[2], other[2]
    return raised if last_alive(raised) + PEER_CLOCK_SKEW_US < last_alive(dead) else dead


def failure_category(a: FailedAttempt) -> str:
    """The category a failure named by attempt ``a`` is counted under: ``killed`` (no end record),
    ``exception:<Type>`` (the detail's text before ": ", so C++ names keep their namespace) or the end
    record's status."""
    if not a.has_end:
        return "killed"
    if a.status == "exception":
        sep = a.detail.find(": ")
        return "exception:" + (a.detail if sep < 0 else a.detail[:sep])
    return a.status
