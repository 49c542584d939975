"""A report on a run whose recorder is still open shows the attempt in progress as running, not killed:
in this process (the ledger is flushed first), and from another process on this host."""

from __future__ import annotations

import signal
import subprocess
import sys

from ettkit import ett

CHILD = """
import sys
from ettkit import ett
rec = ett.Recorder(sys.argv[1], rank=0, world_size=1, launcher_phases_from_env=False)
rec.step(1)
rec.flush()
print("ready", flush=True)
sys.stdin.readline()  # until the parent has reported
rec.close()
"""


def status(run) -> str:
    return ett.build_report(run)["attempts"][-1]["status"]


def test_an_open_recorder_of_this_process_is_running(tmp_path):
    rec = ett.Recorder(tmp_path, rank=0, world_size=1, launcher_phases_from_env=False,
                       flush_interval_s=3600, heartbeat_s=3600)  # nothing reaches the file unless flushed
    rec.step(1)
    report = ett.build_report(tmp_path)
    assert report["attempts"][0]["status"] == "running" and report["failures"] == 0
    rec.close()
    assert status(tmp_path) == "clean"


def test_a_live_recorder_of_another_process_is_running_and_a_killed_one_is_killed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert status(tmp_path) == "running"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0
        assert status(tmp_path) == "clean"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    report = ett.build_report(tmp_path)
    assert [a["status"] for a in report["attempts"]] == ["clean", "killed"] and report["failures"] == 1
