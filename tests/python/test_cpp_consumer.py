"""A C++ project outside this tree finds the installed package with find_package(ettkit), links
ettkit::core, records into a ledger and builds the report (tests/consumer/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import ettkit


def test_find_package_and_link(repo, tmp_path):
    cmake = shutil.which("cmake", path=os.path.dirname(sys.executable)) or "cmake"
    build = tmp_path / "build"
    env = dict(os.environ)
    env.pop("CMAKE_PREFIX_PATH", None)
    configure = subprocess.run([cmake, "-S", os.path.join(repo, "tests", "consumer"), "-B", str(build), "-G", "Ninja",
                                f"-DCMAKE_PREFIX_PATH={ettkit.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
                               capture_output=True, text=True, env=env, timeout=300)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    b = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    run = subprocess.run([str(build / "consumer"), str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "attempts=2 failures=1" in run.stdout

    from ettkit import ett

    r = ett.build_report(tmp_path / "run")
    assert r["failures_by_category"] == {"exception:RuntimeError": 1}
    assert r["steps"]["retrained"] == 5
