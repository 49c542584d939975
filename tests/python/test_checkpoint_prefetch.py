"""Restore prefetch (#23): AsyncCheckpointer.prefetch() verifies the step a restart will load on a background
thread, and load_latest copies from the files it verified. Each test tries to make load_latest use bytes
the prefetch did not verify: a step corrupted before, a file changed and dropped from the page cache after,
a step re-saved under the same number, a step retired meanwhile, a close() in the middle. The 2-rank SIGKILL
restarts with a prefetch are in test_checkpoint_memory_tier.py."""

import os

import ettkit
import pytest
import torch
from ettkit.checkpoint import AsyncCheckpointer

CHUNK = 32 << 20  # storage.h kHashChunkBytes: the unit of the chunk checksums


def _state(step, n=1000):
    return {"w": torch.full((n,), float(step)), "n": torch.tensor([step])}


def _zeros(n=1000):
    return {"w": torch.zeros(n), "n": torch.tensor([0])}


def _data_file(directory, step):
    return os.path.join(directory, f"step-{step}", "rank-0.safetensors")


def _flip_byte(path, offset_from_end=5):
    raw = bytearray(open(path, "rb").read())
    raw[-offset_from_end] ^= 0x40
    open(path, "wb").write(bytes(raw))


def _reader(directory, **kw):
    return AsyncCheckpointer(directory, read_only=True, recorder=None, preempt_signals=(), **kw)


def _resident_pages(path, offset, length):
    """How many pages of [offset, offset + length) of `path` the page cache holds now (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = ctypes.create_string_buffer((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
            assert libc.mincore(addr, length, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, length)
    finally:
        os.close(fd)


def _evict(path, offset=0, length=0):
    """Drops [offset, offset + length) (0: to the end) of `path` from the page cache, and checks it did: a
    page the kernel could not drop at once (under writeback on a busy machine) is asked for again."""
    import time

    end = os.path.getsize(path) if length == 0 else offset + length
    for _ in range(50):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, offset, end - offset, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if _resident_pages(path, offset, end - offset) == 0:
            return
        time.sleep(0.1)
    pytest.fail(f"{path} [{offset}, {end}) stayed in the page cache after 50 POSIX_FADV_DONTNEED")


SMALL_CHUNK = 1 << 20  # the smallest chunk_bytes a manifest may declare (storage.cpp, decode_manifest)


def _rechunk(step_dir, chunk=SMALL_CHUNK):
    """Rewrites `step_dir`'s manifest with `chunk`-byte checksum chunks for its .safetensors files, computed
    here from the files' bytes. The step stays exactly as valid as the writer left it (sizes unchanged; a
    file's `xxh3` is checked against its bytes only when it has no chunks); the loaders verify against whatever
    chunk_bytes the manifest says, so a file of a few MiB gets many chunk groups (with the production chunks
    of 4 MiB and more every file here would have a few)."""
    import json

    from ettkit import _C

    manifest = os.path.join(step_dir, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    for name, d in m["files"].items():
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(step_dir, name), "rb") as f:
            raw = f.read()
        cb = d["chunk_bytes"]  # the writer's chunks, as the writer hashed them
        assert d["chunks"] == [_C.xxh3_hex(raw[i:i + cb]) for i in range(0, len(raw), cb)]
        d["chunk_bytes"] = chunk
        d["chunks"] = [_C.xxh3_hex(raw[i:i + chunk]) for i in range(0, len(raw), chunk)]
    with open(manifest, "r+") as f:  # in place: the file keeps its mode (the memory tier's are 0600)
        f.truncate()
        json.dump(m, f)
    return len(d["chunks"])


def _flip_at(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
    finally:
        os.close(fd)


class _Pinned:
    """[offset, offset + length) of a file mapped and mlock()ed for the block: its pages stay in the page
    cache whatever the machine's memory pressure (posix_fadvise cannot drop them). `locked` is False when
    RLIMIT_MEMLOCK does not allow it (the caller then cannot assume the range stays cached)."""

    def __init__(self, path, offset, length):
        import ctypes

        self.path, self.offset, self.length = path, offset, length
        self.locked = False
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mmap.restype = ctypes.c_void_p
        self._libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_long]
        self._libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._addr = None

    def __enter__(self):
        import ctypes
        import mmap

        fd = os.open(self.path, os.O_RDONLY)
        try:
            addr = self._libc.mmap(None, self.length, mmap.PROT_READ, mmap.MAP_SHARED, fd, self.offset)
        finally:
            os.close(fd)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        self._addr = addr
        self.locked = self._libc.mlock(addr, self.length) == 0  # faults every page in, and keeps it
        return self

    def __exit__(self, *exc):
        self._libc.munmap(self._addr, self.length)  # unlocks too


def _needs_a_disk_backed_file_system(path):
    """tmpfs keeps its pages whatever posix_fadvise says: the tests that evict need a disk-backed file system."""
    import subprocess

    fs = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()
    if fs == "tmpfs":
        pytest.skip(f"{path} is on tmpfs, whose pages cannot be evicted")


def test_prefetch_then_load_restores_the_newest_disk_step_verified_ahead(tmp_path):
    d = str(tmp_path / "ck")
    with AsyncCheckpointer(d, keep_last=3, recorder=None, preempt_signals=()) as ck:
        ck.save(1, _state(1)).wait()
        ck.save(2, _state(2)).wait()
    with _reader(d) as r:
        assert r.prefetch() == [2]
        assert r.wait_prefetch(timeout=60)
        figures = r.prefetch_figures
        assert figures["bytes"] == sum(os.path.getsize(os.path.join(d, "step-2", f)) for f in
                                       ("rank-0.safetensors", "rank-0.extra"))
        assert figures["seconds"] > 0
        target = _zeros()
        assert r.load_latest(target) == (2, None)
        assert r.restore_prefetched == {"reverified_bytes": 0} and r.restored_from == "disk"
        assert torch.equal(target["w"], _state(2)["w"]) and int(target["n"]) == 2
        # A second load without a new prefetch checks the step itself.
        assert r.load_latest(_zeros()) == (2, None) and r.restore_prefetched is None


def test_prefetch_with_nothing_committed_queues_nothing(tmp_path):
    with _reader(str(tmp_path / "empty")) as r:
        assert r.prefetch() == []
        assert r.wait_prefetch(timeout=0)  # nothing to verify: no thread runs
        assert r.load_latest(_zeros()) is None and r.restore_prefetched is None


def test_a_step_corrupt_before_the_prefetch_falls_back_as_without_it(tmp_path):
    d = str(tmp_path / "ck")
    with AsyncCheckpointer(d, keep_last=3, recorder=None, preempt_signals=()) as ck:
        ck.save(1, _state(1)).wait()
        ck.save(2, _state(2)).wait()
    _flip_byte(_data_file(d, 2))
    with _reader(d) as r:
        assert r.prefetch() == [2]
        target = _zeros()
        with pytest.warns(RuntimeWarning, match=r"newer steps \[2\].*failed validation"):
            assert r.load_latest(target) == (1, None)
        # Step 1 was not verified ahead (the prefetch takes the newest step only): checked by the load.
        assert r.restore_prefetched is None
        assert torch.equal(target["w"], _state(1)["w"])


def test_a_file_changed_and_dropped_from_the_page_cache_after_the_prefetch_is_caught(tmp_path):
    # The prefetch hashed the pages; then the file's bytes change and its pages leave the page cache, so the
    # copy would read the changed bytes from the device: load_latest must hash that chunk again.
    _needs_a_disk_backed_file_system(tmp_path)
    d = str(tmp_path / "ck")
    n = 9 << 20  # 36 MiB of float32: two checksum chunks
    with AsyncCheckpointer(d, keep_last=3, recorder=None, preempt_signals=()) as ck:
        ck.save(1, _state(1, n)).wait()
        ck.save(2, _state(2, n)).wait()
    data = _data_file(d, 2)
    size = os.path.getsize(data)
    assert size > CHUNK
    with _reader(d) as r:
        r.prefetch()
        r.wait_prefetch()
        fd = os.open(data, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x7f", size - 100)  # in the second chunk
        finally:
            os.close(fd)
        _evict(data)
        target = _zeros(n)
        with pytest.warns(RuntimeWarning, match=r"newer steps \[2\].*failed validation"):
            assert r.load_latest(target) == (1, None)
        assert torch.equal(target["w"], _state(1, n)["w"])


def test_only_the_chunks_that_left_the_page_cache_are_hashed_again(tmp_path):
    # Chunk 0 is pinned in the page cache (mlock) and every other chunk is evicted (checked with mincore): the
    # load must hash exactly the evicted ones again. Without the pin, a busy machine may drop chunk 0 too, and
    # the load would rightly hash it again as well (the figure then depends on memory pressure, not the code).
    _needs_a_disk_backed_file_system(tmp_path)
    d = str(tmp_path / "ck")
    n = 2 << 20  # 8 MiB of float32: 8 chunks of 1 MiB once rechunked
    with AsyncCheckpointer(d, keep_last=3, recorder=None, preempt_signals=()) as ck:
        ck.save(2, _state(2, n)).wait()
    assert _rechunk(os.path.join(d, "step-2")) >= 8
    data = _data_file(d, 2)
    size = os.path.getsize(data)
    with _reader(d) as r, _Pinned(data, 0, SMALL_CHUNK) as pin:
        r.prefetch()
        r.wait_prefetch()
        _evict(data, SMALL_CHUNK, 0)  # every chunk but the first
        target = _zeros(n)
        assert r.load_latest(target) == (2, None)
        reverified = r.restore_prefetched["reverified_bytes"]
        if pin.locked:
            assert reverified == size - SMALL_CHUNK
        else:  # RLIMIT_MEMLOCK refused the pin: chunk 0 may have left the cache as well
            assert reverified in (size - SMALL_CHUNK, size), (reverified, size)
        assert torch.equal(target["w"], _state(2, n)["w"])


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_a_late_chunk_corrupt_before_the_prefetch_is_refused_among_many_chunk_groups(tmp_path, tier):
    # #48: with <= 2 chunks per file and >= 2 chunks per group, a prefetch that verified only its first group of
    # chunks passed every test. 12+ chunks of 1 MiB here (7 groups of load_threads=2), the corrupt byte in the
    # second-to-last one, written before the prefetch (so the page cache holds it, and the load would trust
    # the prefetch's verdict without hashing anything again).
    shm = tmp_path / "shm"
    shm.mkdir()
    d = str(tmp_path / "ck")
    n = 3 << 20  # 12 MiB of float32
    kw = dict(recorder=None, preempt_signals=(), memory_tier=shm, job_id="j", copy_threads=2)
    ck = AsyncCheckpointer(d, **kw)
    ck.save(1, _state(1, n)).wait()
    ck.save(2, _state(2, n), tier=tier).wait()
    step_dir = os.path.join(ck.memory_tier_directory if tier == "memory" else d, "step-2")
    ck.close(discard_memory_tier=False)
    assert _rechunk(step_dir) >= 12
    data = os.path.join(step_dir, "rank-0.safetensors")
    _flip_at(data, os.path.getsize(data) - SMALL_CHUNK - SMALL_CHUNK // 2)
    with AsyncCheckpointer(d, **kw) as r:
        assert r.prefetch() == ([2, 1] if tier == "memory" else [2])
        r.wait_prefetch()
        target = _zeros(n)
        warning = r"memory tier was not usable \(memory-tier step 2" if tier == "memory" else r"newer steps \[2\]"
        with pytest.warns(RuntimeWarning, match=warning):
            assert r.load_latest(target) == (1, None)
        assert r.restored_from == "disk"
        assert torch.equal(target["w"], _state(1, n)["w"])


def test_a_step_resaved_under_the_same_number_after_the_prefetch_loads_the_new_snapshot(tmp_path):
    d = str(tmp_path / "ck")
    ck = AsyncCheckpointer(d, keep_last=3, recorder=None, preempt_signals=())
    ck.save(2, _state(2)).wait()
    r = _reader(d)
    try:
        assert r.prefetch() == [2]
        r.wait_prefetch()
        ck.save(2, _state(20)).wait()  # a rolled-back job saving step 2 again: another snapshot
        target = _zeros()
        assert r.load_latest(target) == (2, None)
        assert r.restore_prefetched is None  # not the snapshot that was verified
        assert torch.equal(target["w"], _state(20)["w"])
    finally:
        r.close()
        ck.close()


def test_a_step_retired_after_the_prefetch_is_not_loaded_from_its_open_files(tmp_path):
    d = str(tmp_path / "ck")
    ck = AsyncCheckpointer(d, keep_last=1, recorder=None, preempt_signals=())
    ck.save(2, _state(2)).wait()
    r = _reader(d)
    try:
        assert r.prefetch() == [2]
        r.wait_prefetch()
        ck.save(3, _state(3)).wait()  # retention removes step 2
        assert not os.path.exists(os.path.join(d, "step-2"))
        target = _zeros()
        assert r.load_latest(target) == (3, None) and r.restore_prefetched is None
        assert torch.equal(target["w"], _state(3)["w"])
    finally:
        r.close()
        ck.close()


def test_memory_tier_prefetch_verifies_the_memory_step_and_a_corrupt_one_moves_on_to_disk(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    d = str(tmp_path / "ck")

    def write():
        ck = AsyncCheckpointer(d, recorder=None, preempt_signals=(), memory_tier=shm, job_id="j")
        ck.save(2, _state(2)).wait()
        ck.save(3, _state(3), tier="memory").wait()
        mem = ck.memory_tier_directory
        ck.close(discard_memory_tier=False)
        return mem

    mem = write()
    with AsyncCheckpointer(d, recorder=None, preempt_signals=(), memory_tier=shm, job_id="j") as ck:
        assert ck.prefetch() == [3, 2]
        target = _zeros()
        assert ck.load_latest(target) == (3, None)
        assert ck.restored_from == "memory" and ck.restore_prefetched == {"reverified_bytes": 0}
        assert torch.equal(target["w"], _state(3)["w"])
    mem = write()
    _flip_byte(_data_file(mem, 3))
    with AsyncCheckpointer(d, recorder=None, preempt_signals=(), memory_tier=shm, job_id="j") as ck:
        assert ck.prefetch() == [3, 2]
        ck.wait_prefetch()
        # The memory step failed in the prefetch, which went on to the disk step: the load's own check of
        # the memory step fails the same way, and the disk step is the one verified ahead.
        assert ck.prefetch_figures["bytes"] == sum(os.path.getsize(os.path.join(d, "step-2", f)) for f in
                                                   ("rank-0.safetensors", "rank-0.extra"))
        target = _zeros()
        with pytest.warns(RuntimeWarning, match=r"memory tier was not usable \(memory-tier step 3.*XXH3"):
            assert ck.load_latest(target) == (2, None)
        assert ck.restored_from == "disk" and ck.restore_prefetched == {"reverified_bytes": 0}
        assert torch.equal(target["w"], _state(2)["w"])


def test_close_during_a_prefetch_returns_and_leaves_the_checkpoint_loadable(tmp_path):
    # Whatever point the worker has reached when close() comes (not started, between chunk groups, done), the
    # verdicts here hold: close() returns with nothing running, a later prefetch() is refused, the prefetch
    # counts only a step it verified whole, and the step stays loadable. None of them depends on where the
    # worker was, so none can pass or fail by timing. Where the stop lands is pinned deterministically in C++:
    # check_step_files stops between chunk groups and returns nothing (storage_test.cpp,
    # CheckStepFilesRefusesEachFaultByNameAndStopsBetweenChunkGroups; integrity_many_chunks_test.cpp, a stop
    # after the third of 7 groups).
    d = str(tmp_path / "ck")
    n = 4 << 20  # 16 MiB
    with AsyncCheckpointer(d, recorder=None, preempt_signals=()) as ck:
        ck.save(5, _state(5, n)).wait()
    assert _rechunk(os.path.join(d, "step-5")) >= 16  # many groups: many points for the stop to land
    whole = sum(os.path.getsize(os.path.join(d, "step-5", f)) for f in ("rank-0.safetensors", "rank-0.extra"))
    for _ in range(3):
        r = _reader(d, copy_threads=2)
        assert r.prefetch() == [5]
        r.close()
        assert r.wait_prefetch(timeout=0)  # nothing runs after close()
        assert r.prefetch_figures["bytes"] in (0, whole)  # never a partly verified step
        with pytest.raises(ettkit.InvalidArgumentError, match=r"prefetch\(\) after close\(\)"):
            r.prefetch()
    r = _reader(d, copy_threads=2)
    r.prefetch()
    r.prefetch()  # a second prefetch replaces (cancels) the first, at whatever point it was
    assert r.wait_prefetch()  # the second one runs to its end
    assert r.prefetch_figures["bytes"] == whole
    target = _zeros(n)
    assert r.load_latest(target) == (5, None) and r.restore_prefetched is not None
    assert torch.equal(target["w"], _state(5, n)["w"])
    r.close()


def test_a_prefetch_on_a_checkpoint_of_another_world_size_is_skipped_and_the_load_reshards(tmp_path):
    # A step written by 2 ranks, loaded by 1: the prefetch verifies this rank's own files only, so it
    # leaves a resharding load to check the files it reads.
    import json

    d = str(tmp_path / "ck")
    with AsyncCheckpointer(d, recorder=None, preempt_signals=()) as ck:
        ck.save(4, _state(4)).wait()
    manifest = os.path.join(d, "step-4", "manifest.json")
    m = json.load(open(manifest))
    m["world_size"] = 2
    with open(manifest, "w") as f:
        json.dump(m, f)
    with _reader(d) as r:
        assert r.prefetch() == [4]
        r.wait_prefetch()
        assert r.prefetch_figures["bytes"] == 0
        with pytest.raises(ettkit.CorruptCheckpointError, match="rank-1.safetensors' is missing"):
            r.load_latest(_zeros())  # the resharding load checks the old ranks' files itself
        assert r.restore_prefetched is None


def test_a_save_releases_an_unused_prefetch_and_its_memory_tier_files(tmp_path):
    # A job that prefetched and then trained without loading: its first save drops the prefetch, so the
    # retired memory step's tmpfs pages are not held by open files for the rest of the job.
    shm = tmp_path / "shm"
    shm.mkdir()
    d = str(tmp_path / "ck")
    ck = AsyncCheckpointer(d, recorder=None, preempt_signals=(), memory_tier=shm, job_id="j")
    ck.save(3, _state(3), tier="memory").wait()
    mem = ck.memory_tier_directory
    ck.close(discard_memory_tier=False)
    with AsyncCheckpointer(d, recorder=None, preempt_signals=(), memory_tier=shm, job_id="j") as ck:
        assert ck.prefetch() == [3]
        ck.wait_prefetch()
        held = os.path.realpath(_data_file(mem, 3))

        def open_by_this_process():
            fds = os.listdir("/proc/self/fd")
            return [f for f in fds if os.path.realpath(f"/proc/self/fd/{f}").startswith(held)]

        assert open_by_this_process()  # the prefetch holds the step's files open
        for step in (4, 5, 6):
            ck.save(step, _state(step), tier="memory").wait()
        assert not os.path.exists(os.path.join(mem, "step-3"))  # retired
        assert not open_by_this_process()
        assert ck.load_latest(_zeros()) == (6, None) and ck.restore_prefetched is None
