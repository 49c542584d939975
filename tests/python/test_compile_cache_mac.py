"""What the compile cache's HMACs cover besides the key and the body (docs/security.md, issue #68): the
payload's kind (rank 0's file, or why there is none) and the context it was sealed for (a job's Store, or the
shared compile cache). A genuine payload altered in either, or moved from one context to the other under the
same secret and key, must be refused before a byte of it is used.

torch's (de)serialization is replaced (as in test_startup_shared_cache.py): what was deserialized is
recorded, so each test can show that nothing was."""

from __future__ import annotations

import os

import pytest
from ettkit.startup import CompileCache, CompileCacheWarning
from ettkit.startup import cache_seal
from startup_helpers import fake_precompiled_serialization

SECRET = b"compile-cache-mac-test-secret-" + b"0123456789abcdef" * 2
KEY = "ettkit/precompiled/0123456789abcdef01234567"
SHARE_FILE, SHARE_FALLBACK = b"F", b"X"
MAGIC = b"ETTKSHR1"
KIND_AT = len(MAGIC) + 32  # after the magic and the HMAC-SHA256


class FakeFn:
    def source_info(self):
        return type("SourceInfo", (), {"inlined_sources": set()})()


@pytest.fixture
def fake_torch(monkeypatch):
    monkeypatch.setenv("ETTKIT_COMPILE_CACHE_SECRET", SECRET.decode())
    return fake_precompiled_serialization(monkeypatch)


def _flip_kind(payload: bytes) -> bytes:
    kind = payload[KIND_AT:KIND_AT + 1]
    assert kind in (SHARE_FILE, SHARE_FALLBACK), payload[:KIND_AT + 1]
    other = SHARE_FALLBACK if kind == SHARE_FILE else SHARE_FILE
    return payload[:KIND_AT] + other + payload[KIND_AT + 1:]


# ---- the payload's kind is under the MAC ----------------------------------------------------------------


@pytest.mark.parametrize("kind", [SHARE_FILE, SHARE_FALLBACK])
def test_a_genuine_payload_with_its_kind_flipped_does_not_unseal(kind):
    body = b"rank 0's precompiled file" if kind == SHARE_FILE else b"aot_compile failed: out of memory"
    for context in (cache_seal.JOB_CONTEXT, cache_seal.SHARED_CONTEXT):
        sealed = cache_seal.seal(SECRET, KEY, kind, body, context)
        assert cache_seal.unseal(SECRET, KEY, sealed, context) == (kind, body)
        with pytest.raises(ValueError, match="does not verify"):
            cache_seal.unseal(SECRET, KEY, _flip_kind(sealed), context)


def _store(tmp_path):
    import torch.distributed as dist

    return dist.FileStore(str(tmp_path / "store"), 2)


def _ranks(tmp_path):
    store = _store(tmp_path)
    rank0 = CompileCache(tmp_path / "cc0", fingerprint="m", precompile=True, store=store, rank=0, share_secret=SECRET)
    rank1 = CompileCache(
        tmp_path / "cc1", fingerprint="m", precompile=True, store=store, rank=1, share_secret=SECRET,
        share_timeout_s=30,
    )
    return store, rank0, rank1


def _refused_by_rank1(rank1, fake_torch):
    with pytest.warns(CompileCacheWarning, match="does not verify with this rank's share secret"):
        result, fn, why = rank1.receive_precompiled()
    assert fn is None and result.status == "untrusted", (result, why)
    assert why.startswith("rank 0's precompiled file was refused")  # so this rank compiles its own
    assert fake_torch == [] and not rank1.precompiled_path.exists()


def test_rank_0s_file_with_its_kind_flipped_in_the_store_is_refused_not_read_as_a_fallback(tmp_path, fake_torch):
    # Whoever can write the Store turns rank 0's real file into "rank 0 could not precompile: <the file's
    # bytes>" (or a real fallback into a file): the kind byte is not theirs to choose.
    store, rank0, rank1 = _ranks(tmp_path)
    assert rank0.save_precompiled(FakeFn()).written
    rank0.publish_precompiled()
    genuine = store.get(rank1._share_key)
    assert genuine[KIND_AT:KIND_AT + 1] == SHARE_FILE
    store.set(rank1._share_key, _flip_kind(genuine))
    _refused_by_rank1(rank1, fake_torch)
    # The untouched payload still loads: the refusal was the flipped byte's.
    store.set(rank1._share_key, genuine)
    result, fn, why = rank1.receive_precompiled()
    assert why is None and fn == "loaded-fn" and result.status == "precompiled"


def test_rank_0s_fallback_with_its_kind_flipped_is_refused_not_written_as_a_file(tmp_path, fake_torch):
    store, rank0, rank1 = _ranks(tmp_path)
    rank0.publish_precompiled(fallback_reason="aot_compile failed (a real reason)")
    genuine = store.get(rank1._share_key)
    store.set(rank1._share_key, _flip_kind(genuine))
    _refused_by_rank1(rank1, fake_torch)
    store.set(rank1._share_key, genuine)
    result, fn, why = rank1.receive_precompiled()
    assert fn is None and result.status == "miss" and why == "aot_compile failed (a real reason)"


# ---- the context is under the MAC: the job's Store and the shared cache never take each other's ----------


def test_a_payload_sealed_in_one_context_does_not_unseal_in_the_other_under_the_same_secret_and_key():
    job, shared = cache_seal.JOB_CONTEXT, cache_seal.SHARED_CONTEXT
    assert job != shared
    for kind in (SHARE_FILE, SHARE_FALLBACK):
        for sealed_for, offered_to in ((job, shared), (shared, job)):
            sealed = cache_seal.seal(SECRET, KEY, kind, b"the same body", sealed_for)
            assert cache_seal.unseal(SECRET, KEY, sealed, sealed_for) == (kind, b"the same body")
            with pytest.raises(ValueError, match="does not verify"):
                cache_seal.unseal(SECRET, KEY, sealed, offered_to)


def test_a_store_payload_planted_in_the_shared_cache_is_untrusted_under_the_same_secret(tmp_path, fake_torch):
    # A job whose share secret is also the fleet's cache secret: a payload sealed for a job's Store (the same
    # key and body a shared file would have) is not a shared-cache file.
    a = CompileCache(tmp_path / "a", fingerprint="m1", precompile=True)
    assert a.save_precompiled(FakeFn()).written
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    b = CompileCache(tmp_path / "b", fingerprint="m1", precompile=True, shared_dir=shared)
    body = a.precompiled_path.read_bytes()
    planted = cache_seal.seal(SECRET, b.key, SHARE_FILE, body, cache_seal.JOB_CONTEXT)
    (shared / b.shared_name).write_bytes(planted)
    with pytest.warns(CompileCacheWarning, match="does not verify with this job's cache secret"):
        result, fn = b.load_precompiled()
    assert fn is None and result.status == "untrusted"
    assert fake_torch == [] and not b.precompiled_path.exists()
    # Sealed for the shared cache, the same bytes load: the refusal was the context's.
    (shared / b.shared_name).write_bytes(cache_seal.seal(SECRET, b.key, SHARE_FILE, body, cache_seal.SHARED_CONTEXT))
    result, fn = b.load_precompiled()
    assert result.status == "precompiled" and fn == "loaded-fn"


def test_a_shared_cache_file_offered_through_the_store_is_untrusted_under_the_same_secret(tmp_path, fake_torch):
    store, rank0, rank1 = _ranks(tmp_path)
    assert rank0.save_precompiled(FakeFn()).written
    body = rank0.precompiled_path.read_bytes()
    store.set(rank1._share_key,
              cache_seal.seal(SECRET, rank1._share_key, SHARE_FILE, body, cache_seal.SHARED_CONTEXT))
    _refused_by_rank1(rank1, fake_torch)
    store.set(rank1._share_key, cache_seal.seal(SECRET, rank1._share_key, SHARE_FILE, body))
    result, fn, why = rank1.receive_precompiled()
    assert why is None and fn == "loaded-fn" and result.status == "precompiled"
