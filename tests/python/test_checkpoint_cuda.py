"""The checkpointer's CUDA path from Python: the pinned arena, stream-ordered staging (the copy stream waits on
the caller's stream), the GPU-side fence of ``wait_staged()`` (the compute stream waits for the copy event,
the host does not), ``attach`` on a CUDA model, and the DCP stager on CUDA tensors. Each committed step is
read back with safetensors and compared byte for byte with the state at its save().

Every test here needs a GPU: skipped without one, a failure when ETTKIT_REQUIRE_CUDA=1 (cuda_gate.py).
They run on a lent GPU machine through tools/gpu_check.sh.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_checkpoint_integrity import check_commits, outcome, snapshot_of

from ettkit.checkpoint import AsyncCheckpointer

pytestmark = pytest.mark.needs_cuda


def keep_the_stream_busy(ms: float = 100.0) -> None:
    """Queues about ``ms`` milliseconds of matrix products on the current stream; returns at once."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    x = a
    for _ in range(5):
        x = (x @ a).div_(4096)
    torch.cuda.synchronize()
    one = (time.perf_counter() - t) / 5
    for _ in range(max(1, int(ms / 1e3 / max(one, 1e-6)))):
        x = (x @ a).div_(4096)


def test_arena_is_pinned_and_reused(tmp_path):
    state = {"w": torch.randn(1 << 22, device="cuda"), "b": torch.randn(1000, device="cuda")}
    expected = {}
    with AsyncCheckpointer(tmp_path / "ck", keep_last=0, recorder=None) as ck:
        for step in range(1, 4):
            state["w"].add_(1.0)
            expected[step] = snapshot_of(state)
            ck.save(step, state).wait()
        assert ck.pinned
        assert ck.arena_allocations == 1 and ck.plan_builds == 1
        assert ck.arena_bytes >= (4 << 22) + 4000
    assert check_commits(str(tmp_path / "ck"), expected) == [1, 2, 3]


def test_copies_wait_for_the_step_queued_on_the_callers_stream(tmp_path):
    w = torch.zeros(1 << 24, device="cuda")
    torch.cuda.synchronize()
    with AsyncCheckpointer(tmp_path / "ck", keep_last=0, recorder=None) as ck:
        keep_the_stream_busy()
        w.fill_(42.0)  # the optimizer step, still queued behind the products
        h = ck.save(1, {"w": w})
        h.wait()
    torch.cuda.synchronize()
    check_commits(str(tmp_path / "ck"), {1: {"w": torch.full((1 << 24,), 42.0)}})


def test_wait_staged_is_a_gpu_side_fence(tmp_path):
    """save() with overlap returns before the copies; wait_staged() makes the compute stream wait for them
    without blocking the host; the write queued right after lands after the copy: never in the snapshot,
    and never a refusal."""
    state = {"w": torch.zeros(1 << 24, device="cuda"), "m": torch.zeros(1 << 20, device="cuda")}
    expected, handles, host_waits = {}, [], []
    with AsyncCheckpointer(tmp_path / "ck", keep_last=0, recorder=None, overlap=True,
                           unfenced_sync_max_bytes=0) as ck:
        for step in range(1, 5):
            keep_the_stream_busy(50)
            expected[step] = snapshot_of(state)  # clones queued on the stream: the values at save()
            handles.append(ck.save(step, state))
            t = time.perf_counter()
            ck.wait_staged()
            host_waits.append(time.perf_counter() - t)
            staged_at_return = handles[-1].staged
            state["w"].add_(1.0)  # the next optimizer step, queued at once
            state["m"].mul_(2.0).add_(1.0)
            assert not staged_at_return, "the copies were done before the fence: nothing was tested"
        committed, refused = outcome(handles)
    assert committed == [1, 2, 3, 4] and refused == []
    check_commits(str(tmp_path / "ck"), expected)
    assert max(host_waits) < 0.02, f"wait_staged() blocked the host: {host_waits}"


def test_attached_cuda_model_commits_the_exact_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")
    model(x).sum().backward()
    opt.step()  # Adam's state exists from here on
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected, handles = {}, []
    with AsyncCheckpointer(tmp_path / "ck", keep_last=0, recorder=None) as ck:
        ck.attach(model=model, optimizer=opt)
        for step in range(1, 13):
            opt.zero_grad()
            model(x * step).sum().backward()
            opt.step()
            if step % 2 == 0:
                expected[step] = snapshot_of(state)
                handles.append(ck.save(step, state))
        committed, refused = outcome(handles)
        assert ck.overlapped
    assert check_commits(str(tmp_path / "ck"), expected) == committed
    assert len(committed) >= 5, (committed, refused)


def test_load_latest_restores_cuda_tensors_in_place(tmp_path):
    state = {"w": torch.randn(1 << 20, device="cuda"), "s": torch.tensor(3.0)}
    with AsyncCheckpointer(tmp_path / "ck", keep_last=1, recorder=None) as ck:
        ck.save(7, state).wait()
    target = {"w": torch.zeros(1 << 20, device="cuda"), "s": torch.tensor(0.0)}
    ptr = target["w"].data_ptr()
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, read_only=True) as ck:
        assert ck.load_latest(target)[0] == 7
    assert target["w"].is_cuda and target["w"].data_ptr() == ptr
    assert torch.equal(target["w"], state["w"]) and target["s"].item() == 3.0


def test_dcp_stager_stages_cuda_tensors_into_the_pinned_arena():
    from ettkit.checkpoint import DcpStager

    state = {"w": torch.randn(1 << 22, device="cuda"), "v": torch.arange(3000 * 7.0, device="cuda").reshape(3000, 7).t()}
    stager = DcpStager()
    try:
        keep_the_stream_busy(50)
        state["w"].mul_(2.0)
        staged = stager.stage(state)
        if hasattr(staged, "result"):
            staged = staged.result()
        stager.synchronize_staging()
        assert stager.pinned and not staged["w"].is_cuda
        assert torch.equal(staged["w"], state["w"].cpu())
        assert torch.equal(staged["v"], state["v"].cpu())
    finally:
        stager.close()
