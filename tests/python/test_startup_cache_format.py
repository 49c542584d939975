"""The compile cache's file format (ettkit.startup.cache_format) and kernel restore
(ettkit.startup.compiled_kernels) as units of their own, without a CompileCache around them: what
CompileCache relies on when it reports a file "corrupt" or restores kernels."""

from __future__ import annotations

import pytest

from ettkit.startup import cache_format, compiled_kernels
from ettkit.startup.cache_format import MEGACACHE, PRECOMPILED

KEY_FIELDS = {"torch": "2.x", "fingerprint": "model-v1"}
KERNEL = ("ab/cabxyz.main.so", b"\x7fELF kernel bytes")


def _file(kind=MEGACACHE, kernels=(KERNEL,), extra=None) -> bytes:
    data, _ = cache_format.encode(kind, "key-1", KEY_FIELDS, b"section bytes", list(kernels), extra or {})
    return data


def test_a_file_decodes_to_what_was_encoded():
    data, body = cache_format.encode(
        PRECOMPILED, "key-1", KEY_FIELDS, b"artifact", [KERNEL], {"sources": ["m:1-2"]}
    )
    file = cache_format.decode(data, PRECOMPILED)
    assert file.body == body == b"artifact" + KERNEL[1]
    assert file.section == b"artifact" and file.section_bytes == 8
    assert file.kernels == [{"path": KERNEL[0], "bytes": len(KERNEL[1])}]
    assert file.header["key"] == "key-1" and file.header["key_fields"] == KEY_FIELDS
    assert file.header["sources"] == ["m:1-2"] and file.header["format"] == cache_format.FORMAT


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[:5], "shorter than the 12-byte preamble"),
        (lambda d: b"ETTKPREC" + d[8:], "bad magic b'ETTKPREC'"),
        (lambda d: d[:-1], "truncated write"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
        (lambda d: d[:12] + b"x" + d[13:], "header is not JSON"),
    ],
    ids=["short", "magic", "truncated", "flipped", "header"],
)
def test_a_damaged_file_raises_naming_what_is_wrong(damage, message):
    with pytest.raises(ValueError, match=message):
        cache_format.decode(damage(_file()), MEGACACHE)


def test_a_kernel_path_outside_inductors_cache_dir_or_sizes_that_do_not_add_up_are_refused():
    # Both are well-formed, checksummed files, as a hostile writer would make them.
    with pytest.raises(ValueError, match="bad kernel entry .*evil"):
        cache_format.decode(_file(kernels=[("../../evil.so", b"x")]), MEGACACHE)
    with pytest.raises(ValueError, match="sections add up to 18 bytes, the body has 30"):
        cache_format.decode(_file(extra={"megacache_bytes": 1}), MEGACACHE)
    paths = ("ab/c.so", "/ab/c.so", "a/c.so", "ab/c/d", "ab/../x", 3)
    assert [compiled_kernels.is_kernel_path(p) for p in paths] == [True, False, False, False, False, False]


def test_restore_kernels_writes_missing_kernels_into_the_given_dir_only(tmp_path):
    root = tmp_path / "inductor"
    kernels = [KERNEL, ("cd/other.so", b"2")]
    data, _ = cache_format.encode(MEGACACHE, "k", KEY_FIELDS, b"mega", kernels, {})
    file = cache_format.decode(data, MEGACACHE)
    assert compiled_kernels.restore_kernels(file.kernels, file.body, file.section_bytes, root) == 2
    assert (root / "ab" / "cabxyz.main.so").read_bytes() == KERNEL[1]
    assert (root / "cd" / "other.so").read_bytes() == b"2"
    assert (root / "ab" / "cabxyz.main.so").stat().st_mode & 0o777 == 0o600
    # A kernel already there is not rewritten.
    assert compiled_kernels.restore_kernels(file.kernels, file.body, file.section_bytes, root) == 0
