"""The ETT report reproduces the worked example of docs/ett.md ("Worked example") from a scripted ledger,
and handles bad run directories with clear messages."""

from __future__ import annotations

import json
import os

import pytest

import ettkit
from ettkit import ett
from ledger_script import LedgerWriter, us, worked_example


def _buckets(r):
    return r["ett_pct"] + r["idle_pct"] + r["failure_pct"] + r["unattributed_pct"]


def test_worked_example(tmp_path):
    worked_example(tmp_path).save()
    r = ett.build_report(tmp_path)
    assert r["e2e_s"] == pytest.approx(61020)
    assert r["ett_pct"] == pytest.approx(90.46, abs=0.005)
    assert r["idle_pct"] == pytest.approx(4.23, abs=0.005)
    assert r["failure_pct"] == pytest.approx(5.31, abs=0.005)
    assert _buckets(r) == pytest.approx(100.0, abs=1e-9)
    assert r["effective_s"] == pytest.approx(55200)
    assert r["idle_s"] == pytest.approx(2580)
    assert r["failure_s"] == pytest.approx(3240)
    assert sum(r["phases"].values()) == pytest.approx(r["e2e_s"])
    assert r["time_to_start_s"] == pytest.approx([1380, 1020])
    assert r["time_to_recover_s"] == pytest.approx([2040])
    assert r["failures"] == 1 and r["failures_by_category"] == {"killed": 1}
    rec = r["recoveries"][0]
    assert rec["breakdown"] == pytest.approx({"detect_and_teardown": 120, "scheduling": 900, "hardware_setup": 300,
                                              "launcher_init": 180, "checkpoint_restore": 240, "compile": 300})
    assert rec["retraining_s"] == pytest.approx(1200)
    # Meta's estimates beside the measurements.
    assert r["unsaved_training_s"] == pytest.approx({"measured": 1200, "estimated": 1800})
    assert r["checkpoint_blocking_s"] == pytest.approx({"measured": 900, "estimated": 920})
    assert r["checkpoints"]["count"] == 15 and r["checkpoints"]["interval_source"] == "configured"
    # The advisor: I* = sqrt(2 * 60 * 55200) = 2573.7 s, saving 146.3 s against the 3600 s in use.
    assert r["mtbf_s"] == pytest.approx(55200)
    assert r["recommended_interval_s"] == pytest.approx(2573.7, abs=0.05)
    rc = r["recommendation"]
    assert rc["waste_at_current_s"] == pytest.approx(2720)
    assert rc["expected_saving_s"] == pytest.approx(146.3, abs=0.05)
    assert rc["variants"]["daly"] == pytest.approx(2620.8, abs=0.05)        # Daly first order, R = TTR
    assert rc["variants"]["daly_exact"] == pytest.approx(2533.9, abs=0.05)
    assert rc["interval_steps"] == 26                                      # 100 s steps
    assert r["steps"]["retrained"] == 12 and r["steps"]["effective"] == 552


def test_initial_queue_can_be_counted(tmp_path):
    worked_example(tmp_path).save()
    r = ett.build_report(tmp_path, include_initial_queue=True)
    assert r["e2e_s"] == pytest.approx(61620)
    assert r["phases"]["scheduling"] == pytest.approx(1500)
    assert _buckets(r) == pytest.approx(100.0, abs=1e-9)


def test_two_ranks_with_clock_skew_use_earliest_start_and_latest_end(tmp_path):
    worked_example(tmp_path, rank=0, world=2).save()
    worked_example(tmp_path, rank=1, world=2, offset_s=2.0).save()  # rank 1 runs 2 s later throughout
    r = ett.build_report(tmp_path)
    assert r["ranks"] == [0, 1] and r["world_size"] == 2
    assert r["e2e_s"] == pytest.approx(61022)                  # never a sum or a mean of ranks
    assert r["failures"] == 1
    assert r["time_to_start_s"][0] == pytest.approx(1382)     # the job trains once the slower rank does
    assert r["rank_skew"]["attempt_start_skew_s"] == pytest.approx([2.0, 2.0])
    assert _buckets(r) == pytest.approx(100.0, abs=1e-9)


def test_method_and_prior_options(tmp_path):
    worked_example(tmp_path).save()
    r = ett.build_report(tmp_path, method="daly_exact")
    assert r["recommendation"]["method"] == "daly_exact"
    assert r["recommended_interval_s"] == pytest.approx(2533.9, abs=0.05)
    with pytest.raises(ValueError, match="method"):
        ett.build_report(tmp_path, method="magic")


def test_no_failure_uses_the_prior(tmp_path):
    w = LedgerWriter(tmp_path)
    w.attempt(0, ts=0)
    t = 0.0
    for i in range(1, 11):
        t = w.step(i, t, t + 10)
        if i % 5 == 0:
            t = w.phase("checkpoint_blocking", t, t + 1, step=i)
    w.rec("end", ts=us(t), status="clean", detail="")
    w.save()
    r = ett.build_report(tmp_path)
    assert r["failures"] == 0 and r["mtbf_source"] == "lower_bound_no_failures"
    assert r["checkpoints"]["interval_source"] == "inferred" and r["checkpoints"]["interval_s"] == pytest.approx(50)
    r = ett.build_report(tmp_path, mtbf_prior_s=86400)
    assert r["mtbf_source"] == "prior"
    assert r["recommended_interval_s"] == pytest.approx((2 * 1 * 86400) ** 0.5)


def test_missing_and_empty_run_dirs(tmp_path):
    with pytest.raises(ettkit.InvalidArgumentError, match="does not exist"):
        ett.build_report(tmp_path / "nope")
    with pytest.raises(ValueError, match="no 'ett/' ledger folder"):
        ett.build_report(tmp_path)
    os.makedirs(tmp_path / "ett")
    with pytest.raises(ValueError, match="no ledger files"):
        ett.build_report(tmp_path)
    (tmp_path / "ett" / "rank-0.jsonl").write_text("")
    with pytest.raises(ValueError, match="no attempt record"):
        ett.build_report(tmp_path)


def test_torn_and_corrupt_lines_are_counted_not_fatal(tmp_path):
    w = worked_example(tmp_path)
    w.lines.insert(5, "garbage {")
    w.save(raw_tail='{"v":1,"t":"hb","ts":17000')
    r = ett.build_report(tmp_path)
    assert r["ledger"]["corrupt_lines"] == 1 and r["ledger"]["torn_lines"] == 1
    assert any("corrupt record skipped" in x for x in r["ledger"]["warnings"])
    assert r["ett_pct"] == pytest.approx(90.46, abs=0.005)


def test_newer_format_version_is_a_clear_error(tmp_path):
    w = worked_example(tmp_path)
    w.lines.append(json.dumps({"v": 9, "t": "step", "n": 1, "b": 1, "e": 2}))
    w.save()
    with pytest.raises(ettkit.UnsupportedError, match="format version 9.*upgrade ettkit"):
        ett.build_report(tmp_path)


def test_report_does_not_depend_on_the_fast_ledger_scanner(tmp_path, monkeypatch):
    """The reader scans the Recorder's own lines without building a JSON document and hands every other line
    to the full parser. Lines in every other valid or invalid shape, and random byte mutations of real
    lines, must give the same report as the full parser alone (ETTKIT_LEDGER_FULL_PARSER=1)."""
    import random

    w = worked_example(tmp_path)
    w.lines += [
        '{ "v" : 1 , "t" : "hb" , "ts" : %d }' % us(30),          # whitespace
        '{"v":1,"t":"hb","ts":%d.0}' % us(31),                      # a float time: corrupt either way
        '{"v":1,"t":"phase","name":"caf\\u00e9","b":%d,"e":%d}' % (us(32), us(33)),  # an escape
        '{"v":1,"t":"phase","name":"café","b":%d,"e":%d}' % (us(33), us(34)),        # UTF-8
        '{"v":1,"t":"hb","ts":%d,"ts":%d}' % (us(35), us(36)),     # a duplicate key
        '{"v":1,"t":"hb","ts":18446744073709551615}',               # beyond int64
        '{"v":1,"t":"config","key":"mtbf_s","value":7200.5}',       # a float config value
        '{"v":1,"t":"end","ts":%d,"status":null}' % us(37),
    ]
    rng = random.Random(1123)
    base = list(w.lines)
    for _ in range(300):
        line = list(rng.choice(base[1:]))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(12, len(line))  # past the version field: a mutated "v" is a hard error
            line[at] = rng.choice('{}":,-.0123456789e tn\\')
        w.lines.insert(rng.randrange(1, len(w.lines)), "".join(line))
    w.save()

    fast = ett.build_report(tmp_path)
    monkeypatch.setenv("ETTKIT_LEDGER_FULL_PARSER", "1")
    full = ett.build_report(tmp_path)
    assert fast["ledger"]["corrupt_lines"] > 10  # the mutations reached both parsers
    assert json.dumps(fast, sort_keys=True) == json.dumps(full, sort_keys=True)
