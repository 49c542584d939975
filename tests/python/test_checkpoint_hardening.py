"""AsyncCheckpointer hardening (issue 12 items 1-5, 7, 12; issue 25 item 3): retention by commit order,
a `latest` pointer that may fail, malformed manifests, reserved names, conjugate/negative views, a corrupt
`.extra`, and one job per checkpoint directory."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import ettkit
from ettkit.checkpoint import AsyncCheckpointer

HOLDER = r"""
import sys, time
from ettkit.checkpoint import AsyncCheckpointer
ck = AsyncCheckpointer(sys.argv[1], recorder=None)
print("ready", flush=True)
time.sleep(120)
"""

HOLDER_WITH_CHILD = r"""
import os, sys, time
from ettkit.checkpoint import AsyncCheckpointer
ck = AsyncCheckpointer(sys.argv[1], recorder=None)
child = os.fork()  # a DataLoader worker, say: it inherits every open descriptor
if child == 0:
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""

WRITER = r"""
import sys, torch
from ettkit.checkpoint import AsyncCheckpointer
with AsyncCheckpointer(sys.argv[1], recorder=None, keep_last=1) as ck:
    print("ready", flush=True)
    for step in range(1, 10**9):
        ck.save(step, {"w": torch.full((20_000,), float(step))}, extra=step).wait()
"""



def cpp_log(caplog) -> str:
    """What the C++ core logged so far: its messages arrive through Python logging (logger "ettkit")."""
    ettkit._logging.flush()
    return caplog.text

def state(step: int):
    return {"w": torch.full((1000,), float(step)), "i": torch.arange(10, dtype=torch.int64) * step}


def zeros():
    return {"w": torch.zeros(1000), "i": torch.zeros(10, dtype=torch.int64)}


def save_steps(path, steps, keep_last=0):
    with AsyncCheckpointer(path, recorder=None, keep_last=keep_last) as ck:
        for s in steps:
            h = ck.save(s, state(s), extra=s)
            assert h.wait() and h.durable


def steps_on_disk(path):
    return sorted(n for n in os.listdir(path) if n.startswith("step-"))


def load(path, **kw):
    target = zeros()
    with AsyncCheckpointer(path, recorder=None, **kw) as ck:
        res = ck.load_latest(target)
    if res is not None:
        assert torch.equal(target["w"], state(res[0])["w"]) and torch.equal(target["i"], state(res[0])["i"])
        assert res[1] == res[0]
    return res


# ---- 1: retention by commit order --------------------------------------------------------------------------

def test_saving_a_lower_step_number_keeps_it_and_it_is_the_latest(tmp_path):
    save_steps(tmp_path, [100, 200, 300])
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=3) as ck:
        h = ck.save(50, state(50), extra=50)
        assert h.wait() and h.durable
    # The oldest commit (100) is retired, not the step just committed.
    assert steps_on_disk(tmp_path) == ["step-200", "step-300", "step-50"]
    assert (tmp_path / "latest").read_text() == "step-50\n"
    assert load(tmp_path)[0] == 50
    manifest = json.loads((tmp_path / "step-50" / "manifest.json").read_text())
    older = json.loads((tmp_path / "step-300" / "manifest.json").read_text())
    assert manifest["commit_seq"] > older["commit_seq"] >= 1


def test_keep_last_one_with_a_corrupt_higher_step_keeps_the_new_step(tmp_path, caplog):
    save_steps(tmp_path, [10])
    (tmp_path / "step-20").mkdir()
    (tmp_path / "step-20" / "manifest.json").write_text("{not json")
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=1) as ck:
        assert ck.save(15, state(15), extra=15).wait()
    assert steps_on_disk(tmp_path) == ["step-15", "step-20"]  # 10 retired, the corrupt 20 left alone
    assert "step-20" in cpp_log(caplog)
    with pytest.warns(RuntimeWarning, match=r"\[20\]"):
        assert load(tmp_path)[0] == 15


def test_a_job_restarted_from_step_one_advances_its_checkpoints(tmp_path):
    save_steps(tmp_path, [100, 200, 300], keep_last=3)
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=3) as ck:
        for s in (1, 2, 3, 4):
            assert ck.save(s, state(s), extra=s).wait()
            assert load_step_in_place(ck) == s
    assert steps_on_disk(tmp_path) == ["step-2", "step-3", "step-4"]


def load_step_in_place(ck):
    target = zeros()
    return ck.load_latest(target)[0]


def test_foreign_entries_are_never_counted_or_deleted(tmp_path, caplog):
    save_steps(tmp_path, [1])
    os.rename(tmp_path / "step-1", tmp_path / "step-001")            # zero-padded copy of a real step
    (tmp_path / "step-7").write_text("a plain file")
    os.symlink(tmp_path / "nowhere", tmp_path / "step-8")              # dangling link
    (tmp_path / "step-9").mkdir()                                      # never committed
    (tmp_path / ("step-" + "9" * 19)).mkdir()                          # beyond the step limit
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=1) as ck:
        for s in (2, 3):
            assert ck.save(s, state(s), extra=s).wait()
    left_alone = ["step-001", "step-7", "step-8", "step-9", "step-" + "9" * 19]
    assert steps_on_disk(tmp_path) == sorted(left_alone + ["step-3"])
    err = cpp_log(caplog)
    assert "step-001" in err and "step-7" in err and "step-9" in err
    assert err.count("leaving 'step-001'") == 1  # warned once per checkpointer, not at every save
    with pytest.warns(RuntimeWarning):
        assert load(tmp_path)[0] == 3


def test_steps_at_or_above_the_limit_are_refused_at_save(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match="step=1000000000000000000 .*10\\^18"):
            ck.save(10**18, state(1))
        assert ck.save(10**18 - 1, state(1), extra=1).wait()
    target = zeros()
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.load_latest(target)[0] == 10**18 - 1


# ---- 2: `latest` failing after the commit ------------------------------------------------------------------

def test_a_latest_pointer_that_cannot_be_written_does_not_fail_the_committed_step(tmp_path, caplog):
    (tmp_path / "latest").mkdir()  # rename(latest.tmp, latest) fails with EISDIR after every commit
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=1) as ck:
        for s in (1, 2):
            h = ck.save(s, state(s), extra=s)
            assert h.wait() and h.durable and h.error is None
        assert ck.saves_committed == 2
    assert "latest" in cpp_log(caplog)
    assert steps_on_disk(tmp_path) == ["step-2"]  # retention ran
    assert not [n for n in os.listdir(tmp_path) if n.startswith("latest.tmp")]
    assert load(tmp_path)[0] == 2


# ---- 3: malformed manifests fall back ----------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("format", 1),
    ("version", 4294967297),
    ("version", 0),
    ("version", "1"),
    ("step", 2.5),
    ("step", -2),
    ("world_size", 4294967297),
    ("world_size", 1.0),
    ("created_unix_us", "yesterday"),
    ("commit_seq", -1),
    ("torch_version", 2),
    ("files", []),
    ("files", {"rank-0.safetensors": {"size": -1, "xxh3": "0"}}),
    ("files", {"rank-0.safetensors": {"size": 2**64, "xxh3": "0"}}),
    ("metadata", {"a": 1}),
])
def test_a_mistyped_manifest_field_falls_back_to_the_older_step(tmp_path, field, value):
    save_steps(tmp_path, [1, 2])
    path = tmp_path / "step-2" / "manifest.json"
    m = json.loads(path.read_text())
    m[field] = value
    path.write_text(json.dumps(m))
    with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
        assert load(tmp_path)[0] == 1


def test_a_manifest_that_is_a_number_or_a_list_falls_back(tmp_path):
    save_steps(tmp_path, [1, 2, 3])
    (tmp_path / "step-3" / "manifest.json").write_text("3")
    (tmp_path / "step-2" / "manifest.json").write_text("[1, 2]")
    with pytest.warns(RuntimeWarning, match=r"\[3, 2\]"):
        assert load(tmp_path)[0] == 1


# ---- chunk checksums (issue 23 item 5) ----------------------------------------------------------------------

def _big_steps(tmp_path):
    """Steps 1 and 2 of a 40 MiB tensor (eleven 4 MiB chunks: a disk file's chunks are a 64th of it, at least
    4 MiB); returns step 1's values."""
    t = torch.arange(10 << 20, dtype=torch.float32)
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(1, {"t": t}).wait()
        ck.save(2, {"t": t + 1}).wait()
    return t


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_flipped_byte_in_a_later_chunk_is_named_by_its_range_and_falls_back(tmp_path):
    want = _big_steps(tmp_path)
    m = json.loads((tmp_path / "step-2" / "manifest.json").read_text())
    f = m["files"]["rank-0.safetensors"]
    assert f["chunk_bytes"] == 4 << 20 and len(f["chunks"]) == 11 and f["size"] > 40 << 20
    _flip(tmp_path / "step-2" / "rank-0.safetensors", (35 << 20) + 3)
    with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
        with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
            got = {"t": torch.zeros_like(want)}
            assert ck.load_latest(got)[0] == 1
    assert torch.equal(got["t"], want)
    # The same corruption in both steps: no valid step, the error names the range of each.
    _flip(tmp_path / "step-1" / "rank-0.safetensors", (35 << 20) + 3)
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
        with pytest.raises(ettkit.CorruptCheckpointError, match=r"bytes \[33554432, 37748736\) have XXH3"):
            ck.load_latest({"t": torch.zeros_like(want)})


def test_a_manifest_without_chunk_checksums_is_verified_whole(tmp_path):
    # A step written before chunk checksums existed: the whole-file XXH3 still verifies it. (Today's writer
    # derives a multi-chunk file's checksum from its chunks': the old writer's whole-file one is put back.)
    from ettkit import _C

    want = _big_steps(tmp_path)
    for step in (1, 2):
        path = tmp_path / f"step-{step}" / "manifest.json"
        m = json.loads(path.read_text())
        for name, f in m["files"].items():
            del f["chunk_bytes"], f["chunks"]
            f["xxh3"] = _C.xxh3_hex((tmp_path / f"step-{step}" / name).read_bytes())
        path.write_text(json.dumps(m))
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
        got = {"t": torch.zeros_like(want)}
        assert ck.load_latest(got)[0] == 2 and torch.equal(got["t"], want + 1)
    _flip(tmp_path / "step-2" / "rank-0.safetensors", (35 << 20) + 3)
    with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
        with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
            assert ck.load_latest(got)[0] == 1 and torch.equal(got["t"], want)


# ---- 4: reserved names -------------------------------------------------------------------------------------

def test_reserved_safetensors_key_is_refused_at_save(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match="'__metadata__'.*reserved"):
            ck.save(1, {"__metadata__": torch.ones(3), "w": torch.ones(2)})
        # Nested, the name is "a.__metadata__": not reserved.
        assert ck.save(2, {"a": {"__metadata__": torch.ones(3)}}).wait()
    assert not (tmp_path / "step-1").exists()
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "step-2" / "rank-0.safetensors"))
    assert torch.equal(loaded["a.__metadata__"], torch.ones(3))


# ---- 5: conjugate and negative views -----------------------------------------------------------------------

def test_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    z = torch.complex(torch.arange(6.0), torch.arange(6.0) + 10)
    x = torch.arange(5.0) + 1
    src = {"conj": z.conj(), "neg": x._neg_view(), "conj_t": z.reshape(2, 3).conj().t()}
    assert src["conj"].is_conj() and src["neg"].is_neg()
    expect = {k: v.resolve_conj().resolve_neg().clone() for k, v in src.items()}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.save(1, src).wait()
    from safetensors.torch import load_file

    on_disk = load_file(str(tmp_path / "step-1" / "rank-0.safetensors"))
    for k, v in expect.items():
        assert torch.equal(on_disk[k], v), k
    target = {k: torch.zeros_like(v) for k, v in expect.items()}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.load_latest(target)[0] == 1
    for k, v in expect.items():
        assert torch.equal(target[k], v), k
    # Loading into a conjugate view writes the values it shows.
    view_target = {"conj": torch.zeros(6, dtype=torch.complex64).conj(), "neg": torch.zeros(5)._neg_view(),
                   "conj_t": torch.zeros(3, 2, dtype=torch.complex64)}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.load_latest(view_target)
    assert torch.equal(view_target["conj"].resolve_conj(), expect["conj"])
    assert torch.equal(view_target["neg"].resolve_neg(), expect["neg"])


# ---- 7: a corrupt .extra is found before any tensor is copied ----------------------------------------------

def _corrupt_extra(path, step):
    f = path / f"step-{step}" / "rank-0.extra"
    data = bytearray(f.read_bytes())
    magic = len(b"ettkit-py-extra-v2\n")
    for i in range(magic, len(data)):  # same size: only the checksum (off here) would notice
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))


def test_corrupt_extra_without_verification_falls_back_before_copying(tmp_path):
    save_steps(tmp_path, [1, 2])
    _corrupt_extra(tmp_path, 2)
    with pytest.warns(RuntimeWarning, match=r"\[2\]"):
        assert load(tmp_path, verify_on_load=False)[0] == 1
    _corrupt_extra(tmp_path, 1)
    target = zeros()
    with AsyncCheckpointer(tmp_path, recorder=None, verify_on_load=False) as ck:
        with pytest.raises(ettkit.CorruptCheckpointError, match="rank-0.extra"):
            ck.load_latest(target)
    assert torch.equal(target["w"], torch.zeros(1000))
    assert torch.equal(target["i"], torch.zeros(10, dtype=torch.int64))


@pytest.mark.parametrize("record,allow_pickle", [
    # A record of the current format that decodes to a list of three ints, not a dict of fields.
    (b"ettkit-py-extra-v2\nl\x03" + b"".join(b"i" + i.to_bytes(8, "little") for i in (1, 2, 3)), False),
    # The former (pickled) format, read under the opt-in: a list, not the record's dict.
    (b"ettkit-py-extra-v1\n" + pickle.dumps([1, 2, 3]), True),
])
def test_extra_that_decodes_to_the_wrong_shape_falls_back(tmp_path, record, allow_pickle):
    save_steps(tmp_path, [1, 2])
    f = tmp_path / "step-2" / "rank-0.extra"
    f.write_bytes(record)
    m = json.loads((tmp_path / "step-2" / "manifest.json").read_text())
    m["files"]["rank-0.extra"]["size"] = f.stat().st_size
    (tmp_path / "step-2" / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(RuntimeWarning, match=r"\[2\]"):
        assert load(tmp_path, verify_on_load=False, allow_pickle=allow_pickle)[0] == 1


# ---- 12: one job per checkpoint directory ------------------------------------------------------------------

def test_two_checkpointers_in_one_process_on_one_directory(tmp_path):
    first = AsyncCheckpointer(tmp_path, recorder=None)
    with pytest.raises(ettkit.CheckpointLockedError, match=f"pid {os.getpid()}") as e:
        AsyncCheckpointer(tmp_path, recorder=None)
    # One sentence that says who holds the lock (this process) and how to only read, spelled for Python.
    assert (f"pid {os.getpid()} on host '{os.uname().nodename}' (that is another checkpointer of this process, "
            f"which must be closed before a new one opens) holds '{tmp_path}/.lock'") in str(e.value)
    assert "read_only=True in Python" in str(e.value)
    holder = (tmp_path / ".lock").read_text()
    assert json.loads(holder)["pid"] == os.getpid()
    first.close()
    with AsyncCheckpointer(tmp_path, recorder=None) as again:  # released by close()
        assert again.save(1, state(1), extra=1).wait()
    del first
    AsyncCheckpointer(tmp_path, recorder=None)  # released by destruction (the previous one was unreferenced)
    AsyncCheckpointer(tmp_path, recorder=None)


def test_a_second_job_fails_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        inflight = tmp_path / ".tmp-step-5-0123456789abcdef"   # the first job's save in progress
        inflight.mkdir()
        with pytest.raises(ettkit.CheckpointLockedError, match=f"pid {proc.pid}") as e:
            AsyncCheckpointer(tmp_path, recorder=None)
        assert os.uname().nodename in str(e.value)
        assert inflight.exists()  # the second job deleted nothing
        # A read-only loader neither takes the lock nor cleans up.
        save_dir_ro = AsyncCheckpointer(tmp_path, recorder=None, read_only=True)
        assert save_dir_ro.load_latest(zeros()) is None
        with pytest.raises(ettkit.InvalidArgumentError, match="read_only"):
            save_dir_ro.save(1, state(1))
        save_dir_ro.close()
        assert inflight.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The holder died: the kernel released its flock, the next job takes over and cleans its leftovers.
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        assert not inflight.exists()
        assert ck.save(1, state(1), extra=1).wait()


def test_a_forked_child_never_keeps_the_directory_locked(tmp_path):
    # The parent closes: its next checkpointer gets the lock although the child still runs.
    ck = AsyncCheckpointer(tmp_path, recorder=None)
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    try:
        ck.close()
        with AsyncCheckpointer(tmp_path, recorder=None) as again:
            assert again.save(1, state(1), extra=1).wait()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    # The parent dies while its forked child lives on: the lock is free at once.
    proc = subprocess.Popen([sys.executable, "-c", HOLDER_WITH_CHILD, str(tmp_path)], stdout=subprocess.PIPE)
    grandchild = int(proc.stdout.readline())
    try:
        with pytest.raises(ettkit.CheckpointLockedError):
            AsyncCheckpointer(tmp_path, recorder=None)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(grandchild, 0)  # still alive
        with AsyncCheckpointer(tmp_path, recorder=None) as ck:
            assert ck.save(2, state(2), extra=2).wait()
    finally:
        proc.kill()
        proc.wait()
        os.kill(grandchild, signal.SIGKILL)


def test_a_read_only_loader_never_fails_while_retention_runs(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        while not steps_on_disk(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        loaded = []
        with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck, warnings.catch_warnings():
            # Load while the writer commits and retires: every load must succeed, whatever it races, and a
            # step retired under the loader is not reported as a corrupt one. On until retention has moved
            # several times (bounded: how fast the writer advances depends on the machine's load, the
            # loader's correctness not).
            warnings.simplefilter("error", RuntimeWarning)
            deadline = time.monotonic() + 120
            while len(set(loaded)) < 6 and time.monotonic() < deadline:
                target = {"w": torch.zeros(20_000)}
                step, extra = ck.load_latest(target)
                assert extra == step and torch.equal(target["w"], torch.full((20_000,), float(step)))
                loaded.append(step)
        assert loaded == sorted(loaded) and len(set(loaded)) >= 6
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


# ---- a step number is an integer ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1.5, 2.0, "7", True, None, torch.tensor(1.5), torch.tensor([1, 2])])
def test_a_step_that_is_not_an_integer_is_refused_by_name_and_nothing_is_saved(tmp_path, bad):
    # int(1.5) would silently commit step-1 and int("7") would parse text: both are refused.
    with AsyncCheckpointer(tmp_path, recorder=None, every=1) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match=r"step=.* is not a step number: give an int"):
            ck.save(bad, {"w": torch.ones(3)})
        with pytest.raises(ettkit.InvalidArgumentError, match=r"step=.* is not a step number"):
            ck.should_save(bad)
    assert not list(tmp_path.glob("step-*"))


def test_integer_steps_of_numpy_and_torch_are_steps(tmp_path):
    import numpy as np

    with AsyncCheckpointer(tmp_path, recorder=None, every=None) as ck:
        ck.save(np.int64(3), {"w": torch.ones(3)}).wait()
        ck.save(torch.tensor(4), {"w": torch.ones(3)}).wait()
        assert ck.should_save(np.int32(5)) is False
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-3", "step-4"]


# ---- the binding: options and the load result by name, every check in C++ once ----------------------------

def test_options_and_load_result_are_named_and_checked_once_in_cpp(tmp_path):
    from ettkit import _C

    # A value of the wrong type is C++'s InvalidArgumentError naming the field (not pybind11's TypeError).
    with pytest.raises(ettkit.InvalidArgumentError, match=r"on_busy=3 is not valid: give one of 'wait'"):
        AsyncCheckpointer(tmp_path / "a", recorder=None, on_busy=3)
    with pytest.raises(ettkit.InvalidArgumentError, match=r"overlap='sometimes' is not one of 'auto', 'on', 'off'"):
        AsyncCheckpointer(tmp_path / "a", recorder=None, overlap="sometimes")
    with pytest.raises(ettkit.InvalidArgumentError, match=r"unfenced_sync_max_bytes=-1 must be >= 0"):
        AsyncCheckpointer(tmp_path / "a", recorder=None, unfenced_sync_max_bytes=-1)
    options = _C.checkpoint.CheckpointerOptions()
    options.on_busy, options.overlap = "skip", "off"
    assert (options.on_busy, options.overlap, options.keep_last, options.stager.num_arenas) == ("skip", "off", 3, 1)
    with pytest.raises(AttributeError):
        options.keep_lsat = 2  # a misspelt field is an error, not a new attribute
    with AsyncCheckpointer(tmp_path / "b", recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match=r"tier=3 is not valid: give one of 'disk', 'memory'"):
            ck.save(1, {"w": torch.ones(2)}, tier=3)
        ck.save(4, {"w": torch.ones(2)}, extra=b"x").wait()
        res = ck._c.load_latest(["w"], [torch.zeros(2)])
        assert (res.step, res.tier, res.skipped_steps) == (4, "disk", [])
        assert isinstance(res.extra, bytes) and len(res.extra) > 0  # the encoded skeleton and extra=
        assert (res.saved_world_size, res.memory_from_rank) == (1, -1)
        assert res.read == {} and not res.prefetched and res.memory_fallback == ""
