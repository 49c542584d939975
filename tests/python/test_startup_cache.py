"""CompileCache: keyed, atomic, checksummed MegaCache files; stale or corrupt ones are warnings, never errors;
and a cache written by one process makes a fresh process compile warm (Inductor, the one test here that
needs it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
import warnings
from collections import defaultdict

import pytest
import torch
from ettkit.startup import CompileCache, CompileCacheWarning, compile_fingerprint
from ettkit.startup import cache as cache_module
from startup_helpers import TinyRec, declared_spec, megacache_blob

HERE = os.path.dirname(os.path.abspath(__file__))


class FakeTorchCache:
    """Stands in for torch.compiler.save/load_cache_artifacts, so the file format is tested without a
    compile (the cross-process test below uses the real ones)."""

    def __init__(self, keys=("k1", "k2")):
        # CompileCache.load checks the artifact list: a real MegaCache layout, not arbitrary bytes.
        self.payload = megacache_blob({"inductor": {"k1": b"graph-1", "k2": b"graph-2"}})
        self.keys = keys
        self.loaded = []
        self.reject = False

    def info(self):
        return types.SimpleNamespace(artifacts=defaultdict(list, {"inductor": list(self.keys)}))

    def save(self):
        return None if self.payload is None else (self.payload, self.info())

    def load(self, data):
        if self.reject:
            raise RuntimeError("unpickling failed")
        self.loaded.append(data)
        return self.info()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    fake = FakeTorchCache()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", list)
    monkeypatch.setattr(cache_module, "_inductor_cache_dir", lambda: tmp_path / "inductor")
    return fake


def _cache(tmp_path, **kw):
    return CompileCache(
        tmp_path / "ckpt" / "compile-cache", fingerprint=kw.pop("fingerprint", "model-v1"), **kw
    )


def test_save_is_atomic_and_a_new_process_view_loads_it(fake, tmp_path):
    first = _cache(tmp_path)
    assert first.load().status == "miss"
    saved = first.save()
    assert saved.written and saved.artifacts == {"inductor": 2}
    files = sorted(p.name for p in first.dir.iterdir())
    assert files == [first.path.name], f"temporary files left behind: {files}"
    again = _cache(tmp_path)  # what a restarted job builds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit warns about nothing
        result = again.load()
    assert result.hit and result.artifacts == {"inductor": 2}
    assert fake.loaded == [fake.payload]
    assert again.save().reason == "unchanged since load"
    fake.keys = ("k1", "k2", "k3")  # a recompile added an artifact
    assert again.save().written


def test_nothing_compiled_means_nothing_written(fake, tmp_path):
    fake.payload = None
    cache = _cache(tmp_path)
    result = cache.save()
    assert not result.written and "nothing was compiled" in result.reason
    assert not cache.path.exists()


def test_the_key_covers_torch_version_and_fingerprint(fake, tmp_path, monkeypatch):
    _cache(tmp_path).save()
    other = _cache(tmp_path, fingerprint="model-v2")
    assert other.path != _cache(tmp_path).path
    result = other.load()
    assert result.status == "miss" and "1 cache file(s) for other keys" in result.reason
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert _cache(tmp_path).path != other.path and _cache(tmp_path).load().status == "miss"


@pytest.mark.parametrize(
    "damage, status, reason",
    [
        (lambda b: b"garbage" * 10, "corrupt", "bad magic"),
        (lambda b: b[:-5], "corrupt", "truncated write"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), "corrupt", "checksum mismatch"),
        (lambda b: b[:12] + b"{not json" + b[21:], "corrupt", "not JSON"),
        (lambda b: b"", "corrupt", "shorter than"),
    ],
    ids=["foreign", "truncated", "bit-flip", "bad-header", "empty"],
)
def test_a_corrupt_file_is_ignored_with_a_warning(fake, tmp_path, damage, status, reason):
    cache = _cache(tmp_path)
    cache.save()
    cache.path.write_bytes(damage(cache.path.read_bytes()))
    with pytest.warns(CompileCacheWarning, match=reason):
        result = cache.load()
    assert result.status == status and not result.hit
    assert fake.loaded == []


def test_a_stale_file_and_a_rejected_one_are_ignored_with_a_warning(fake, tmp_path):
    old = _cache(tmp_path, fingerprint="model-v0")
    old.save()
    cache = _cache(tmp_path)
    os.replace(old.path, cache.path)  # e.g. copied by hand from another job
    with pytest.warns(CompileCacheWarning, match="written for another key"):
        assert cache.load().status == "stale"
    cache.save()
    fake.reject = True
    with pytest.warns(CompileCacheWarning, match="torch rejected its artifacts.*unpickling failed"):
        assert cache.load().status == "rejected"


def test_an_unwritable_directory_warns_instead_of_failing(fake, tmp_path):
    (tmp_path / "ckpt").write_text("a file where the directory should be")
    with pytest.warns(CompileCacheWarning, match="could not write"):
        assert not _cache(tmp_path).save().written


def test_compiled_kernels_travel_with_the_cache(fake, tmp_path, monkeypatch):
    built = tmp_path / "built"
    (built / "ab").mkdir(parents=True)
    lib = built / "ab" / "cabxyz.main.so"
    lib.write_bytes(b"\x7fELF fake kernel")
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", lambda: [("ab/cabxyz.main.so", lib)])
    saved = _cache(tmp_path).save()
    assert saved.artifacts["cpu_kernel_files"] == 1
    result = _cache(tmp_path).load()
    restored = tmp_path / "inductor" / "ab" / "cabxyz.main.so"
    assert result.artifacts["cpu_kernel_files"] == 1
    assert restored.read_bytes() == b"\x7fELF fake kernel"
    assert _cache(tmp_path).load().artifacts["cpu_kernel_files"] == 0, "existing kernels are not rewritten"


def test_a_kernel_path_outside_the_cache_dir_is_corrupt(fake, tmp_path, monkeypatch):
    lib = tmp_path / "evil.so"
    lib.write_bytes(b"x")
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", lambda: [("../../evil.so", lib)])
    cache = _cache(tmp_path)
    cache.save()
    with pytest.warns(CompileCacheWarning, match="bad kernel entry"):
        assert cache.load().status == "corrupt"
    assert not (tmp_path / "inductor").exists()


def test_fingerprint_tracks_what_decides_the_graphs():
    torch.manual_seed(0)
    base = compile_fingerprint(TinyRec(), declared_spec(), {"backend": "inductor"})
    assert base == compile_fingerprint(TinyRec(), declared_spec(), {"backend": "inductor"}), (
        "weights do not matter"
    )
    assert base != compile_fingerprint(TinyRec().eval(), declared_spec(), {"backend": "inductor"})
    assert base != compile_fingerprint(TinyRec(), declared_spec(dynamic=False), {"backend": "inductor"})
    assert base != compile_fingerprint(
        TinyRec(), declared_spec(), {"backend": "inductor", "mode": "max-autotune"}
    )
    wider = TinyRec()
    wider.fc2 = torch.nn.Linear(16, 2)
    assert base != compile_fingerprint(wider, declared_spec(), {"backend": "inductor"})


def _run_child(tmp_path, name, cache_dir, hash_seed):
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"),  # empty: only the CompileCache can help
        PYTHONHASHSEED=str(hash_seed),
        PYTHONPATH=os.pathsep.join([HERE] + sys.path),
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "startup_cache_script.py"), str(cache_dir)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cache_written_by_one_process_is_hit_by_a_fresh_process(tmp_path):
    cache_dir = tmp_path / "ckpt" / "compile-cache"
    first = _run_child(tmp_path, "first", cache_dir, hash_seed=1)
    assert first["load"] == "miss" and first["saved"]
    assert first["stats"]["fxgraph_misses"] >= 1
    assert first["artifacts_saved"].get("cpu_kernel_files", 0) >= 1
    # A different hash seed and Inductor cache dir: the key must not depend on either.
    second = _run_child(tmp_path, "second", cache_dir, hash_seed=2)
    assert second["load"] == "hit", second["load_reason"]
    stats = second["stats"]
    assert stats["autograd_hits"] + stats["fxgraph_hits"] >= 1, stats
    assert stats["autograd_misses"] == 0 and stats["fxgraph_misses"] == 0, stats
    assert second["artifacts_loaded"]["cpu_kernel_files"] >= 1
    assert second["save_reason"] == "unchanged since load"
    assert second["graphs"] == first["graphs"] == 1


_KILLED_WRITER = r"""
import os, resource, signal, sys, types
from collections import defaultdict
import torch
from ettkit.startup import CompileCache
from ettkit.startup import cache as cache_module
sys.path.insert(0, sys.argv[2])
from startup_helpers import megacache_blob

payload = [megacache_blob({"inductor": {"k1": b"old-artifacts" * 1000}})]
info = types.SimpleNamespace(artifacts=defaultdict(list, {"inductor": ["k1"]}))
torch.compiler.save_cache_artifacts = lambda: (payload[0], info)
cache_module._loaded_kernel_files = list
cache = CompileCache(sys.argv[1], fingerprint="model-v1")
assert cache.save().written                      # a complete, valid file
payload[0] = megacache_blob({"inductor": {"k1": b"new-artifacts" * 100000}})  # a second save dies half-way
info.artifacts["inductor"].append("k2")          # (a save writes only when the artifacts changed)
# The kernel kills the writer inside write(2) once the file reaches 600 KB (SIGXFSZ, whose default action
# terminates the process; CPython ignores it unless told otherwise): the writer is killed mid-write at
# a deterministic point, before its fsync and rename, as kill -9 at that moment would. With "--survive" the
# signal stays ignored and the write fails with EFBIG instead.
if "--survive" not in sys.argv:
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, resource.RLIM_INFINITY))
result = cache.save()
print(result.written, result.reason)
"""


def test_a_write_that_fails_half_way_warns_leaves_no_temporary_and_keeps_the_previous_file(fake, tmp_path):
    directory = tmp_path / "ckpt" / "compile-cache"
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(directory), HERE, "--survive"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("False write failed:") and "File too large" in proc.stdout, proc.stdout
    assert "could not write compile cache" in proc.stderr and ".tmp" in proc.stderr  # names the file
    assert list(directory.glob(".*.tmp")) == []  # the writer removed its temporary
    cache = _cache(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.load().hit
    assert fake.loaded == [megacache_blob({"inductor": {"k1": b"old-artifacts" * 1000}})]


def test_a_writer_killed_mid_write_leaves_the_previous_file_and_its_temporary_is_cleaned_up(fake, tmp_path):
    directory = tmp_path / "ckpt" / "compile-cache"
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(directory), HERE], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr[-3000:]
    temporaries = list(directory.glob(".*.tmp"))
    assert len(temporaries) == 1 and temporaries[0].stat().st_size == 600_000  # the half-written new file
    # The next start loads the complete previous file: the rename never happened.
    cache = _cache(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.load().hit
    assert fake.loaded == [megacache_blob({"inductor": {"k1": b"old-artifacts" * 1000}})]
    # A young temporary may be a live writer elsewhere: kept. An old one is a dead writer's: removed.
    fake.keys = ("k1", "k2", "k3")
    assert cache.save().written
    assert temporaries[0].exists()
    old = temporaries[0].stat().st_mtime - 2 * 3600
    os.utime(temporaries[0], (old, old))
    fake.keys = ("k1", "k2", "k3", "k4")
    assert cache.save().written
    assert sorted(p.name for p in directory.iterdir()) == [cache.path.name]
