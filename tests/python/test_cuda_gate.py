"""The CUDA gate bites: with ETTKIT_REQUIRE_CUDA=1 a missing GPU, or a CUDA test that skips, fails the run
(cuda_gate.py for pytest, tests/cpp/cuda_test_util.h for the C++ tests). Each case runs a tiny pytest (or a
C++ test binary) in a subprocess and reads its exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
HAVE_GPU = torch.cuda.is_available()

TINY = textwrap.dedent(
    """
    import pytest
    import torch

    @pytest.mark.needs_cuda
    def test_on_the_gpu():
        assert torch.ones(1, device="cuda").item() == 1.0

    @pytest.mark.needs_cuda
    def test_that_skips_itself():
        pytest.skip("pretends a GPU feature is missing")

    def test_on_the_cpu():
        assert torch.ones(1).item() == 1.0
    """
)


def run_tiny(tmp_path, require: bool | None, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text(TINY)
    env = dict(os.environ)
    env.pop("ETTKIT_REQUIRE_CUDA", None)
    if require is not None:
        env["ETTKIT_REQUIRE_CUDA"] = "1" if require else "0"
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "cuda_gate", "-p", "no:cacheprovider", "-q", "-rA",
         "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_without_the_variable_cuda_tests_skip_and_the_run_passes(tmp_path):
    r = run_tiny(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 2 skipped" in r.stdout or (HAVE_GPU and "2 passed, 1 skipped" in r.stdout), r.stdout


def test_required_a_skipping_cuda_test_fails(tmp_path):
    r = run_tiny(tmp_path, True, "-k", "skips_itself or on_the_cpu")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "ETTKIT_REQUIRE_CUDA=1" in r.stdout, r.stdout


@pytest.mark.skipif(HAVE_GPU, reason="checks the CPU machine's side of the gate")
def test_required_without_a_gpu_every_cuda_test_fails(tmp_path):
    r = run_tiny(tmp_path, True, "-k", "on_the_gpu or on_the_cpu")
    assert r.returncode != 0, r.stdout + r.stderr
    # The CUDA test fails at setup (pytest counts that as an error), the CPU test still runs and passes.
    assert "1 passed" in r.stdout and ("1 error" in r.stdout or "1 failed" in r.stdout), r.stdout
    assert "torch sees no CUDA device" in r.stdout


@pytest.mark.skipif(HAVE_GPU, reason="checks the CPU machine's side of the gate")
def test_required_without_a_gpu_fails_even_with_no_cuda_test_selected(tmp_path):
    r = run_tiny(tmp_path, True, "-k", "on_the_cpu")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "torch sees no CUDA device" in r.stdout, r.stdout


@pytest.mark.skipif(not HAVE_GPU, reason="checks the GPU machine's side of the gate")
def test_required_with_a_gpu_passes(tmp_path):
    r = run_tiny(tmp_path, True, "-k", "on_the_gpu or on_the_cpu")
    assert r.returncode == 0, r.stdout + r.stderr


def _cpp_test(name: str) -> str | None:
    repo = os.path.dirname(os.path.dirname(HERE))
    builds = [os.environ.get("ETTKIT_BUILD_DIR", ""), "build/py", "build/gpu-work/build"]
    for build in filter(None, builds):
        path = os.path.join(repo, build, "tests", "cpp", name)
        if os.path.exists(path):
            return path
    return None


@pytest.mark.skipif(HAVE_GPU, reason="checks the CPU machine's side of the gate")
@pytest.mark.parametrize("binary", ["cuda_timer_test", "cuda_stager_test"])
def test_required_without_a_gpu_the_cpp_cuda_tests_fail(binary):
    path = _cpp_test(binary)
    if path is None:
        pytest.skip(f"{binary} is not built (make build builds it)")
    env = dict(os.environ, ETTKIT_REQUIRE_CUDA="1")
    r = subprocess.run([path], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    assert "ETTKIT_REQUIRE_CUDA=1" in r.stdout, r.stdout
    env["ETTKIT_REQUIRE_CUDA"] = "0"
    r = subprocess.run([path], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SKIPPED" in r.stdout, r.stdout
