"""The memory tier is created, never adopted (#39 item 3), attacked end to end by a second user.

The tier lives in a directory every user of the node can write (/dev/shm) under a name anyone can compute
(the victim's uid, its job id, its checkpoint directory). A co-tenant who creates that directory first, world
writable and holding a planted step, used to get the victim's restart to load the planted step (code execution
through the step's ``.extra``, issue #39 item 1) and to read every later snapshot written into it. Here the
co-tenant is a real second uid (``setpriv --reuid=65534``, which needs root; skipped otherwise) and the tests
check that the victim refuses the directory, loads nothing from it, writes nothing into it, and still
checkpoints to disk. The finer cases (a symbolic link, modes, a stale tier of another user) are pinned in C++
(tests/cpp/checkpoint/memory_tier_security_test.cpp)."""

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile

import ettkit
import pytest
import torch
from ettkit.checkpoint import AsyncCheckpointer

ATTACKER_UID = 65534  # "nobody": a user who is not the victim
JOB = "job-39"

needs_second_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="the attacker runs as a second uid (setpriv --reuid=65534), which needs root and setpriv",
)


def _state(value):
    return {"w": torch.full((1000,), float(value)), "n": torch.tensor([int(value)])}


def _tree(path):
    """Every entry under `path` with its type, mode, owner and bytes (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = hashlib.sha256(open(p, "rb").read()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[os.path.relpath(p, path)] = (st.st_mode, st.st_uid, st.st_size, digest)
    st = os.lstat(path)
    out["."] = (st.st_mode, st.st_uid)
    return out


@pytest.fixture
def shared_root():
    """A root like /dev/shm: sticky, every user may create in it (tmp_path is private to this user, so the
    attacker could not reach a root inside it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="ettkit-security-shm-", dir=base)
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _as_attacker(*argv):
    subprocess.run(["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups", *argv],
                   check=True, capture_output=True, text=True)


def _planted_tier(root, tmp_path):
    """A whole tier (owner.json, rank-0/step-99) holding the attacker's values, readable by the attacker: what
    the attacker copies into the squatted directory. Made by ettkit itself, so that the step is one the
    victim's restart would load if it adopted the directory."""
    staging_root = os.path.join(root, "staging")
    os.mkdir(staging_root, 0o700)
    ck = AsyncCheckpointer(tmp_path / "attacker-ck", recorder=None, memory_tier=staging_root,
                           job_id="attacker")
    assert ck.save(99, _state(666), tier="memory").wait()
    job_dir = os.path.dirname(ck.memory_tier_directory)
    ck.close(discard_memory_tier=False)
    planted = os.path.join(root, "planted")
    shutil.copytree(job_dir, planted)
    os.unlink(os.path.join(planted, "rank-0", ".lock"))
    shutil.rmtree(staging_root)
    subprocess.run(["chmod", "-R", "a+rX", planted], check=True)
    return planted


@needs_second_user
def test_a_tier_directory_squatted_by_another_user_is_refused_and_disk_checkpoints_still_work(
        tmp_path, shared_root):
    ck_dir = tmp_path / "ck"
    # The victim's first run: a disk step, and the name of its tier (removed by the clean close).
    with AsyncCheckpointer(ck_dir, recorder=None, memory_tier=shared_root, job_id=JOB) as ck:
        assert ck.save(1, _state(1)).wait()
        tier_name = os.path.basename(os.path.dirname(ck.memory_tier_directory))
    assert not os.path.exists(os.path.join(shared_root, tier_name))
    disk_before = _tree(ck_dir)

    # The co-tenant creates the victim's tier directory first: mode 0777, with a planted step 99.
    planted = _planted_tier(shared_root, tmp_path)
    squat = os.path.join(shared_root, tier_name)
    _as_attacker("sh", "-c", 'mkdir -m 0777 "$1" && cp -R "$2"/. "$1"/ && chmod -R a+rwX "$1"', "sh",
                 squat, planted)
    assert os.stat(squat).st_uid == ATTACKER_UID
    squat_before = _tree(squat)

    # The victim restarts: the squatted directory is refused, naming it, its owner and its mode.
    with pytest.raises(ettkit.IoError) as refused:
        AsyncCheckpointer(ck_dir, recorder=None, memory_tier=shared_root, job_id=JOB)
    message = str(refused.value)
    assert squat in message and f"owned by uid {ATTACKER_UID}" in message and "mode 0777" in message, message
    # Nothing was written into it, chmod-ed, or removed: the attacker reads no snapshot of the victim's.
    assert _tree(squat) == squat_before
    assert _tree(ck_dir) == disk_before

    # Disk checkpointing still works, and restores the victim's own step, never the planted one.
    target = _state(0)
    with AsyncCheckpointer(ck_dir, recorder=None) as ck:
        assert ck.load_latest(target) == (1, None) and ck.restored_from == "disk"
        assert torch.equal(target["w"], _state(1)["w"]) and torch.equal(target["n"], _state(1)["n"])
        assert ck.save(2, _state(2)).wait()
    with AsyncCheckpointer(ck_dir, recorder=None, read_only=True) as ck:
        assert ck.load_latest(target) == (2, None)
        assert torch.equal(target["w"], _state(2)["w"])
    # So does a memory tier in a root of the victim's own, the way out the error names.
    own_root = tmp_path / "own-shm"
    own_root.mkdir(mode=0o700)
    with AsyncCheckpointer(ck_dir, recorder=None, memory_tier=own_root, job_id=JOB) as ck:
        assert ck.save(3, _state(3), tier="memory").wait()
    assert _tree(squat) == squat_before


def test_a_root_other_users_can_rename_entries_in_is_refused(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o777)  # world-writable without the sticky bit: anyone could swap the tier for their own
    with pytest.raises(ettkit.InvalidArgumentError, match="sticky"):
        AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=root, job_id=JOB)
    assert os.listdir(root) == []
    os.chmod(root, 0o1777)
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, memory_tier=root, job_id=JOB) as ck:
        assert ck.save(1, _state(1), tier="memory").wait()
        tier = os.path.dirname(ck.memory_tier_directory)
        assert os.path.basename(tier).startswith(f"ettkit-mem-{os.geteuid()}-")
        assert stat.S_IMODE(os.stat(tier).st_mode) == 0o700
        step = os.path.join(ck.memory_tier_directory, "step-1")
        assert {stat.S_IMODE(os.stat(os.path.join(step, f)).st_mode) for f in os.listdir(step)} == {0o600}
