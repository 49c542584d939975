"""Helpers of the integration tests (test_integration_*.py): run a training worker, read back its per-step
losses and the ETT report of its run directory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys


def run_worker(worker: str, run_dir, *args) -> int:
    """Runs ``worker RUN_DIR ARGS...``; returns its exit status, which must be 0 or a SIGKILL it gave itself."""
    p = subprocess.run([sys.executable, worker, str(run_dir), *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode in (0, -signal.SIGKILL), p.stderr[-4000:]
    return p.returncode


def losses(run_dir) -> list[tuple[int, float]]:
    """(step, loss) for every step the worker trained, in order, across its attempts."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())]


def report(run_dir) -> dict:
    """``ettkit report RUN_DIR --json``, run as a user runs it."""
    r = subprocess.run([sys.executable, "-m", "ettkit", "report", str(run_dir), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def attempts(report: dict) -> list[tuple[str, int, int]]:
    return [(a["status"], a["first_step"], a["last_step"]) for a in report["attempts"]]


def reference_and_resumed(tmp, worker: str, kill_step: int, after_kill=None):
    """Runs ``worker`` uninterrupted in ``tmp/ref``, then in ``tmp/crash`` killed at ``kill_step`` (it must die
    of that SIGKILL, not earlier), ``after_kill(crash)`` if given, then again in ``tmp/crash`` (it resumes).
    Returns the two run directories."""
    ref, crash = tmp / "ref", tmp / "crash"
    assert run_worker(worker, ref) == 0
    assert run_worker(worker, crash, kill_step) == -signal.SIGKILL
    if after_kill is not None:
        after_kill(crash)
    assert run_worker(worker, crash) == 0
    return ref, crash
