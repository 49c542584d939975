"""`make build`'s install steps (tools/pip_install.sh, used by tools/bootstrap.sh and the Makefile) fail
loudly: pip's exit status and its error reach the caller. Offline and quick: the requirement cannot resolve, pip
runs with --dry-run --no-index, and the real .venv is never changed."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "pip_install.sh")


def run(tmp_path, *pip_args):
    log = tmp_path / "logs" / "pip.log"
    p = subprocess.run(["bash", SCRIPT, "--label", "test step", "--log", str(log), sys.executable, *pip_args],
                       capture_output=True, text=True, timeout=300)
    return p, log


def test_a_failing_install_exits_non_zero_with_pip_s_error(tmp_path):
    p, log = run(tmp_path, "--dry-run", "--no-index", "--no-deps", "ettkit-no-such-package-for-tests==0.0.1")
    assert p.returncode != 0
    assert "test step: FAILED (pip exit status" in p.stderr
    # pip's own error:
    assert "No matching distribution found for ettkit-no-such-package-for-tests" in p.stderr
    assert "test step: started" in p.stdout and "done" not in p.stdout
    assert "ettkit-no-such-package-for-tests" in log.read_text()  # the full output is kept


def test_a_successful_step_says_so_with_its_time(tmp_path):
    # Nothing to install: a dry run of an empty requirements file succeeds offline.
    req = tmp_path / "empty.txt"
    req.write_text("")
    p, _ = run(tmp_path, "--dry-run", "--no-index", "-r", str(req))
    assert p.returncode == 0, p.stderr
    assert "test step: started" in p.stdout and "test step: done in" in p.stdout


def test_a_misspelt_cuda_option_stops_the_configure_and_names_the_valid_values(tmp_path):
    # CMake reads an unknown word as a false condition: "-DETTKIT_USE_CUDA=yes-please" built without CUDA.
    import shutil

    cmake = shutil.which("cmake", path=os.path.dirname(sys.executable)) or "cmake"
    repo = os.path.join(os.path.dirname(__file__), "..", "..")
    p = subprocess.run([cmake, "-S", repo, "-B", str(tmp_path / "b"), "-DETTKIT_USE_CUDA=yes-please",
                        f"-DPython_EXECUTABLE={sys.executable}"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "ETTKIT_USE_CUDA=yes-please is not one of AUTO" in p.stderr and "OFF" in p.stderr
