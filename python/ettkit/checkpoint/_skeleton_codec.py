"""The data format of ``rank-<r>.extra``: a step's non-tensor state (the skeleton of the state dict, the
``extra=`` value and the world size it was saved at), written and read without pickle.

A record is a magic line, then one tagged value: a dict of exactly three fields, ``world_size`` (an int),
``skeleton`` and ``extra``. Each value is a one-byte tag and its payload; lengths and counts are unsigned
LEB128 varints; fixed-width numbers are little-endian::

    N  None                  T / F  True / False
    i  int in [-2^63, 2^63)  8 bytes          I  any other int: length, two's complement bytes
    f  float                 8 bytes (IEEE 754 binary64: nan, inf and -0.0 exact)
    c  complex               16 bytes         s  str: length, UTF-8   b  bytes: length, bytes
    l / t  list / tuple      count, values    d  dict: count, (key, value) pairs in insertion order
    S  torch.Size            count, ints      D  torch.dtype: its name    V  torch.device: str(device)
    X  the skeleton's tensor placeholder (the tensor itself is in rank-<r>.safetensors)
    K  a dict of str keys whose values are all X (a module's state dict, a parameter's optimizer state):
       count, each key's length in code points (4 bytes each), byte length, the keys' UTF-8 concatenated;
       its key set is numbered (0, 1, ... in order of appearance in the record)
    R  a dict like K whose keys are those of K key set number n: n
    J  a list of ints in [-2^63, 2^63): count, 8 bytes each
    H  a ShardedTensor's record (ShardedSlot): the tuple (size, dtype, shards)
    A  a tensor held in extra=: dtype name, dims, byte length, the bytes (loaded as a CPU tensor)
    P  a pickled leaf: length, pickle bytes (written only by a checkpointer with allow_pickle=True)

The decoder is strict: an unknown tag or field, a length past the end, a duplicate dict key, trailing bytes,
more than :data:`MAX_DEPTH` levels of nesting, more than :data:`MAX_NODES` values or a record larger than
:data:`MAX_RECORD_BYTES` raise :class:`ettkit.CorruptDataError` naming the field and the byte offset; every
length is checked against the bytes left before anything is allocated, so a hostile record costs at most
its own size plus what its (bounded number of) values take. The writer enforces the same limits, so a
record it writes is one the reader accepts.

Pickle is read only under ``allow_pickle=True``, and then through :class:`RestrictedUnpickler`, which
builds nothing outside an allow-list (the way ``torch.load(weights_only=True)`` does): that covers the
leaves a checkpointer created with ``allow_pickle=True`` pickled, and records of the first format (magic
``ettkit-py-extra-v1``: the whole record one pickle), which ettkit wrote before this one.
"""

from __future__ import annotations

import io
import operator
import pickle
import re
import struct
import zipfile
from collections import OrderedDict
from itertools import repeat
from typing import Any, NamedTuple, Optional

import torch

from ..errors import CorruptDataError, InvalidArgumentError
from ._flatten import MAX_LEAF_BYTES, TENSOR, ShardedSlot

#: The magic line of the pickle format ettkit wrote before (read only with ``allow_pickle=True``).
MAGIC_PICKLE = b"ettkit-py-extra-v1\n"
#: The magic line of this format.
MAGIC = b"ettkit-py-extra-v2\n"
# Any record written from Python starts with this; other bytes are the C++ checkpointer's caller's own.
_MAGIC_PREFIX = b"ettkit-py-extra-v"

#: The most bytes a record may take after its magic line. The non-tensor state of a 10^5-tensor model takes
#: a few MB; more belongs in tensors (saved tensor by tensor, checksummed, loaded in place).
MAX_RECORD_BYTES = 64 << 20
#: The most levels of nesting (dicts, lists, tuples, pickled leaves' contents) a record may hold.
MAX_DEPTH = 100
#: The most values a record may hold: a decoded value takes at most ~70 bytes of Python objects and about a
#: microsecond to decode, so this bounds a hostile record's memory to ~75 MB and its decode to about 1.5 s
#: whatever its shape (docs/benchmarks.md, "The decoder's worst cases"). The skeleton of a model and its Adam
#: state holding 10^5 tensors has ~3 * 10^5 values.
MAX_NODES = 1 << 20

#: The most keys of one dict that may share a hash value, counted over the keys that are not a str or an int64
#: (a big int, a float, a complex, a tuple...). Such keys' hashes are not randomized: a writer can make
#: thousands share one, and a dict then spends a comparison with every earlier one on each insert (40,000
#: such keys took 8.7 s, quadratic). A checkpoint's keys are str and int: 8 is already beyond chance.
MAX_KEYS_PER_HASH = 8
#: The most tensors (tag A) a record may store as bytes: each is a torch.Tensor built on load (microseconds
#: each, ~20 s at the value limit). Large data belongs in the state's tensors, not in extra=.
MAX_ARRAYS = 1 << 14

_OPT_IN = "AsyncCheckpointer(..., allow_pickle=True)"


class ExtraRecord(NamedTuple):
    """A decoded ``rank-<r>.extra``: the state's skeleton, the ``extra=`` value, the world size it was saved at
    (``None`` in a first-format record from before the world size was kept), and the rank's random generators'
    states (:mod:`ettkit.checkpoint.rng_state`; ``None`` in a record saved without them)."""

    skeleton: Any
    extra: Any
    world_size: Optional[int]
    rng: Any = None


class EncodedSkeleton(NamedTuple):
    """A skeleton encoded once and reused by later saves while it does not change: its bytes and how many
    values they hold (the record's limit counts them)."""

    data: bytes
    nodes: int


# ---- tags ------------------------------------------------------------------------------------------------
_NONE, _TRUE, _FALSE, _INT, _BIGINT, _FLOAT, _COMPLEX = b"NTFiIfc"
_STR, _BYTES, _LIST, _TUPLE, _DICT = b"sbltd"
_SIZE, _DTYPE, _DEVICE, _SLOT, _SHARDED, _ARRAY, _PICKLE = b"SDVXHAP"
_KEYS, _KEYS_AGAIN, _INTS = b"KRJ"

_i64 = struct.Struct("<q")
_f64 = struct.Struct("<d")
_c128 = struct.Struct("<dd")
_INT64_MIN, _INT64_END = -(1 << 63), 1 << 63

# torch.dtype <-> its name ("float32"); the names are what the format stores, looked up, never evaluated.
_DTYPES: dict = {}
for _n in dir(torch):
    _d = getattr(torch, _n, None)
    if isinstance(_d, torch.dtype):
        _DTYPES[str(_d).rpartition(".")[2]] = _d
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}
# Dtypes a tensor in extra= may have: those whose bytes torch.frombuffer reads back as they were.
_ARRAY_DTYPES = frozenset(d for n, d in _DTYPES.items() if n in {
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz"})
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?\Z")


class _Refused(Exception):
    """A value the encoder will not write: ``why`` completes "<where> is a <type> ..." (empty: the format has no
    tag for it and pickling is not allowed); ``path`` leads to it (innermost key first)."""

    def __init__(self, obj: Any, why: str = ""):
        super().__init__(why)
        self.obj, self.why, self.path = obj, why, []


class _Bad(Exception):
    """A record that does not decode: the reason, the byte offset, the path to the field (innermost first)."""

    def __init__(self, why: str, pos: int):
        super().__init__(why)
        self.why, self.pos, self.path = why, pos, []


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


class _NeedsOptIn(_Bad):
    """A pickled leaf met without ``allow_pickle=True``: the caller's setting refuses the step, it is not bad."""


def _field_name(path: list) -> str:
    """Where a value of a record sits, in the words of the code that saved it: ``state entry 'model.w'``
    (dotted as flatten names tensors), ``save(..., extra=...)['k']``, or the record's own ``field 'x'``."""
    if path[:1] == ["skeleton"]:
        return f"state entry '{'.'.join(str(p) for p in path[1:])}'" if path[1:] else "the state"
    if path[:1] == ["extra"]:
        return "save(..., extra=...)" + "".join(f"[{p!r}]" for p in path[1:])
    return f"field '{'.'.join(str(p) for p in path)}'"


# ---- writing ---------------------------------------------------------------------------------------------
class _Encoder:
    """Appends the tagged encoding of values to one buffer. ``pickle_limit``: None refuses every value the
    format has no tag for (raising :class:`_Refused`); an int pickles such a value when its pickle takes at
    most that many bytes (and only when the restricted unpickler would build it back)."""

    __slots__ = ("out", "nodes", "arrays", "pickle_limit", "key_sets")

    def __init__(self, pickle_limit: Optional[int]):
        self.out = bytearray()
        self.nodes = self.arrays = 0
        self.pickle_limit = pickle_limit
        self.key_sets: dict = {}  # the key tuple of each K dict written -> its number, for R

    def value(self, obj: Any, depth: int) -> None:
        out = self.out
        self.nodes += 1
        t = type(obj)
        if obj is TENSOR:
            out.append(_SLOT)
        elif t is str:
            e = obj.encode("utf-8", "surrogatepass")
            out.append(_STR)
            _varint(out, len(e))
            out += e
        elif t is dict:
            if depth >= MAX_DEPTH:
                raise _Refused(obj, f"that is nested more than {MAX_DEPTH} levels deep")
            if self._placeholders(obj):
                return
            out.append(_DICT)
            _varint(out, len(obj))
            val, placeholders, inner = self.value, self._placeholders, depth + 1 < MAX_DEPTH
            k = None
            same_hash: Optional[dict] = None  # as the decoder counts them (_Decoder.key_hash)
            try:
                # The common entries inline (a str or int key; a placeholder, an int, a dict of placeholders):
                # a call per value would double the time of a state's skeleton, which is mostly such entries.
                for k, v in obj.items():
                    tk = type(k)
                    if tk is str:
                        e = k.encode("utf-8", "surrogatepass")
                        out.append(_STR)
                        _varint(out, len(e))
                        out += e
                        self.nodes += 1
                    elif tk is int and _INT64_MIN <= k < _INT64_END:
                        out.append(_INT)
                        out += _i64.pack(k)
                        self.nodes += 1
                    else:
                        val(k, depth + 1)
                        same_hash = self._key_hash(k, same_hash)
                    if v is TENSOR:
                        self.nodes += 1
                        out.append(_SLOT)
                    elif type(v) is int and _INT64_MIN <= v < _INT64_END:
                        self.nodes += 1
                        out.append(_INT)
                        out += _i64.pack(v)
                    elif not (inner and type(v) is dict and placeholders(v, 1)):
                        val(v, depth + 1)
            except _Refused as e:
                e.path.append(k)
                raise
        elif t is int:
            if _INT64_MIN <= obj < _INT64_END:
                out.append(_INT)
                out += _i64.pack(obj)
            else:
                b = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                out.append(_BIGINT)
                _varint(out, len(b))
                out += b
        elif t is list or t is tuple:
            if depth >= MAX_DEPTH:
                raise _Refused(obj, f"that is nested more than {MAX_DEPTH} levels deep")
            if t is list and obj and all(map(operator.is_, map(type, obj), repeat(int))):
                try:
                    packed = struct.pack(f"<{len(obj)}q", *obj)
                except struct.error:  # an int outside int64: item by item below
                    pass
                else:
                    out.append(_INTS)
                    _varint(out, len(obj))
                    out += packed
                    self.nodes += len(obj)
                    return
            out.append(_LIST if t is list else _TUPLE)
            _varint(out, len(obj))
            i = 0
            val = self.value
            try:
                for i, v in enumerate(obj):
                    if type(v) is int and _INT64_MIN <= v < _INT64_END:
                        self.nodes += 1
                        out.append(_INT)
                        out += _i64.pack(v)
                    else:
                        val(v, depth + 1)
            except _Refused as e:
                e.path.append(i)
                raise
        elif obj is None:
            out.append(_NONE)
        elif t is bool:
            out.append(_TRUE if obj else _FALSE)
        elif t is float:
            out.append(_FLOAT)
            out += _f64.pack(obj)
        elif t is complex:
            out.append(_COMPLEX)
            out += _c128.pack(obj.real, obj.imag)
        elif t is bytes:
            out.append(_BYTES)
            _varint(out, len(obj))
            out += obj
        elif t is torch.dtype:
            self._name(_DTYPE, _DTYPE_NAMES[obj])
        elif t is torch.device:
            self._name(_DEVICE, str(obj))
        elif t is torch.Size:
            out.append(_SIZE)
            _varint(out, len(obj))
            for n in obj:
                self.value(int(n), depth + 1)
        elif t is ShardedSlot:
            out.append(_SHARDED)
            self.value((tuple(obj.size), obj.dtype, tuple(obj.shards)), depth + 1)
        elif (t is torch.Tensor or t is torch.nn.Parameter) and _plain_array(obj):
            self._array(obj)
        else:
            self._pickled(obj, depth)

    def _placeholders(self, obj: dict, counted: int = 0) -> bool:
        """Writes a non-empty dict of str keys and placeholder values as its keys in one piece (K), or as the
        number of the same key set written before (R), and returns True; False for any other dict (nothing
        written). A state's skeleton is mostly such dicts, and most of them repeat (each parameter's
        optimizer state has the same keys). ``counted``: the dict's own value, when the caller did not
        count it."""
        # Identity and exact types, checked in C (map, not a generator): `==` could call a value's __eq__.
        if not obj or not all(map(operator.is_, obj.values(), repeat(TENSOR))):
            return False
        keys = tuple(obj)
        if not all(map(operator.is_, map(type, keys), repeat(str))):
            return False
        n = len(keys)
        seen = self.key_sets.get(keys)
        out = self.out
        self.nodes += 2 * n + counted
        if seen is not None:
            out.append(_KEYS_AGAIN)
            _varint(out, seen)
            return True
        self.key_sets[keys] = len(self.key_sets)
        data = "".join(keys).encode("utf-8", "surrogatepass")
        out.append(_KEYS)
        _varint(out, len(keys))
        out += struct.pack(f"<{len(keys)}I", *map(len, keys))
        _varint(out, len(data))
        out += data
        return True

    def _name(self, tag: int, name: str) -> None:
        out = self.out
        e = name.encode("utf-8")
        out.append(tag)
        _varint(out, len(e))
        out += e

    def _key_hash(self, k: Any, same_hash: Optional[dict]) -> dict:
        """The decoder's limit on keys of one hash (MAX_KEYS_PER_HASH), so that what is written loads."""
        if same_hash is None:
            same_hash = {}
        h = hash(k)
        c = same_hash[h] = same_hash.get(h, 0) + 1
        if c > MAX_KEYS_PER_HASH:
            raise _Refused(k, f"that shares its hash with {MAX_KEYS_PER_HASH} other keys of its dict (a load "
                              f"would take quadratic time to rebuild it); use str or int keys")
        return same_hash

    def _array(self, t: torch.Tensor) -> None:
        self.arrays += 1
        if self.arrays > MAX_ARRAYS:
            raise _Refused(t, f"beyond the {MAX_ARRAYS} tensors a record stores as bytes; keep tensors in the state")
        cpu = t.detach().to("cpu").contiguous()
        out = self.out
        self._name(_ARRAY, _DTYPE_NAMES[cpu.dtype])
        _varint(out, cpu.dim())
        for n in cpu.shape:
            _varint(out, int(n))
        nbytes = cpu.numel() * cpu.element_size()
        _varint(out, nbytes)
        if nbytes:
            out += cpu.reshape(-1).view(torch.uint8).numpy().tobytes()

    def _pickled(self, obj: Any, depth: int) -> None:
        if self.pickle_limit is None:
            raise _Refused(obj)
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - any pickling failure: the caller names the key
            raise _Refused(obj, f"that cannot be pickled ({type(e).__name__}: {e})") from None
        if len(data) > self.pickle_limit:
            raise _Refused(obj, f"whose pickle takes {len(data)} bytes, more than {self.pickle_limit}")
        try:
            # What is written must load back: a leaf whose pickle names a global outside the allow-list, or
            # that holds more than a record may, would make every later load of this step fail.
            back = RestrictedUnpickler(io.BytesIO(data)).load()
            self.nodes += _count(back, depth, MAX_NODES - self.nodes, lambda why: _Bad(why, 0))
        except _Bad as e:
            raise _Refused(obj, f"that cannot be stored: {e.why}") from None
        except Exception as e:  # noqa: BLE001 - a global outside the allow-list, a constructor that raised
            raise _Refused(obj, f"that cannot be loaded back through the restricted unpickler "
                                f"({type(e).__name__}: {e})") from None
        out = self.out
        out.append(_PICKLE)
        _varint(out, len(data))
        out += data


def _plain_array(t: torch.Tensor) -> bool:
    """Whether a tensor in extra= is stored as its bytes: dense, of a dtype :func:`torch.frombuffer` reads."""
    return (t.layout == torch.strided and not t.is_quantized and not t.is_nested and t.dtype in _ARRAY_DTYPES
            and t.device.type != "meta")


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_PLAIN = ("None, bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, and lists, tuples "
          "and dicts of those")


_EXTRA_VALID = ("extra= holds None, bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, "
                "tensors (stored as their bytes, loaded as CPU tensors), and lists, tuples and dicts of those; with "
                "allow_pickle=True, any picklable object")


def _refusal(e: _Refused, where: str, valid: str, instead: str) -> InvalidArgumentError:
    what = f"{where} is a {_type_name(e.obj)}"
    if e.why:
        return InvalidArgumentError(f"{what} {e.why}; {valid}")
    return InvalidArgumentError(
        f"{what}, which ettkit's checkpoint format stores only as a pickle: make it a plain value ({_PLAIN}) "
        f"{instead}, or create the checkpointer with {_OPT_IN} to store it pickled (a load then needs "
        f"allow_pickle=True too, and its class registered with torch.serialization.add_safe_globals)")


def encode_skeleton(skeleton: Any, *, allow_pickle: bool) -> EncodedSkeleton:
    """The skeleton's encoding. A leaf the format has no tag for is refused naming its key
    (:class:`InvalidArgumentError`), unless ``allow_pickle``: then it is pickled when its pickle takes at most
    ``MAX_LEAF_BYTES``."""
    from ._flatten import _VALID

    enc = _Encoder(MAX_LEAF_BYTES if allow_pickle else None)
    try:
        enc.value(skeleton, 1)  # the record's field: one level down
    except _Refused as e:
        raise _refusal(e, _field_name(["skeleton", *e.path[::-1]]), _VALID, "or a tensor or a Stateful") from None
    return EncodedSkeleton(bytes(enc.out), enc.nodes)


def encode_extra(skeleton: EncodedSkeleton, extra: Any, world_size: int, *, allow_pickle: bool,
                 rng: Optional[dict] = None) -> bytes:
    """The whole ``rank-<r>.extra`` record. ``extra`` may hold what the skeleton may and plain tensors (their
    bytes are stored; they load as CPU tensors); anything else only with ``allow_pickle`` (pickled, without
    the skeleton's per-leaf size limit). Raises :class:`InvalidArgumentError` for a record the reader would
    refuse (too large, too deep, too many values)."""
    enc = _Encoder(MAX_RECORD_BYTES if allow_pickle else None)
    enc.value(world_size, 0)
    head = bytes(enc.out)
    enc.out = bytearray()
    try:
        enc.value(extra, 1)
    except _Refused as e:
        raise _refusal(e, _field_name(["extra", *e.path[::-1]]), _EXTRA_VALID, "or a tensor") from None
    nodes = skeleton.nodes + enc.nodes + 4
    if nodes > MAX_NODES:
        raise InvalidArgumentError(f"the state's non-tensor skeleton and extra= hold {nodes} values together, more "
                                   f"than a checkpoint record holds ({MAX_NODES}); keep large data in tensors")
    parts = [MAGIC, bytes((_DICT, 3 if rng is None else 4)),
             b"s\x0aworld_size", head,
             b"s\x08skeleton", skeleton.data,
             b"s\x05extra", bytes(enc.out)]
    if rng is not None:  # the generators' states: plain values and bytes (rng_state.capture), never refused
        enc.out = bytearray()
        enc.value(rng, 1)
        parts += [b"s\x03rng", bytes(enc.out)]
    blob = b"".join(parts)
    if len(blob) - len(MAGIC) > MAX_RECORD_BYTES:
        raise InvalidArgumentError(
            f"the state's non-tensor skeleton and extra= take {len(blob) - len(MAGIC)} bytes, more than a "
            f"checkpoint record holds ({MAX_RECORD_BYTES}); keep large data in tensors")
    return blob


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

    def bad(self, why: str, at: Optional[int] = None) -> _Bad:
        return _Bad(why, self.pos if at is None else at)

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
        if tag == _SLOT:
            return TENSOR
        if tag == _STR:
            return self.text("str")
        if tag == _DICT:
            return self.dict(depth)
        if tag == _KEYS_AGAIN or tag == _KEYS:
            if depth >= MAX_DEPTH:
                raise self.bad(f"the record nests deeper than {MAX_DEPTH} levels")
            return self.placeholders(pos) if tag == _KEYS else self.again(pos)
        if tag == _INTS:
            n = self.length("int list's count", 8)
            self.room(n)
            self.nodes += n
            return list(struct.unpack_from(f"<{n}q", self.buf, self.take(8 * n)))
        if tag == _INT:
            return _i64.unpack_from(self.buf, self.fixed(8, "int"))[0]
        if tag == _LIST or tag == _TUPLE:
            if depth >= MAX_DEPTH:
                raise self.bad(f"the record nests deeper than {MAX_DEPTH} levels")
            n = self.length("list's count")
            self.room(n)
            items = self.items(n, depth)
            return items if tag == _LIST else tuple(items)
        leaf = _LEAVES.get(tag)  # the rarer tags, one lookup instead of a test each
        if leaf is None:
            raise self.bad(f"unknown tag {tag:#04x}", pos)
        return leaf(self, pos, depth)

    # ---- the rarer tags (_LEAVES); `pos` is the tag's offset, self.pos the payload's ----
    def _float(self, pos: int, depth: int) -> float:
        return _f64.unpack_from(self.buf, self.fixed(8, "float"))[0]

    def _bigint(self, pos: int, depth: int) -> int:
        n = self.length("int's length")
        p = self.take(n)
        return int.from_bytes(self.mv[p:p + n], "little", signed=True)

    def _complex(self, pos: int, depth: int) -> complex:
        return complex(*_c128.unpack_from(self.buf, self.fixed(16, "complex")))

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
            obj = self.names[key] = self._dtype(pos) if tag == _DTYPE else self._device(pos)
        return obj

    def _dtype(self, pos: int) -> torch.dtype:
        name = self.text("dtype")
        d = _DTYPES.get(name)
        if d is None:
            raise self.bad(f"'{name[:64]}' is not a torch dtype", pos)
        return d

    def _device(self, pos: int) -> torch.device:
        name = self.text("device")
        if not _DEVICE_RE.match(name):
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
        return _sharded_slot(self.value(depth + 1), lambda why: self.bad(why, pos))

    def _pickled(self, pos: int, depth: int) -> Any:
        n = self.length("pickle's length")
        p = self.take(n)
        if not self.allow_pickle:
            raise _NeedsOptIn("a pickled object is stored here", pos)
        try:
            obj = RestrictedUnpickler(io.BytesIO(self.buf[p:p + n])).load()
        except (pickle.UnpicklingError, _Bad) as e:
            raise self.bad(f"the pickled object does not load: {e}", pos) from None
        except Exception as e:  # noqa: BLE001 - an allowed constructor refusing its arguments
            raise self.bad(f"the pickled object does not load: {type(e).__name__}: {e}", pos) from None
        self.nodes += _count(obj, depth, MAX_NODES - self.nodes, lambda why: self.bad(why, pos))
        return obj

    def key_hash(self, k: Any, same_hash: Optional[dict], pos: int) -> dict:
        """Counts a dict key that is not a str or an int64 under its hash (``same_hash``: the dict's counts so
        far, None before its first such key), refusing the dict past MAX_KEYS_PER_HASH keys of one hash."""
        try:
            h = hash(k)
        except TypeError:
            raise _Bad(f"a dict key is a {type(k).__name__}, which cannot be a key", pos) from None
        if same_hash is None:
            same_hash = {}
        c = same_hash[h] = same_hash.get(h, 0) + 1
        if c > MAX_KEYS_PER_HASH:
            raise _Bad(f"a dict holds more than {MAX_KEYS_PER_HASH} keys of type {type(k).__name__} that share "
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
                if tag == _STR and buf[pos + 1] < 0x80:
                    q = pos + 2 + buf[pos + 1]
                    if q > end:
                        raise _Bad("a key is cut off", pos)
                    try:
                        k = str(mv[pos + 2:q], "utf-8", "surrogatepass")
                    except UnicodeDecodeError as e:
                        raise _Bad(f"a key is not UTF-8 ({e.reason})", pos) from None
                    self.nodes += 1
                    pos = q
                elif tag == _INT and pos + 9 <= end:
                    k = _i64.unpack_from(buf, pos + 1)[0]
                    self.nodes += 1
                    pos += 9
                else:
                    self.pos = pos
                    k = value(depth + 1)
                    same_hash = self.key_hash(k, same_hash, pos)
                    pos = self.pos
                tag = buf[pos] if pos < end else -1
                if tag == _SLOT:
                    self.nodes += 1
                    pos += 1
                    out[k] = TENSOR
                elif tag == _INT and pos + 9 <= end:
                    self.nodes += 1
                    out[k] = _i64.unpack_from(buf, pos + 1)[0]
                    pos += 9
                elif tag == _KEYS_AGAIN and inner and pos + 1 < end and buf[pos + 1] < len(key_sets) \
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
        except _Bad as e:
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
                if tag == _INT and pos + 9 <= end:
                    self.nodes += 1
                    append(_i64.unpack_from(buf, pos + 1)[0])
                    pos += 9
                elif tag == _SLOT:
                    self.nodes += 1
                    append(TENSOR)
                    pos += 1
                elif tag == _NONE:
                    self.nodes += 1
                    append(None)
                    pos += 1
                else:
                    self.pos = pos
                    append(value(depth + 1))
                    pos = self.pos
        except _Bad as e:
            e.path.append(i)
            raise
        self.pos = pos
        return items

    def array(self, pos: int, depth: int = 0) -> torch.Tensor:
        self.arrays += 1
        if self.arrays > MAX_ARRAYS:
            raise self.bad(f"the record stores more than {MAX_ARRAYS} tensors as bytes", pos)
        name = self.text("tensor's dtype")
        dtype = _DTYPES.get(name)
        if dtype not in _ARRAY_DTYPES:
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
    _NONE: lambda d, pos, depth: None, _TRUE: lambda d, pos, depth: True, _FALSE: lambda d, pos, depth: False,
    _FLOAT: _Decoder._float, _BIGINT: _Decoder._bigint, _COMPLEX: _Decoder._complex, _BYTES: _Decoder._bytes,
    _DTYPE: _Decoder._named, _DEVICE: _Decoder._named, _SIZE: _Decoder._size, _SHARDED: _Decoder._sharded,
    _ARRAY: _Decoder.array, _PICKLE: _Decoder._pickled,
}


def _sharded_slot(value: Any, bad: Any) -> ShardedSlot:
    """A ShardedSlot from its stored ``(size, dtype, shards)``, each field checked: sizes and offsets are
    tuples of non-negative ints of the tensor's rank, placements strings or None."""

    def dims(x: Any, n: Optional[int]) -> bool:
        return (isinstance(x, tuple) and (n is None or len(x) == n)
                and all(type(v) is int and v >= 0 for v in x))

    if not (isinstance(value, tuple) and len(value) == 3):
        raise bad("a sharded tensor's record is not (size, dtype, shards)")
    size, dtype, shards = value
    if not dims(size, None) or type(dtype) is not torch.dtype or not isinstance(shards, tuple):
        raise bad("a sharded tensor's size, dtype or shards have the wrong type")
    for s in shards:
        if not (isinstance(s, tuple) and len(s) == 3 and dims(s[0], len(size)) and dims(s[1], len(size))
                and (s[2] is None or type(s[2]) is str)):
            raise bad("a sharded tensor's shard is not (offsets, sizes, placement) of its rank")
    return ShardedSlot(size, dtype, shards)


def _count(obj: Any, depth: int, budget: int, bad: Any) -> int:
    """The values in an unpickled object (containers walked), refusing one nested deeper than MAX_DEPTH
    (a cycle is) or holding more than ``budget`` values (a shared subtree counts at every place it is), and
    checking every ShardedSlot's fields."""
    n = 0
    stack = [(obj, depth)]
    while stack:
        x, d = stack.pop()
        n += 1
        if n > budget:
            raise bad(f"the record holds more than {MAX_NODES} values")
        if isinstance(x, (dict, list, tuple, set, frozenset)):
            if d >= MAX_DEPTH:
                raise bad(f"the record nests deeper than {MAX_DEPTH} levels (or holds a cycle)")
            items = [*x.keys(), *x.values()] if isinstance(x, dict) else x
            stack.extend((v, d + 1) for v in items)
        elif isinstance(x, ShardedSlot):
            _sharded_slot((x.size, x.dtype, x.shards), bad)
    return n


# ---- the restricted unpickler ------------------------------------------------------------------------------
def _storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (how a plain pickle of a tensor holds its storage: a ``torch.save``
    of it, in the legacy format), read through ``torch.load(weights_only=True)`` instead of the unrestricted
    load it calls; a zip only when its members are stored, not compressed (_stored_zip). Either way the
    storage must not be larger than the bytes that held it."""
    if type(data) is not bytes:
        raise pickle.UnpicklingError("a pickled tensor's storage is not bytes")
    if zipfile.is_zipfile(io.BytesIO(data)):
        _stored_zip(data)
    storage = torch.load(io.BytesIO(data), weights_only=True)
    nbytes = storage.nbytes() if hasattr(storage, "nbytes") else 0
    if nbytes > len(data):
        raise pickle.UnpicklingError(f"a pickled tensor's storage of {nbytes} bytes came from {len(data)}")
    return storage


def _stored_zip(data: bytes) -> None:
    """Refuses a storage in ``torch.save``'s zip format with a member that is compressed: a DEFLATE member
    inflates a 2 MB record into a 2 GiB tensor (1000:1). Stored members take what they hold, so a storage
    costs its bytes."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, ValueError) as e:
        raise pickle.UnpicklingError(f"a pickled tensor's storage is not a valid zip ({e})") from None
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
            raise pickle.UnpicklingError(
                f"a pickled tensor's storage holds a compressed member ({m.filename[:64]!r}: {m.compress_size} "
                f"bytes that would inflate to {m.file_size}); torch.save stores its members uncompressed")


def _no_hooks(backward_hooks: Any) -> dict:
    """A rebuilt tensor's backward hooks: torch.save writes none (an empty OrderedDict); a pickle that brings
    some would install any allowed callable as a hook that runs, and fails, in the next backward."""
    if backward_hooks is None or (type(backward_hooks) in (dict, OrderedDict) and not backward_hooks):
        return OrderedDict()
    raise pickle.UnpicklingError(f"a pickled tensor carries backward hooks ({type(backward_hooks).__name__} of "
                                 f"{len(backward_hooks) if hasattr(backward_hooks, '__len__') else '?'}); a "
                                 f"checkpoint's tensors carry none")


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                    backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` without backward hooks (_no_hooks)."""
    from torch import _utils

    return _utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, _no_hooks(backward_hooks),
                                     metadata)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter`` without backward hooks (_no_hooks)."""
    from torch import _utils

    return _utils._rebuild_parameter(data, requires_grad, _no_hooks(backward_hooks))


def _allowed_globals() -> tuple[dict, set]:
    """``"module.name"`` -> object, for every global a pickle in a record may name: plain containers and
    numbers, torch's sizes, devices and dtypes, tensors rebuilt from their storage bytes through
    ``torch.load(weights_only=True)``, ettkit's skeleton nodes, and what the user registered with
    ``torch.serialization.add_safe_globals`` (as for ``torch.load(weights_only=True)``); and the ids of the
    classes the user registered (only their instances may have their state set)."""
    allowed = {
        "builtins.complex": complex, "builtins.set": set, "builtins.frozenset": frozenset,
        "collections.OrderedDict": OrderedDict,
        "torch.Size": torch.Size, "torch.device": torch.device,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch.storage._load_from_bytes": _storage_from_bytes,
        "ettkit.checkpoint._flatten.TENSOR": TENSOR,
        "ettkit.checkpoint._flatten.ShardedSlot": ShardedSlot,
    }
    allowed.update({f"torch.{n}": d for n, d in _DTYPES.items()})
    user: set = set()
    for g in torch.serialization.get_safe_globals():
        if isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], str):
            g, name = g
        else:
            name = f"{g.__module__}.{g.__qualname__}"
        allowed[name] = g
        if isinstance(g, type):
            user.add(id(g))
    return allowed, user


class RestrictedUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be restricted
    """Unpickles only what :func:`_allowed_globals` names: a global outside it, a persistent id, or state set
    on anything but an instance of a class the user registered raises ``pickle.UnpicklingError`` (a class
    or function of the allow-list cannot be altered through it). Opt-in only (``allow_pickle=True``): the
    allow-list decides what may be built, and a registered class's constructor and ``__setstate__`` run."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any):
        super().__init__(file)
        self._allowed, self._user = _allowed_globals()
        self._key_counts: dict = {}  # id(container) -> (container, {hash: keys}) for _keys
        for name in ("builtins.set", "builtins.frozenset", "collections.OrderedDict"):
            self._allowed[name] = self._counted(self._allowed[name])

    def _counted(self, build: Any) -> Any:
        """`build` (set, frozenset, OrderedDict: callable from a pickle's REDUCE with an iterable) with the
        iterable's keys counted first (_keys)."""

        def checked(items: Any = ()) -> Any:
            items = list(items.items()) if isinstance(items, dict) else list(items)
            keys = [i[0] if build is OrderedDict and isinstance(i, tuple) and len(i) == 2 else i for i in items]
            self._keys(items, keys)
            return build(items)

        return checked

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get(f"{module}.{name}")
        if obj is None:
            raise pickle.UnpicklingError(
                f"the pickle names the global '{module}.{name}', which is not allowed: only plain values, tensors "
                f"and classes registered with torch.serialization.add_safe_globals load (register it only if you "
                f"trust this checkpoint's writer)")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("the pickle holds a persistent id, which a checkpoint record never does")

    def _load_build(self) -> None:
        inst = self.stack[-2] if len(self.stack) >= 2 else None  # under the state BUILD pops
        if id(type(inst)) not in self._user:
            raise pickle.UnpicklingError(f"the pickle sets the state of a {type(inst).__name__}, which only "
                                         f"instances of registered classes may have set")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    # ---- keys of one hash (MAX_KEYS_PER_HASH), as the record's own dicts: a pickle's dicts and sets are
    # built by these opcodes, and hashes of big ints, floats and tuples can be made to collide ----
    def _keys(self, container: Any, keys: Any) -> None:
        """Counts `keys` going into `container` under their hash; refuses past MAX_KEYS_PER_HASH of one."""
        entry = self._key_counts.get(id(container))
        if entry is None:  # the container is held with its counts, so its id stays its own
            entry = self._key_counts[id(container)] = (container, {})
        counts = entry[1]
        for k in keys:
            if type(k) is str or (type(k) is int and _INT64_MIN <= k < _INT64_END):
                continue
            h = hash(k)
            c = counts[h] = counts.get(h, 0) + 1
            if c > MAX_KEYS_PER_HASH:
                raise pickle.UnpicklingError(
                    f"the pickle builds a dict or set with more than {MAX_KEYS_PER_HASH} keys of type "
                    f"{type(k).__name__} that share one hash value (its decoding would take quadratic time)")

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        self._keys(self.stack[-1], items[0::2])
        d = self.stack[-1]
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def _load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._keys(self.stack[-1], (key,))
        self.stack[-1][key] = value

    def _load_dict(self) -> None:
        items = self.pop_mark()
        d: dict = {}
        self._keys(d, items[0::2])
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]
        self.append(d)

    def _load_additems(self) -> None:
        items = self.pop_mark()
        self._keys(self.stack[-1], items)
        s = self.stack[-1]
        for item in items:
            s.add(item)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        self._keys(items, items)
        self.append(frozenset(items))

    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset


# ---- the record --------------------------------------------------------------------------------------------
def decode_extra(blob: bytes, where: str, *, allow_pickle: bool) -> Optional[ExtraRecord]:
    """The record of a ``rank-<r>.extra`` (``where`` names it in errors); ``None`` for the C++ checkpointer's
    opaque bytes. A record that does not decode raises :class:`CorruptDataError`; a first-format (pickle)
    record, or one holding a pickled leaf, raises :class:`InvalidArgumentError` naming ``allow_pickle=True``
    unless it is given (then it goes through :class:`RestrictedUnpickler`)."""
    if not blob.startswith(_MAGIC_PREFIX):
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
            raise _Bad(f"the record is a {type(record).__name__}, not a dict of fields", len(MAGIC))
        for field in record:
            if field not in ("world_size", "skeleton", "extra", "rng"):
                raise _Bad(f"unknown field {field!r} (a record has 'world_size', 'skeleton', 'extra' and "
                           "optionally 'rng')",
                           len(MAGIC))
        for field in ("world_size", "skeleton", "extra"):
            if field not in record:
                raise _Bad(f"the field '{field}' is missing", len(MAGIC))
        world = record["world_size"]
        if type(world) is not int or not 1 <= world <= 1 << 24:
            raise _Bad(f"world_size is {world!r}, not a world size in [1, 2^24]", len(MAGIC))
    except _NeedsOptIn as e:
        raise InvalidArgumentError(
            f"{where}: {_field_name(e.path[::-1])} holds a pickled object, and pickles load only with {_OPT_IN}: "
            f"pass it if you trust whoever can write this checkpoint directory (pickles then load through an "
            f"allow-list; docs/checkpoint.md)") from None
    except _Bad as e:
        at = f" ({_field_name(e.path[::-1])})" if e.path else ""
        raise CorruptDataError(f"{where} does not decode at byte {e.pos}{at}: {e.why}") from None
    return ExtraRecord(record["skeleton"], record["extra"], world, record.get("rng"))


def _decode_pickled(blob: bytes, where: str, allow_pickle: bool) -> ExtraRecord:
    """A first-format record: a pickle of ``{"skeleton_pickle": bytes, "extra": ..., "world_size": int}``
    whose skeleton is a pickle itself. Read only under the opt-in, through the restricted unpickler."""
    if not allow_pickle:
        raise InvalidArgumentError(
            f"{where} is in ettkit's former format, a pickle, which loads only with {_OPT_IN}: pass it if you "
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
    nodes = _count(skeleton, 0, MAX_NODES, bad)
    _count(payload["extra"], 0, MAX_NODES - nodes, bad)
    return ExtraRecord(skeleton, payload["extra"], world)
