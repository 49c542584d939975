"""The shared compile cache (CompileCache(shared_dir=...), issue #44): a job whose own directory has no
precompiled file for its key loads the one another job wrote into the shared directory, after checking its
HMAC; everything a hostile co-tenant could put there is refused before a byte of it is unpickled.

The unit tests stand in for torch's serialization (as test_startup_precompile.py does); the end-to-end test
compiles for real in one process and starts from the shared cache in another."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import warnings

import pytest
from ettkit.errors import InvalidArgumentError, IoError
from ettkit.startup import CompileCache, CompileCacheWarning, precompiled, trusted_files
from startup_helpers import fake_precompiled_serialization

from ettkit.startup import cache_shared as cache_module_for_bound  # its size bound, patched by one test

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "shared-cache-test-secret-" + "0123456789abcdef" * 2
OTHER_SECRET = "another-fleet-secret-" + "fedcba9876543210" * 2


class FakeFn:
    """Stands in for an AOTCompiledFunction: serializes to fixed bytes, inlines no source."""

    def source_info(self):
        return type("SourceInfo", (), {"inlined_sources": set()})()


@pytest.fixture
def fake_torch(monkeypatch):
    """torch's (de)serialization replaced: what was unpickled is recorded, so a test can show nothing was."""
    monkeypatch.setenv("ETTKIT_COMPILE_CACHE_SECRET", SECRET)
    return fake_precompiled_serialization(monkeypatch)


@pytest.fixture
def shared(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o750)
    os.chmod(d, 0o750)
    return d


def _publish(tmp_path, shared, fingerprint="m1", job="warmup-1"):
    """Job A: compiles (here: a fake artifact), writes its own file and the shared one."""
    a = CompileCache(tmp_path / "a", fingerprint=fingerprint, precompile=True, shared_dir=shared, job=job)
    assert a.save_precompiled(FakeFn()).written
    published = a.publish_shared()
    assert published.written, published.reason
    return a


def test_a_job_starts_from_the_file_another_job_shared_and_keeps_its_own_copy(fake_torch, tmp_path, shared):
    a = _publish(tmp_path, shared)
    shared_file = shared / a.shared_name
    assert stat.S_IMODE(shared_file.stat().st_mode) == 0o640  # the group that shares the directory reads it
    assert shared_file.read_bytes().startswith(b"ETTKSHR1")  # sealed: magic, HMAC, kind, the file
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result, fn = b.load_precompiled()
    assert result.status == "precompiled" and fn == "loaded-fn" and fake_torch == [b"artifact-bytes"]
    host = os.uname().nodename
    assert result.source == f"shared, job warmup-1 on {host}", result.source
    assert result.reason == f"from the shared cache (shared, job warmup-1 on {host})"
    # Its own copy, 0600, identical to job A's own file: a restart of B needs nothing shared.
    assert b.precompiled_path.read_bytes() == a.precompiled_path.read_bytes()
    assert stat.S_IMODE(b.precompiled_path.stat().st_mode) == 0o600
    shared_file.unlink()
    result, fn = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared).load_precompiled()
    assert result.status == "precompiled" and result.source is None  # this node's own file now


def test_a_plain_miss_says_the_shared_cache_had_none_either(fake_torch, tmp_path, shared):
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a miss is silent
        result, fn = b.load_precompiled()
    assert result.status == "miss" and fn is None
    assert f"none in the shared cache {shared} either" in result.reason


def test_a_shared_dir_that_does_not_exist_warns_naming_it_and_the_start_compiles(fake_torch, tmp_path):
    missing = tmp_path / "not-mounted"
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=missing)
    with pytest.warns(CompileCacheWarning, match=f"the shared compile cache {missing} does not exist"):
        result, fn = b.load_precompiled()
    assert result.status == "miss" and fn is None


def test_a_shared_dir_without_a_secret_or_with_a_short_one_is_refused_at_construction(tmp_path, monkeypatch):
    monkeypatch.delenv("ETTKIT_COMPILE_CACHE_SECRET", raising=False)
    with pytest.raises(InvalidArgumentError, match=r"needs the shared cache's secret.*ETTKIT_COMPILE_CACHE_SECRET"):
        CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"shared_secret= is 5 bytes; it must be at least 32"):
        CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=tmp_path, shared_secret="short")
    monkeypatch.setenv("ETTKIT_COMPILE_CACHE_SECRET", "x" * 31)
    with pytest.raises(InvalidArgumentError, match=r"\$ETTKIT_COMPILE_CACHE_SECRET is 31 bytes"):
        CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=tmp_path)


def _refused(cache, fake_torch, match):
    with pytest.warns(CompileCacheWarning, match=match):
        result, fn = cache.load_precompiled()
    assert fn is None and fake_torch == []  # nothing unpickled
    assert not cache.precompiled_path.exists()  # nothing copied
    return result


def test_a_file_sealed_with_another_secret_is_untrusted_and_never_loaded(fake_torch, tmp_path, shared):
    a = CompileCache(tmp_path / "a", fingerprint="m1", precompile=True, shared_dir=shared, shared_secret=OTHER_SECRET)
    a.save_precompiled(FakeFn())
    assert a.publish_shared().written
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    result = _refused(b, fake_torch, r"does not verify with this job's cache secret")
    assert result.status == "untrusted"


def test_a_planted_unsealed_file_is_untrusted(fake_torch, tmp_path, shared):
    # A co-tenant who can write the directory but lacks the secret copies a valid precompiled file there.
    a = CompileCache(tmp_path / "a", fingerprint="m1", precompile=True, shared_dir=shared)
    a.save_precompiled(FakeFn())
    (shared / a.shared_name).write_bytes(a.precompiled_path.read_bytes())
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    assert _refused(b, fake_torch, r"carries no ettkit HMAC").status == "untrusted"


def test_a_valid_file_replayed_under_another_key_is_untrusted(fake_torch, tmp_path, shared):
    a = _publish(tmp_path, shared, fingerprint="m1")
    b = CompileCache(tmp_path / "b", fingerprint="m2", precompile=True, shared_dir=shared)
    os.replace(shared / a.shared_name, shared / b.shared_name)  # the HMAC covers the key
    assert _refused(b, fake_torch, r"does not verify").status == "untrusted"


def test_a_flipped_byte_is_untrusted(fake_torch, tmp_path, shared):
    a = _publish(tmp_path, shared)
    path = shared / a.shared_name
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    assert _refused(b, fake_torch, r"does not verify").status == "untrusted"


def test_a_world_writable_shared_dir_is_refused_for_reading_and_writing(fake_torch, tmp_path, shared):
    a = _publish(tmp_path, shared)
    os.chmod(shared, 0o777)
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    assert _refused(b, fake_torch, r"is world-writable \(mode 0777\)").status == "untrusted"
    with pytest.warns(CompileCacheWarning, match="world-writable"):
        assert not a.publish_shared().written
    os.chmod(shared, 0o770)  # group-writable: the team that shares it; the HMAC keeps out the rest
    result, fn = b.load_precompiled()
    assert result.status == "precompiled" and fn == "loaded-fn"


def test_a_shared_file_over_the_size_bound_is_refused_before_it_is_read(fake_torch, tmp_path, shared, monkeypatch):
    a = _publish(tmp_path, shared)
    size = (shared / a.shared_name).stat().st_size
    monkeypatch.setattr(cache_module_for_bound, "_MAX_SHARED_BYTES", size - 1)
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    assert _refused(b, fake_torch, rf"is {size} bytes, more than the {size - 1}").status == "untrusted"


def test_a_symlink_in_the_shared_dir_is_refused(fake_torch, tmp_path, shared):
    a = _publish(tmp_path, shared)
    real = tmp_path / "elsewhere.bin"
    os.replace(shared / a.shared_name, real)
    os.symlink(real, shared / a.shared_name)
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    assert _refused(b, fake_torch, r"symbolic link").status == "untrusted"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_shared_dir_and_file_another_user_owns_are_loaded_when_sealed(fake_torch, tmp_path, shared):
    # The difference from this node's own directory, which must be this user's: the shared cache is filled
    # by others (a precompile service), so ownership proves nothing there and the HMAC decides.
    a = _publish(tmp_path, shared)
    os.chown(shared / a.shared_name, 4242, 4242)
    os.chown(shared, 4242, 4242)
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    result, fn = b.load_precompiled()
    assert result.status == "precompiled" and fn == "loaded-fn"
    assert b.precompiled_path.stat().st_uid == os.geteuid()  # the copy is this user's own


def test_a_stale_shared_file_falls_back_to_compiling_with_the_reason(fake_torch, tmp_path, shared, monkeypatch):
    _publish(tmp_path, shared)
    monkeypatch.setattr(precompiled, "changed_sources", lambda sources: ["model.py:10-20"])
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    with pytest.warns(CompileCacheWarning, match=r"source it was traced from has changed \(model.py:10-20\)"):
        result, fn = b.load_precompiled()
    assert result.status == "stale" and fn is None and fake_torch == []


def test_publishing_into_a_cache_this_job_may_only_read_is_quiet(fake_torch, tmp_path, shared, monkeypatch):
    a = CompileCache(tmp_path / "a", fingerprint="m1", precompile=True, shared_dir=shared)
    a.save_precompiled(FakeFn())

    def denied(self, name, data, **kw):
        error = IoError(f"creating '{self.path}/.{name}.tmp' failed: Permission denied (errno 13)")
        error.errno = errno.EACCES
        raise error

    monkeypatch.setattr(trusted_files.CacheDirectory, "write", denied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read-only for jobs is how a fleet may run it: no warning per start
        result = a.publish_shared()
    assert not result.written and result.reason.startswith("read-only for this job")


def test_a_failed_write_names_its_errno(tmp_path):
    with trusted_files.CacheDirectory(tmp_path) as d:
        os.mkdir(tmp_path / "sub")
        with pytest.raises(IoError) as e:
            d.write("sub", b"x")  # renaming a file over a directory
    assert e.value.errno == errno.EISDIR and "(errno 21)" in str(e.value)


def _run(tmp_path, tag, cache_dir, shared, job, fail_on_recompile=False):
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{tag}"),
        PYTHONPATH=os.pathsep.join([HERE] + sys.path),
        ETTKIT_TEST_FAIL_ON_RECOMPILE="1" if fail_on_recompile else "0",
        ETTKIT_TEST_SHARED_DIR=str(shared),
        ETTKIT_TEST_JOB=job,
        ETTKIT_COMPILE_CACHE_SECRET=SECRET,
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "startup_precompile_script.py"), "ettkit", str(cache_dir), "static"],
        check=False, env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _precompile_cli(tmp_path, shared, *extra):
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cli"),
        PYTHONPATH=os.pathsep.join([HERE] + sys.path),
        ETTKIT_COMPILE_CACHE_SECRET=SECRET,
    )
    return subprocess.run(
        [sys.executable, "-m", "ettkit", "precompile", "--model", "startup_helpers:TinyRec",
         "--spec", "startup_helpers:static_spec", "--shared-dir", str(shared), *extra],
        check=False, env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path),
    )


def test_a_job_starts_from_ettkit_precompile_without_compiling_and_trains_as_a_cold_job(tmp_path):
    """`ettkit precompile` fills a shared cache from the model factory and batch spec alone; a job with its own
    (empty) cache and Inductor directories, as on another node, starts from it: it may not compile a graph,
    and it trains bit for bit as a cold job, which compiles and publishes into a cache of its own. (A job
    started from another job's file, under torchrun: test_demo.py's second ettkit job.)"""
    by_job, by_cli = tmp_path / "shared-by-job", tmp_path / "shared-by-cli"
    for d in (by_job, by_cli):
        d.mkdir(mode=0o750)
    cold = _run(tmp_path, "cold", tmp_path / "node1", by_job, "cold-job")
    assert cold["summary"]["cache"] == "miss" and cold["origin"] == "compiled"
    assert cold["saved"] is True and cold["shared_saved"] is True
    assert [p.suffix for p in by_job.iterdir()] == [".shared"]

    run_dir = tmp_path / "precompile-run"
    cli = _precompile_cli(tmp_path, by_cli, "--job", "nightly-precompile", "--run-dir", str(run_dir))
    assert cli.returncode == 0, cli.stderr[-4000:]
    assert cli.stdout.startswith(f"ettkit precompile: compiled: {by_cli}/precompiled-"), cli.stdout
    again = _precompile_cli(tmp_path, by_cli)  # the cache has it now: nothing to compile
    assert again.returncode == 0 and "ettkit precompile: shared:" in again.stdout, again.stdout + again.stderr
    warm = _run(tmp_path, "warm", tmp_path / "node2", by_cli, "warm-job", fail_on_recompile=True)
    host = os.uname().nodename
    assert warm["summary"]["cache"] == "precompiled", warm["precompiled_reason"]
    assert warm["summary"]["precompiled_source"] == f"shared, job nightly-precompile on {host}"
    assert warm["origin"] == "loaded" and warm["summary"]["recompiles"] == 0
    assert warm["shared_saved"] is None  # it compiled nothing, so it wrote nothing shared
    assert len(list((tmp_path / "node2").glob("precompiled-*.bin"))) == 1  # its own copy for its restarts
    for name in ("losses", "grads", "bn_mean"):
        assert warm[name] == cold[name], name  # the same graph: every bit
    # The precompile run's own ledger: its compile time counts in a fleet report instead of vanishing.
    from ettkit import ett

    report = ett.build_report(str(run_dir))
    assert len(report["attempts"]) == 1 and report["phases"]["compile"] > 0
    notes = report["attempts"][0]["notes"]
    assert notes["job_kind"] == "precompile" and notes["device"] == "cpu"
    fleet = ett.fleet_report([str(run_dir)])
    assert fleet["precompile"]["jobs"] == 1 and set(fleet["precompile"]["by_device_h"]) == {"cpu"}


@pytest.mark.parametrize("argv, match", [
    (["--model", "startup_helpers"], "--model 'startup_helpers': write MODULE:NAME"),
    (["--model", "no_such_module_x:f"], "cannot import no_such_module_x"),
    (["--model", "startup_helpers:nothing"], "startup_helpers has no attribute nothing"),
    (["--model", "startup_helpers:static_spec"], "not a torch.nn.Module"),
    (["--spec", "startup_helpers:TinyRec"], "not a BatchSpec"),
    (["--config", "[1]"], "--config: a JSON object is needed"),
    (["--compile-kwargs", "{"], "--compile-kwargs: not JSON"),
])
def test_precompile_refuses_bad_arguments_by_name(tmp_path, monkeypatch, capsys, argv, match):
    from ettkit.__main__ import main

    monkeypatch.setenv("ETTKIT_COMPILE_CACHE_SECRET", SECRET)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    options = {"--model": "startup_helpers:TinyRec", "--spec": "startup_helpers:static_spec"}
    options.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["precompile", *[a for kv in options.items() for a in kv], "--shared-dir", str(shared)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ettkit precompile: error: ") and match in err, err
    assert os.listdir(shared) == []


def test_precompile_without_the_cache_secret_says_which_variable(tmp_path, monkeypatch, capsys):
    from ettkit.__main__ import main

    monkeypatch.delenv("ETTKIT_COMPILE_CACHE_SECRET", raising=False)
    assert main(["precompile", "--model", "startup_helpers:TinyRec", "--spec", "startup_helpers:static_spec",
                 "--shared-dir", str(tmp_path)]) == 2
    assert "ETTKIT_COMPILE_CACHE_SECRET" in capsys.readouterr().err
