"""AsyncCheckpointer.prepare(): the arenas of the first save are sized, allocated and backed before it, off the
training thread, so that the first save of an attempt takes no page fault for them (#45). Backed is checked as
residency, not counted as page faults: the arena's pages are in memory once prepare() is done (/proc/self/smaps
for the anonymous arena, mincore() on the memory tier's arena files), whatever other threads fault meanwhile.
The plan and arena counters are exact: no verdict here depends on load."""

import ctypes
import gc
import glob
import mmap
import os
import weakref

import ettkit
import pytest
import torch
from ettkit.checkpoint import AsyncCheckpointer


def big_state():
    """64 MiB in the model and a small optimizer state: a cold arena faults at least 32 times (huge pages),
    16,384 times with small ones."""
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16 << 20, generator=g), "b": torch.randn(1000, generator=g)},
            "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}


def anonymous_mappings() -> dict:
    """This process's anonymous mappings: (start, end) -> resident bytes (/proc/self/smaps Rss)."""
    out, key = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                start, end = (int(x, 16) for x in head[0].split("-"))
                key = (start, end) if head[4] == "0" else None  # inode 0: anonymous
            elif key is not None and head[0] == "Rss:":
                out[key] = int(head[1]) * 1024
    return out


def newly_resident(before: dict, after: dict, at_least: int) -> int:
    """The most bytes one mapping of `at_least` bytes or more that appeared between the two listings holds in
    memory, less what the mappings it covers held before (the kernel may have merged the new one into a
    neighbour)."""
    best = 0
    for (start, end), rss in after.items():
        if (start, end) in before or end - start < at_least:
            continue
        covered = sum(r for (s, e), r in before.items() if s < end and e > start)
        best = max(best, rss - covered)
    return best


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(path: str) -> int:
    """The pages of the file in memory now: mincore() over a mapping of it reports the page cache (tmpfs's
    pages), whoever faulted them in."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    try:
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw)
    finally:
        _libc.munmap(addr, size)


def test_the_first_save_after_prepare_uses_the_arena_prepare_backed(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=()) as ck:
        state = big_state()
        before = anonymous_mappings()
        ck.prepare(state)
        assert ck.wait_prepared() == ck.arena_bytes * ck.num_arenas
        # The arena is in memory before the save: its pages were faulted in by prepare(), not by the copies.
        resident = newly_resident(before, anonymous_mappings(), ck.arena_bytes)
        assert resident >= ck.arena_bytes, (resident, ck.arena_bytes)
        ck.save(1, state)
        assert ck.plan_builds == 1 and ck.arena_allocations == 1  # the save reused what prepare() built
        ck.wait()
        restored = {"model": {k: torch.zeros_like(v) for k, v in big_state()["model"].items()},
                    "optim": {"state": {0: {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0.0, "params": [0]}]}}
        assert ck.load_latest(restored)[0] == 1
        for k, v in big_state()["model"].items():
            assert torch.equal(restored["model"][k], v), k  # the prepared arena held the right bytes


def test_the_memory_tiers_second_arena_is_backed_by_prepare_too(tmp_path):
    """#65: the memory tier stages into two files in turn; prepare() backs both (in 256 KiB slices: every slice,
    the last partial one included), so the first save into the second one faults none of it in."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with AsyncCheckpointer(tmp_path / "c", recorder=None, preempt_signals=(), memory_tier=str(shm), job_id="t") as ck:
        state = big_state()
        ck.prepare(state, wait=True)
        files = glob.glob(os.path.join(ck.memory_tier_directory, ".arena-*"))
        assert len(files) == 2, files
        data_pages = ck.arena_bytes // mmap.PAGESIZE  # the data section; the header room before it is not backed
        for f in files:
            assert resident_pages(f) >= data_pages, (f, resident_pages(f), data_pages)
        ck.save(1, state, tier="memory").wait()
        ck.save(2, state, tier="memory").wait()
        assert ck.arena_allocations == 2  # both saves staged into the files prepare() backed


def test_prepare_also_does_the_python_side_of_the_first_save(tmp_path):
    """The skeleton encoded and the names converted for C++ at prepare() time, on the caller's thread, are
    what the first save() reuses (for 10^4 tensors each costs milliseconds of that save's blocking); and
    prepare() binds the state (_state_binding.py), whose references last until a save binds another state:
    a tensor replaced in between is freed by that save, with no cyclic collection needed."""
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=()) as ck:
        state = {"model": {f"t{i}": torch.full((8,), float(i)) for i in range(2000)}}
        ck.prepare(state)
        code, names = ck._skeleton_code, ck._names
        assert code is not None and len(names) == 2000
        ck.wait_prepared()
        probe = torch.zeros(8)
        ref = weakref.ref(probe)
        ck.prepare({"model": {**state["model"], "t0": probe}}, wait=True)  # same structure, another tensor
        assert ck._bound.binding is not None
        del probe
        ck.save(1, state).wait()  # another state than the bound one: walked, and bound in its place
        assert ref() is None  # the save let go of the tensor prepare() had bound
        assert ck._skeleton_code is code and ck._names is names  # the first save re-encoded nothing


def test_double_buffered_arenas_are_both_backed_and_prepare_again_is_free(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=(), double_buffer=True) as ck:
        state = big_state()
        ck.prepare(state, wait=True)
        assert ck.num_arenas == 2 and ck.arena_allocations == 2
        assert ck.wait_prepared() == 2 * ck.arena_bytes
        ck.prepare(state)
        assert ck.wait_prepared() == 0  # the same structure: nothing left to do
        for step in (1, 2):
            ck.save(step, state)
        assert ck.plan_builds == 1 and ck.arena_allocations == 2


def test_a_save_that_comes_while_prepare_runs_waits_for_it(tmp_path):
    """Whichever gets the stager first, one plan and one arena serve both: the save either waits for the
    prepared arena or builds it itself, and the prepare then finds nothing left to do."""
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=()) as ck:
        state = big_state()
        ck.prepare(state)
        ck.save(1, state).wait()
        assert ck.wait_prepared() in (0, ck.arena_bytes)
        assert ck.plan_builds == 1 and ck.arena_allocations == 1


def test_a_state_that_grows_after_prepare_is_planned_again_at_its_save(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=()) as ck:
        state = big_state()
        ck.prepare(state, wait=True)
        state["optim"]["state"][0]["exp_avg"] = torch.zeros(16 << 20)  # an optimizer's lazy state appeared
        ck.save(1, state).wait()
        assert ck.plan_builds == 2 and ck.arena_allocations == 2


def test_what_save_refuses_prepare_refuses_in_the_background_and_the_save_again(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=(), memory_budget_bytes=1 << 20) as ck:
        ck.prepare(big_state())
        with pytest.raises(ettkit.InvalidArgumentError, match="memory_budget_bytes=1048576"):
            ck.wait_prepared()
        assert ck.wait_prepared() is None  # raised once; nothing is left to report
        assert ck.arena_allocations == 0
        with pytest.raises(ettkit.InvalidArgumentError, match="memory_budget_bytes=1048576"):
            ck.save(1, big_state())
    with AsyncCheckpointer(tmp_path / "dtype", recorder=None, preempt_signals=()) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match="'model.z' has dtype .*safetensors cannot store"):
            ck.prepare({"model": {"z": torch.zeros(4, dtype=torch.complex128)}}, wait=True)
        assert ck.arena_allocations == 0


def test_prepare_on_a_read_only_or_closed_checkpointer_is_refused_and_close_waits_for_it(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=()) as ck:
        ck.save(1, big_state()).wait()
    reader = AsyncCheckpointer(tmp_path, recorder=None, read_only=True)
    with pytest.raises(ettkit.InvalidArgumentError, match="prepare\\(\\) on a read_only checkpointer"):
        reader.prepare(big_state(), wait=True)
    reader.close()
    ck = AsyncCheckpointer(tmp_path / "closing", recorder=None, preempt_signals=())
    ck.prepare(big_state())
    ck.close()  # joins the background prepare before stopping the checkpointer under it
    assert ck.wait_prepared(timeout=0) >= 64 << 20  # it had ended, with the arena backed
    with pytest.raises(ettkit.InvalidArgumentError, match="closed checkpointer"):
        ck.prepare(big_state())


def test_a_statefuls_fresh_tensors_are_freed_when_the_flattened_state_is_dropped_without_a_collection():
    """flatten_state's two walkers call each other; their closures must not keep the state's tensors (here a
    Stateful's fresh state_dict() tensor, which nothing else holds) alive until the cyclic collector runs."""
    from ettkit.checkpoint._flatten import flatten_state

    class Fresh:
        def state_dict(self):
            return {"w": torch.ones(3), "inner": [torch.zeros(2)]}

        def load_state_dict(self, d):
            pass

    was = gc.isenabled()
    gc.disable()
    try:
        for for_load in (False, True):
            flat = flatten_state({"fresh": Fresh(), "plain": torch.ones(1)}, for_load=for_load)
            refs = [weakref.ref(t) for t in flat[1]]
            assert len(refs) == 3
            del flat
            assert [r() for r in refs[:2]] == [None, None]  # the Stateful's own tensors are gone at once
    finally:
        if was:
            gc.enable()


FIRST_SAVE_IMPORTS = r"""
import os, resource, sys, tempfile, torch
from ettkit.checkpoint import AsyncCheckpointer
tier, root, phase = sys.argv[1], sys.argv[2], sys.argv[3]
extra = {"memory_tier": os.path.join(root, "shm"), "job_id": "t"} if tier == "memory" else {}
os.makedirs(os.path.join(root, "shm"), exist_ok=True)
ck = AsyncCheckpointer(os.path.join(root, "c"), keep_last=2, recorder=None, preempt_signals=(), **extra)
state = {"w": torch.randn(1 << 22), "b": torch.randn(10)}  # 16 MiB: 4,096 small pages
first = 1
if phase == "restart":  # the new attempt: restore the step the killed one left, then prepare and save on
    first = ck.load_latest(state)[0] + 1
    assert first == 3, first
ck.prepare(state, wait=True)
allocations = ck.arena_allocations
pages = state["w"].nbytes // resource.getpagesize()
for step in range(first, first + 5):  # the memory tier's two arenas, each more than once
    before, faults = set(sys.modules), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ck.save(step, state, tier=tier)
    ck.wait()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    imported = sorted(set(sys.modules) - before)
    assert not imported, f"save {step} imported {imported}"
    # Every thread's faults, the copy threads' included: an arena the save faulted in takes one per page (the
    # memory tier's tmpfs files; the disk tier's anonymous arena takes huge pages, so there allocations pin it).
    assert faults < pages // 4, f"save {step}: {faults} minor faults for {pages} pages of state"
    if phase == "first" and step == 2:
        os._exit(0)  # killed after two committed saves: no close(), so the memory tier stays for the restart
assert allocations == (2 if tier == "memory" else 1), allocations  # the memory tier: both file arenas
assert ck.arena_allocations == allocations, (allocations, ck.arena_allocations)  # none after prepare()
assert ck.plan_builds == 1, ck.plan_builds
ck.close()
print("ok")
"""


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_no_save_after_prepare_imports_a_module_or_allocates_an_arena(tier, tmp_path):
    """#65: every first-time cost of a save is taken before it. A save that imports a module pays it inside
    the first save of every attempt (numpy.random, loaded lazily by NumPy 2, cost the demo's restart 40 ms on
    a 5.7 ms median); an arena allocated after prepare() is faulted in by the save's copies (the memory tier's
    second arena included), one page fault per page. A fresh interpreter: what this test process imported
    already would hide it. Then the same after a restart: a new process that loads the step a killed one left
    (its memory tier's files included), prepares and saves into each arena again."""
    import subprocess
    import sys

    for phase in ("first", "restart"):
        out = subprocess.run([sys.executable, "-c", FIRST_SAVE_IMPORTS, tier, str(tmp_path), phase],
                             capture_output=True, text=True, timeout=120)
        expected = "" if phase == "first" else "ok"  # the first process ends in os._exit, as if killed
        assert out.returncode == 0 and out.stdout.strip() == expected, (phase, out.stderr[-2000:])
