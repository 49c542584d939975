"""The writer of the ``rank-<r>.extra`` record (_extra_format.py describes the format): the skeleton encoded
once and reused while it does not change, then the record around it and ``extra=``."""

from __future__ import annotations

import io
import operator
import pickle
import struct
from itertools import repeat
from typing import Any, Optional

import torch

from ..errors import InvalidArgumentError
from ._extra_format import (  # the format's constants, tags and shared checks
    ARRAY_DTYPES, C128, DTYPE_NAMES, F64, I64, INT64_END, INT64_MIN, MAGIC, MAX_ARRAYS, MAX_DEPTH,
    MAX_KEYS_PER_HASH, MAX_NODES, MAX_RECORD_BYTES, OPT_IN, Bad, EncodedSkeleton, Refused, count_values,
    field_name, varint, TAG_ARRAY, TAG_BIGINT, TAG_BYTES, TAG_COMPLEX, TAG_DEVICE, TAG_DICT, TAG_DTYPE, TAG_FALSE,
    TAG_FLOAT, TAG_INT, TAG_INTS, TAG_KEYS, TAG_KEYS_AGAIN, TAG_LIST, TAG_NONE, TAG_PICKLE, TAG_SHARDED, TAG_SIZE,
    TAG_SLOT, TAG_STR, TAG_TRUE, TAG_TUPLE
)
from ._restricted_unpickler import RestrictedUnpickler
from ._tensor_kinds import MAX_LEAF_BYTES, SAVE_VALID, TENSOR, ShardedSlot

# ---- writing ---------------------------------------------------------------------------------------------
class _Encoder:
    """Appends the tagged encoding of values to one buffer. ``pickle_limit``: None refuses every value the
    format has no tag for (raising :class:`Refused`); an int pickles such a value when its pickle takes at
    most that many bytes (and only when the restricted unpickler would build it back)."""

    __slots__ = ("out", "nodes", "arrays", "pickle_limit", "key_sets", "holes")

    def __init__(self, pickle_limit: Optional[int]):
        self.out = bytearray()
        self.nodes = self.arrays = 0
        self.pickle_limit = pickle_limit
        self.key_sets: dict = {}  # the key tuple of each K dict written -> its number, for R
        self.holes: list = []  # (offset, depth, index) of each Hole met (encode_template)

    def value(self, obj: Any, depth: int) -> None:
        out = self.out
        self.nodes += 1
        t = type(obj)
        if obj is TENSOR:
            out.append(TAG_SLOT)
        elif t is str:
            e = obj.encode("utf-8", "surrogatepass")
            out.append(TAG_STR)
            varint(out, len(e))
            out += e
        elif t is dict:
            self._dict(obj, depth)
        elif t is int:
            if INT64_MIN <= obj < INT64_END:
                out.append(TAG_INT)
                out += I64.pack(obj)
            else:
                b = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                out.append(TAG_BIGINT)
                varint(out, len(b))
                out += b
        elif t is list or t is tuple:
            self._sequence(obj, t, depth)
        else:
            self._other(obj, t, depth)

    def _dict(self, obj: dict, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise Refused(obj, f"that is nested more than {MAX_DEPTH} levels deep")
        if self._placeholders(obj):
            return
        out = self.out
        out.append(TAG_DICT)
        varint(out, len(obj))
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
                    out.append(TAG_STR)
                    varint(out, len(e))
                    out += e
                    self.nodes += 1
                elif tk is int and INT64_MIN <= k < INT64_END:
                    out.append(TAG_INT)
                    out += I64.pack(k)
                    self.nodes += 1
                else:
                    val(k, depth + 1)
                    same_hash = self._key_hash(k, same_hash)
                if v is TENSOR:
                    self.nodes += 1
                    out.append(TAG_SLOT)
                elif type(v) is int and INT64_MIN <= v < INT64_END:
                    self.nodes += 1
                    out.append(TAG_INT)
                    out += I64.pack(v)
                elif not (inner and type(v) is dict and placeholders(v, 1)):
                    val(v, depth + 1)
        except Refused as e:
            e.path.append(k)
            raise

    def _sequence(self, obj: Any, t: type, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise Refused(obj, f"that is nested more than {MAX_DEPTH} levels deep")
        out = self.out
        if t is list and obj and all(map(operator.is_, map(type, obj), repeat(int))):
            try:
                packed = struct.pack(f"<{len(obj)}q", *obj)
            except struct.error:  # an int outside int64: item by item below
                pass
            else:
                out.append(TAG_INTS)
                varint(out, len(obj))
                out += packed
                self.nodes += len(obj)
                return
        out.append(TAG_LIST if t is list else TAG_TUPLE)
        varint(out, len(obj))
        i = 0
        val = self.value
        try:
            for i, v in enumerate(obj):
                if type(v) is int and INT64_MIN <= v < INT64_END:
                    self.nodes += 1
                    out.append(TAG_INT)
                    out += I64.pack(v)
                else:
                    val(v, depth + 1)
        except Refused as e:
            e.path.append(i)
            raise

    def _other(self, obj: Any, t: type, depth: int) -> None:
        """Every value but the common ones (a placeholder, str, dict, int, list, tuple) that ``value`` writes
        itself."""
        out = self.out
        if obj is None:
            out.append(TAG_NONE)
        elif t is bool:
            out.append(TAG_TRUE if obj else TAG_FALSE)
        elif t is float:
            out.append(TAG_FLOAT)
            out += F64.pack(obj)
        elif t is complex:
            out.append(TAG_COMPLEX)
            out += C128.pack(obj.real, obj.imag)
        elif t is bytes:
            out.append(TAG_BYTES)
            varint(out, len(obj))
            out += obj
        elif t is torch.dtype:
            self._name(TAG_DTYPE, DTYPE_NAMES[obj])
        elif t is torch.device:
            self._name(TAG_DEVICE, str(obj))
        elif t is torch.Size:
            out.append(TAG_SIZE)
            varint(out, len(obj))
            for n in obj:
                self.value(int(n), depth + 1)
        elif t is ShardedSlot:
            out.append(TAG_SHARDED)
            self.value((tuple(obj.size), obj.dtype, tuple(obj.shards)), depth + 1)
        elif (t is torch.Tensor or t is torch.nn.Parameter) and _plain_array(obj):
            self._array(obj)
        elif t is Hole:
            self.nodes -= 1  # the value filled in counts its own
            self.holes.append((len(out), depth, obj.index))
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
            out.append(TAG_KEYS_AGAIN)
            varint(out, seen)
            return True
        self.key_sets[keys] = len(self.key_sets)
        data = "".join(keys).encode("utf-8", "surrogatepass")
        out.append(TAG_KEYS)
        varint(out, len(keys))
        out += struct.pack(f"<{len(keys)}I", *map(len, keys))
        varint(out, len(data))
        out += data
        return True

    def _name(self, tag: int, name: str) -> None:
        out = self.out
        e = name.encode("utf-8")
        out.append(tag)
        varint(out, len(e))
        out += e

    def _key_hash(self, k: Any, same_hash: Optional[dict]) -> dict:
        """The decoder's limit on keys of one hash (MAX_KEYS_PER_HASH), so that what is written loads."""
        if same_hash is None:
            same_hash = {}
        h = hash(k)
        c = same_hash[h] = same_hash.get(h, 0) + 1
        if c > MAX_KEYS_PER_HASH:
            raise Refused(k, f"that shares its hash with {MAX_KEYS_PER_HASH} other keys of its dict (a load "
                              f"would take quadratic time to rebuild it); use str or int keys")
        return same_hash

    def _array(self, t: torch.Tensor) -> None:
        self.arrays += 1
        if self.arrays > MAX_ARRAYS:
            raise Refused(t, f"beyond the {MAX_ARRAYS} tensors a record stores as bytes; keep tensors in the state")
        cpu = t.detach().to("cpu").contiguous()
        out = self.out
        self._name(TAG_ARRAY, DTYPE_NAMES[cpu.dtype])
        varint(out, cpu.dim())
        for n in cpu.shape:
            varint(out, int(n))
        nbytes = cpu.numel() * cpu.element_size()
        varint(out, nbytes)
        if nbytes:
            out += cpu.reshape(-1).view(torch.uint8).numpy().tobytes()

    def _pickled(self, obj: Any, depth: int) -> None:
        if self.pickle_limit is None:
            raise Refused(obj)
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - any pickling failure: the caller names the key
            raise Refused(obj, f"that cannot be pickled ({type(e).__name__}: {e})") from None
        if len(data) > self.pickle_limit:
            raise Refused(obj, f"whose pickle takes {len(data)} bytes, more than {self.pickle_limit}")
        try:
            # What is written must load back: a leaf whose pickle names a global outside the allow-list, or
            # that holds more than a record may, would make every later load of this step fail.
            back = RestrictedUnpickler(io.BytesIO(data)).load()
            self.nodes += count_values(back, depth, MAX_NODES - self.nodes, lambda why: Bad(why, 0))
        except Bad as e:
            raise Refused(obj, f"that cannot be stored: {e.why}") from None
        except Exception as e:  # noqa: BLE001 - a global outside the allow-list, a constructor that raised
            raise Refused(obj, f"that cannot be loaded back through the restricted unpickler "
                                f"({type(e).__name__}: {e})") from None
        out = self.out
        out.append(TAG_PICKLE)
        varint(out, len(data))
        out += data


def _plain_array(t: torch.Tensor) -> bool:
    """Whether a tensor in extra= is stored as its bytes: dense, of a dtype :func:`torch.frombuffer` reads."""
    return (t.layout == torch.strided and not t.is_quantized and not t.is_nested and t.dtype in ARRAY_DTYPES
            and t.device.type != "meta")


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_PLAIN = ("None, bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, and lists, tuples "
          "and dicts of those")


_EXTRA_VALID = ("extra= holds None, bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, "
                "tensors (stored as their bytes, loaded as CPU tensors), and lists, tuples and dicts of those; with "
                "allow_pickle=True, any picklable object")


def _refusal(e: Refused, where: str, valid: str, instead: str) -> InvalidArgumentError:
    what = f"{where} is a {_type_name(e.obj)}"
    if e.why:
        return InvalidArgumentError(f"{what} {e.why}; {valid}")
    return InvalidArgumentError(
        f"{what}, which ettkit's checkpoint format stores only as a pickle: make it a plain value ({_PLAIN}) "
        f"{instead}, or create the checkpointer with {OPT_IN} to store it pickled (a load then needs "
        f"allow_pickle=True too, and its class registered with torch.serialization.add_safe_globals)")


def encode_skeleton(skeleton: Any, *, allow_pickle: bool) -> EncodedSkeleton:
    """The skeleton's encoding. A leaf the format has no tag for is refused naming its key
    (:class:`InvalidArgumentError`), unless ``allow_pickle``: then it is pickled when its pickle takes at most
    ``MAX_LEAF_BYTES``."""
    enc = _Encoder(MAX_LEAF_BYTES if allow_pickle else None)
    try:
        enc.value(skeleton, 1)  # the record's field: one level down
    except Refused as e:
        raise _refusal(e, field_name(["skeleton", *e.path[::-1]]), SAVE_VALID, "or a tensor or a Stateful") from None
    return EncodedSkeleton(bytes(enc.out), enc.nodes)


class Hole:
    """Where a bound state's tensor-free part goes in a :class:`SkeletonTemplate` (_state_binding.py)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class SkeletonTemplate:
    """A skeleton's encoding with holes: the bytes around them, encoded once, and each hole's depth. A
    tensor-free part of a state (a step count, an LR scheduler, an optimizer's ``param_groups``) is encoded
    on its own at every save and put in its hole, which makes the same bytes as encoding the whole skeleton:
    such a part writes no K/R key set (those hold placeholders, which a tensor-free part has none of), so its
    encoding does not depend on what was written before it, nor what follows on it."""

    __slots__ = ("fragments", "depths", "nodes", "pickle_limit")

    def __init__(self, template: Any, *, allow_pickle: bool):
        enc = _Encoder(MAX_LEAF_BYTES if allow_pickle else None)
        enc.value(template, 1)
        data = bytes(enc.out)
        cuts = [h[0] for h in enc.holes]
        if [h[2] for h in enc.holes] != list(range(len(enc.holes))):
            raise AssertionError("a skeleton template's holes are not met in order")
        self.fragments = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        self.depths = [h[1] for h in enc.holes]
        self.nodes = enc.nodes
        self.pickle_limit = enc.pickle_limit

    def fill(self, parts: list) -> EncodedSkeleton:
        """The encoding of the skeleton with ``parts`` (skeletons, in hole order) in the holes. Raises
        :class:`Refused` for a part the format refuses (the caller encodes the whole skeleton again, which
        raises the error naming its key)."""
        out = [self.fragments[0]]
        nodes = self.nodes
        for part, depth, after in zip(parts, self.depths, self.fragments[1:]):
            enc = _Encoder(self.pickle_limit)
            enc.value(part, depth)
            nodes += enc.nodes
            out.append(enc.out)
            out.append(after)
        return EncodedSkeleton(b"".join(out), nodes)


_NONE = bytes((TAG_NONE,))


def encode_extra(skeleton: EncodedSkeleton, extra: Any, world_size: int, *, allow_pickle: bool,
                 rng: Any = None) -> bytes:
    """The whole ``rank-<r>.extra`` record. ``extra`` may hold what the skeleton may and plain tensors (their
    bytes are stored; they load as CPU tensors); anything else only with ``allow_pickle`` (pickled, without
    the skeleton's per-leaf size limit). Raises :class:`InvalidArgumentError` for a record the reader would
    refuse (too large, too deep, too many values)."""
    # world_size's encoding (an int), and extra=None's written directly: the common save has no extra, and an
    # encoder per save cost microseconds on the training thread (#65); a value written by _Encoder otherwise.
    head = bytes((TAG_INT,)) + I64.pack(world_size)
    if extra is None:
        body, extra_nodes = _NONE, 1
    else:
        enc = _Encoder(MAX_RECORD_BYTES if allow_pickle else None)
        try:
            enc.value(extra, 1)
        except Refused as e:
            raise _refusal(e, field_name(["extra", *e.path[::-1]]), _EXTRA_VALID, "or a tensor") from None
        body, extra_nodes = bytes(enc.out), enc.nodes
    nodes = skeleton.nodes + 1 + extra_nodes + 4  # world_size, extra's values, the record and its 3 keys
    if nodes > MAX_NODES:
        raise InvalidArgumentError(f"the state's non-tensor skeleton and extra= hold {nodes} values together, more "
                                   f"than a checkpoint record holds ({MAX_NODES}); keep large data in tensors")
    parts = [MAGIC, bytes((TAG_DICT, 3 if rng is None else 4)),
             b"s\x0aworld_size", head,
             b"s\x08skeleton", skeleton.data,
             b"s\x05extra", body]
    if rng is not None:  # the generators' states, encoded by their one encoder (rng_state.capture_record)
        if type(rng) is not bytes:
            raise TypeError(f"rng= takes the encoded field (capture_record), not {type(rng).__name__}")
        parts += [b"s\x03rng", rng]
    blob = b"".join(parts)
    if len(blob) - len(MAGIC) > MAX_RECORD_BYTES:
        raise InvalidArgumentError(
            f"the state's non-tensor skeleton and extra= take {len(blob) - len(MAGIC)} bytes, more than a "
            f"checkpoint record holds ({MAX_RECORD_BYTES}); keep large data in tensors")
    return blob
