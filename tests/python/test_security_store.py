"""Issue 39 item 4: a client of the job's TCPStore that is not a rank cannot make a rank delete, move or write
anything by announcing a peer-replica snapshot whose run id is a path (`a/` + `../` x 30 + a victim
directory), nor by any other malformed announcement: the ranks ignore it with a warning, and their own saves,
replicas and the next load work as if it had never been sent. The C++ side of the same rules (every decoder,
every link in a checkpoint directory) is tests/cpp/checkpoint/path_safety_test.cpp and peer_replica_test.cpp.
"""

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from ettkit import _C

RANK = os.path.join(os.path.dirname(__file__), "store_attack_rank.py")


def empty_file():
    return {"size": 0, "xxh3": _C.xxh3_hex(b"")}


def announcement(src: int, run_id: str, step: int = 2, world_size: int = 2) -> bytes:
    """A snapshot announcement that decodes, checksums included (the stranger computes them: they prove
    nothing), naming the sender's two files as empty files: nothing has to follow over the process group."""
    manifest = {"format": "ettkit-checkpoint", "version": 1, "step": step, "world_size": world_size,
                "files": {f"rank-{src}.safetensors": empty_file(), f"rank-{src}.extra": empty_file()},
                "metadata": {"ettkit.run_id": run_id}}
    return json.dumps({"manifest": json.dumps(manifest)}).encode()


def taken(store, key: str, timeout_s: float = 30.0) -> bool:
    """Whether the receiver took (read and deleted) `key` within timeout_s: a condition polled, not a sleep
    that hopes it happened."""
    deadline = time.monotonic() + timeout_s
    while store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def victim(tmp_path):
    """A directory of the user's outside the checkpoint: what the stranger aims at."""
    v = tmp_path / "victim"
    (v / "sub").mkdir(parents=True)
    (v / "marker").write_text("the user's")
    (v / "sub" / "marker").write_text("the user's too")
    return v


def assert_untouched(victim):
    names = sorted(p.relative_to(victim).as_posix() for p in victim.rglob("*"))
    assert names == ["marker", "sub", "sub/marker"]
    assert (victim / "marker").read_text() == "the user's"
    assert (victim / "sub" / "marker").read_text() == "the user's too"


def test_a_stranger_on_the_store_cannot_make_a_rank_delete_or_write_anything(tmp_path, victim):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    shm = [tmp_path / f"node-{r}" for r in range(2)]
    for s in shm:
        s.mkdir()
    port = str(store.port)
    ranks = [subprocess.Popen([sys.executable, RANK, str(r), port, str(ckpt), str(shm[r]), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        store.wait(["ready/0", "ready/1"], datetime.timedelta(seconds=120))
        # What any client of the Store can read: the run id the ranks agreed on, hence every key of the run.
        base = f"ettkit_ckpt:{os.path.realpath(ckpt)}/"
        run_id = store.get(base + "gen/0/run_id").decode()
        climb = "a/" + "../" * 30 + str(victim).lstrip("/")
        hostile = [
            announcement(0, climb),                                   # the review's attack
            announcement(0, climb + "/sub"),
            announcement(0, "../" + run_id),                          # almost this run's id
            announcement(0, run_id, step=-1),                         # out of range
            announcement(0, run_id, world_size=3),                    # another job's shape
            json.dumps({"manifest": "{not a manifest"}).encode(),
            b"\xff\xfe not json",
        ]
        # Rank 1 keeps rank 0's replicas, rank 0 rank 1's: both receivers are attacked, each under the key of
        # its sender's first snapshot. A receiver that acted on a message moves on to the next key and leaves
        # the following ones untaken (what the code before this fix did).
        untaken = []
        for src in (0, 1):
            key = f"{base}{run_id}/replica/announce/{src}/0"
            for message in hostile:
                store.set(key, message.replace(b"rank-0.", f"rank-{src}.".encode()))
                if not taken(store, key, timeout_s=10.0):
                    untaken.append(key)
                    break
        store.set("attack-done", "1")
        outs = [p.communicate(timeout=240) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    # Nothing of the user's was deleted, moved or written into.
    assert_untouched(victim)
    errs = [e for _, e in outs]
    assert [p.returncode for p in ranks] == [0, 0], errs
    assert not untaken, ("a receiver stopped taking announcements after acting on one", untaken, errs)
    for r in range(2):
        got = json.loads((out / f"rank-{r}.json").read_text())
        # Every malformed announcement was ignored with a warning that says why, and no acknowledgement.
        assert errs[r].count("ignored a malformed snapshot announcement") == len(hostile), errs[r]
        assert "a run id is 16 lowercase hex digits" in errs[r], errs[r]
        # The ranks' own replica went through as if nothing had happened, and the next load works.
        assert got["replica_stats"] == {"sent": 1, "received": 1, "failed": 0}, got
        assert got["replica_steps"] == ["step-2"], got
        assert got["loaded"] == {"step": 4, "extra": {"rank": r}, "equal": True}, got
    # The attack left nothing in the checkpoint directory either.
    assert sorted(os.listdir(ckpt)) == [".lock", "latest", "step-4"]
