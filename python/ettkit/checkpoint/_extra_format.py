"""The data format of ``rank-<r>.extra`` (the record's tags, limits and shared checks; the writer is
_extra_encode.py, the reader _skeleton_codec.py, pickled leaves _restricted_unpickler.py): a step's non-tensor state (the skeleton of the state dict, the
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

import re
import struct
from typing import Any, NamedTuple, Optional

import torch

from ._tensor_kinds import ShardedSlot

#: The magic line of the pickle format ettkit wrote before (read only with ``allow_pickle=True``).
MAGIC_PICKLE = b"ettkit-py-extra-v1\n"
#: The magic line of this format.
MAGIC = b"ettkit-py-extra-v2\n"
# Any record written from Python starts with this; other bytes are the C++ checkpointer's caller's own.
MAGIC_PREFIX = b"ettkit-py-extra-v"

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

OPT_IN = "AsyncCheckpointer(..., allow_pickle=True)"


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
TAG_NONE, TAG_TRUE, TAG_FALSE, TAG_INT, TAG_BIGINT, TAG_FLOAT, TAG_COMPLEX = b"NTFiIfc"
TAG_STR, TAG_BYTES, TAG_LIST, TAG_TUPLE, TAG_DICT = b"sbltd"
TAG_SIZE, TAG_DTYPE, TAG_DEVICE, TAG_SLOT, TAG_SHARDED, TAG_ARRAY, TAG_PICKLE = b"SDVXHAP"
TAG_KEYS, TAG_KEYS_AGAIN, TAG_INTS = b"KRJ"

I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
C128 = struct.Struct("<dd")
INT64_MIN, INT64_END = -(1 << 63), 1 << 63

# torch.dtype <-> its name ("float32"); the names are what the format stores, looked up, never evaluated.
DTYPES: dict = {}
for _n in dir(torch):
    _d = getattr(torch, _n, None)
    if isinstance(_d, torch.dtype):
        DTYPES[str(_d).rpartition(".")[2]] = _d
DTYPE_NAMES = {d: n for n, d in DTYPES.items()}
# Dtypes a tensor in extra= may have: those whose bytes torch.frombuffer reads back as they were.
ARRAY_DTYPES = frozenset(d for n, d in DTYPES.items() if n in {
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz"})
DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?\Z")


class Refused(Exception):
    """A value the encoder will not write: ``why`` completes "<where> is a <type> ..." (empty: the format has no
    tag for it and pickling is not allowed); ``path`` leads to it (innermost key first)."""

    def __init__(self, obj: Any, why: str = ""):
        super().__init__(why)
        self.obj, self.why, self.path = obj, why, []


class Bad(Exception):
    """A record that does not decode: the reason, the byte offset, the path to the field (innermost first)."""

    def __init__(self, why: str, pos: int):
        super().__init__(why)
        self.why, self.pos, self.path = why, pos, []


def varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


class NeedsOptIn(Bad):
    """A pickled leaf met without ``allow_pickle=True``: the caller's setting refuses the step, it is not bad."""


def field_name(path: list) -> str:
    """Where a value of a record sits, in the words of the code that saved it: ``state entry 'model.w'``
    (dotted as flatten names tensors), ``save(..., extra=...)['k']``, or the record's own ``field 'x'``."""
    if path[:1] == ["skeleton"]:
        return f"state entry '{'.'.join(str(p) for p in path[1:])}'" if path[1:] else "the state"
    if path[:1] == ["extra"]:
        return "save(..., extra=...)" + "".join(f"[{p!r}]" for p in path[1:])
    return f"field '{'.'.join(str(p) for p in path)}'"


def sharded_slot_of(value: Any, bad: Any) -> ShardedSlot:
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


def count_values(obj: Any, depth: int, budget: int, bad: Any) -> int:
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
            sharded_slot_of((x.size, x.dtype, x.shards), bad)
    return n
