"""ETT projection (docs/ett.md, "Projection") against hand-computed values.

The model, for a job of T = days·86400 s with N = λ·days failures:
    I = √(2·B·MTBF), MTBF = 86400/λ                     (Young, through ett.recommend_interval)
    T = S + D + N·(R + I/2) + E·(1 + B/I + ρ)         → E, and ETT% = 100·E/T
The worked example of docs/ett.md measures B = 60 s per checkpoint, R = 2,040 s (its one recovery: 900 of
them scheduling), S = 1,380 s (attempt 0's Time to Start), D = 300 s of shutdown and no other idle (ρ = 0).
"""

from __future__ import annotations

import json
import math

import pytest

from ettkit import ett
from ettkit.__main__ import main
from ettkit.errors import InvalidArgumentError
from ledger_script import LedgerWriter, us, worked_example

DAY = 86400.0


@pytest.fixture(scope="module")
def we(tmp_path_factory):
    run = tmp_path_factory.mktemp("we")
    worked_example(run).save()
    return str(run), ett.build_report(run, include_timeline=False)


def test_worked_example_at_two_failures_a_day(we):
    _, report = we
    p = ett.project(report, days=30, failures_per_day=2)
    T, N, B, R, S, D = 30 * DAY, 60, 60.0, 2040.0, 1380.0, 300.0
    mtbf = DAY / 2                                         # 43,200 s
    I = math.sqrt(2 * B * mtbf)                            # Young: √(2·60·43,200) = 2,276.84 s
    assert p["interval_s"] == pytest.approx(I) and I == pytest.approx(2276.84, abs=0.005)
    assert p["interval_s"] == pytest.approx(ett.recommend_interval(B, mtbf))
    E = (T - S - D - N * (R + I / 2)) / (1 + B / I)        # = 2,338,003 s
    assert p["effective_s"] == pytest.approx(E) and p["ett_pct"] == pytest.approx(100 * E / T)
    assert p["ett_pct"] == pytest.approx(90.2007, abs=5e-5)
    assert p["waste_s"] == pytest.approx({"startup": S, "shutdown": D, "checkpoint_blocking": E * B / I,
                                          "failure_recovery": N * R, "unsaved_work": N * I / 2, "other_idle": 0.0})
    assert p["effective_s"] + sum(p["waste_s"].values()) == pytest.approx(T)
    assert p["idle_pct"] == pytest.approx(100 * (S + D + E * B / I) / T)
    assert p["failure_pct"] == pytest.approx(100 * N * (R + I / 2) / T)
    # The recoveries dominate (122,400 s of 253,997 s of waste), and scheduling is 900 / 2,040 of each.
    assert p["dominant"] == "failure_recovery"
    assert p["dominant_share_pct"] == pytest.approx(100 * N * R / (T - E))
    assert p["dominant_phase"] == pytest.approx({"phase": "scheduling", "share_of_recovery_pct": 100 * 900 / 2040})
    # At the run's configured 3,600 s interval the same job loses more.
    E_cur = (T - S - D - N * (R + 3600 / 2)) / (1 + B / 3600)
    assert p["at_current_interval"]["ett_pct"] == pytest.approx(100 * E_cur / T)
    assert p["at_current_interval"]["ett_gain_pct"] == pytest.approx(100 * (E - E_cur) / T)
    assert p["accelerator_h"] == pytest.approx(720) and p["lost_accelerator_h"] == pytest.approx((T - E) / 3600)
    assert p["inputs"]["restart_source"].startswith("mean time to recover of 1")


def test_what_if_table_over_failure_rates(we):
    _, report = we
    p = ett.project(report, days=30, failures_per_day=3)
    assert [r["failures_per_day"] for r in p["table"]] == [0.5, 1.0, 2.0, 3.0, 4.0]
    for row in p["table"]:
        lam = row["failures_per_day"]
        I = math.sqrt(2 * 60 * DAY / lam)
        E = (30 * DAY - 1680 - 30 * lam * (2040 + I / 2)) / (1 + 60 / I)
        assert row["interval_s"] == pytest.approx(I) and row["ett_pct"] == pytest.approx(100 * E / (30 * DAY))
        assert row["mtbf_h"] == pytest.approx(24 / lam)
    # At half a failure a day the unsaved half-intervals (15 × 2,276.8 s) outweigh the recoveries (15 × 2,040 s).
    assert [r["dominant"] for r in p["table"]] == ["unsaved_work"] + ["failure_recovery"] * 4
    assert [r["ett_pct"] for r in p["table"]] == sorted((r["ett_pct"] for r in p["table"]), reverse=True)


def test_rate_given_as_mtbf_or_per_device_scales_with_world_size(we):
    _, report = we
    base = ett.project(report, failures_per_day=2)
    assert ett.project(report, mtbf_h=12)["ett_pct"] == pytest.approx(base["ett_pct"])
    # 0.25 failures per 1,000 devices a day at 8,000 devices = 2 a day for the job.
    p = ett.project(report, failures_per_1000_per_day=0.25, world_size=8000)
    assert p["failures_per_day"] == pytest.approx(2) and p["ett_pct"] == pytest.approx(base["ett_pct"])
    assert p["world_size"] == 8000 and p["accelerator_h"] == pytest.approx(8000 * 720)
    assert [r["world_size"] for r in p["table"]] == [2000, 4000, 8000, 16000, 32000]
    assert [r["failures_per_day"] for r in p["table"]] == pytest.approx([0.5, 1, 2, 4, 8])
    # Without world_size the run's (1 device) is used: 0.25 per 1,000 devices is 0.00025 a day.
    assert ett.project(report, failures_per_1000_per_day=0.25)["failures_per_day"] == pytest.approx(0.00025)


def test_other_idle_and_the_restart_fallback(tmp_path):
    # hardware_setup 50 + compile 100 (S = 150), 100 steps of 10 s, a 5 s checkpoint every 20 steps, one 20 s
    # eval, shutdown 30: ρ = (225 idle − 150 − 30 − 25) / 1,000 s of training = 0.02. No failure, so R
    # falls back to the mean Time to Start, 150 s.
    w = LedgerWriter(tmp_path)
    w.attempt(0, ts=50)
    w.phase("hardware_setup", 0, 50)
    t = w.phase("compile", 50, 150)
    for n in range(1, 101):
        t = w.step(n, t, t + 10)
        if n % 20 == 0:
            t = w.phase("checkpoint_blocking", t, t + 5, step=n)
        if n == 50:
            t = w.phase("eval", t, t + 20)
    t = w.phase("shutdown", t, t + 30)
    w.rec("end", ts=us(t), status="clean", detail="")
    w.save()
    report = ett.build_report(tmp_path, include_timeline=False)
    p = ett.project(report, days=10, failures_per_day=1)
    m = p["inputs"]
    assert (m["blocking_s"], m["startup_s"], m["shutdown_s"], m["restart_s"]) == pytest.approx((5, 150, 30, 150))
    assert m["other_idle_per_training_s"] == pytest.approx(0.02)
    assert m["restart_source"].startswith("no recovered failure") and m["recovery_breakdown_s"] is None
    T, N = 10 * DAY, 10
    I = math.sqrt(2 * 5 * DAY)                             # 929.52 s
    E = (T - 150 - 30 - N * (150 + I / 2)) / (1 + 5 / I + 0.02)
    assert p["ett_pct"] == pytest.approx(100 * E / T)
    assert p["waste_s"]["other_idle"] == pytest.approx(0.02 * E)
    assert p["dominant"] == "other_idle" and p["dominant_phase"] is None   # 0.02·E ≈ 16,800 s
    # The run's interval is inferred (20 steps of 10 s between checkpoints): 200 s, far below Young's 929.5 s.
    assert report["checkpoints"]["interval_source"] == "inferred"
    E_cur = (T - 180 - N * (150 + 200 / 2)) / (1 + 5 / 200 + 0.02)
    assert p["at_current_interval"]["interval_s"] == pytest.approx(200)
    assert p["at_current_interval"]["ett_pct"] == pytest.approx(100 * E_cur / T)


def test_a_failure_rate_that_stops_progress(we):
    _, report = we
    p = ett.project(report, days=1, failures_per_day=60)   # 60 × (2,040 + I/2) > 86,400 − 1,680
    assert p["ett_pct"] == 0 and p["progress"] is False
    assert sum(p["waste_s"].values()) == pytest.approx(DAY)
    assert p["waste_s"]["failure_recovery"] == pytest.approx(DAY - 1680)


@pytest.mark.parametrize("kwargs,match", [
    (dict(days=0, failures_per_day=1), r"days=0 must be in \(0, 3650\]"),
    (dict(days=4000, failures_per_day=1), r"days=4000 must be in \(0, 3650\]"),
    (dict(days=math.nan, failures_per_day=1), "days=nan"),
    (dict(days="30", failures_per_day=1), "days='30' must be a number"),
    (dict(failures_per_day=0), "failures_per_day=0 must be a positive, finite number"),
    (dict(failures_per_day=math.inf), "failures_per_day=inf"),
    (dict(failures_per_day=True), "failures_per_day=True must be a number"),
    (dict(mtbf_h=-1), "mtbf_h=-1 must be a positive"),
    (dict(failures_per_1000_per_day=0), "failures_per_1000_per_day=0"),
    (dict(), "exactly one of failures_per_day, mtbf_h, failures_per_1000_per_day .got none"),
    (dict(failures_per_day=1, mtbf_h=24), "exactly one .* .got failures_per_day, mtbf_h"),
    (dict(failures_per_day=1, world_size=0), "world_size=0 must be a positive integer"),
    (dict(failures_per_day=1, world_size=2.5), "world_size=2.5 must be a positive integer"),
    (dict(days=0.01, failures_per_day=1), r"days=0.01 is shorter than the run's start-up and shutdown \(1680.0 s\)"),
])
def test_bad_arguments_name_the_argument_and_its_range(we, kwargs, match):
    _, report = we
    with pytest.raises(InvalidArgumentError, match=match):
        ett.project(report, **kwargs)


def test_reports_the_projection_cannot_use(we, tmp_path):
    _, report = we
    with pytest.raises(ValueError, match="report must be the dict of ett.build_report"):
        ett.project([report], failures_per_day=1)
    with pytest.raises(ValueError, match="report has no 'checkpoints.blocking_mean_s'"):
        ett.project({}, failures_per_day=1)
    w = LedgerWriter(tmp_path)                 # trains, never checkpoints
    w.attempt(0, ts=0)
    w.step(1, 0, 10)
    w.rec("end", ts=us(10), status="clean", detail="")
    w.save()
    with pytest.raises(ValueError, match=r"checkpoints.blocking_mean_s is None.*saved no checkpoint"):
        ett.project(ett.build_report(tmp_path, include_timeline=False), failures_per_day=1)


def test_cli(we, capsys):
    run, report = we
    assert main(["project", run, "--days", "30", "--failures-per-day", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(json.dumps(ett.project(report, days=30, failures_per_day=2)))
    assert main(["project", run, "--mtbf-hours", "12"]) == 0
    text = capsys.readouterr().out
    assert "ETT%          90.20%" in text and "mostly scheduling (44.1% of a recovery)" in text
    assert main(["project", run, "--failures-per-day", "-1"]) == 2
    assert "ettkit project: error: failures_per_day=-1.0 must be a positive" in capsys.readouterr().err
    assert main(["project", run + "/missing", "--failures-per-day", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                    # argparse: the rate is required
        main(["project", run])
    assert e.value.code == 2
