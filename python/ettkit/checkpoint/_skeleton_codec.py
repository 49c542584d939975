"""The reader of the ``rank-<r>.extra`` record (its format: _extra_format.py) and the codec's entry points:
:func:`decode_extra` here, :func:`encode_skeleton`/:func:`encode_extra` from the writer (_extra_encode.py).
The decoder is strict and bounded: every length is checked against the bytes left before anything is
allocated, and every value counts toward :data:`MAX_NODES`.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any, Optional

import torch

from ..errors import CorruptDataError, InvalidArgumentError
from ._extra_encode import encode_extra, encode_skeleton
from ._extra_format import (  # the format's constants, tags and shared checks
    ARRAY_DTYPES, C128, DEVICE_RE, DTYPES, F64, I64, MAGIC, MAGIC_PICKLE, MAGIC_PREFIX, MAX_ARRAYS, MAX_DEPTH,
    MAX_KEYS_PER_HASH, MAX_NODES, MAX_RECORD_BYTES, OPT_IN, Bad, EncodedSkeleton, ExtraRecord, NeedsOptIn,
    count_values, field_name, sharded_slot_of, TAG_ARRAY, TAG_BIGINT, TAG_BYTES, TAG_COMPLEX, TAG_DEVICE, TAG_DICT,
    TAG_DTYPE, TAG_FALSE, TAG_FLOAT, TAG_INT, TAG_INTS, TAG_KEYS, TAG_KEYS_AGAIN, TAG_LIST, TAG_NONE, TAG_PICKLE,
    TAG_SHARDED, TAG_SIZE, TAG_SLOT, TAG_STR, TAG_TRUE, TAG_TUPLE
)
from ._restricted_unpickler import RestrictedUnpickler
from ._tensor_kinds import TENSOR, ShardedSlot

# The codec's entry points and the format's constants, for the checkpointer and the tests.
__all__ = ["EncodedSkeleton", "ExtraRecord", "MAGIC", "MAGIC_PICKLE", "MAX_ARRAYS", "MAX_DEPTH", "MAX_KEYS_PER_HASH",
           "MAX_NODES", "MAX_RECORD_BYTES", "RestrictedUnpickler", "decode_extra", "encode_extra", "encode_skeleton"]

# ---- reading ---------------------------------------------------------------------------------------------
class _Decoder:
    """Decodes one value from ``buf`` starting at ``pos`` (after the magic line: offsets in errors are the
    file's), counting values against MAX_NODES."""

    __slots__ = ("buf", "mv", "pos", "end", "nodes", "arrays", "allow_pickle", "key_sets", "names")

    def __init__(self, buf: bytes, pos: int, allow_pickle: bool):
        self.buf, self.mv = buf, memoryview(buf)
        self.pos, self.end = pos, len(buf)
        self.nodes = self.arrays = 0
        self.names: dict = {}  # the encoded dtypes, devices and sizes met, tag included -> their object
        self.allow_pickle = allow_pickle
        self.key_sets: list = []  # the keys of each K dict read, in order, for R

    def room(self, n: int) -> None:
        """Refuses a container of ``n`` more values when the record could then hold more than MAX_NODES:
        checked before they are decoded, so that memory stays bounded by the count, not the bytes."""
        if self.nodes + n > MAX_NODES:
            raise self.bad(f"the record holds more than {MAX_NODES} values")

    def bad(self, why: str, at: Optional[int] = None) -> Bad:
        return Bad(why, self.pos if at is None else at)

    def length(self, what: str, unit: int = 1) -> int:
        """A varint count of items of at least ``unit`` bytes each, checked against the bytes left."""
        buf, pos = self.buf, self.pos
        n = shift = 0
        while True:
            if pos >= self.end:
                raise self.bad(f"the {what} is cut off")
            b = buf[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
            if shift > 63:
                raise self.bad(f"the {what} is not a valid varint")
        if n * unit > self.end - pos:
            raise self.bad(f"the {what} says {n}, more than the {self.end - pos} bytes left hold")
        self.pos = pos
        return n

    def take(self, n: int) -> int:
        """Advances past ``n`` bytes (already checked to be there); returns where they start."""
        p = self.pos
        self.pos = p + n
        return p

    def fixed(self, n: int, what: str) -> int:
        if self.end - self.pos < n:
            raise self.bad(f"the {what} is cut off")
        return self.take(n)

    def text(self, what: str) -> str:
        n = self.length(f"{what}'s length")
        p = self.take(n)
        try:
            return str(self.mv[p:p + n], "utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise self.bad(f"the {what} is not UTF-8 ({e.reason})", p) from None

    def value(self, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.bad(f"the record holds more than {MAX_NODES} values")
        pos = self.pos
        if pos >= self.end:
            raise self.bad("the record is cut off")
        tag = self.buf[pos]
        self.pos = pos + 1
        if tag == TAG_SLOT:
            return TENSOR
        if tag == TAG_STR:
            return self.text("str")
        if tag == TAG_DICT:
            return self.dict(depth)
        if tag == TAG_KEYS_AGAIN or tag == TAG_KEYS:
            if depth >= MAX_DEPTH:
                raise self.bad(f"the record nests deeper than {MAX_DEPTH} levels")
            return self.placeholders(pos) if tag == TAG_KEYS else self.again(pos)
        if tag == TAG_INTS:
            n = self.length("int list's count", 8)
            self.room(n)
            self.nodes += n
            return list(struct.unpack_from(f"<{n}q", self.buf, self.take(8 * n)))
        if tag == TAG_INT:
            return I64.unpack_from(self.buf, self.fixed(8, "int"))[0]
        if tag == TAG_LIST or tag == TAG_TUPLE:
            if depth >= MAX_DEPTH:
                raise self.bad(f"the record nests deeper than {MAX_DEPTH} levels")
            n = self.length("list's count")
            self.room(n)
            items = self.items(n, depth)
            return items if tag == TAG_LIST else tuple(items)
        leaf = _LEAVES.get(tag)  # the rarer tags, one lookup instead of a test each
        if leaf is None:
            raise self.bad(f"unknown tag {tag:#04x}", pos)
        return leaf(self, pos, depth)

    # ---- the rarer tags (_LEAVES); `pos` is the tag's offset, self.pos the payload's ----
    def _float(self, pos: int, depth: int) -> float:
        return F64.unpack_from(self.buf, self.fixed(8, "float"))[0]

    def _bigint(self, pos: int, depth: int) -> int:
        n = self.length("int's length")
        p = self.take(n)
        return int.from_bytes(self.mv[p:p + n], "little", signed=True)

    def _complex(self, pos: int, depth: int) -> complex:
        return complex(*C128.unpack_from(self.buf, self.fixed(16, "complex")))

    def _bytes(self, pos: int, depth: int) -> bytes:
        n = self.length("bytes' length")
        p = self.take(n)
        return self.buf[p:p + n]

    def _named(self, pos: int, depth: int) -> Any:
        """A dtype or a device by its name: decoded and checked once per distinct name of the record, then
        looked up (a record may hold MAX_NODES, 2^20, of them)."""
        tag = self.buf[pos]
        n = self.length("name's length")
        p = self.take(n)
        key = self.buf[pos:p + n]
        obj = self.names.get(key)
        if obj is None:
            self.pos = pos + 1
            obj = self.names[key] = self._dtype(pos) if tag == TAG_DTYPE else self._device(pos)
        return obj

    def _dtype(self, pos: int) -> torch.dtype:
        name = self.text("dtype")
        d = DTYPES.get(name)
        if d is None:
            raise self.bad(f"'{name[:64]}' is not a torch dtype", pos)
        return d

    def _device(self, pos: int) -> torch.device:
        name = self.text("device")
        if not DEVICE_RE.match(name):
            raise self.bad(f"'{name[:64]}' is not a device name", pos)
        try:
            return torch.device(name)
        except RuntimeError:
            raise self.bad(f"'{name}' is not a device this torch knows", pos) from None

    def _size(self, pos: int, depth: int) -> torch.Size:
        n = self.length("torch.Size's count", 9)
        p = self.pos
        if self.buf[p:p + 9 * n:9] == b"i" * n:  # every dim an int64, as the encoder writes them: looked up
            self.room(n)
            self.nodes += n
            self.pos = p + 9 * n
            key = self.buf[pos:p + 9 * n]
            size = self.names.get(key)
            if size is None:
                size = self.names[key] = torch.Size(struct.unpack_from("<" + "xq" * n, self.buf, p))
            return size
        dims = [self.value(depth + 1) for _ in range(n)]
        if any(type(d) is not int for d in dims):
            raise self.bad("a torch.Size holds a value that is not an int", pos)
        return torch.Size(dims)

    def _sharded(self, pos: int, depth: int) -> ShardedSlot:
        return sharded_slot_of(self.value(depth + 1), lambda why: self.bad(why, pos))

    def _pickled(self, pos: int, depth: int) -> Any:
        n = self.length("pickle's length")
        p = self.take(n)
        if not self.allow_pickle:
            raise NeedsOptIn("a pickled object is stored here", pos)
        try:
            obj = RestrictedUnpickler(io.BytesIO(self.buf[p:p + n])).load()
        except (pickle.UnpicklingError, Bad) as e:
            raise self.bad(f"the pickled object does not load: {e}", pos) from None
        except Exception as e:  # noqa: BLE001 - an allowed constructor refusing its arguments
            raise self.bad(f"the pickled object does not load: {type(e).__name__}: {e}", pos) from None
        self.nodes += count_values(obj, depth, MAX_NODES - self.nodes, lambda why: self.bad(why, pos))
        return obj

    def key_hash(self, k: Any, same_hash: Optional[dict], pos: int) -> dict:
        """Counts a dict key that is not a str or an int64 under its hash (``same_hash``: the dict's counts so
        far, None before its first such key), refusing the dict past MAX_KEYS_PER_HASH keys of one hash."""
        try:
            h = hash(k)
        except TypeError:
            raise Bad(f"a dict key is a {type(k).__name__}, which cannot be a key", pos) from None
        if same_hash is None:
            same_hash = {}
        c = same_hash[h] = same_hash.get(h, 0) + 1
        if c > MAX_KEYS_PER_HASH:
            raise Bad(f"a dict holds more than {MAX_KEYS_PER_HASH} keys of type {type(k).__name__} that share "
                       f"one hash value (their decoding would take quadratic time); a checkpoint's keys are "
                       f"str and int", pos)
        return same_hash

    def dict(self, depth: int) -> dict:
        if depth >= MAX_DEPTH:
            raise self.bad(f"the record nests deeper than {MAX_DEPTH} levels")
        n = self.length("dict's count", 2)
        self.room(2 * n)
        start = self.pos
        out: dict = {}
        # The common entries (a short str or an int key; a placeholder, an int, a key set read before) are
        # decoded inline, with the position in a local: a state's skeleton is mostly such entries, and a call
        # per value doubles the time.
        buf, mv, end, value, key_sets = self.buf, self.mv, self.end, self.value, self.key_sets
        inner = depth + 1 < MAX_DEPTH
        pos = start
        k: Any = None
        same_hash: Optional[dict] = None  # the hashes of keys other than str and int64 (key_hash)
        try:
            for _ in range(n):
                k = None
                tag = buf[pos] if pos + 1 < end else -1
                if tag == TAG_STR and buf[pos + 1] < 0x80:
                    q = pos + 2 + buf[pos + 1]
                    if q > end:
                        raise Bad("a key is cut off", pos)
                    try:
                        k = str(mv[pos + 2:q], "utf-8", "surrogatepass")
                    except UnicodeDecodeError as e:
                        raise Bad(f"a key is not UTF-8 ({e.reason})", pos) from None
                    self.nodes += 1
                    pos = q
                elif tag == TAG_INT and pos + 9 <= end:
                    k = I64.unpack_from(buf, pos + 1)[0]
                    self.nodes += 1
                    pos += 9
                else:
                    self.pos = pos
                    k = value(depth + 1)
                    same_hash = self.key_hash(k, same_hash, pos)
                    pos = self.pos
                tag = buf[pos] if pos < end else -1
                if tag == TAG_SLOT:
                    self.nodes += 1
                    pos += 1
                    out[k] = TENSOR
                elif tag == TAG_INT and pos + 9 <= end:
                    self.nodes += 1
                    out[k] = I64.unpack_from(buf, pos + 1)[0]
                    pos += 9
                elif tag == TAG_KEYS_AGAIN and inner and pos + 1 < end and buf[pos + 1] < len(key_sets) \
                        and buf[pos + 1] < 0x80:
                    keys = key_sets[buf[pos + 1]]
                    self.nodes += 1
                    self.room(2 * len(keys))
                    self.nodes += 2 * len(keys)
                    out[k] = dict.fromkeys(keys, TENSOR)
                    pos += 2
                else:
                    self.pos = pos
                    out[k] = value(depth + 1)
                    pos = self.pos
        except Bad as e:
            e.path.append("?" if k is None else k)
            raise
        self.pos = pos
        if len(out) != n:
            raise self.bad(f"a dict of {n} entries repeats a key ({len(out)} distinct)", start)
        return out

    def again(self, pos: int) -> dict:
        """An R dict: the placeholders under a key set read before."""
        i = self.length("key set number", 0)
        if i >= len(self.key_sets):
            raise self.bad(f"key set {i} is referred to before it is defined ({len(self.key_sets)} are)", pos)
        keys = self.key_sets[i]
        self.room(2 * len(keys))
        self.nodes += 2 * len(keys)
        return dict.fromkeys(keys, TENSOR)

    def placeholders(self, pos: int) -> dict:
        """A K dict: its keys cut from one decoded string by their lengths, each value the placeholder."""
        n = self.length("key count", 5)
        self.room(2 * n)
        p = self.take(4 * n)
        lengths = struct.unpack_from(f"<{n}I", self.buf, p)
        nbytes = self.length("keys' byte length")
        p = self.take(nbytes)
        try:
            text = str(self.mv[p:p + nbytes], "utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise self.bad(f"the keys are not UTF-8 ({e.reason})", p) from None
        if sum(lengths) != len(text):
            raise self.bad(f"the keys' lengths add up to {sum(lengths)}, not the {len(text)} code points stored", pos)
        keys, at = [], 0
        for n_chars in lengths:
            keys.append(text[at:at + n_chars])
            at += n_chars
        out = dict.fromkeys(keys, TENSOR)
        if len(out) != n:
            raise self.bad(f"a dict of {n} entries repeats a key ({len(out)} distinct)", pos)
        self.nodes += 2 * n
        self.key_sets.append(tuple(keys))
        return out

    def items(self, n: int, depth: int) -> list:
        """The ``n`` values of a list or tuple; ints and placeholders inline, as in :meth:`dict`."""
        buf, end, value = self.buf, self.end, self.value
        pos = self.pos
        items: list = []
        append = items.append
        i = 0
        try:
            for i in range(n):
                tag = buf[pos] if pos < end else -1
                if tag == TAG_INT and pos + 9 <= end:
                    self.nodes += 1
                    append(I64.unpack_from(buf, pos + 1)[0])
                    pos += 9
                elif tag == TAG_SLOT:
                    self.nodes += 1
                    append(TENSOR)
                    pos += 1
                elif tag == TAG_NONE:
                    self.nodes += 1
                    append(None)
                    pos += 1
                else:
                    self.pos = pos
                    append(value(depth + 1))
                    pos = self.pos
        except Bad as e:
            e.path.append(i)
            raise
        self.pos = pos
        return items

    def array(self, pos: int, depth: int = 0) -> torch.Tensor:
        self.arrays += 1
        if self.arrays > MAX_ARRAYS:
            raise self.bad(f"the record stores more than {MAX_ARRAYS} tensors as bytes", pos)
        name = self.text("tensor's dtype")
        dtype = DTYPES.get(name)
        if dtype not in ARRAY_DTYPES:
            raise self.bad(f"'{name[:64]}' is not a dtype a stored tensor may have", pos)
        ndim = self.length("tensor's dimension count")
        if ndim > 64:
            raise self.bad(f"a stored tensor has {ndim} dimensions, more than 64", pos)
        shape = [self.length("tensor's size", 0) for _ in range(ndim)]
        if any(s >= 1 << 62 for s in shape):
            raise self.bad(f"a stored tensor has a size in {shape} of 2^62 or more", pos)
        nbytes = self.length("tensor's byte length")
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize != nbytes:
            raise self.bad(f"a {name} tensor of shape {shape} takes {numel * dtype.itemsize} bytes, not {nbytes}",
                           pos)
        p = self.take(nbytes)
        try:
            if not nbytes:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(self.mv[p:p + nbytes]), dtype=dtype).reshape(shape)
        except RuntimeError as e:  # a shape torch refuses (sizes whose product overflows, with a 0 among them)
            raise self.bad(f"a stored tensor of shape {shape[:8]} cannot be built ({e})", pos) from None


_LEAVES = {
    TAG_NONE: lambda d, pos, depth: None, TAG_TRUE: lambda d, pos, depth: True, TAG_FALSE: lambda d, pos, depth: False,
    TAG_FLOAT: _Decoder._float, TAG_BIGINT: _Decoder._bigint, TAG_COMPLEX: _Decoder._complex, TAG_BYTES: _Decoder._bytes,
    TAG_DTYPE: _Decoder._named, TAG_DEVICE: _Decoder._named, TAG_SIZE: _Decoder._size, TAG_SHARDED: _Decoder._sharded,
    TAG_ARRAY: _Decoder.array, TAG_PICKLE: _Decoder._pickled,
}


# ---- the record --------------------------------------------------------------------------------------------
def decode_extra(blob: bytes, where: str, *, allow_pickle: bool) -> Optional[ExtraRecord]:
    """The record of a ``rank-<r>.extra`` (``where`` names it in errors); ``None`` for the C++ checkpointer's
    opaque bytes. A record that does not decode raises :class:`CorruptDataError`; a first-format (pickle)
    record, or one holding a pickled leaf, raises :class:`InvalidArgumentError` naming ``allow_pickle=True``
    unless it is given (then it goes through :class:`RestrictedUnpickler`)."""
    if not blob.startswith(MAGIC_PREFIX):
        return None
    if blob.startswith(MAGIC_PICKLE):
        return _decode_pickled(blob, where, allow_pickle)
    if not blob.startswith(MAGIC):
        end = blob.find(b"\n", 0, 40)
        line = bytes(blob[:end if end >= 0 else 40])
        raise CorruptDataError(f"{where} starts with {line!r}: a format this ettkit does not know (it reads "
                               f"{MAGIC[:-1]!r} and, with allow_pickle=True, {MAGIC_PICKLE[:-1]!r}); written by a "
                               f"newer ettkit?")
    if len(blob) - len(MAGIC) > MAX_RECORD_BYTES:
        raise CorruptDataError(f"{where} holds a {len(blob) - len(MAGIC)}-byte record; a record takes at most "
                               f"{MAX_RECORD_BYTES}")
    d = _Decoder(bytes(blob), len(MAGIC), allow_pickle)
    try:
        record = d.value(0)
        if d.pos != d.end:
            raise d.bad(f"{d.end - d.pos} bytes follow the record")
        if type(record) is not dict:
            raise Bad(f"the record is a {type(record).__name__}, not a dict of fields", len(MAGIC))
        for field in record:
            if field not in ("world_size", "skeleton", "extra", "rng"):
                raise Bad(f"unknown field {field!r} (a record has 'world_size', 'skeleton', 'extra' and "
                           "optionally 'rng')",
                           len(MAGIC))
        for field in ("world_size", "skeleton", "extra"):
            if field not in record:
                raise Bad(f"the field '{field}' is missing", len(MAGIC))
        world = record["world_size"]
        if type(world) is not int or not 1 <= world <= 1 << 24:
            raise Bad(f"world_size is {world!r}, not a world size in [1, 2^24]", len(MAGIC))
    except NeedsOptIn as e:
        raise InvalidArgumentError(
            f"{where}: {field_name(e.path[::-1])} holds a pickled object, and pickles load only with {OPT_IN}: "
            f"pass it if you trust whoever can write this checkpoint directory (pickles then load through an "
            f"allow-list; docs/checkpoint.md)") from None
    except Bad as e:
        at = f" ({field_name(e.path[::-1])})" if e.path else ""
        raise CorruptDataError(f"{where} does not decode at byte {e.pos}{at}: {e.why}") from None
    return ExtraRecord(record["skeleton"], record["extra"], world, record.get("rng"))


def _decode_pickled(blob: bytes, where: str, allow_pickle: bool) -> ExtraRecord:
    """A first-format record: a pickle of ``{"skeleton_pickle": bytes, "extra": ..., "world_size": int}``
    whose skeleton is a pickle itself. Read only under the opt-in, through the restricted unpickler."""
    if not allow_pickle:
        raise InvalidArgumentError(
            f"{where} is in ettkit's former format, a pickle, which loads only with {OPT_IN}: pass it if you "
            f"trust whoever can write this checkpoint directory (the pickle then loads through an allow-list; "
            f"the next save writes the current, pickle-free format)")
    body = memoryview(blob)[len(MAGIC_PICKLE):]
    if len(body) > MAX_RECORD_BYTES:
        raise CorruptDataError(f"{where} holds a {len(body)}-byte record; a record takes at most {MAX_RECORD_BYTES}")

    def bad(why: str) -> CorruptDataError:
        return CorruptDataError(f"{where} (a pickle, former format) does not load: {why}")

    def load(data: Any) -> Any:
        try:
            return RestrictedUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            raise bad(str(e)) from None
        except Exception as e:  # noqa: BLE001 - truncated data, an allowed constructor refusing its arguments
            raise bad(f"{type(e).__name__}: {e}") from None

    payload = load(body)
    if not (type(payload) is dict and type(payload.get("skeleton_pickle")) is bytes and "extra" in payload):
        raise bad(f"the record is a {type(payload).__name__}, not a dict with 'skeleton_pickle' and 'extra'")
    world = payload.get("world_size")
    if world is not None and (type(world) is not int or not 1 <= world <= 1 << 24):
        raise bad(f"world_size is {world!r}, not a world size")
    skeleton = load(payload["skeleton_pickle"])
    nodes = count_values(skeleton, 0, MAX_NODES, bad)
    count_values(payload["extra"], 0, MAX_NODES - nodes, bad)
    return ExtraRecord(skeleton, payload["extra"], world)
