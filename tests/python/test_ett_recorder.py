"""The Python recorder API: context managers, decorators, step(n), end status, the default recorder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ettkit
from ettkit import ett


def records(run_dir, rank=0, t=None):
    with open(os.path.join(run_dir, "ett", f"rank-{rank}.jsonl")) as f:
        out = [json.loads(line) for line in f if line.strip()]
    return [r for r in out if t is None or r["t"] == t]


def test_phases_steps_and_clean_end(tmp_path):
    with ett.Recorder(tmp_path, rank=0, world_size=1) as rec:
        assert rec.attempt == 0 and rec.ledger_path.endswith("ett/rank-0.jsonl")
        with rec.phase("compile"):
            pass

        @rec.timed("eval")
        def evaluate(x):
            return x + 1

        assert evaluate(1) == 2
        for i in range(1, 4):
            rec.step(i)
        rec.set_config("checkpoint_interval_steps", 2)
    names = [r["name"] for r in records(tmp_path, t="phase")]
    assert "compile" in names and "eval" in names and "process_bootstrap" in names
    assert [r["n"] for r in records(tmp_path, t="step")] == [1, 2, 3]
    assert records(tmp_path, t="end")[0]["status"] == "clean"
    assert rec.closed


def test_exception_type_is_recorded(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with ett.Recorder(tmp_path, rank=0, world_size=1):
            1 / 0
    end = records(tmp_path, t="end")[0]
    assert end["status"] == "exception" and end["detail"].startswith("ZeroDivisionError")
    r = ett.build_report(tmp_path)
    assert r["failures_by_category"] == {"exception:ZeroDivisionError": 1}


def test_cpp_exception_type_keeps_its_namespace(tmp_path):
    # A C++ trainer describes its exception as "std::runtime_error: what()": the category must not stop at
    # the first ':' of the namespace.
    rec = ett.Recorder(tmp_path, rank=0, world_size=1)
    rec.close("exception", "std::runtime_error: loss is NaN at step 7")
    assert ett.build_report(tmp_path)["failures_by_category"] == {"exception:std::runtime_error": 1}


def test_keyboard_interrupt_is_a_signal(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with ett.Recorder(tmp_path, rank=0, world_size=1):
            raise KeyboardInterrupt
    assert records(tmp_path, t="end")[0]["status"] == "signal"


def test_attempts_numbered_by_ledger(tmp_path):
    for expected in range(3):
        with ett.Recorder(tmp_path, rank=1, world_size=2) as rec:
            assert rec.attempt == expected
    # The number comes from the ledger: each attempt's record in rank 1's file carries its own, in order.
    assert [(r["attempt"], r["rank"], r["world"]) for r in records(tmp_path, rank=1, t="attempt")] == \
        [(0, 1, 2), (1, 1, 2), (2, 1, 2)]


def test_bad_options_are_value_errors(tmp_path):
    with pytest.raises(ettkit.InvalidArgumentError, match="heartbeat_s"):
        ett.Recorder(tmp_path, heartbeat_s=-1)
    with pytest.raises(ValueError, match="fsync='sometimes'"):
        ett.Recorder(tmp_path, fsync="sometimes")
    with ett.Recorder(tmp_path, rank=0, world_size=1) as rec:
        with pytest.raises(ValueError, match="phase name 'a b'"):
            rec.phase("a b")
        with pytest.raises(ValueError, match="status='weird'"):
            rec.close("weird")


def test_a_negative_step_is_refused_and_not_recorded(tmp_path):
    # -1 is the ledger's "no step": a step mark below 0 would be read as a phase outside any step.
    with ett.Recorder(tmp_path, rank=0, world_size=1) as rec:
        for bad in (-1, -3):
            with pytest.raises(ettkit.InvalidArgumentError, match=f"global step numbers are >= 0; got {bad}"):
                rec.step(bad)
        with pytest.raises(ettkit.InvalidArgumentError, match="step_interval: global step numbers are >= 0"):
            rec.step_interval(-2, 0, 1)
        rec.step(0)
    assert [r["n"] for r in records(tmp_path, t="step")] == [0]


def test_launcher_phases_from_env(tmp_path):
    import time

    now = time.time()
    code = (
        "from ettkit import ett\n"
        f"with ett.Recorder({str(tmp_path)!r}, rank=0, world_size=1): pass\n"
    )
    env = dict(os.environ, ETTKIT_LAUNCHER_PHASES=json.dumps(
        {"scheduling": [now - 30, now - 10], "hardware_setup": [now - 10, now - 1]}))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    launcher = [x for x in records(tmp_path, t="phase") if x.get("src") == "launcher"]
    assert sorted(x["name"] for x in launcher) == ["hardware_setup", "scheduling"]
    r = ett.build_report(tmp_path)
    assert r["phases"]["hardware_setup"] == pytest.approx(9, abs=0.01)
    assert r["attempts"][0]["begin_us"] == pytest.approx((now - 30) * 1e6, abs=2e4)
    bad = dict(env, ETTKIT_LAUNCHER_PHASES="{\"scheduling\": 5}")
    p = subprocess.run([sys.executable, "-c", code], env=bad, capture_output=True, text=True)
    assert p.returncode != 0 and "ETTKIT_LAUNCHER_PHASES[\"scheduling\"]" in p.stderr
    assert "Traceback" in p.stderr and "terminate" not in p.stderr  # a Python ValueError, not an abort
    assert len(records(tmp_path, t="attempt")) == 1  # the failed construction wrote nothing


def test_default_recorder_helpers_and_uncaught_exception(tmp_path):
    # An uncaught exception in a script that used ett.init() is recorded with its type by the excepthook.
    code = (
        "from ettkit import ett\n"
        f"ett.init({str(tmp_path)!r}, rank=0, world_size=1)\n"
        "@ett.phase('train_module_creation')\n"
        "def build(): return 3\n"
        "build()\n"
        "with ett.phase('compile'): pass\n"
        "ett.step(1)\n"
        "raise RuntimeError('data loader died')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 1 and "data loader died" in p.stderr
    names = [r["name"] for r in records(tmp_path, t="phase")]
    assert "train_module_creation" in names and "compile" in names
    end = records(tmp_path, t="end")[0]
    assert end["status"] == "exception" and end["detail"] == "RuntimeError: data loader died"


def test_phase_helper_without_recorder_is_a_noop():
    # Library code instrumented with ett.phase/ett.step runs unchanged in a process without a recorder.
    assert ett.current() is None
    with ett.phase("anything") as scope:
        assert scope._scope is None
    ett.step(5)
