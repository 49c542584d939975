"""The live view's copies of the report's two timeline rules (python/ettkit/ett/_ownership.py) against the
corpus that tests/cpp/ett/ownership_rules_test.cpp holds the C++ rules (src/ett/report_timeline.cpp) to:
tests/data/ownership_rules.json. Both sides give the corpus's verdicts, so they agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ettkit.ett import _live_figures, _ownership
from ettkit.ett.live_ledger import _Attempt

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "ownership_rules.json").read_text())
KINDS = {"phase": _ownership.PHASE, "training": _ownership.TRAINING, "wasted": _ownership.WASTED}
LAYERS = {"filler": _ownership.FILLER, "step": _ownership.STEP, "phase": _ownership.PHASE_LAYER}


def items_of(case: dict) -> list[_ownership.Item]:
    """The corpus case's items as the live view holds records, in the corpus's order (its file order)."""
    return [(it["b"], it["e"], LAYERS[it["layer"]], seq, it["name"], KINDS[it["kind"]])
            for seq, it in enumerate(case["items"])]


def flatten(case: dict) -> list[list]:
    """The corpus case's owners as the live view decides them, coalesced as the report's flatten() does."""
    out: list[list] = []
    for p, q, top in _ownership.owner_spans(items_of(case), case["lo"], case["hi"]):
        name, kind = ("unattributed", _ownership.UNATTRIBUTED) if top is None else (top[4], top[5])
        if out and out[-1][1] == p and (out[-1][2], out[-1][3]) == (name, kind):
            out[-1][1] = q
        else:
            out.append([p, q, name, kind])
    return [seg[:3] for seg in out]


@pytest.mark.parametrize("case", CORPUS["flatten"], ids=lambda c: c["case"])
def test_the_live_view_owns_each_instant_as_the_report_does(case):
    assert flatten(case) == case["owners"]


def test_owning_a_span_in_two_windows_gives_what_owning_it_at_once_does():
    # What lets the live view settle its window: items are ranked by their whole interval.
    for case in CORPUS["flatten"]:
        items = items_of(case)
        lo, hi = case["lo"], case["hi"]
        whole: tuple[dict, dict] = ({}, {})
        _ownership.own(items, lo, hi, False, 0, None, *whole)
        for cut in range(lo + 1, hi):
            parts: tuple[dict, dict] = ({}, {})
            first = _ownership.own(items, lo, cut, False, 0, None, *parts)
            _ownership.own(items, cut, hi, False, 0, first, *parts)
            assert parts == whole, (case["case"], cut)


def attempts_of(case: dict) -> list[tuple[int, _Attempt]]:
    """The corpus case's ranks as the attempts (number 0) the live view folds from their records."""
    out = []
    for r in case["ranks"]:
        a = _Attempt(0, r["ts"], None, None, first=True)
        a.activity_end, a.last_ts = r["activity_end"], r["last_ts"]
        end = r["end"]
        if end is not None:  # else killed: no end record
            a.has_end, a.end_ts, a.status, a.detail = True, end["ts"], end["status"], end["detail"]
        out.append((r["rank"], a))
    return out


class _RankAttempts:
    def __init__(self, rank: int, a: _Attempt) -> None:
        self.rank, self.attempts = rank, [a]


@pytest.mark.parametrize("case", CORPUS["cause_of_failure"], ids=lambda c: c["case"])
def test_the_live_view_names_a_failure_as_the_report_does(case):
    ranks = attempts_of(case)
    # latest_attempt 1: a later attempt exists, so an attempt without an end record was killed (as the report,
    # which knows its process is gone, decides).
    jobs = _live_figures.job_view([_RankAttempts(rank, a) for rank, a in ranks], latest_attempt=1)
    assert jobs[0]["failed"] is True
    assert jobs[0]["category"] == case["category"]
    assert jobs[0]["failure_point"] == case["failure_point"]
    failed = [(a.failure_point(), rank, a) for rank, a in ranks if _live_figures.rank_failed(a, 1)]
    assert _ownership.cause_of_failure(failed).detail == case["detail"]
    assert _ownership.cause_of_failure(failed[::-1]).detail == case["detail"]  # whatever the order
