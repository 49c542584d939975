"""Lightning through ettkit (#67): a run checkpointed by ``EttkitCheckpointIO`` and killed with SIGKILL mid-epoch
resumes from ettkit's newest step with the same per-step losses as an uninterrupted run, and ``ettkit report``
reports both attempts from the ledger ``EttCallback`` wrote. The runs are
tests/python/integration_lightning_worker.py (real ``lightning``, CPU)."""

from __future__ import annotations

import os

import lightning.pytorch as L
import pytest
import torch
from integration_runs import attempts, losses, reference_and_resumed, report

from ettkit.errors import InvalidArgumentError
from ettkit.integrations.lightning import EttkitCheckpointIO

WORKER = os.path.join(os.path.dirname(__file__), "integration_lightning_worker.py")
KILL_STEP, SAVED_STEP, LAST_STEP = 12, 8, 24  # killed 4 steps into epoch 2; epoch 1 ended at step 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return reference_and_resumed(tmp_path_factory.mktemp("lightning"), WORKER, KILL_STEP)


def test_a_run_killed_mid_epoch_resumes_with_the_losses_of_an_uninterrupted_run(runs):
    ref, crash = runs
    expected = losses(ref)
    assert [s for s, _ in expected] == list(range(1, LAST_STEP + 1))
    got = losses(crash)
    # The killed attempt's steps 1..12, then the resumed one's from the step after the saved one: equal, float
    # for float (the same operations on the same values in the same order: no tolerance needed).
    assert got == expected[:KILL_STEP] + expected[SAVED_STEP:]


def test_ettkit_report_reports_the_killed_and_the_resumed_attempt(runs):
    _, crash = runs
    r = report(crash)
    assert attempts(r) == [("killed", 1, KILL_STEP), ("clean", SAVED_STEP + 1, LAST_STEP)]
    assert r["failures"] == 1 and r["checkpoints"]["tiers"]["disk"]["restores"] == 1
    assert r["checkpoints"]["count"] == 3  # step 8 in the killed attempt, 16 and 24 in the resumed one
    assert {"launcher_init/pre_train", "eval/sanity_check"} <= set(r["substages"])
    assert r["phases"]["wasted_training"] > 0 and r["phases"]["checkpoint_restore"] > 0


def test_the_checkpoint_io_loads_only_its_newest_step_and_keeps_lightnings_values(runs, tmp_path):
    _, crash = runs
    io = EttkitCheckpointIO(crash / "ckpt", recorder=None)
    newest = io.resume_path()
    assert newest.endswith(f"step-{LAST_STEP}")
    ckpt = io.load_checkpoint(newest)
    assert ckpt["global_step"] == LAST_STEP and ckpt["pytorch-lightning_version"] == L.__version__
    assert set(ckpt["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert isinstance(ckpt["optimizer_states"][0]["state"][0]["momentum_buffer"], torch.Tensor)
    with pytest.raises(InvalidArgumentError, match="not the newest committed step"):
        io.load_checkpoint(crash / "ckpt" / "step-8")
    io.teardown()
    assert EttkitCheckpointIO(tmp_path / "empty").resume_path() is None
