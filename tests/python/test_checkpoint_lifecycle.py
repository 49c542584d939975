"""The checkpointer's lifecycle under faults (issue #25): each reproduction runs in its own interpreter with
a time limit, so that a heap corruption, a hang or an abort fails the test instead of the suite."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "checkpoint_script.py")


def run_case(case, *args, timeout=120):
    try:
        return subprocess.run([sys.executable, SCRIPT, "lifecycle", case, *map(str, args)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"lifecycle case {case!r} hung for {timeout} s: {e.stdout!r} {e.stderr!r}")


def test_handle_wait_staged_then_wait_repeatedly_does_not_corrupt_the_heap():
    # Was: 'corrupted double-linked list' or a segfault in THPVariable_traverse, 10 of 10 runs.
    for _ in range(3):
        r = run_case("wait_staged")
        assert r.returncode == 0 and "lifecycle-ok" in r.stdout, r.stderr[-2000:]


def test_unclosed_checkpointer_in_a_function_that_raises_does_not_hang():
    r = run_case("unclosed", timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "caught" in r.stdout


def test_uncaught_exception_with_a_save_in_flight_exits_1_with_the_traceback():
    r = run_case("uncaught", timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # not 134 (SIGABRT)
    assert "RuntimeError: uncaught at module level" in r.stderr
    assert "terminate called" not in r.stderr


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mix_of_handle_and_checkpointer_calls_from_two_threads(seed):
    r = run_case("threads", seed, timeout=240)
    assert r.returncode == 0 and "lifecycle-ok" in r.stdout, r.stderr[-2000:]
