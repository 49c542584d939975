"""One recorder, however it was made: ``with ett.Recorder(...)``, ``ett.init(...)`` and C++ recorders are the
process's current recorder (one stack, in C++) for the components that are not given ``recorder=``."""

from __future__ import annotations

import itertools
import subprocess
import sys
import warnings

import ettkit
import pytest
import torch
import torch._dynamo
from ettkit import _C, ett, startup
from ettkit.checkpoint import AsyncCheckpointer
from startup_helpers import RecDataset, TinyRec, declared_spec, loss_fn, train_steps
from torch.utils.data import DataLoader


def opts():
    return {"rank": 0, "world_size": 1, "launcher_phases_from_env": False}


def names_in(rec) -> list[str]:
    import json

    if not rec.closed:
        rec.flush()
    with open(rec.ledger_path) as f:
        return [r.get("name") for r in map(json.loads, f) if r.get("t") == "phase"]


def small_state(step: int) -> dict:
    return {"w": torch.full((64,), float(step))}


@pytest.fixture(autouse=True)
def no_recorder_open():
    assert ett.current() is None, "a recorder of an earlier test is still open"
    yield
    assert ett.current() is None


def test_the_readme_usage_records_compile_and_checkpoint_phases(tmp_path):
    # README: `with ett.Recorder(run_dir) as rec:` around overlapped_start and an AsyncCheckpointer, neither
    # given recorder=. Before the current-recorder stack both recorded nothing: compile time counted as
    # training and checkpoint blocking read 0.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyRec()
    loader = DataLoader(RecDataset(48), batch_size=16, num_workers=0)
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ettkit.NoRecorderWarning)  # a recorder is open: nothing to warn about
        with ett.Recorder(run, **opts()) as rec:
            compiled, first, _, batches = startup.overlapped_start(
                model, loader, declared_spec(), loss_fn, compile_kwargs={"backend": "aot_eager"})
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            with AsyncCheckpointer(tmp_path / "ckpt", every=2, preempt_signals=()) as ck:
                state = {"model": model.state_dict()}
                for step, batch in enumerate(itertools.chain([first], batches), start=1):
                    train_steps(compiled, opt, [batch])
                    if ck.should_save(step):
                        ck.save(step, state).wait()
                    rec.step(step)
    torch._dynamo.reset()
    report = ett.build_report(run)
    phases = report["phases"]
    assert phases["compile"] > 0
    assert phases["checkpoint_blocking"] > 0
    assert report["checkpoints"]["count"] == 1  # step 2 of 3
    # ETT% is the training share of E2E: the hand sum of the report's phases gives it back.
    e2e = sum(phases.values())
    assert e2e == pytest.approx(report["e2e_s"], abs=1e-5)
    assert report["ett_pct"] == pytest.approx(100 * phases["training"] / e2e, abs=1e-6)


def test_nesting_restores_the_previous_current_recorder(tmp_path):
    with ett.Recorder(tmp_path / "outer", **opts()) as outer:
        assert ett.current() is outer
        with ett.Recorder(tmp_path / "inner", **opts()) as inner:
            assert ett.current() is inner and _C.ett.current_recorder() is inner
            with AsyncCheckpointer(tmp_path / "ck1", preempt_signals=()) as ck:
                ck.save(1, small_state(1)).wait()
        assert ett.current() is outer
        with AsyncCheckpointer(tmp_path / "ck2", preempt_signals=()) as ck:
            ck.save(2, small_state(2)).wait()
        assert names_in(inner).count("checkpoint_blocking") == 1
        assert names_in(outer).count("checkpoint_blocking") == 1
    assert ett.current() is None


def test_ett_init_is_current_until_a_with_block_opens_and_again_after_it(tmp_path):
    rec = ett.init(tmp_path / "init", **opts())
    try:
        assert ett.current() is rec
        with ett.Recorder(tmp_path / "block", **opts()) as block:
            assert ett.current() is block
            with ett.phase("eval"):
                pass
        assert ett.current() is rec
        assert "eval" in names_in(block) and "eval" not in names_in(rec)
    finally:
        rec.close()
    assert ett.current() is None


def test_an_explicit_recorder_wins_over_the_current_one(tmp_path):
    mine = ett.Recorder(tmp_path / "mine", **opts())
    try:
        with ett.Recorder(tmp_path / "current", **opts()) as other:
            with AsyncCheckpointer(tmp_path / "ck", recorder=mine, preempt_signals=()) as ck:
                ck.save(1, small_state(1)).wait()
            graph = startup.StageGraph(recorder=mine)
            graph.add("device_init", lambda: None)
            graph.run()
            assert "checkpoint_blocking" not in names_in(other) and "device_init" not in names_in(other)
        assert "checkpoint_blocking" in names_in(mine) and "device_init" in names_in(mine)
    finally:
        mine.close()


def test_a_stage_graph_made_in_a_with_block_records_into_it(tmp_path):
    with ett.Recorder(tmp_path / "run", **opts()) as rec:
        graph = startup.StageGraph()
        graph.add("train_module_creation", lambda: None)
        graph.run()
        assert "train_module_creation" in names_in(rec)


def test_a_component_without_any_recorder_warns_and_none_is_silent(tmp_path):
    with pytest.warns(ettkit.NoRecorderWarning, match="AsyncCheckpointer: no ETT recorder is open") as caught:
        AsyncCheckpointer(tmp_path / "ck", preempt_signals=()).close()
    assert caught[0].filename == __file__  # points at the line that made the checkpointer
    with pytest.warns(ettkit.NoRecorderWarning, match="StageGraph"):
        startup.StageGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AsyncCheckpointer(tmp_path / "ck", recorder=None, preempt_signals=()).close()
        startup.StageGraph(recorder=None)


def test_the_warning_is_shown_once_per_call_site_under_the_default_filter(tmp_path):
    code = (
        "import ettkit, sys\n"
        "from ettkit.checkpoint import AsyncCheckpointer\n"
        "for i in range(3):\n"
        f"    AsyncCheckpointer({str(tmp_path / 'ck')!r}, preempt_signals=()).close()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("NoRecorderWarning") == 1, p.stderr


def test_a_closed_recorder_is_never_current(tmp_path):
    rec = ett.Recorder(tmp_path / "run", **opts())
    assert ett.current() is rec
    rec.close()
    assert ett.current() is None
    del rec
