"""A real process instrumented with the recorder is SIGKILLed mid-training and restarted: the report
counts two attempts, one failure (killed) and the re-trained steps as wasted training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ettkit import ett


def run_trainer(repo, run_dir, *extra):
    script = os.path.join(repo, "examples", "python", "ett_train.py")
    return subprocess.run([sys.executable, script, "--run-dir", str(run_dir), "--steps", "40", "--ckpt-every", "10",
                           "--hidden", "64", *extra], capture_output=True, text=True, timeout=120)


def test_sigkill_and_restart(repo, tmp_path):
    first = run_trainer(repo, tmp_path, "--crash-at-step", "27")
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = run_trainer(repo, tmp_path, "--crash-at-step", "27")   # the restart resumes from step 20
    assert second.returncode == 0, second.stderr

    r = ett.build_report(tmp_path)
    assert len(r["attempts"]) == 2
    assert [a["status"] for a in r["attempts"]] == ["killed", "clean"]
    assert r["failures"] == 1 and r["failures_by_category"] == {"killed": 1}
    # Steps 21..26 completed before the kill and were done again after the restore from step 20.
    assert r["steps"]["retrained"] == 6
    assert r["steps"]["effective"] == 40
    assert r["attempts"][1]["first_step"] == 21 and r["attempts"][1]["last_step"] == 40
    assert r["phases"]["wasted_training"] > 0
    assert r["unsaved_training_s"]["measured"] == pytest.approx(r["phases"]["wasted_training"])
    assert len(r["time_to_recover_s"]) == 1 and r["time_to_recover_s"][0] > 0
    assert "checkpoint_restore" in r["recoveries"][0]["breakdown"]
    assert r["checkpoints"]["count"] == 2 + 2          # steps 10, 20 then 30, 40
    assert abs(r["ett_pct"] + r["idle_pct"] + r["failure_pct"] + r["unattributed_pct"] - 100) < 1e-9
    assert r["recommended_interval_s"] is not None and r["recommended_interval_s"] > 0
