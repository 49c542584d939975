"""A committed step is never a torn snapshot, whatever writes the saved tensors while they are copied.

Each test trains a model the way a user would (optimizer-in-backward, BatchNorm statistics written by the
next forward, an EMA updated after the step, a write right after save()), remembers the exact state at each
save() call, and then reads every committed step back with `safetensors` (not through ettkit) and compares
it byte for byte. A save may be refused (TornSnapshotError); it may never commit other bytes.
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ettkit
from ettkit import ett
from ettkit.checkpoint import AsyncCheckpointer


# The CUDA variants run on the GPU machine (tools/gpu_check.sh); here they are skipped.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)]  # skipped without a GPU (cuda_gate.py)


def committed_steps(path):
    return sorted(int(p[5:]) for p in os.listdir(path) if p.startswith("step-")
                  and os.path.exists(os.path.join(path, p, "manifest.json")))


def snapshot_of(state):
    """The flat name -> tensor copy the checkpoint must hold (the names ettkit gives a nested dict)."""
    out = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(x, torch.Tensor):
            out[prefix[:-1]] = x.detach().clone()

    walk("", state)
    return out


def check_commits(path, expected):
    """Every committed step equals the state at its save() exactly. Returns the committed steps."""
    steps = committed_steps(path)
    for step in steps:
        got = load_file(os.path.join(path, f"step-{step}", "rank-0.safetensors"))
        want = expected[step]
        assert set(got) >= set(want), (step, set(want) - set(got))
        for name, t in want.items():
            assert torch.equal(got[name], t.cpu()), f"step {step}: '{name}' holds bytes of another step"
    return steps


def outcome(handles):
    committed, refused = [], []
    for h in handles:
        try:
            h.wait()
            committed.append(h.step)
        except ettkit.TornSnapshotError as e:
            assert "changed while they were being copied" in str(e)
            refused.append(h.step)
    return committed, refused


# ---- optimizer-in-backward on a sparse embedding ------------------------------------------------------------
class SparseModel(torch.nn.Module):
    def __init__(self, rows=500_000, dim=128):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, idx, offsets):
        return self.head(self.emb(idx, offsets)).sum()


def in_backward_training(tmp_path, attach, saves=8, overlap="auto"):
    model = SparseModel()
    emb_opt = torch.optim.SGD([model.emb.weight], lr=0.5)
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)

    # The optimizer-in-backward pattern: the embedding is updated as soon as its gradient is ready.
    def step_embedding(p):
        emb_opt.step()
        emb_opt.zero_grad()

    model.emb.weight.register_post_accumulate_grad_hook(step_embedding)
    path = str(tmp_path / "ck")
    ck = AsyncCheckpointer(path, keep_last=0, recorder=None, overlap=overlap)
    if attach:
        ck.attach(model=model, optimizer=[emb_opt, dense_opt])
    gen = torch.Generator().manual_seed(1)
    state = {"model": model.state_dict()}
    expected, handles = {}, []
    for step in range(1, saves * 2 + 1):
        # Every row is touched each step, so any row copied after the update is a torn row.
        idx = torch.randint(0, model.emb.num_embeddings, (model.emb.num_embeddings // 2,), generator=gen)
        idx = torch.cat([torch.arange(model.emb.num_embeddings), idx])
        offsets = torch.arange(0, idx.numel(), 64)
        dense_opt.zero_grad()
        model(idx, offsets).backward()
        dense_opt.step()
        if step % 2 == 0:
            expected[step] = snapshot_of(state)
            handles.append(ck.save(step, state))
    committed, refused = outcome(handles)
    ck.close()
    assert check_commits(path, expected) == sorted(committed)
    return committed, refused, ck


def test_in_backward_sparse_update_attached_commits_consistent_steps(tmp_path):
    committed, refused, ck = in_backward_training(tmp_path, attach=True)
    assert ck.overlapped
    assert len(committed) >= 0.9 * (len(committed) + len(refused)), (committed, refused)


def test_in_backward_sparse_update_without_attach_blocks_and_commits(tmp_path):
    committed, refused, ck = in_backward_training(tmp_path, attach=False, saves=4)
    assert not ck.overlapped  # nothing fences the writers: save() returned with the copies done
    assert refused == [] and len(committed) == 4


def test_in_backward_sparse_update_forced_overlap_never_commits_torn(tmp_path):
    # overlap=True with no fences: the in-backward update races the copy; every save commits the exact
    # state or is refused, never anything else.
    committed, refused, ck = in_backward_training(tmp_path, attach=False, saves=4, overlap=True)
    # in_backward_training checked every committed step byte for byte; the checkpointer's own counts must
    # agree with what the handles said (a refusal counted as a commit, or lost, fails here). A refused save
    # is a failed one too.
    assert (ck.saves_committed, ck.saves_refused, ck.saves_failed) == (len(committed), len(refused), len(refused))


# ---- BatchNorm statistics written by the next forward ----------------------------------------------------
def bn_training(tmp_path, attach_model, steps=40, every=4, overlap="auto", device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.BatchNorm1d(8192), torch.nn.ReLU(),
                                torch.nn.Linear(8192, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = str(tmp_path / "ck")
    ck = AsyncCheckpointer(path, keep_last=0, recorder=None, overlap=overlap)
    if attach_model:
        ck.attach(model=model, optimizer=opt)
    else:
        ck.attach(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected, handles = {}, []
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(device)
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(x + step).sum().backward()
        opt.step()
        if step % every == 0:
            expected[step] = snapshot_of(state)
            handles.append(ck.save(step, state))
    committed, refused = outcome(handles)
    ck.close()
    assert check_commits(path, expected) == sorted(committed)
    return committed, refused


@pytest.mark.parametrize("device", DEVICES)
def test_batchnorm_8192_channels_with_model_attached_commits(tmp_path, device):
    committed, refused = bn_training(tmp_path, attach_model=True, device=device)
    assert len(committed) >= 9 and len(refused) <= 1, (committed, refused)


def test_batchnorm_statistics_unfenced_are_never_torn(tmp_path):
    # Forced overlap with only the optimizer attached: the next forward writes running_mean/var without a
    # version bump, so no counter can see it. Unfenced overlapped saves copy tensors up to 64 KiB inside
    # save() (these 32 KiB statistics among them), so every save commits the exact statistics.
    committed, refused = bn_training(tmp_path, attach_model=False, overlap=True)
    assert len(committed) == 10 and refused == []


def test_optimizer_alone_does_not_overlap(tmp_path):
    # attach(optimizer) alone cannot fence the forward's buffer writes: save() keeps waiting for its copies,
    # and every save commits the exact state.
    committed, refused = bn_training(tmp_path, attach_model=False)
    assert len(committed) == 10 and refused == []


# ---- an EMA updated after the step ---------------------------------------------------------------------------
def test_ema_buffer_updated_after_the_step_commits_consistent_steps(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = str(tmp_path / "ck")
    ck = AsyncCheckpointer(path, keep_last=0, recorder=None)
    ck.attach(model=model, optimizer=opt)
    x = torch.randn(16, 512)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()  # Adam's state exists from here on
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "ema": ema}
    expected, handles = {}, []
    for step in range(1, 31):
        opt.zero_grad()
        model(x * step).sum().backward()
        opt.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(0.9).add_(v, alpha=0.1)
        if step % 3 == 0:
            expected[step] = snapshot_of(state)
            handles.append(ck.save(step, state))
    committed, refused = outcome(handles)
    ck.close()
    assert check_commits(path, expected) == sorted(committed)
    assert len(committed) >= 9, (committed, refused)


# ---- a write right after save() -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_write_right_after_save_with_nothing_attached_is_not_torn(tmp_path, device):
    path = str(tmp_path / "ck")
    state = {"w": torch.zeros(1 << 22, device=device),
             "v": torch.zeros(3000, 7, device=device).t()}  # one contiguous, one strided
    expected = {}
    with AsyncCheckpointer(path, keep_last=0, recorder=None) as ck:
        handles = []
        for step in range(1, 6):
            expected[step] = snapshot_of(state)
            handles.append(ck.save(step, state))
            state["w"].add_(1.0)  # right after save() returns
            state["v"].add_(1.0)
        committed, refused = outcome(handles)
    assert committed == [1, 2, 3, 4, 5] and refused == []
    assert check_commits(path, expected) == committed


def test_write_during_an_overlapped_save_is_refused_and_the_previous_step_stays_latest(tmp_path):
    path = str(tmp_path / "ck")
    state = {"w": torch.zeros(1 << 20), "b": torch.zeros(16)}
    rec_dir = tmp_path / "run"
    with ett.Recorder(str(rec_dir)) as rec:
        with AsyncCheckpointer(path, keep_last=0, recorder=rec, overlap=True) as ck:
            ck.save(1, state).wait()
            ck._c._hold_commits_for_testing(True)
            h = ck.save(2, state)
            state["w"][7] = 5.0  # the copy may or may not have read it: the bytes could mix two steps
            ck._c._hold_commits_for_testing(False)
            with pytest.raises(ettkit.TornSnapshotError, match=r"'w'"):
                h.wait()
            assert isinstance(h.error, ettkit.TornSnapshotError)
            assert isinstance(h.error, ettkit.CheckpointError)
            assert not h.durable
            assert ck.saves_refused == 1 and ck.saves_committed == 1
            target = {"w": torch.ones(1 << 20), "b": torch.ones(16)}
            assert ck.load_latest(target)[0] == 1
            assert torch.equal(target["w"], torch.zeros(1 << 20))
    assert committed_steps(path) == [1]
    assert not [p for p in os.listdir(path) if p.startswith(".tmp")]  # the refused bytes are gone
    rep = ett.build_report(str(rec_dir))
    assert rep["checkpoints"]["refused"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_wait_for_fences_a_manual_writer(tmp_path, device):
    path = str(tmp_path / "ck")
    state = {"w": torch.zeros(1 << 22, device=device), "other": torch.zeros(1 << 20, device=device)}
    expected = {}
    with AsyncCheckpointer(path, keep_last=0, recorder=None, overlap=True) as ck:
        handles = []
        for step in range(1, 6):
            expected[step] = snapshot_of(state)
            handles.append(ck.save(step, state))
            ck.wait_for([state["w"]])
            state["w"].add_(1.0)
            ck.wait_for([state["other"][10:]])  # a view: matched by its storage
            state["other"].add_(1.0)
        committed, refused = outcome(handles)
    assert committed == [1, 2, 3, 4, 5] and refused == []
    check_commits(path, expected)


def test_inference_tensors_are_copied_synchronously(tmp_path):
    with torch.inference_mode():
        t = torch.ones(1 << 16)
    path = str(tmp_path / "ck")
    with AsyncCheckpointer(path, recorder=None, overlap=True) as ck:
        ck.save(1, {"t": t}).wait()
    assert torch.equal(load_file(os.path.join(path, "step-1", "rank-0.safetensors"))["t"], t)


def test_attach_rejects_other_objects(tmp_path):
    with AsyncCheckpointer(str(tmp_path / "ck"), recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match="nn.Module"):
            ck.attach({"not": "a model"})
        with pytest.raises(ettkit.InvalidArgumentError, match="in_backward"):
            ck.attach(torch.nn.Linear(2, 2), in_backward="sometimes")
        with pytest.raises(ettkit.InvalidArgumentError, match="overlap"):
            AsyncCheckpointer(str(tmp_path / "ck2"), overlap="maybe")


# ---- several ranks: one refusal commits nothing anywhere -------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
def test_a_refusal_on_one_rank_commits_nothing_on_any_rank(tmp_path, world):
    script = os.path.join(os.path.dirname(__file__), "checkpoint_script.py")
    # A file:// rendezvous: no port chosen here and bound later by rank 0, which another test's process
    # (pytest-xdist) could take in between.
    init = f"file://{tmp_path}/rdzv"
    procs = [subprocess.Popen([sys.executable, script, "tornrank", str(tmp_path / "ck"), str(r), str(world),
                               init], stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    outs = [p.communicate(timeout=180) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (r, out.decode(), err.decode()[-3000:])
        assert f"rank-ok {r}".encode() in out
    assert committed_steps(str(tmp_path / "ck")) == [1]
