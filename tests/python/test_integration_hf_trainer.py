"""The Hugging Face Trainer through ettkit (#67): a tiny GPT-2 trained by ``transformers.Trainer`` with
``EttkitTrainerCallback``, killed with SIGKILL two steps after a mid-epoch save, resumes from ettkit's newest
step (weights exported for the Trainer, optimizer, scheduler and generators loaded by ettkit, the consumed
batches skipped by the Trainer) with the same per-step losses as an uninterrupted run, and ``ettkit report``
reports both attempts. The runs are tests/python/integration_hf_trainer_worker.py (real ``transformers``, CPU)."""

from __future__ import annotations

import os

import pytest
from integration_runs import attempts, losses, reference_and_resumed, report
from transformers import TrainerState

WORKER = os.path.join(os.path.dirname(__file__), "integration_hf_trainer_worker.py")
KILL_STEP, SAVED_STEP, LAST_STEP = 8, 6, 12  # saves every 3 steps; 8 steps per epoch


def saved_before_the_kill(crash) -> None:
    steps = sorted(f for f in os.listdir(crash / "ckpt") if f.startswith("step-"))
    assert steps == ["step-3", f"step-{SAVED_STEP}"], steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return reference_and_resumed(tmp_path_factory.mktemp("hf-trainer"), WORKER, KILL_STEP, saved_before_the_kill)


def test_a_killed_trainer_run_resumes_mid_epoch_with_the_losses_of_an_uninterrupted_run(runs):
    ref, crash = runs
    expected = losses(ref)
    assert [s for s, _ in expected] == list(range(1, LAST_STEP + 1))
    # Equal float for float: the resumed run does the same operations on the same values in the same order
    # (same batches, optimizer moments, scheduler position), so no tolerance is needed.
    assert losses(crash) == expected[:KILL_STEP] + expected[SAVED_STEP:]
    # What the Trainer resumed from: the saved step's own TrainerState, read back by transformers.
    state = TrainerState.load_from_json(str(crash / "ckpt" / f"hf-resume-{SAVED_STEP}" / "trainer_state.json"))
    assert state.global_step == SAVED_STEP and state.max_steps == LAST_STEP


def test_ettkit_report_reports_the_killed_and_the_resumed_trainer_attempt(runs):
    _, crash = runs
    r = report(crash)
    assert attempts(r) == [("killed", 1, KILL_STEP), ("clean", SAVED_STEP + 1, LAST_STEP)]
    assert r["failures"] == 1 and r["checkpoints"]["count"] == 4  # steps 3, 6, then 9, 12
    assert "launcher_init/pre_train" in r["substages"] and r["phases"]["checkpoint_restore"] > 0
    assert r["phases"]["wasted_training"] > 0  # steps 7 and 8 trained twice
