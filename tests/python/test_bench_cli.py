"""`make bench` runs every benchmarks/*.py with `--quick --json build/bench/<name>.json`: a benchmark that does
not take both fails the whole target before it measures anything (checkpoint_fsdp2.py and
ett_report_scale.py did, issue #48). This runs each one's `--help` and checks that it names both options."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The Makefile's rule: a benchmark is a benchmarks/*.py with a __main__ block; the others are its modules.
BENCHES = sorted(p for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 if '\nif __name__ == "__main__":' in open(p).read())


def test_the_benchmarks_are_the_scripts_and_not_their_modules():
    names = {os.path.basename(p) for p in BENCHES}
    assert {"checkpoint.py", "ett_overhead.py", "checkpoint_fsdp2.py", "ett_report_scale.py"} <= names
    assert not names & {"bench_common.py", "startup_models.py"}


def test_the_makefile_still_runs_each_benchmark_with_quick_and_json():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert "$$f --quick --json build/bench/$$name.json" in makefile
    assert """grep -q '^if __name__ == "__main__":' $$f || continue""" in makefile


@pytest.mark.parametrize("path", BENCHES, ids=[os.path.basename(p) for p in BENCHES])
def test_every_benchmark_takes_quick_and_json(path):
    out = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "--json" in out.stdout, f"{path}: --help does not offer --quick and --json"


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_profile_save_saves_to_its_tier_and_switches_perf_around_the_measured_saves_only(tmp_path, tier):
    """tools/profile_save.py (docs/benchmarks.md, "Where a save's CPU goes"): perf's control FIFO gets
    "enable" before the measured saves and "disable" after them, nothing else."""
    import threading

    fifo = str(tmp_path / "perf.ctl")
    os.mkfifo(fifo)
    got: list[str] = []

    def perf():  # what perf does with its control FIFO: read commands, one per line
        for _ in range(2):
            with open(fifo) as f:
                got.extend(f.read().splitlines())

    reader = threading.Thread(target=perf, daemon=True)
    reader.start()
    env = {**os.environ, "ETTKIT_LOG_LEVEL": "error"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "profile_save.py"), "--tier", tier,
                          "--gib", "0.004", "--tensors", "3", "--saves", "2", "--dir", str(tmp_path),
                          "--perf-control", fifo], capture_output=True, text=True, timeout=300, env=env)
    reader.join(timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{tier} tier, 0.004 GiB in 3 tensors: save -> committed" in out.stdout
    assert "(medians of 2)" in out.stdout
    assert got == ["enable", "disable"]
    assert os.listdir(tmp_path) == ["perf.ctl"]  # the scratch checkpoint directory is gone
