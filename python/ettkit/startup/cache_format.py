"""The bytes of a compile cache file, and the strict checks a file read from disk must pass.

Both files of a :class:`~ettkit.startup.CompileCache` (the MegaCache file and the precompiled one) share one
layout::

    magic (8 bytes) | header length (uint32, little-endian) | header (JSON) | body

The body is the file's first section (torch's MegaCache blob, or the precompiled artifact) followed by the
compiled kernel files (:mod:`.compiled_kernels`); the header names the key, each section's size and the
body's XXH3-64, as every ettkit file format does. :func:`decode` treats a file as hostile: every size must add
up, every kernel path must stay inside Inductor's cache dir, and a damaged file raises ValueError naming what
is wrong (the cache reports it as "corrupt"). Whether the file belongs to this key is the cache's decision,
not the format's.

:func:`megacache_artifacts` decodes the artifact list inside a MegaCache blob (torch's own container) the
same strict way, and refuses a key that torch would turn into a path outside its cache dir.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
import struct
import time

from .. import _C
from .compiled_kernels import is_kernel_path

__all__ = ["MEGACACHE", "PRECOMPILED", "CacheFile", "FileKind", "decode", "encode", "megacache_artifacts"]

# 2: the body's checksum is XXH3-64 (body_xxh3), as in every ettkit file format; format 1's SHA-256 files
# read as a miss ("unsupported header") and are rewritten by the next save.
FORMAT = 2
_PREAMBLE = struct.Struct("<8sI")  # magic, header JSON length; then the JSON, then the payload


@dataclasses.dataclass(frozen=True)
class FileKind:
    """Which of the two files: its magic, and the header field that holds its first section's size."""

    magic: bytes
    section: str


MEGACACHE = FileKind(b"ETTKMEGA", "megacache_bytes")
PRECOMPILED = FileKind(b"ETTKPREC", "artifact_bytes")


@dataclasses.dataclass(frozen=True)
class CacheFile:
    """A decoded file: its header (checked: sizes, checksum, kernel paths) and its body."""

    header: dict
    body: bytes
    kind: FileKind

    @property
    def section_bytes(self) -> int:
        return self.header[self.kind.section]

    @property
    def section(self) -> bytes:
        """The first section: the MegaCache blob, or the precompiled artifact."""
        return self.body[: self.section_bytes]

    @property
    def kernels(self) -> list:
        """The kernel entries (``{"path", "bytes"}``), whose bytes follow the first section in the body."""
        return self.header.get("kernels", [])


def encode(
    kind: FileKind, key: str, key_fields: dict, section: bytes, kernels: list, extra: dict
) -> tuple[bytes, bytes]:
    """The bytes of a cache file and its body. ``kernels``: (relative path, bytes) of the kernel files to
    carry after ``section``; ``extra``: more header fields (artifact counts, sources, ...)."""
    body = section + b"".join(data for _, data in kernels)
    header = {
        "format": FORMAT,
        "key": key,
        "key_fields": key_fields,
        kind.section: len(section),
        "kernels": [{"path": rel, "bytes": len(data)} for rel, data in kernels],
        "body_bytes": len(body),
        "body_xxh3": _C.xxh3_hex(body),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    return _PREAMBLE.pack(kind.magic, len(header_bytes)) + header_bytes + body, body


def _header(data: bytes, kind: FileKind) -> tuple[dict, int]:
    """The header of ``data`` and where the body starts; ValueError for a preamble or header that is not one
    this ettkit writes."""
    if len(data) < _PREAMBLE.size:
        raise ValueError(f"file is {len(data)} bytes, shorter than the {_PREAMBLE.size}-byte preamble")
    magic, header_len = _PREAMBLE.unpack_from(data)
    if magic != kind.magic:
        raise ValueError(f"bad magic {magic!r} (expected {kind.magic!r}): not an ettkit compile cache")
    end = _PREAMBLE.size + header_len
    if end > len(data):
        raise ValueError(f"header of {header_len} bytes runs past the end of the {len(data)}-byte file")
    try:
        header = json.loads(data[_PREAMBLE.size : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(
            f"unsupported header (format {header.get('format') if isinstance(header, dict) else '?'}, "
            f"this ettkit reads format {FORMAT})"
        )
    return header, end


def _check_sections(header: dict, body: bytes, kind: FileKind) -> None:
    """ValueError unless the first section and the kernel entries are well formed and add up to the body."""
    kernels = header.get("kernels", [])
    first = header.get(kind.section)
    if not isinstance(first, int) or not isinstance(kernels, list) or first < 0:
        raise ValueError(f"header lacks {kind.section}/kernels")
    total = first
    for k in kernels:
        if not (
            isinstance(k, dict)
            and is_kernel_path(k.get("path"))
            and isinstance(k.get("bytes"), int)
            and k["bytes"] >= 0
        ):
            raise ValueError(f"bad kernel entry {k!r}")
        total += k["bytes"]
    if total != len(body):
        raise ValueError(f"sections add up to {total} bytes, the body has {len(body)}")


def decode(data: bytes, kind: FileKind) -> CacheFile:
    """The file ``data`` decoded and checked (preamble, header, body size and checksum, sections, kernel
    paths). Raises ValueError naming the first thing that is wrong."""
    header, end = _header(data, kind)
    body = data[end:]
    if len(body) != header.get("body_bytes"):
        raise ValueError(
            f"body is {len(body)} bytes, the header says {header.get('body_bytes')} (truncated write?)"
        )
    if _C.xxh3_hex(body) != header.get("body_xxh3"):
        raise ValueError("body checksum mismatch (XXH3-64)")
    _check_sections(header, body, kind)
    return CacheFile(header, body, kind)


# ---- MegaCache: the artifact list, checked before torch sees it ------------------------------------------
#
# torch.compiler.load_cache_artifacts(bytes) hands every artifact to its type's populate_cache(), which turns
# the artifact's key into a path under Inductor's cache dir: an "autotune" key is os.path.join(cache_dir(),
# key) (an absolute key replaces the cache dir altogether), an "inductor" / "aot_autograd" key a directory
# name, a "precompile" key a directory under cache_dir()/dynamo. The container is torch's
# AppendingByteSerializer (torch/utils/_appending_byte_serializer.py, torch/compiler/_cache.py; not a pickle):
#   crc32 (4 bytes, big-endian, of the rest) | version (uint64 = 1) |
#   per artifact type: type (str) | count (uint64) | count x (key (str), content (bytes))
# with str = uint64 length + base64 of the UTF-8 text and bytes = uint64 length + the bytes. Decoded here
# strictly (base64 without stray characters, UTF-8, every length inside the blob), so that torch's lenient
# decoder reads the same keys as this check.

_MEGACACHE_VERSION = 1
#: One file or directory name, as torch's own keys are (hashes, "<hash>.best_config", a PGO job key).
_ARTIFACT_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.:=+@,-]{0,254}"
#: Autotune keys are "<kernel directory>/<hash>.best_config" (the last two components of the local path:
#: AutotuneCache._artifact_key_from_local_cache_key), so exactly one "/" between two names; every other
#: type: one name.
_ARTIFACT_KEY = {"autotune": re.compile(rf"{_ARTIFACT_NAME}/{_ARTIFACT_NAME}")}
_ARTIFACT_KEY_DEFAULT = re.compile(_ARTIFACT_NAME)


class _Reader:
    """Strict reader of the AppendingByteSerializer fields: every length must lie inside the blob."""

    def __init__(self, data: bytes):
        self.data, self.i = memoryview(data), 0

    def uint64(self) -> int:
        if self.i + 8 > len(self.data):
            raise ValueError(f"MegaCache blob ends inside a length field at byte {self.i}")
        value = int.from_bytes(self.data[self.i : self.i + 8], "big")
        self.i += 8
        return value

    def bytes_(self) -> memoryview:
        size = self.uint64()
        if size > len(self.data) - self.i:
            raise ValueError(
                f"MegaCache field of {size} bytes at byte {self.i} runs past the end of the blob"
            )
        out = self.data[self.i : self.i + size]
        self.i += size
        return out

    def text(self) -> str:
        raw = self.bytes_()
        try:
            return base64.b64decode(bytes(raw), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ValueError(f"MegaCache text before byte {self.i} is not base64 of UTF-8 ({exc})") from None

    def done(self) -> bool:
        return self.i == len(self.data)


def megacache_artifacts(blob: bytes) -> list:
    """``[(type, key, content size), ...]`` of a MegaCache blob (what ``save_cache_artifacts()`` returns
    first), decoded strictly without unpickling or copying anything. Raises ValueError for a damaged blob,
    and for an artifact key that is not a plain name (see ``_ARTIFACT_KEY``): absolute, with "..", a
    backslash, NUL or a "/" (autotune: more than its one), or empty — torch would write such an artifact
    outside its cache dir."""
    if len(blob) < 12:
        raise ValueError(f"MegaCache blob of {len(blob)} bytes is shorter than its 12-byte preamble")
    # The leading CRC-32 is not checked here: the file's XXH3 already covers these bytes, torch checks the CRC
    # itself, and no CRC makes a key safe (a forger computes it). Skipping it halves the cost of this check.
    reader = _Reader(blob)
    reader.i = 4
    version = reader.uint64()
    if version != _MEGACACHE_VERSION:
        raise ValueError(f"MegaCache blob has encoding version {version}; ettkit reads {_MEGACACHE_VERSION}")
    out = []
    while not reader.done():
        kind = reader.text()
        count = reader.uint64()
        if count > (len(blob) - reader.i) // 16:  # each artifact has two length fields at least
            raise ValueError(f"MegaCache blob claims {count} {kind!r} artifacts, more than its bytes hold")
        rule = _ARTIFACT_KEY.get(kind, _ARTIFACT_KEY_DEFAULT)
        for _ in range(count):
            key = reader.text()
            size = len(reader.bytes_())
            if not rule.fullmatch(key) or ".." in key:
                raise ValueError(
                    f"MegaCache artifact key {key!r} (type {kind!r}) is not "
                    + ("<name>/<name>" if kind in _ARTIFACT_KEY else "one file name")
                    + " (no absolute path, '..', '\\', NUL or other '/'): torch would write it outside its "
                    "cache dir; refused"
                )
            out.append((kind, key, size))
    return out
