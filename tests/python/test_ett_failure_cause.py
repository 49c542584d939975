"""Issue #47 item 6: a failure's category must not depend on which rank's last record came first.

Rank k is SIGKILLed (no end record); its peer's collective then fails with gloo's error and records an
exception. The two ranks' last records lie within a millisecond of each other in either order, so the old
rule (the rank whose last activity came first names the failure) reported `killed` or
`exception:RuntimeError` by chance. The killed rank is the cause in every order, in the report and in the
live view; an exception recorded while the other rank was demonstrably still alive stays the cause.
"""

from __future__ import annotations

import json
import os

import pytest

from ettkit import ett
from ettkit.ett.live import LiveLedger

T0 = 1_700_000_000_000_000  # epoch µs


def us(seconds: float) -> int:
    return T0 + round(seconds * 1_000_000)


class Ledger:
    def __init__(self, run_dir, rank: int) -> None:
        self.path = os.path.join(run_dir, "ett", f"rank-{rank}.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.rank = rank

    def rec(self, t: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"v": 1, "t": t, **fields}) + "\n")

    def attempt(self, n: int, ts: float) -> None:
        self.rec("attempt", attempt=n, rank=self.rank, world=2, ts=us(ts))

    def steps(self, last_end: float) -> None:
        """Steps 0..9, one second each, the last one ending at `last_end`."""
        for n in range(10):
            self.rec("step", n=n, b=us(n), e=us(last_end if n == 9 else n + 1))


GLOO = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def write_job(run_dir, killed: int, killed_last: float, survivor_last: float, survivor_end: float,
              killed_hb: float | None = None) -> None:
    """Attempt 0: rank `killed` dies without an end record after its last step (and heartbeat); the other
    rank ends with gloo's exception. Attempt 1: both ranks restart and train, so the live view, too, knows
    that attempt 0 is over."""
    for rank in (0, 1):
        led = Ledger(run_dir, rank)
        led.attempt(0, 0.0)
        led.steps(killed_last if rank == killed else survivor_last)
        if rank == killed and killed_hb is not None:
            led.rec("hb", ts=us(killed_hb))
        if rank != killed:
            led.rec("end", ts=us(survivor_end), status="exception", detail=GLOO)
        led.attempt(1, 20.0)
        led.rec("step", n=10, b=us(20.0), e=us(21.0))
        led.rec("end", ts=us(21.0), status="clean", detail="")


def categories(run_dir) -> tuple[dict, str, dict]:
    report = ett.build_report(run_dir, include_timeline=False)
    live = LiveLedger(run_dir)
    live.refresh()
    return report["failures_by_category"], report["attempts"][0]["status"], live.figures()["failures_by_category"]


# (survivor's last step end, survivor's exception record) around the killed rank's last step at 10.0 s:
# the survivor's last record before and after the killed rank's, and its exception recorded up to 1 ms
# before (clock skew between hosts) or after the killed rank's last record.
RACES = [(9.9995, 10.0009), (10.0005, 10.0009), (9.9995, 9.9991), (10.0, 10.0), (9.9991, 10.0001)]


@pytest.mark.parametrize("killed", [0, 1])
@pytest.mark.parametrize("survivor_last,survivor_end", RACES)
def test_the_killed_rank_names_the_failure_in_either_order(tmp_path, killed, survivor_last, survivor_end):
    write_job(tmp_path, killed, killed_last=10.0, survivor_last=survivor_last, survivor_end=survivor_end)
    report_categories, status, live_categories = categories(tmp_path)
    assert report_categories == {"killed": 1}
    assert status == "killed"
    assert live_categories == {"killed": 1}


def test_the_failure_point_is_still_the_first_rank_to_stop(tmp_path):
    # The cause and the failure point are separate questions: lost work still counts from the earliest
    # last activity (the survivor's step at 9.9995 s), whichever rank names the failure.
    write_job(tmp_path, killed=1, killed_last=10.0, survivor_last=9.9995, survivor_end=10.0009)
    report = ett.build_report(tmp_path, include_timeline=True)
    lost = [s for s in report["timeline"] if s["name"] == "lost_in_flight" and s["attempt"] == 0]
    assert min(s["begin_us"] for s in lost) == us(9.9995)


def test_an_exception_raised_while_the_peer_was_still_alive_is_the_cause(tmp_path):
    # Rank 0 raised at 10.5 s; rank 1 heartbeat at 11.5 s and was then torn down by the launcher (SIGKILL,
    # no end record): the kill is the exception's consequence, not its cause.
    write_job(tmp_path, killed=1, killed_last=10.0, survivor_last=10.0, survivor_end=10.5, killed_hb=11.5)
    report_categories, status, live_categories = categories(tmp_path)
    assert report_categories == {"exception:RuntimeError": 1}
    assert status == "exception"
    assert live_categories == {"exception:RuntimeError": 1}


def _owned_after_failure(report: dict, rank: int) -> dict:
    """Attempt 0's time on ``rank`` by segment name, in seconds (the report's timeline)."""
    out: dict = {}
    for s in report["timeline"]:
        if s["attempt"] == 0 and s["rank"] == rank and s["name"] in ("lost_in_flight", "peer_teardown"):
            out[s["name"]] = out.get(s["name"], 0.0) + (s["end_us"] - s["begin_us"]) / 1e6
    return out


def test_the_survivors_teardown_is_peer_teardown_not_lost_work(tmp_path):
    # Issue #63 item 3: rank 1 is SIGKILLed after its step ending at 10 s (heartbeat at 10.4 s: a step in
    # flight); rank 0 waits in its next collective until torchrun tears it down at 15 s (heartbeats, no end
    # record). Rank 1's tail is work lost in flight; rank 0's 5 s are its teardown, not lost training.
    for rank, last_step, hb in ((0, 10.2, [12.0, 15.0]), (1, 10.0, [10.4])):
        led = Ledger(tmp_path, rank)
        led.attempt(0, 0.0)
        led.steps(last_step)
        for t in hb:
            led.rec("hb", ts=us(t))
        led.attempt(1, 20.0)
        led.rec("step", n=10, b=us(20.0), e=us(21.0))
        led.rec("end", ts=us(21.0), status="clean", detail="")
    report = ett.build_report(tmp_path, include_timeline=True)
    assert report["failures_by_category"] == {"killed": 1}
    assert _owned_after_failure(report, 1) == {"lost_in_flight": pytest.approx(0.4)}
    # Rank 0's step from 10.0 to 10.2 s (after the job's failure point) is lost work; the rest is teardown.
    assert _owned_after_failure(report, 0) == {"lost_in_flight": pytest.approx(0.2),
                                               "peer_teardown": pytest.approx(4.8)}
    assert report["phases"]["peer_teardown"] == pytest.approx(4.8)
    live = LiveLedger(tmp_path)
    live.refresh()
    figures = live.figures()
    assert figures["phases"]["peer_teardown"] == pytest.approx(4.8)
    assert figures["phases"]["lost_in_flight"] == pytest.approx(report["phases"]["lost_in_flight"])
