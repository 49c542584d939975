"""``.extra`` records assembled by hand, as the writer of a hostile checkpoint would: the decoder's tests feed it
bytes the encoder did not make (shared by the security, limit and bound tests)."""

from __future__ import annotations

from ettkit.checkpoint._skeleton_codec import MAGIC


def varint(n: int) -> bytes:
    """The format's unsigned LEB128 length."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def record(extra: bytes = b"N", skeleton: bytes = b"N", world: bytes = b"i" + (1).to_bytes(8, "little"),
           fields: list | None = None) -> bytes:
    """A current-format record of the given encoded field values (world size 1 unless ``world``), or of
    ``fields`` as (name, encoded value) pairs in that order."""
    fields = fields if fields is not None else [("world_size", world), ("skeleton", skeleton), ("extra", extra)]
    body = b"d" + varint(len(fields))
    for name, value in fields:
        body += b"s" + varint(len(name)) + name.encode() + value
    return MAGIC + body
