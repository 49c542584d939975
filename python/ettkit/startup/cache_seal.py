"""HMAC sealing of what a :class:`ettkit.startup.CompileCache` takes from others: rank 0's precompiled file
through a job's c10d Store (compile once per job) and the files of a shared compile cache.

Both hold pickles that run code as they load, and neither channel authenticates its writer (the Store has no
authentication; another user may own the shared directory). So each payload carries an HMAC-SHA256 keyed by a
secret given outside the channel, over its context (Store or shared cache), its key, its kind and its body,
and is verified before a byte of it is used. A payload is ``MAGIC | MAC | kind | body``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from ..errors import InvalidArgumentError

__all__ = [
    "CACHE_SECRET_ENV", "JOB_CONTEXT", "NO_SECRET", "SHARED_CONTEXT", "SHARE_FALLBACK", "SHARE_FILE",
    "SHARE_SECRET_ENV", "check_sealed_file", "mac_of", "read_secret", "read_share_secret", "seal", "unseal",
]

#: The pieces a shared-cache file's HMAC is streamed in before the file is read (check_sealed_file).
_HMAC_PIECE = 1 << 20
SHARE_SECRET_ENV = "ETTKIT_COMPILE_SHARE_SECRET"
# The shared compile cache's secret: the fleet's (whoever may fill the cache holds it), not one job's.
CACHE_SECRET_ENV = "ETTKIT_COMPILE_CACHE_SECRET"
_MIN_SECRET_BYTES = 32
# What a MAC is for, under the MAC: a payload one job published through its Store cannot pass for a shared
# cache file, nor the reverse.
JOB_CONTEXT = b"ettkit precompiled share v1"
SHARED_CONTEXT = b"ettkit shared compile cache v1"
_SHARE_MAGIC = b"ETTKSHR1"
SHARE_FILE, SHARE_FALLBACK = b"F", b"X"  # the payload's kind: rank 0's file, or why there is none
_MAC_BYTES = hashlib.sha256().digest_size
NO_SECRET = (
    "CompileCache(store=...) does not share the precompiled file through the Store: the Store has no "
    "authentication, and compile once per job needs a secret the ranks share outside it to sign what goes "
    f"through it. Set ${SHARE_SECRET_ENV} (32+ random bytes, the same on every rank: e.g. export "
    f"{SHARE_SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') in the job "
    "script before the launcher) or pass share_secret=. Each rank compiles or loads its own file meanwhile."
)


def read_secret(explicit: bytes | str | None, env: str = SHARE_SECRET_ENV, argument: str = "share_secret=",
                who: str = "set once by the launcher for every rank") -> tuple[bytes | None, str]:
    """A secret (``explicit``, else ``$env``) and where it came from. Raises InvalidArgumentError for one
    shorter than 32 bytes: a short secret is a configuration mistake."""
    source = argument
    if explicit is None:
        explicit, source = os.environ.get(env) or None, f"${env}"
    if explicit is None:
        return None, ""
    secret = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
    if len(secret) < _MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"the compile cache secret from {source} is {len(secret)} bytes; it must be at least "
            f"{_MIN_SECRET_BYTES} random bytes, e.g. {env}=$(python -c 'import secrets; "
            f"print(secrets.token_hex(32))') {who}"
        )
    return secret, source


def read_share_secret(explicit: bytes | str | None) -> tuple[bytes | None, str]:
    """The job's share secret (``share_secret=``, else $ETTKIT_COMPILE_SHARE_SECRET) and where it came from."""
    return read_secret(explicit)


def mac_of(secret: bytes, share_key: str, kind: bytes, context: bytes, nonce: bytes = b"") -> Any:
    """The HMAC of a sealed payload before its body is fed. The key is under the MAC: a payload published
    for one model cannot be replayed under another; so is `nonce` when there is one (the job's run id, for
    the Store: a payload of another job sharing the secret is refused), length-prefixed."""
    head = context + b"\0" + share_key.encode() + b"\0" + kind
    if nonce:
        head += b"\0nonce" + len(nonce).to_bytes(4, "little") + nonce
    return hmac.new(secret, head, hashlib.sha256)


def _share_mac(secret: bytes, share_key: str, kind: bytes, body: bytes, context: bytes = JOB_CONTEXT,
               nonce: bytes = b"") -> bytes:
    mac = mac_of(secret, share_key, kind, context, nonce)
    mac.update(body)
    return mac.digest()


def seal(secret: bytes, share_key: str, kind: bytes, body: bytes, context: bytes = JOB_CONTEXT,
         nonce: bytes = b"") -> bytes:
    return _SHARE_MAGIC + _share_mac(secret, share_key, kind, body, context, nonce) + kind + body


def _no_mac(context: bytes) -> ValueError:
    """The refusal of a payload that is not sealed at all (for a job's Store, or the shared cache)."""
    return ValueError(
        "carries no ettkit HMAC ("
        + ("not published by an ettkit rank with a share secret)" if context == JOB_CONTEXT else "not written "
           f"by ettkit with ${CACHE_SECRET_ENV} set)")
    )


def _bad_mac(context: bytes) -> ValueError:
    """The refusal of a payload whose HMAC does not verify."""
    if context == JOB_CONTEXT:
        return ValueError(
            f"has an HMAC-SHA256 that does not verify with this rank's share secret (${SHARE_SECRET_ENV} or "
            "share_secret=): it was not published by a rank of this job, or the ranks' secrets differ"
        )
    return ValueError(
        f"has an HMAC-SHA256 that does not verify with this job's cache secret (${CACHE_SECRET_ENV} or "
        "shared_secret=) for this key: it was written by someone without the secret, for another key, or "
        "with another secret"
    )


def unseal(secret: bytes, share_key: str, payload: bytes, context: bytes = JOB_CONTEXT,
           nonce: bytes = b"") -> tuple[bytes, memoryview]:
    """``(kind, body)`` of a sealed payload (the body a view into ``payload``: a precompiled file is not
    copied to be verified); ValueError, before anything of it is used, when it is not one this secret sealed
    under this key for this ``context`` (a job's Store, or the shared cache)."""
    head = len(_SHARE_MAGIC) + _MAC_BYTES + 1
    if len(payload) < head or not payload.startswith(_SHARE_MAGIC):
        raise _no_mac(context)
    mac = payload[len(_SHARE_MAGIC) : len(_SHARE_MAGIC) + _MAC_BYTES]
    kind, body = payload[head - 1 : head], memoryview(payload)[head:]
    if kind not in (SHARE_FILE, SHARE_FALLBACK) or not hmac.compare_digest(
        mac, _share_mac(secret, share_key, kind, body, context, nonce)
    ):
        raise _bad_mac(context)
    return kind, body


def check_sealed_file(secret: bytes, share_key: str, fd: int, size: int) -> None:
    """Verifies the HMAC of the sealed shared-cache file open as ``fd`` (``size`` bytes) by streaming it in
    pieces, before it is read into memory: a file someone without the secret planted (sparse, gigabytes)
    costs one pass at hashing speed and no memory, not its size in RSS. Raises ValueError as
    :func:`unseal` does. The caller unseals the bytes it then reads too (the file could change between)."""
    head = len(_SHARE_MAGIC) + _MAC_BYTES + 1
    start = os.pread(fd, head, 0)
    if len(start) < head or not start.startswith(_SHARE_MAGIC):
        raise _no_mac(SHARED_CONTEXT)
    kind = start[head - 1 : head]
    mac = mac_of(secret, share_key, kind, SHARED_CONTEXT)
    buf = bytearray(_HMAC_PIECE)
    view = memoryview(buf)
    offset = head
    while offset < size:
        n = os.preadv(fd, [view[: min(_HMAC_PIECE, size - offset)]], offset)
        if n <= 0:
            break
        mac.update(view[:n])
        offset += n
    if kind not in (SHARE_FILE, SHARE_FALLBACK) or not hmac.compare_digest(
        start[len(_SHARE_MAGIC) : len(_SHARE_MAGIC) + _MAC_BYTES], mac.digest()
    ):
        raise _bad_mac(SHARED_CONTEXT)

