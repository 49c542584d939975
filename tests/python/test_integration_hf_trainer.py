"""The Hugging Face Trainer through ettkit (#67): a tiny GPT-2 trained by ``transformers.Trainer`` with
``EttkitTrainerCallback``, killed with SIGKILL two steps after a mid-epoch save, resumes from ettkit's newest
step (weights exported for the Trainer, optimizer, scheduler and generators loaded by ettkit, the consumed
batches skipped by the Trainer) with the same per-step losses as an uninterrupted run, and ``ettkit report``
reports both attempts. The runs are tests/python/integration_hf_trainer_worker.py (real ``transformers``, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "integration_hf_trainer_worker.py")
KILL_STEP, SAVED_STEP, LAST_STEP = 8, 6, 12  # saves every 3 steps; 8 steps per epoch


def run(run_dir, *args) -> int:
    p = subprocess.run([sys.executable, WORKER, str(run_dir), *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode in (0, -signal.SIGKILL), p.stderr[-4000:]
    return p.returncode


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-trainer")
    assert run(tmp / "ref") == 0
    assert run(tmp / "crash", KILL_STEP) == -signal.SIGKILL  # died as planned, not earlier
    assert sorted(f for f in os.listdir(tmp / "crash" / "ckpt") if f.startswith("step-")) == ["step-3",
                                                                                         f"step-{SAVED_STEP}"]
    assert run(tmp / "crash") == 0
    return tmp / "ref", tmp / "crash"


def test_a_killed_trainer_run_resumes_mid_epoch_with_the_losses_of_an_uninterrupted_run(runs):
    ref, crash = runs
    expected = losses(ref)
    assert [s for s, _ in expected] == list(range(1, LAST_STEP + 1))
    # Equal float for float: the resumed run does the same operations on the same values in the same order
    # (same batches, optimizer moments, scheduler position), so no tolerance is needed.
    assert losses(crash) == expected[:KILL_STEP] + expected[SAVED_STEP:]
    assert os.path.isfile(crash / "ckpt" / f"hf-resume-{SAVED_STEP}" / "trainer_state.json")


def test_ettkit_report_reports_the_killed_and_the_resumed_trainer_attempt(runs):
    _, crash = runs
    r = subprocess.run([sys.executable, "-m", "ettkit", "report", str(crash), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    attempts = [(a["status"], a["first_step"], a["last_step"]) for a in report["attempts"]]
    assert attempts == [("killed", 1, KILL_STEP), ("clean", SAVED_STEP + 1, LAST_STEP)]
    assert report["failures"] == 1 and report["checkpoints"]["count"] == 4  # steps 3, 6, then 9, 12
    assert "launcher_init/pre_train" in report["substages"] and report["phases"]["checkpoint_restore"] > 0
    assert report["phases"]["wasted_training"] > 0  # steps 7 and 8 trained twice
