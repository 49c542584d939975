"""Issue #39, item 2: the compile cache trusts only what this user wrote.

Each test attacks as the review did and asserts that the attack fails and that nothing of the user's is lost
or changed: a planted precompiled file whose pickle would create a marker file (owned by another uid, in a
directory others can write or that another uid created first (run as that uid with setpriv), a symlink, a
FIFO), a MegaCache artifact whose key is an absolute or "../" path,
bundled kernels aimed through a symlinked directory, and a Store payload without a valid HMAC. Where a test
shows the attack is live (the same bytes, trusted, do run), it says so: the gate is what stops it.

Only the two end-to-end tests compile (a planted file met by overlapped_start, a forged payload met by rank
1); torch's loaders are the real ones wherever the attack goes through them
(``torch.compiler.load_cache_artifacts``, ``torch.compiler.load_compiled_function``)."""

from __future__ import annotations

import os
import re
import stat
import threading
import types
import warnings
from collections import defaultdict

import pytest
import torch
from ettkit.errors import InvalidArgumentError
from ettkit.startup import CompileCache, CompileCacheWarning, overlapped_start, precompiled
from ettkit.startup import cache as cache_module
from ettkit.startup import cache_format, cache_seal
from startup_helpers import declared_spec, loss_fn, make_batch, megacache_blob

SECRET = b"ettkit-test-share-secret-0123456789abcdef"
OTHER_UID = 65534  # "nobody": a user who is not this one


class _Plant:
    """A pickle that creates ``marker`` when it is loaded: the hostile payload of every test here."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _hostile_precompiled_file(tmp_path, monkeypatch, marker, fingerprint="m") -> bytes:
    """A well-formed precompiled-tier file for ``fingerprint`` (right magic, key, checksum: the attacker
    computes them) whose artifact is a pickle that creates ``marker``."""
    import pickle

    with monkeypatch.context() as m:
        m.setattr(precompiled, "serialize", lambda fn: pickle.dumps(_Plant(marker)))
        m.setattr(precompiled, "source_fingerprint", lambda fn: [])
        m.setattr(cache_module, "_loaded_kernel_files", list)
        scratch = CompileCache(tmp_path / "attacker-scratch", fingerprint=fingerprint, precompile=True)
        assert scratch.save_precompiled(object()).written
    data = scratch.precompiled_path.read_bytes()
    scratch.precompiled_path.unlink()
    return data


def _plant(cache: CompileCache, data: bytes) -> None:
    cache.dir.mkdir(parents=True, exist_ok=True)
    cache.precompiled_path.write_bytes(data)
    os.chmod(cache.precompiled_path, 0o600)


@pytest.fixture
def inductor_dir(tmp_path, monkeypatch):
    """A fresh Inductor cache dir for this test (torch reads the variable at each use)."""
    path = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    monkeypatch.setattr(cache_module, "_inductor_cache_dir", lambda: path)
    return path


def _needs_root():
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root (chown); the mode and symlink cases still run")


# ---- the precompiled tier: a planted file never runs ----------------------------------------------------


def test_the_planted_precompiled_file_is_live_when_trusted(tmp_path, monkeypatch):
    # The control for the tests below: these bytes, in a file this user owns, do run their pickle on load
    # (torch's AOT loader is plain pickle). Only the trust rules stand between a planted file and the trainer.
    marker = tmp_path / "marker"
    cache = CompileCache(tmp_path / "cc", fingerprint="m", precompile=True)
    _plant(cache, _hostile_precompiled_file(tmp_path, monkeypatch, marker))
    with pytest.warns(CompileCacheWarning):
        cache.load_precompiled()
    assert marker.exists()


@pytest.mark.parametrize(
    "how",
    [
        "file_of_another_uid",
        "directory_of_another_uid",
        "world_writable_directory",
        "group_writable_file",
        "symlink",
        "fifo",
    ],
)
def test_a_planted_precompiled_file_is_refused_and_its_pickle_never_runs(tmp_path, monkeypatch, how):
    marker = tmp_path / "marker"
    hostile = _hostile_precompiled_file(tmp_path, monkeypatch, marker)
    cache = CompileCache(tmp_path / "cc", fingerprint="m", precompile=True)
    cache.dir.mkdir(mode=0o700)
    target = cache.precompiled_path
    expect = "is owned by"
    if how == "file_of_another_uid":
        _needs_root()
        _plant(cache, hostile)
        os.chown(target, OTHER_UID, OTHER_UID)
        expect = f"owned by uid {OTHER_UID}"
    elif how == "directory_of_another_uid":
        _needs_root()
        _plant(cache, hostile)
        os.chown(cache.dir, OTHER_UID, OTHER_UID)
        expect = f"owned by uid {OTHER_UID}"
    elif how == "world_writable_directory":  # e.g. a cache dir under a shared scratch area, mode 0777
        _plant(cache, hostile)
        os.chmod(cache.dir, 0o777)
        expect = "with mode 0777"
    elif how == "group_writable_file":
        _plant(cache, hostile)
        os.chmod(target, 0o660)
        expect = "with mode 0660"
    elif how == "symlink":  # to a file this user owns, even: a link is never followed
        elsewhere = tmp_path / "elsewhere.bin"
        elsewhere.write_bytes(hostile)
        os.chmod(elsewhere, 0o600)
        target.symlink_to(elsewhere)
        expect = "is a symbolic link"
    elif how == "fifo":  # fed by the attacker: a plain open() waits for the writer, then reads the pickle
        os.mkfifo(target, 0o600)
        feeder = threading.Thread(target=_feed_fifo, args=(target, hostile), daemon=True)
        feeder.start()
        expect = "is not a regular file"
    with pytest.warns(
        CompileCacheWarning, match=f"ignoring compile cache {re.escape(str(target))}: .*{expect}"
    ):
        result, fn = cache.load_precompiled()
    assert result.status == "untrusted" and fn is None
    assert str(cache.dir) in result.reason  # names the file, or the directory that cannot be trusted
    assert not marker.exists()
    if how == "symlink":
        assert (tmp_path / "elsewhere.bin").read_bytes() == hostile  # followed nowhere, changed nothing
    if how == "fifo":  # let the feeder finish: a reader end for its open, then its write goes nowhere
        reader = os.open(target, os.O_RDONLY | os.O_NONBLOCK)
        feeder.join()
        os.close(reader)


def _feed_fifo(path, data):
    try:
        with open(path, "wb") as f:  # blocks until a reader opens the FIFO
            f.write(data)
    except BrokenPipeError:
        pass  # the reader closed without reading: what the fixed loader does


def test_a_cache_directory_squatted_by_another_user_is_refused(tmp_path, monkeypatch):
    # The attack for real: another uid (run with setpriv) creates the victim's cache directory first, in a
    # shared sticky directory like /tmp, mode 0777, and plants a precompiled file there.
    import shutil
    import subprocess
    import tempfile

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running the attacker as another uid needs root and setpriv (util-linux)")
    marker = tmp_path / "marker"
    hostile = _hostile_precompiled_file(tmp_path, monkeypatch, marker)
    shared = tempfile.mkdtemp(prefix="ettkit-shared-")  # under /tmp: every uid can reach it
    try:
        os.chmod(shared, 0o1777)
        cache = CompileCache(os.path.join(shared, "cc"), fingerprint="m", precompile=True)
        attacker = [
            "setpriv",
            f"--reuid={OTHER_UID}",
            f"--regid={OTHER_UID}",
            "--clear-groups",
            "sh",
            "-c",
            f'mkdir -m 777 "$0" && cat > "$0/{cache.precompiled_path.name}"',
            str(cache.dir),
        ]
        subprocess.run(attacker, input=hostile, check=True, timeout=60)
        assert os.stat(cache.precompiled_path).st_uid == OTHER_UID  # planted by the other user
        with pytest.warns(
            CompileCacheWarning, match=f"{re.escape(str(cache.dir))} is owned by uid {OTHER_UID}"
        ):
            result, fn = cache.load_precompiled()
        assert result.status == "untrusted" and fn is None and not marker.exists()
        # Nor does this user's save write into the squatter's directory, where they could read or swap it.
        monkeypatch.setattr(precompiled, "serialize", lambda fn: b"the user's artifact")
        monkeypatch.setattr(precompiled, "source_fingerprint", lambda fn: [])
        with pytest.warns(CompileCacheWarning, match="could not write compile cache"):
            assert not cache.save_precompiled(object()).written
        assert cache.precompiled_path.read_bytes() == hostile
    finally:
        shutil.rmtree(shared)


def test_trust_shared_trusts_another_owner_as_documented_but_never_a_symlink(tmp_path, monkeypatch):
    _needs_root()
    marker = tmp_path / "marker"
    hostile = _hostile_precompiled_file(tmp_path, monkeypatch, marker)
    cache = CompileCache(tmp_path / "cc", fingerprint="m", precompile=True, trust_shared=True)
    _plant(cache, hostile)
    os.chown(cache.precompiled_path, OTHER_UID, OTHER_UID)
    os.chmod(cache.dir, 0o777)
    with pytest.warns(CompileCacheWarning, match="torch rejected it"):
        cache.load_precompiled()
    assert marker.exists(), "trust_shared=True trusts whoever can write the cache: their pickle runs"
    marker.unlink()
    cache.precompiled_path.unlink()
    (tmp_path / "elsewhere.bin").write_bytes(hostile)
    cache.precompiled_path.symlink_to(tmp_path / "elsewhere.bin")
    with pytest.warns(CompileCacheWarning, match="is a symbolic link"):
        assert cache.load_precompiled()[0].status == "untrusted"
    assert not marker.exists()


def test_a_planted_file_makes_the_start_compile_cold_and_the_users_model_trains(tmp_path, monkeypatch):
    # End to end: overlapped_start finds the planted file, refuses it, precompiles the model itself and
    # replaces the planted file with its own.
    marker = tmp_path / "marker"
    model = Small()
    spec = declared_spec(dynamic=False, batch=8)
    cache = CompileCache(tmp_path / "cc", model=model, spec=spec, config={}, precompile=True)
    hostile = _hostile_precompiled_file(
        tmp_path, monkeypatch, marker, fingerprint=cache.key_fields["fingerprint"]
    )
    _plant(cache, hostile)
    os.chmod(cache.precompiled_path, 0o666)  # left writable by anyone (or owned by another uid: same verdict)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(CompileCacheWarning, match="with mode 0666"):
        compiled, first, report, _ = overlapped_start(
            model, [make_batch(8, 1)], spec, loss_fn, cache, recorder=None
        )
    assert report.precompiled.status == "untrusted" and not marker.exists()
    assert isinstance(compiled, precompiled.PrecompiledModel) and compiled.origin == "compiled"
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # the start changed nothing
    torch.testing.assert_close(compiled(first), model(first))
    st = os.stat(cache.precompiled_path)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600  # now this user's own file


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 1)

    def forward(self, batch):
        return self.fc(batch["dense"]).squeeze(1)


# ---- MegaCache: artifact keys that would leave Inductor's cache dir -------------------------------------


def _megacache_file(tmp_path, monkeypatch, blob) -> CompileCache:
    """A well-formed MegaCache file of this user carrying ``blob`` (as a poisoned artifact list would be
    saved by a compile that recorded it)."""
    info = types.SimpleNamespace(artifacts=defaultdict(list, {"inductor": ["k"]}))
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "save_cache_artifacts", lambda: (blob, info))
        m.setattr(cache_module, "_loaded_kernel_files", list)
        cache = CompileCache(tmp_path / "cc", fingerprint="m")
        assert cache.save().written
    return CompileCache(tmp_path / "cc", fingerprint="m")


@pytest.mark.parametrize(
    "kind, key",
    [
        ("autotune", "{victim}"),  # torch: os.path.join(cache_dir(), key): the absolute key wins
        ("autotune", "ab/../../victim/planted.best_config"),  # -> <tmp>/victim/planted.best_config
        ("inductor", "../../victim/planted"),  # torch: <cache>/fxgraph/<key[1:3]>/<key>/<sha256>
        ("aot_autograd", "{victim}"),
        ("precompile", "{victim}"),
        ("pgo", "..\\..\\x"),
        ("inductor", "a\0b"),
        ("inductor", ""),
    ],
    ids=[
        "autotune-absolute",
        "autotune-dotdot",
        "inductor-dotdot",
        "aot_autograd-absolute",
        "precompile-absolute",
        "pgo-backslash",
        "nul",
        "empty",
    ],
)
def test_a_megacache_key_outside_the_cache_dir_is_refused_before_torch_sees_it(
    tmp_path, monkeypatch, inductor_dir, kind, key
):
    victim = tmp_path / "victim" / "settings.json"
    victim.parent.mkdir()
    victim.write_text("the user's own file")
    key = key.format(victim=victim)
    cache = _megacache_file(tmp_path, monkeypatch, megacache_blob({kind: {key: b'{"hostile": true}'}}))
    before = sorted(p for p in tmp_path.rglob("*") if "inductor" not in p.parts)
    with pytest.warns(CompileCacheWarning, match="MegaCache artifact key .* refused"):
        result = cache.load()  # the real torch.compiler.load_cache_artifacts behind it
    assert result.status == "corrupt" and not result.hit
    assert victim.read_text() == "the user's own file"
    after = sorted(p for p in tmp_path.rglob("*") if "inductor" not in p.parts)
    assert after == before  # nothing new anywhere outside Inductor's dir
    assert not inductor_dir.exists() or not any(inductor_dir.rglob("*"))


def test_torchs_own_autotune_key_shape_is_accepted_and_lands_inside_the_cache_dir(
    tmp_path, monkeypatch, inductor_dir
):
    # The positive control: the key torch records for a Triton kernel's autotuning (derived here by torch's
    # own functions, as a GPU compile does: "<kernel dir>/<hash>.best_config") loads, inside the cache dir.
    from torch._inductor.codecache import get_path
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    _, _, kernel_file = get_path("c" + "abcdefghijklmnopqrstuvwxyz234567", "py")  # a generated kernel's path
    local = AutotuneCache._make_local_cache_key(
        os.path.dirname(kernel_file), AutotuneCache._prepare_key(kernel_file)
    )
    key = AutotuneCache._artifact_key_from_local_cache_key(local)
    assert key.startswith("ab/") and key.endswith(".best_config")
    cache = _megacache_file(tmp_path, monkeypatch, megacache_blob({"autotune": {key: b'{"num_warps": 4}'}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        assert cache.load().status == "hit"
    assert (inductor_dir / key).read_bytes() == b'{"num_warps": 4}'


def test_megacache_artifacts_decodes_strictly():
    ok = megacache_blob({"inductor": {"fabc": b"x"}, "autotune": {"ab/c.best_config": b"{}"}})
    assert cache_format.megacache_artifacts(ok) == [
        ("inductor", "fabc", 1),
        ("autotune", "ab/c.best_config", 2),
    ]
    # A length that runs past the end: refused, not read short as torch's reader would.
    with pytest.raises(ValueError, match="runs past the end"):
        cache_format.megacache_artifacts(ok[:-1])
    with pytest.raises(ValueError, match="ends inside a length field"):
        cache_format.megacache_artifacts(ok + b"\0\0\0")
    with pytest.raises(ValueError, match="encoding version 2"):
        cache_format.megacache_artifacts(ok[:4] + (2).to_bytes(8, "big") + ok[12:])
    # Stray characters in a base64 key: torch's lenient decoder would drop them and read another key.
    stray = megacache_blob({"autotune": {"ab/c.best_config": b"{}"}}).replace(
        b"YWIvYy5iZXN0X2NvbmZpZw==", b"L2V0Yy9wYXNzd2Q!!!!!!!!"
    )
    with pytest.raises(ValueError, match="not base64"):
        cache_format.megacache_artifacts(stray)
    for key in ("ab/cd/e", "/ab", "ab/", "ab/..", "ab\\c"):
        with pytest.raises(ValueError, match="refused"):
            cache_format.megacache_artifacts(megacache_blob({"autotune": {key: b"{}"}}))


def test_a_megacache_file_another_user_owns_never_reaches_torch(tmp_path, monkeypatch, inductor_dir):
    _needs_root()
    cache = _megacache_file(tmp_path, monkeypatch, megacache_blob({"inductor": {"fabc": b"pickled graph"}}))
    os.chown(cache.path, OTHER_UID, OTHER_UID)
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    with pytest.warns(CompileCacheWarning, match=f"owned by uid {OTHER_UID}"):
        assert cache.load().status == "untrusted"
    assert loaded == [] and (not inductor_dir.exists() or not any(inductor_dir.rglob("*")))


# ---- bundled kernels: written only into real directories of this user -----------------------------------


def _cache_with_a_kernel(tmp_path, monkeypatch) -> None:
    lib = tmp_path / "built" / "ab" / "cabxyz.main.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF kernel")
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", lambda: [("ab/cabxyz.main.so", lib)])
    info = types.SimpleNamespace(artifacts=defaultdict(list, {"inductor": ["k"]}))
    blob = megacache_blob({"inductor": {"fabc": b"g"}})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (blob, info))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: info)
    assert CompileCache(tmp_path / "cc", fingerprint="m").save().written


@pytest.mark.parametrize("planted", ["symlink", "world_writable", "another_uid"])
def test_bundled_kernels_are_never_written_into_a_directory_someone_else_controls(
    tmp_path, monkeypatch, inductor_dir, planted
):
    _cache_with_a_kernel(tmp_path, monkeypatch)
    inductor_dir.mkdir(exist_ok=True)  # torch makes it when it first imports Dynamo
    os.chmod(inductor_dir, 0o700)
    sub = inductor_dir / "ab"
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    if planted == "symlink":  # inductor/ab -> a directory of the user's: nothing may be written through it
        sub.symlink_to(victim_dir, target_is_directory=True)
        expect = "symbolic link"
    elif planted == "world_writable":
        sub.mkdir()
        os.chmod(sub, 0o777)
        expect = "mode 0777"
    else:
        _needs_root()
        sub.mkdir(mode=0o755)
        os.chown(sub, OTHER_UID, OTHER_UID)
        expect = f"owned by uid {OTHER_UID}"
    with pytest.warns(CompileCacheWarning, match=f"could not restore compiled kernels.*{expect}"):
        result = CompileCache(tmp_path / "cc", fingerprint="m").load()
    assert result.hit and result.artifacts["cpu_kernel_files"] == 0  # the cache still works: g++ rebuilds
    assert list(victim_dir.iterdir()) == [] and not (sub / "cabxyz.main.so").exists()


def test_bundled_kernels_go_into_inductors_group_writable_directory(tmp_path, monkeypatch, inductor_dir):
    # torch makes Inductor's directories with the umask's mode (0775 under umask 002) and loads from them
    # anyway: refusing one would only make every warm start rebuild the kernels.
    _cache_with_a_kernel(tmp_path, monkeypatch)
    (inductor_dir / "ab").mkdir(parents=True)
    os.chmod(inductor_dir / "ab", 0o775)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        result = CompileCache(tmp_path / "cc", fingerprint="m").load()
    assert result.artifacts["cpu_kernel_files"] == 1
    assert (inductor_dir / "ab" / "cabxyz.main.so").read_bytes() == b"\x7fELF kernel"


# ---- compile once per job: the Store payload is signed ------------------------------------------------


def _store(tmp_path):
    import torch.distributed as dist

    return dist.FileStore(str(tmp_path / "store"), 2)


def test_the_store_route_is_refused_without_a_secret_and_each_rank_uses_its_own_file(tmp_path, monkeypatch):
    monkeypatch.delenv("ETTKIT_COMPILE_SHARE_SECRET", raising=False)
    store = _store(tmp_path)
    with pytest.warns(
        CompileCacheWarning, match="Set \\$ETTKIT_COMPILE_SHARE_SECRET .* or pass share_secret="
    ):
        cache = CompileCache(tmp_path / "cc", fingerprint="m", precompile=True, store=store, rank=1)
    assert not cache.shares
    with pytest.raises(InvalidArgumentError, match="share_secret= is 5 bytes; it must be at least 32"):
        CompileCache(tmp_path / "cc", fingerprint="m", precompile=True, store=store, share_secret="short")
    monkeypatch.setenv("ETTKIT_COMPILE_SHARE_SECRET", "x" * 31)
    with pytest.raises(InvalidArgumentError, match="ETTKIT_COMPILE_SHARE_SECRET is 31 bytes"):
        CompileCache(tmp_path / "cc", fingerprint="m", precompile=True, store=store)
    monkeypatch.setenv("ETTKIT_COMPILE_SHARE_SECRET", "x" * 32)
    assert CompileCache(tmp_path / "cc", fingerprint="m", precompile=True, store=store).shares


def _ranks(tmp_path, secret0=SECRET, secret1=SECRET):
    store = _store(tmp_path)
    rank0 = CompileCache(
        tmp_path / "cc0", fingerprint="m", precompile=True, store=store, rank=0, share_secret=secret0
    )
    rank1 = CompileCache(
        tmp_path / "cc1",
        fingerprint="m",
        precompile=True,
        store=store,
        rank=1,
        share_secret=secret1,
        share_timeout_s=30,
    )
    return store, rank0, rank1


def test_a_signed_file_from_rank_0_loads_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(precompiled, "serialize", lambda fn: b"artifact-bytes")
    monkeypatch.setattr(precompiled, "deserialize", lambda data: ("loaded", data))
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", list)
    _, rank0, rank1 = _ranks(tmp_path)
    assert rank0.save_precompiled(object()).written
    rank0.publish_precompiled()
    result, fn, why = rank1.receive_precompiled()
    assert why is None and fn == ("loaded", b"artifact-bytes") and result.status == "precompiled"
    assert result.reason.startswith("from rank 0")
    assert rank1.precompiled_path.read_bytes() == rank0.precompiled_path.read_bytes()
    assert stat.S_IMODE(os.stat(rank1.precompiled_path).st_mode) == 0o600


@pytest.mark.parametrize(
    "forgery", ["unsigned_file", "wrong_secret", "tampered_body", "other_key", "fallback"]
)
def test_a_store_payload_without_a_valid_hmac_is_never_unpickled_or_written(tmp_path, monkeypatch, forgery):
    marker = tmp_path / "marker"
    hostile = _hostile_precompiled_file(tmp_path, monkeypatch, marker)
    store, rank0, rank1 = _ranks(tmp_path)
    key = rank1._share_key
    seal = cache_seal.seal
    if forgery == "unsigned_file":  # what any client of the Store could set before this fix, and was loaded
        payload = hostile
    elif forgery == "wrong_secret":
        payload = seal(b"w" * 32, key, b"F", hostile)
    elif forgery == "tampered_body":
        good = seal(SECRET, key, b"F", b"rank 0's real file")
        payload = good[: -len(b"rank 0's real file")] + hostile
    elif forgery == "other_key":  # a real signature, for another model's key: not replayable here
        payload = seal(SECRET, "ettkit/precompiled/another-model", b"F", hostile)
    else:  # a forged "rank 0 could not precompile": it must not stop this rank from precompiling itself
        payload = seal(b"w" * 32, key, b"X", b"aot_compile failed (forged)")
    store.set(key, payload)
    with pytest.warns(CompileCacheWarning, match="HMAC|carries no ettkit HMAC"):
        result, fn, why = rank1.receive_precompiled()
    assert fn is None and result.status == "untrusted"
    assert why.startswith("rank 0's precompiled file was refused")  # overlapped_start then compiles here
    assert not marker.exists()
    assert not rank1.precompiled_path.exists() and not any(rank1.dir.glob("*"))


def test_a_rank_given_a_forged_payload_precompiles_itself(tmp_path, monkeypatch):
    # overlapped_start on rank 1: the forged payload is refused and this rank compiles its own graph (it does
    # not take the forgery's word that rank 0 could not precompile).
    marker = tmp_path / "marker"
    hostile = _hostile_precompiled_file(tmp_path, monkeypatch, marker, fingerprint="small")
    store = _store(tmp_path)
    model = Small()
    spec = declared_spec(dynamic=False, batch=8)
    rank1 = CompileCache(
        tmp_path / "cc1",
        fingerprint="small",
        precompile=True,
        store=store,
        rank=1,
        share_secret=SECRET,
        share_timeout_s=30,
    )
    store.set(rank1._share_key, hostile)
    with pytest.warns(CompileCacheWarning, match="carries no ettkit HMAC"):
        compiled, first, report, _ = overlapped_start(
            model, [make_batch(8, 1)], spec, loss_fn, rank1, recorder=None
        )
    assert not marker.exists()
    assert report.precompile_peer.startswith("rank 0's precompiled file was refused")
    assert isinstance(compiled, precompiled.PrecompiledModel) and compiled.origin == "compiled"
    torch.testing.assert_close(compiled(first), model(first))


# ---- what ettkit creates: 0700 directories, 0600 files, never widened ----------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["umask-022", "umask-077", "umask-002"])
def test_cache_files_are_0600_in_0700_directories_whatever_the_umask(
    tmp_path, monkeypatch, inductor_dir, umask
):
    lib = tmp_path / "built" / "ab" / "cabxyz.main.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF kernel")
    info = types.SimpleNamespace(artifacts=defaultdict(list, {"inductor": ["k"]}))
    blob = megacache_blob({"inductor": {"fabc": b"g"}})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (blob, info))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: info)
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", lambda: [("ab/cabxyz.main.so", lib)])
    monkeypatch.setattr(precompiled, "serialize", lambda fn: b"artifact-bytes")
    monkeypatch.setattr(precompiled, "source_fingerprint", lambda fn: [])
    existing = tmp_path / "ckpt"
    existing.mkdir(mode=0o750)  # the user's own directory: left as it is
    os.chmod(existing, 0o750)
    # Inductor's cache dir is torch's (it makes it at import, with the umask's mode): left as it is too.
    inductor_dir.mkdir(exist_ok=True)
    os.chmod(inductor_dir, 0o755)
    old = os.umask(umask)
    try:
        cache = CompileCache(existing / "compile" / "cache", fingerprint="m", precompile=True)
        assert cache.save().written and cache.save_precompiled(object()).written
        assert cache.load().artifacts["cpu_kernel_files"] == 1  # restored into the (fresh) Inductor dir
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.lstat(p).st_mode)

    assert mode(existing) == 0o750 and mode(inductor_dir) == 0o755
    for d in (existing / "compile", cache.dir, inductor_dir / "ab"):
        assert mode(d) == 0o700, d
    for f in (cache.path, cache.precompiled_path, inductor_dir / "ab" / "cabxyz.main.so"):
        assert mode(f) == 0o600, f
    assert sorted(p.name for p in cache.dir.iterdir()) == sorted(
        [cache.path.name, cache.precompiled_path.name]
    )
