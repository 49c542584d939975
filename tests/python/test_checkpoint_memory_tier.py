"""The memory tier from Python (#23 item 1): a 2-rank job killed with SIGKILL restores from memory when
both ranks' snapshots survive, and both ranks restore the same disk step when one rank's memory is gone (its
node was lost); the API's errors, the clean-exit cleanup and the fallback warning. The commit and kill -9
rules themselves are pinned in C++ (tests/cpp/checkpoint/memory_tier_test.cpp)."""

import os
import shutil
import signal
import subprocess
import sys

import ettkit
import pytest
import torch
from ettkit import ett
from ettkit.checkpoint import AsyncCheckpointer

TRAINER = os.path.join(os.path.dirname(__file__), "memory_tier_trainer.py")
STEPS, KILL_AT, LAST_DISK = 14, 10, 6


def run_job(tmp_path, name, kill_at, out, shm_of_rank, peer_replica=False, prefetch=False):
    """Both ranks of one attempt; returns their return codes."""
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, ETTKIT_TEST_PEER_REPLICA="1" if peer_replica else "0",
               ETTKIT_TEST_PREFETCH="1" if prefetch else "0")
    init = f"file://{tmp_path / ('rendezvous-' + name)}"
    procs = [subprocess.Popen([sys.executable, TRAINER, str(r), "2", init, str(tmp_path / "run"), str(shm_of_rank(r)),
                               str(STEPS), str(kill_at), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    return [p.returncode for p in procs], [e for _, e in outs]


def assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: what every resumed run must end with."""
    tmp = tmp_path_factory.mktemp("reference")
    for r in range(2):
        (tmp / f"shm-{r}").mkdir()
    codes, errs = run_job(tmp, "ref", -1, tmp / "out", lambda r: tmp / f"shm-{r}")
    assert codes == [0, 0], errs
    return [torch.load(tmp / "out" / f"final-{r}.pt") for r in range(2)]


def _entries_and_arenas(rank_dir, rank, steps):
    """The entries of a killed rank's memory directory other than its stager's two arenas, after checking
    that each of `steps` has its data file as one of those arenas (linked, not copied) and mode 0600. The
    next checkpointer of the rank removes the arena names (test_memory_tier_arena in C++)."""
    names = sorted(os.listdir(rank_dir))
    arenas = {os.stat(rank_dir / n).st_ino for n in names if n.startswith(".arena-")}
    assert len(arenas) == 2, names
    for step in steps:
        st = os.stat(rank_dir / f"step-{step}" / f"rank-{rank}.safetensors")
        assert st.st_ino in arenas and st.st_nlink == 2 and (st.st_mode & 0o777) == 0o600, (step, names)
    return [n for n in names if not n.startswith(".arena-")]


@pytest.mark.parametrize("prefetch", [False, True], ids=["load", "prefetch-then-load"])
@pytest.mark.parametrize("lose_rank_1_memory", [False, True], ids=["memory-survives", "node-of-rank-1-lost"])
def test_sigkilled_job_restores_from_memory_or_all_ranks_from_disk(tmp_path, reference, lose_rank_1_memory, prefetch):
    # Each rank gets its own memory root: two "nodes" on one machine.
    shm = [tmp_path / f"shm-{r}" for r in range(2)]
    for s in shm:
        s.mkdir()
    codes, errs = run_job(tmp_path, "a", KILL_AT, tmp_path / "a", lambda r: shm[r])
    assert codes == [-signal.SIGKILL] * 2, errs
    for r in range(2):  # each rank's memory tier holds the killed step
        (job,) = os.listdir(shm[r])
        entries = _entries_and_arenas(shm[r] / job / f"rank-{r}", r, [KILL_AT, KILL_AT - 2])
        assert entries == [".lock", f"step-{KILL_AT}", f"step-{KILL_AT - 2}"]
    if lose_rank_1_memory:
        shutil.rmtree(shm[1])
        shm[1].mkdir()
    codes, errs = run_job(tmp_path, "b", -1, tmp_path / "b", lambda r: shm[r], prefetch=prefetch)
    assert codes == [0, 0], errs
    for r in range(2):
        resumed = torch.load(tmp_path / "b" / f"resumed-{r}.pt")
        expected = torch.load(tmp_path / "a" / f"expected-{r}.pt")
        if not prefetch:
            assert resumed["prefetch_queued"] is None and resumed["prefetched"] is None
        elif lose_rank_1_memory and r == 0:
            # Rank 0 verified its memory step 10 ahead, but the ranks agreed on the disk step, which it then
            # checked itself.
            assert resumed["prefetch_queued"] == [KILL_AT, LAST_DISK] and resumed["prefetched"] is None
        elif lose_rank_1_memory:
            assert resumed["prefetch_queued"] == [LAST_DISK]
            assert resumed["prefetched"] == {"reverified_bytes": 0}
        else:
            assert resumed["prefetch_queued"] == [KILL_AT, LAST_DISK]
            assert resumed["prefetched"] == {"reverified_bytes": 0}
        if lose_rank_1_memory:
            # Rank 0 still held step 10 in memory, but rank 1 did not: both restore the disk step together.
            assert (resumed["step"], resumed["tier"]) == (LAST_DISK, "disk"), resumed["step"]
            assert resumed["extra"] == {"step": LAST_DISK}
        else:
            assert (resumed["step"], resumed["tier"]) == (KILL_AT, "memory")
            assert resumed["extra"] == {"step": KILL_AT}
            # Model (BatchNorm statistics included) and Adam's moments, bit for bit.
            assert_same(expected["model"], resumed["model"], "model")
            assert_same(expected["optim"], resumed["optim"], "optim")
        final = torch.load(tmp_path / "b" / f"final-{r}.pt")
        # The resumed run trains exactly the steps after the restored one, and ends where the uninterrupted
        # run does: the same losses, the same weights and moments.
        assert sorted(final["losses"]) == list(range(resumed["step"] + 1, STEPS + 1))
        for step, loss in final["losses"].items():
            assert loss == reference[r]["losses"][step], (r, step)
        assert_same(reference[r]["model"], final["model"], "final model")
        assert_same(reference[r]["optim"], final["optim"], "final optim")
        # The job ended cleanly: its memory tier is gone.
        assert os.listdir(shm[r]) == [], os.listdir(shm[r])
    if lose_rank_1_memory:
        assert "not every rank holds it" in errs[0], errs[0][-3000:]
    # The ETT report splits the checkpoints by tier and says which tier the recovery restored from.
    rep = ett.build_report(str(tmp_path / "run"), include_timeline=False)
    tiers = rep["checkpoints"]["tiers"]
    (recovery,) = rep["recoveries"]
    assert recovery["recovered"] is True
    # Memory saves at steps 2, 4, 8, 10 (attempt 0), then 14, or 8, 10 and 14 again after a restore of step 6
    # (attempt 1); disk saves at 6 and 12.
    memory_saves = 7 if lose_rank_1_memory else 5
    assert (tiers["memory"]["count"], tiers["disk"]["count"], rep["checkpoints"]["count"]) == (memory_saves, 2, 2)
    assert tiers["memory"]["blocking_s"] > 0 and tiers["disk"]["blocking_s"] > 0
    assert rep["phases"]["checkpoint_blocking"] == pytest.approx(tiers["memory"]["blocking_s"] + tiers["disk"]["blocking_s"],
                                                                abs=1e-6)
    if lose_rank_1_memory:
        assert recovery["restored_from"] == "disk"
        assert (tiers["disk"]["restores"], tiers["memory"]["restores"]) == (1, 0)
        assert rep["steps"]["retrained"] == KILL_AT - LAST_DISK  # steps 7..10 again
        assert tiers["disk"]["retraining_s"] == recovery["retraining_s"] > 0
    else:
        assert recovery["restored_from"] == "memory"
        assert (tiers["disk"]["restores"], tiers["memory"]["restores"]) == (0, 1)
        assert rep["steps"]["retrained"] == 0 and tiers["memory"]["retraining_s"] == 0
        assert tiers["memory"]["recovered_failures"] == 1
    # Where the restore's verification went: a note of the restarted attempt when the prefetch did it.
    notes = rep["attempts"][1]["notes"]
    if prefetch and not lose_rank_1_memory:
        assert notes["restore_prefetch"].startswith(f"step {KILL_AT} (memory) verified ahead in "), notes
        assert notes["restore_prefetch"].endswith(" s; 0 bytes hashed again at load"), notes
    elif not prefetch:
        assert "restore_prefetch" not in notes, notes


def _state(step):
    return {"w": torch.full((1000,), float(step)), "n": torch.tensor([step])}


def test_memory_saves_need_a_memory_tier_and_valid_arguments(tmp_path):
    with AsyncCheckpointer(tmp_path / "ck", recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match="memory tier"):
            ck.save(1, _state(1), tier="memory")
        with pytest.raises(ettkit.InvalidArgumentError, match="tier='tape'"):
            ck.save(1, _state(1), tier="tape")
    with pytest.raises(ettkit.InvalidArgumentError, match="memory_tier=3"):
        AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=3)
    with pytest.raises(ettkit.InvalidArgumentError, match="memory_tier_budget_bytes=0"):
        AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=True, memory_tier_budget_bytes=0)
    with pytest.raises(ettkit.InvalidArgumentError, match="is not a directory"):
        AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=tmp_path / "nowhere", job_id="j")


def test_an_exception_keeps_the_memory_tier_and_a_clean_close_removes_it(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(RuntimeError, match="the step failed"):
        with AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=shm, job_id="j") as ck:
            h = ck.save(4, _state(4), tier="memory")
            assert h.wait() and h.tier == "memory" and h.durable
            assert ck.memory_saves_committed == 1 and ck.saves_committed == 0
            raise RuntimeError("the step failed")
    assert sorted(os.listdir(ck.memory_tier_directory)) == [".lock", "step-4"]
    target = {"w": torch.zeros(1000), "n": torch.tensor([0])}
    ck = AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=shm, job_id="j")
    assert ck.load_latest(target) == (4, None) and ck.restored_from == "memory"
    assert torch.equal(target["w"], _state(4)["w"])
    ck.close()
    assert os.listdir(shm) == []


def test_a_corrupt_memory_step_falls_back_to_disk_with_a_warning(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    ck = AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=shm, job_id="j")
    ck.save(2, _state(2)).wait()
    ck.save(3, _state(3), tier="memory").wait()
    data = os.path.join(ck.memory_tier_directory, "step-3", "rank-0.safetensors")
    ck.close(discard_memory_tier=False)
    raw = bytearray(open(data, "rb").read())
    raw[-5] ^= 0x40
    open(data, "wb").write(bytes(raw))
    target = {"w": torch.zeros(1000), "n": torch.tensor([0])}
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=shm, job_id="j") as ck:
        with pytest.warns(RuntimeWarning, match=r"memory tier was not usable \(memory-tier step 3.*XXH3"):
            assert ck.load_latest(target) == (2, None)
        assert ck.restored_from == "disk"
    assert torch.equal(target["w"], _state(2)["w"])


# ---- the peer replica (#23 item 3) ------------------------------------------------------------------------


@pytest.mark.parametrize("corrupt_replica", [False, True], ids=["replica-restores", "corrupt-replica-falls-back"])
def test_a_rank_whose_node_was_lost_restores_from_its_partners_replica(tmp_path, reference, corrupt_replica):
    # Two "nodes" (one memory root each), ranks_per_host=1: rank 0 keeps rank 1's replica and the reverse.
    shm = [tmp_path / f"shm-{r}" for r in range(2)]
    for s in shm:
        s.mkdir()
    codes, errs = run_job(tmp_path, "a", KILL_AT, tmp_path / "a", lambda r: shm[r], peer_replica=True)
    assert codes == [-signal.SIGKILL] * 2, errs
    (job,) = os.listdir(shm[0])
    for r in range(2):
        # Each rank holds its own two newest snapshots and its partner's: save().wait() returned only once
        # the partner had committed its copy.
        other = 1 - r
        rank_dir = shm[r] / job / f"rank-{r}"
        assert _entries_and_arenas(rank_dir, r, [KILL_AT, KILL_AT - 2]) == [
            ".lock", f"replica-of-rank-{other}", f"step-{KILL_AT}", f"step-{KILL_AT - 2}"]
        assert sorted(os.listdir(rank_dir / f"replica-of-rank-{other}")) == [f"step-{KILL_AT}", f"step-{KILL_AT - 2}"]
    # Rank 1's node is lost with its memory.
    shutil.rmtree(shm[1])
    shm[1].mkdir()
    if corrupt_replica:
        data = shm[0] / job / "rank-0" / "replica-of-rank-1" / f"step-{KILL_AT}" / "rank-1.safetensors"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    codes, errs = run_job(tmp_path, "b", -1, tmp_path / "b", lambda r: shm[r], peer_replica=True)
    assert codes == [0, 0], errs
    for r in range(2):
        resumed = torch.load(tmp_path / "b" / f"resumed-{r}.pt")
        if corrupt_replica:
            # The bytes rank 1 got back fail their checksum: both ranks restore the same disk step.
            assert (resumed["step"], resumed["tier"], resumed["from_rank"]) == (LAST_DISK, "disk", None)
        else:
            expected = torch.load(tmp_path / "a" / f"expected-{r}.pt")
            assert (resumed["step"], resumed["tier"]) == (KILL_AT, "memory")
            assert resumed["from_rank"] == (0 if r == 1 else None)
            assert_same(expected["model"], resumed["model"], "model")
            assert_same(expected["optim"], resumed["optim"], "optim")
        final = torch.load(tmp_path / "b" / f"final-{r}.pt")
        assert sorted(final["losses"]) == list(range(resumed["step"] + 1, STEPS + 1))
        assert_same(reference[r]["model"], final["model"], "final model")
        assert_same(reference[r]["optim"], final["optim"], "final optim")
        assert os.listdir(shm[r]) == [], os.listdir(shm[r])
    if corrupt_replica:
        assert "did not come back from rank 0" in errs[1] and "XXH3" in errs[1], errs[1][-3000:]
    # Attempt b's memory saves (step 14, or 8, 10 and 14 after the disk restore) all reached the partner.
    memory_saves = 3 if corrupt_replica else 1
    for r in range(2):
        stats = torch.load(tmp_path / "b" / f"replica-{r}.pt")
        assert stats == {"sent": memory_saves, "received": memory_saves, "failed": 0}, (r, stats)


def test_peer_replica_arguments_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ettkit.InvalidArgumentError, match="peer_replica=True needs a memory tier"):
        AsyncCheckpointer(tmp_path / "ck", recorder=None, peer_replica=True)
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(ettkit.InvalidArgumentError, match="needs world_size > 1"):
        AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=shm, job_id="j", peer_replica=True)
    # The checkpointer that refused to open released its directory and memory tier.
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=shm, job_id="j") as ck:
        assert ck.replica_stats == {"sent": 0, "received": 0, "failed": 0}
