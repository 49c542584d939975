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


# ---- a peer dies: the survivors fail fast ----------------------------------------------------------------------
# No port is chosen before it is bound (a port found free and released could be taken by another test's
# process under pytest-xdist before a rank binds it): the launcher's Store binds port 0 here, rank 0's binds
# port 0 in rank 0 and tells the others through a FileStore (checkpoint_script.rank0_hosted_store).
#
# What "fast" means: the target is 5 s from the death to a survivor's exit (peer_timeout_s=3 plus the heartbeat
# period, then the interpreter's exit). The bug this guards against is a survivor that does not notice the
# death and waits for its commit vote's timeout (commit_timeout_s=600 in the script) or the Store's (300 s).
# 60 s sits far below those and 12x above the target, so a loaded CI machine does not fail it; the measured
# time is printed.
FAIL_FAST_BOUND_S = 60.0


@pytest.mark.parametrize("world,victim,store_mode", [(2, 1, "rank0"), (3, 2, "rank0"), (3, 1, "launcher"),
                                                     (2, 0, "launcher"), (2, 0, "rank0")])
def test_survivors_exit_within_seconds_after_a_peer_dies(tmp_path, world, victim, store_mode):
    import time

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) \
        if store_mode == "launcher" else None
    rdzv = str(server.port) if server else str(tmp_path / "rdzv")
    path = tmp_path / "ck"
    path.mkdir()
    procs = {r: subprocess.Popen([sys.executable, SCRIPT, "peerdeath", str(path), str(r), str(world), rdzv,
                                  str(victim), store_mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)}
    exited = {}
    deadline = time.monotonic() + 120
    while len(exited) < world and time.monotonic() < deadline:
        for r, p in procs.items():
            if r not in exited and p.poll() is not None:
                exited[r] = time.time()
        time.sleep(0.01)  # polling the exits, not a verdict: their times are compared below
    for p in procs.values():
        p.kill()
    outs = {r: p.communicate() for r, p in procs.items()}
    assert len(exited) == world, f"survivors still running after 120 s: {outs}"
    death = float((path / "death").read_text())
    for r, p in procs.items():
        if r == victim:
            continue
        # The script exits 0 only when each of its three saves after the death raised PeerLostError.
        assert p.returncode == 0, (r, outs[r][0], outs[r][1][-3000:])
        print(f"world={world} victim={victim} store={store_mode} rank {r}: exit {exited[r] - death:.2f} s after the death")
        assert exited[r] - death < FAIL_FAST_BOUND_S, (r, exited[r] - death)
    del server


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_fails_fast_when_another_job_holds_the_directory(tmp_path, world):
    from ettkit.checkpoint import AsyncCheckpointer

    path = tmp_path / "ck"
    with AsyncCheckpointer(path, recorder=None):  # the other job
        init = f"file://{tmp_path}/rdzv"  # no port to race for (see above)
        procs = [subprocess.Popen([sys.executable, SCRIPT, "lockedrank", str(path), str(r), str(world), init],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"locked-ok {r}" in out, (r, out, err[-3000:])
