"""The writers against hostile input (issue #61, docs/security.md): the Recorder's ledger and its process_exit
record.

Another local user who creates a shared run directory first, or can write its ``ett`` folder, plants what the
Recorder will open for appending: a link to a file of the job's user, a FIFO, a file of their own, a hard
link. The attacker is a real second uid (``setpriv --reuid=65534``, which needs root; skipped otherwise), as
in test_security_memory_tier.py. Each test asserts that the Recorder refuses with an ``IoError`` naming the
path, and that the planted target is unchanged. A Recorder that could hang (a FIFO) runs in a child process
under a timeout, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

import ettkit
from ettkit import ett

ATTACKER_UID = 65534  # "nobody": a user who is not the victim
CHILD_TIMEOUT_S = 60

needs_second_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="the attacker runs as a second uid (setpriv --reuid=65534), which needs root and setpriv",
)


def _as_attacker(script: str, *args: str) -> None:
    subprocess.run(["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups",
                    "sh", "-c", script, "attacker", *args], check=True, capture_output=True, text=True,
                   timeout=CHILD_TIMEOUT_S)


@pytest.fixture
def shared_dir():
    """A directory like /tmp: sticky, every user may create in it (tmp_path is private to this user)."""
    root = tempfile.mkdtemp(prefix="ettkit-security-writers-")
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def victims_file(tmp_path):
    """A file of the job's user in a 0700 directory: what a planted link or hard link points at."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    config = private / "config.toml"
    config.write_text("lr = 0.1\n")
    return config


def _record_in_child(run_dir: str, extra: str = "") -> subprocess.CompletedProcess:
    """Runs a Recorder on `run_dir` in a child process (a hang becomes a timeout, not a stuck suite); prints
    the growth of its peak RSS across the Recorder's life; runs `extra` after it."""
    code = textwrap.dedent(f"""
        import resource, sys
        from ettkit import ett
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            with ett.Recorder(sys.argv[1], rank=0, world_size=1, launcher_phases_from_env=False) as rec:
                rec.step(1)
        except Exception as e:
            print(type(e).__name__, e)
            sys.exit(3)
        print("rss_growth_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """) + textwrap.dedent(extra)
    return subprocess.run([sys.executable, "-c", code, run_dir], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)


@needs_second_user
def test_a_run_directory_squatted_by_another_user_with_a_linked_ledger_is_refused(shared_dir, victims_file):
    # Issue #61 item 1, as reported: the other user creates the run directory first and plants
    # ett/rank-0.jsonl as a link to a file of the job's user; the Recorder appended its lines to that file.
    run_dir = os.path.join(shared_dir, "run")
    _as_attacker('mkdir -m 777 "$1" "$1/ett" && ln -s "$2" "$1/ett/rank-0.jsonl"', run_dir, str(victims_file))
    before = victims_file.read_bytes()
    with pytest.raises(ettkit.IoError, match=f"{run_dir}/ett.*owned by uid {ATTACKER_UID}"):
        ett.Recorder(run_dir, rank=0, world_size=1, launcher_phases_from_env=False)
    assert victims_file.read_bytes() == before  # not a byte appended


@needs_second_user
@pytest.mark.parametrize("plant", ["symlink", "fifo", "their_file"])
def test_what_another_user_plants_in_a_writable_ledger_folder_is_refused_by_name(shared_dir, victims_file, plant):
    # The ledger folder is this user's but others may write it (a team's umask): the attacker plants the
    # rank's ledger before the job starts. A FIFO used to hang the Recorder's constructor.
    run_dir = os.path.join(shared_dir, "run")
    os.makedirs(os.path.join(run_dir, "ett"))
    os.chmod(os.path.join(run_dir, "ett"), 0o777)
    ledger = os.path.join(run_dir, "ett", "rank-0.jsonl")
    script = {"symlink": 'ln -s "$2" "$1"', "fifo": 'mkfifo "$1"', "their_file": 'echo "{}" > "$1"'}[plant]
    _as_attacker(script, ledger, str(victims_file))
    before = victims_file.read_bytes()
    proc = _record_in_child(run_dir)  # times out (fails) if the open blocks
    expected = {"symlink": "is a symbolic link", "fifo": "is a FIFO",
                "their_file": f"is owned by uid {ATTACKER_UID}"}[plant]
    assert proc.returncode == 3 and proc.stdout.startswith("IoError"), proc.stdout + proc.stderr
    assert f"'{ledger}' {expected}" in proc.stdout, proc.stdout
    assert victims_file.read_bytes() == before
    assert os.lstat(ledger).st_uid == ATTACKER_UID  # left where it is, for its owner to see


def test_a_hard_link_to_another_file_of_the_user_is_not_appended_to(tmp_path, victims_file):
    # A second name of one of the user's own files: appending to it would write into that file.
    os.makedirs(tmp_path / "run" / "ett")
    os.link(victims_file, tmp_path / "run" / "ett" / "rank-0.jsonl")
    before = victims_file.read_bytes()
    with pytest.raises(ettkit.IoError, match=r"rank-0.jsonl' has 2 hard links"):
        ett.Recorder(tmp_path / "run", rank=0, world_size=1, launcher_phases_from_env=False)
    assert victims_file.read_bytes() == before


def test_the_ledger_is_created_0600_in_a_0700_folder_unless_others_may_read_it(tmp_path):
    with ett.Recorder(tmp_path / "private", rank=0, world_size=1, launcher_phases_from_env=False):
        pass
    with ett.Recorder(tmp_path / "shared", rank=0, world_size=1, launcher_phases_from_env=False,
                      ledger_readable_by_others=True):
        pass
    old = os.umask(0o022)
    os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "private" / "ett") == 0o700
    assert mode(tmp_path / "private" / "ett" / "rank-0.jsonl") == 0o600
    assert mode(tmp_path / "shared" / "ett") == 0o755 & ~old
    assert mode(tmp_path / "shared" / "ett" / "rank-0.jsonl") == 0o644 & ~old


def test_a_huge_sparse_ledger_is_scanned_without_being_held(tmp_path):
    # The existing ledger used to be read whole: a 1 GiB sparse file cost 1 GiB of RSS to every start.
    os.makedirs(tmp_path / "ett")
    ledger = tmp_path / "ett" / "rank-0.jsonl"
    with open(ledger, "wb") as f:
        f.write(b'{"v":1,"t":"attempt","attempt":0,"ts":5}\n')
        f.truncate(1 << 30)
        f.seek(1 << 30)
        f.write(b'\n{"v":1,"t":"end","ts":7,"status":"clean"}\n')
    proc = _record_in_child(str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    growth_mib = int(proc.stdout.split("rss_growth_kib")[1]) / 1024
    assert growth_mib < 64, f"peak RSS grew {growth_mib:.0f} MiB: the ledger was held in memory"
    lines = ledger.read_bytes()[(1 << 30):].splitlines()
    assert b'"attempt":1' in lines[2]  # the second attempt, numbered from the streamed scan


def test_a_fifo_swapped_in_after_close_does_not_hang_the_exit_and_the_record_lands(tmp_path):
    # Issue #61 item 2: the process_exit record reopened the ledger by path at exit, without O_NONBLOCK; a
    # FIFO put there after close() blocked the interpreter's exit forever. The hook now writes through the
    # descriptor it kept: the record lands in the ledger (wherever its name went), and nothing blocks.
    ledger = tmp_path / "ett" / "rank-0.jsonl"
    moved = tmp_path / "ett" / "moved.jsonl"
    swap = textwrap.dedent(f"""
        import atexit, os
        def swap():
            os.rename({str(ledger)!r}, {str(moved)!r})
            os.mkfifo({str(ledger)!r})
        atexit.register(swap)
    """)
    proc = _record_in_child(str(tmp_path), extra=swap)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert stat.S_ISFIFO(os.lstat(ledger).st_mode)
    last = moved.read_text().splitlines()[-1]
    assert '"t":"process_exit"' in last, last


# ---- the shared compile cache's publisher (issue #61 items 3 and 6) -------------------------------------------

SECRET = "writers-test-secret-" + "0123456789abcdef" * 2


class _FakeFn:
    """Stands in for an AOTCompiledFunction (the serialization is faked: startup_helpers)."""

    def source_info(self):
        return type("SourceInfo", (), {"inlined_sources": set()})()


@pytest.fixture
def fake_torch(monkeypatch):
    from startup_helpers import fake_precompiled_serialization

    monkeypatch.setenv("ETTKIT_COMPILE_CACHE_SECRET", SECRET)
    return fake_precompiled_serialization(monkeypatch)


def _team_cache(shared_dir, tmp_path):
    """A job's cache directory a team shares on purpose (trust_shared=True, mode 0777), and the fleet's
    shared cache, which trusts only the secret."""
    from ettkit.startup import CompileCache

    team = os.path.join(shared_dir, "team-cache")
    os.mkdir(team)
    os.chmod(team, 0o777)
    fleet = tmp_path / "fleet"
    fleet.mkdir(mode=0o750)
    return CompileCache(team, fingerprint="m1", precompile=True, trust_shared=True, shared_dir=fleet)


def _sealed_body(cache) -> bytes:
    from ettkit.startup.cache_seal import SHARED_CONTEXT as _SHARED_CONTEXT
    from ettkit.startup.cache_seal import unseal as _unseal

    payload = (cache.shared_dir / cache.shared_name).read_bytes()
    return bytes(_unseal(SECRET.encode(), cache.key, payload, _SHARED_CONTEXT)[1])


@needs_second_user
def test_publish_shared_seals_the_bytes_it_saved_not_a_file_another_user_swapped_in(fake_torch, shared_dir,
                                                                                    tmp_path):
    # Issue #61 item 3: publish_shared re-read the precompiled file from a directory others may write and
    # sealed whatever it found with the fleet's secret: a job that trusts only the secret then ran it.
    cache = _team_cache(shared_dir, tmp_path)
    assert cache.save_precompiled(_FakeFn()).written
    produced = cache.precompiled_path.read_bytes()
    _as_attacker('printf planted > "$1.x" && mv -f "$1.x" "$1"', str(cache.precompiled_path))
    assert os.stat(cache.precompiled_path).st_uid == ATTACKER_UID
    assert cache.publish_shared().written
    assert _sealed_body(cache) == produced  # what this process saved, not b"planted"


@needs_second_user
def test_publish_shared_refuses_a_file_it_only_loaded_from_a_directory_others_write(fake_torch, shared_dir, tmp_path):
    from ettkit.startup import CompileCache, CompileCacheWarning

    cache = _team_cache(shared_dir, tmp_path)
    assert cache.save_precompiled(_FakeFn()).written
    planted = cache.precompiled_path.read_bytes()  # a valid file: the team's trust lets it load here
    os.unlink(cache.precompiled_path)
    subprocess.run(["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups", "sh", "-c",
                    'cat > "$0"', str(cache.precompiled_path)], input=planted, check=True, timeout=CHILD_TIMEOUT_S)
    loader = CompileCache(cache.dir, fingerprint="m1", precompile=True, trust_shared=True,
                          shared_dir=cache.shared_dir)
    result, fn = loader.load_precompiled()
    assert fn == "loaded-fn"  # trust_shared=True: this job runs what the team put there, as documented
    with pytest.warns(CompileCacheWarning, match=rf"{re.escape(str(loader.precompiled_path))} was not written by "
                                                 r"this process \(and under trust_shared=True"):
        published = loader.publish_shared()
    assert not published.written
    assert not (loader.shared_dir / loader.shared_name).exists()  # the fleet's cache holds nothing of it


def test_a_huge_unsealed_shared_file_is_refused_without_being_read_into_memory(fake_torch, tmp_path):
    # Issue #61 item 6: a shared-cache file was read whole (up to 4 GiB) before its HMAC was checked; a
    # sparse 3 GiB file cost 15.8 s and 3.5 GiB of RSS on every start of every rank.
    from ettkit.startup import CompileCache

    fleet = tmp_path / "fleet"
    fleet.mkdir(mode=0o750)
    cache = CompileCache(tmp_path / "own", fingerprint="m1", precompile=True, shared_dir=fleet)
    with open(fleet / cache.shared_name, "wb") as f:
        f.write(b"ETTKSHR1" + bytes(32) + b"F")  # looks sealed; its HMAC is zeros
        f.truncate(1 << 30)
    code = textwrap.dedent(f"""
        import resource, sys, time, warnings
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from ettkit.startup import CompileCache
        from ettkit.startup import precompiled
        precompiled.supported = lambda: None
        cache = CompileCache({str(tmp_path / "own")!r}, fingerprint="m1", precompile=True, shared_dir={str(fleet)!r})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            result, fn = cache.load_precompiled()
        print(result.status, fn, time.perf_counter() - t,
              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "|", w[0].message if w else "")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env={**os.environ, "ETTKIT_COMPILE_CACHE_SECRET": SECRET})
    assert proc.returncode == 0, proc.stderr
    status, fn, seconds, growth_kib, _, message = proc.stdout.split(" ", 5)
    assert status == "untrusted" and fn == "None", proc.stdout
    assert "does not verify with this job's cache secret" in message and cache.shared_name in message
    assert int(growth_kib) < 64 << 10, f"peak RSS grew {int(growth_kib) >> 10} MiB: the file was held"


# ---- residuals (issue #61 item 8) --------------------------------------------------------------------------------


def test_a_memory_tier_root_under_a_directory_others_may_rename_in_is_refused(tmp_path):
    # The root's own mode was checked, never its parents': a user who can write the directory above the
    # root (without the sticky bit) can rename the root away and put their own in its place.
    from ettkit.checkpoint import AsyncCheckpointer

    above = tmp_path / "team"
    (above / "shm").mkdir(parents=True)
    os.chmod(above, 0o777)
    os.chmod(above / "shm", 0o700)
    with pytest.raises(ettkit.InvalidArgumentError, match=rf"the directory '{re.escape(str(above))}' above it "
                                                          r"\(owner uid \d+, mode 0777\) lets another user rename"):
        AsyncCheckpointer(tmp_path / "ckpt", recorder=None, memory_tier=str(above / "shm"), job_id="j")
    os.chmod(above, 0o1777)  # sticky, like /dev/shm: only an entry's owner may rename it
    with AsyncCheckpointer(tmp_path / "ckpt", recorder=None, memory_tier=str(above / "shm"), job_id="j") as ck:
        assert ck.memory_tier_directory.startswith(str(above / "shm"))


def test_a_store_payload_of_another_job_is_refused(tmp_path, monkeypatch):
    # Issue #61 item 8: the compile-once payload's MAC had no job nonce. A launcher that reuses the share
    # secret across jobs let a payload recorded from one job's Store be replayed into another's.
    import torch.distributed as dist
    from ettkit.startup import CompileCache, CompileCacheWarning, precompiled
    from ettkit.startup import cache as cache_module

    monkeypatch.setattr(precompiled, "serialize", lambda fn: b"artifact-bytes")
    monkeypatch.setattr(precompiled, "deserialize", lambda data: ("loaded", data))
    monkeypatch.setattr(cache_module, "_loaded_kernel_files", list)
    secret = "s" * 32

    def ranks(job, store_dir):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        store = dist.FileStore(str(tmp_path / store_dir), 2)
        return [CompileCache(tmp_path / f"{job}-{r}", fingerprint="m", precompile=True, store=store, rank=r,
                             share_secret=secret, share_timeout_s=30) for r in (0, 1)]

    old0, _ = ranks("job-a", "store-a")
    assert old0.save_precompiled(object()).written
    old0.publish_precompiled()
    recorded = dist.FileStore(str(tmp_path / "store-a"), 2).get(old0._share_key)
    _, new1 = ranks("job-b", "store-b")
    new1.store.set(new1._share_key, recorded)  # the replay: same model, same secret, another job
    with pytest.warns(CompileCacheWarning, match="does not verify"):
        result, fn, why = new1.receive_precompiled()
    assert fn is None and result.status == "untrusted" and not new1.precompiled_path.exists()
    _, same1 = ranks("job-a", "store-c")  # the same job (its next attempt) still takes rank 0's payload
    same1.store.set(same1._share_key, recorded)
    assert same1.receive_precompiled()[1] == ("loaded", b"artifact-bytes")
