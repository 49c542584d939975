"""kill -9 while the writer thread backs a memory-tier spare arena (#65), then restart, several times over.

The spare is the arena file the writer makes and backs after a commit when the arena the next save would
reclaim stays linked (here: a hard link to the older step's data file, as a copy tool or a debugger may hold).
The child process saves two memory steps with that link in place and dies by SIGKILL halfway through backing
the spare: deterministically, through the kill point ETTKIT_TEST_KILL_BACKING_FILE_ARENA=1
(src/checkpoint/host_arena.cpp), not a timed kill. Each round checks:
  * the kill landed where it should: a sized, half-backed arena file that no step links is left behind;
  * a restart removes it (and every arena name), and loads the newest committed step bit-exact from memory;
  * what the tier holds does not grow from one crash to the next.

Run as a script, this file is the child: python test_checkpoint_spare_crash.py CK_DIR SHM PINS
"""

import os
import signal
import subprocess
import sys

import pytest
import torch

ELEMS = 1 << 20  # 4 MiB of float32: 16 slices of the backing, so that halfway is inside it
JOB = "spare-crash"


def values(step: int) -> torch.Tensor:
    return torch.randn(ELEMS, generator=torch.Generator().manual_seed(step))


def child(ck_dir: str, shm: str, pins: str) -> int:
    from ettkit.checkpoint import AsyncCheckpointer

    # pin_memory=False: a pinned arena is backed by its registration, so the kill point (in the backing of an
    # unpinned file arena) would never be reached on a CUDA machine.
    ck = AsyncCheckpointer(ck_dir, recorder=None, preempt_signals=(), memory_tier=shm, job_id=JOB, pin_memory=False)
    state = {"w": torch.zeros(ELEMS)}
    restored = ck.load_latest(state)
    start = restored[0] + 1 if restored else 1
    for step in (start, start + 1):
        state["w"].copy_(values(step))
        ck.save(step, state, extra={"step": step}, tier="memory").wait()
        if step == start:
            # A third link to this step's arena: the next commit sees that reclaiming it would leave it
            # linked, and makes and backs a spare - where the kill point fires.
            data = os.path.join(ck.memory_tier_directory, f"step-{step}", "rank-0.safetensors")
            os.link(data, os.path.join(pins, f"pin-{step}"))
    print("survived: the spare was never backed", flush=True)
    ck.close(discard_memory_tier=False)
    return 0


def rank_dir(shm) -> str:
    tiers = [d for d in os.listdir(shm) if d.startswith("ettkit-mem-")]
    assert len(tiers) == 1, tiers
    return os.path.join(shm, tiers[0], "rank-0")


def arenas(dir_: str) -> dict:
    return {n: os.stat(os.path.join(dir_, n)) for n in os.listdir(dir_) if n.startswith(".arena-")}


def tier_bytes(shm) -> int:
    """The bytes the tier's files take (each inode once: a step's data file is its arena's inode)."""
    seen, total = set(), 0
    for root, _, files in os.walk(shm):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


@pytest.fixture
def shm_dir(tmp_path):
    """A root on tmpfs where there is one (the memory tier's own case: /dev/shm), with the test's pins beside
    it on the same file system (a hard link cannot cross one)."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="ettkit-spare-crash-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path)
    try:
        os.makedirs(os.path.join(base, "shm"), mode=0o700)
        os.makedirs(os.path.join(base, "pins"), mode=0o700)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_kill_while_backing_a_spare_arena_leaves_nothing_a_restart_keeps(tmp_path, shm_dir):
    from ettkit.checkpoint import AsyncCheckpointer

    ck_dir, shm, pins = str(tmp_path / "ck"), os.path.join(shm_dir, "shm"), os.path.join(shm_dir, "pins")
    env = dict(os.environ, ETTKIT_TEST_KILL_BACKING_FILE_ARENA="1")
    held, latest = [], 0
    for round_ in range(3):
        proc = subprocess.run([sys.executable, __file__, ck_dir, shm, pins], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == -signal.SIGKILL, (round_, proc.returncode, proc.stdout, proc.stderr[-2000:])
        latest += 2  # each child commits two steps after the one it restored, and dies backing the spare
        dir_ = rank_dir(shm)
        # Where the kill landed: besides the two arenas the steps link, one file no step links, sized and
        # backed only in part (tmpfs counts the pages the backing faulted in).
        left = arenas(dir_)
        assert len(left) == 3, (round_, sorted(left))
        spare = [st for st in left.values() if st.st_nlink == 1]
        assert len(spare) == 1, (round_, {n: st.st_nlink for n, st in left.items()})
        assert spare[0].st_size >= ELEMS * 4
        if shm.startswith("/dev/shm/"):
            assert 0 < spare[0].st_blocks * 512 < spare[0].st_size, (spare[0].st_blocks, spare[0].st_size)
        assert sorted(n for n in os.listdir(dir_) if n.startswith("step-")) == [f"step-{latest - 1}",
                                                                               f"step-{latest}"]
        # The restart: the leftovers go, the newest committed step loads bit-exact from memory.
        ck = AsyncCheckpointer(ck_dir, recorder=None, preempt_signals=(), memory_tier=shm, job_id=JOB)
        try:
            assert arenas(dir_) == {}, sorted(arenas(dir_))
            target = {"w": torch.zeros(ELEMS)}
            step, extra = ck.load_latest(target)
            assert (step, extra, ck.restored_from) == (latest, {"step": latest}, "memory")
            assert torch.equal(target["w"], values(latest))
        finally:
            ck.close(discard_memory_tier=False)
        assert not [n for n in os.listdir(dir_) if n.startswith((".arena-", ".tmp-", ".trash-"))], os.listdir(dir_)
        held.append(tier_bytes(shm))
    # The restored step alone (a restore retires every other step): one arena file, whatever the number of
    # crashes; the manifest, owner record and lock take a few pages.
    arena_file = ELEMS * 4
    assert all(arena_file <= h <= arena_file + (1 << 20) for h in held), held
    assert max(held) - min(held) <= 64 << 10, held


if __name__ == "__main__":
    sys.exit(child(*sys.argv[1:4]))
