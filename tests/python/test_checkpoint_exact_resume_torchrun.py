"""Issue #63: a GPT-style model with dropout, 2 ranks under torchrun, rank 1 SIGKILLed mid-epoch and restarted:
every step of every rank, before and after the restart, has the uninterrupted run's loss to the bit. Nothing but
the README's state is saved; the generators travel with the checkpoint by default."""

from __future__ import annotations

import os
import subprocess
import sys

import ettkit

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, KILL_AT = 24, 13  # saves every 5 steps: the restart resumes at step 10, mid-epoch (16 batches an epoch)


def _torchrun(run_dir, kill_at: int) -> None:
    os.makedirs(run_dir)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(ettkit.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           os.path.join(HERE, "gpt_dropout_trainer.py"), str(run_dir), str(STEPS), str(kill_at)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def _losses(run_dir, rank: int) -> tuple[dict, set]:
    """step -> loss (the last attempt's line winning), and the attempts that trained."""
    losses, attempts = {}, set()
    with open(os.path.join(run_dir, f"losses-rank-{rank}.txt")) as f:
        for line in f:
            attempt, step, loss = line.split()
            losses[int(step)] = loss
            attempts.add(int(attempt))
    return losses, attempts


def test_a_dropout_gpt_killed_under_torchrun_resumes_bit_for_bit(tmp_path):
    _torchrun(tmp_path / "whole", -1)
    _torchrun(tmp_path / "killed", KILL_AT)
    for rank in (0, 1):
        want, _ = _losses(tmp_path / "whole", rank)
        got, attempts = _losses(tmp_path / "killed", rank)
        assert attempts == {0, 1}, attempts  # it was restarted
        assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
        differ = {s: (got[s], want[s]) for s in want if got[s] != want[s]}
        assert differ == {}, f"rank {rank}: steps that differ from the uninterrupted run: {differ}"
