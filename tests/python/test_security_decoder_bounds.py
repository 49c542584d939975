"""The ``.extra`` decoder bounded in time, not only in size (issue #61 item 4; docs/security.md).

Dict keys that are big ints, floats, complex numbers or tuples hash the same for every process (only str and
bytes hashes are randomized), so a record can hold thousands of distinct keys of one hash: the dict then
compares each new key with all the earlier ones, and 40,000 such keys (0.5 MB) took 8.7 s, with the GIL held,
before any fallback. And each tensor stored as bytes is a torch.Tensor built on load (microseconds each).
The decoder now refuses a dict with more than MAX_KEYS_PER_HASH keys of one hash and a record with more than
MAX_ARRAYS tensors; the encoder refuses the same at save, so what it writes loads. The worst case of every
shape is measured by benchmarks/extra_decoder_worst_case.py (docs/benchmarks.md)."""

from __future__ import annotations

import struct
import time

import pytest
import torch

import ettkit
from ettkit.checkpoint import AsyncCheckpointer
from ettkit.checkpoint._skeleton_codec import (
    MAX_ARRAYS,
    MAX_KEYS_PER_HASH,
    decode_extra,
    encode_extra,
    encode_skeleton,
)
from extra_record_bytes import record, varint

P = (1 << 61) - 1  # CPython hashes an int n as n mod P
KEYS = 40_000  # the figure: 8.7 s before


def bigint(n: int) -> bytes:
    b = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"I" + varint(len(b)) + b


def colliding_keys(kind: str, n: int) -> list:
    """`n` distinct keys of `kind` that share one hash value."""
    if kind == "big int":
        return [(1 << 64) + j * P for j in range(n)]
    if kind == "tuple":
        return [((1 << 64) + j * P,) for j in range(n)]
    if kind == "complex":  # hash(complex(r, i)) = hash(r) + 1000003 * hash(i), mod 2^64
        return [complex(float((1 << 52) - 1000003 * j), float(j)) for j in range(n)]
    if kind == "float":  # 2^61 is 1 mod P: every 2^(61 k) hashes as 1 (34 of them are floats)
        return [2.0 ** (61 * k) for k in range(-17, 17)][:n]
    raise AssertionError(kind)


def encoded_key(key) -> bytes:
    if type(key) is int:
        return bigint(key)
    if type(key) is tuple:
        return b"t\x01" + encoded_key(key[0])
    if type(key) is complex:
        return b"c" + struct.pack("<dd", key.real, key.imag)
    return b"f" + struct.pack("<d", key)


@pytest.mark.parametrize("kind", ["big int", "tuple", "complex", "float"])
def test_a_dict_of_keys_sharing_one_hash_is_refused_at_once(kind):
    keys = colliding_keys(kind, KEYS)
    assert len({hash(k) for k in keys}) == 1  # distinct by construction (a set of them would be quadratic)
    blob = record(b"d" + varint(len(keys)) + b"".join(encoded_key(k) + b"N" for k in keys))
    begin = time.process_time()
    with pytest.raises(ettkit.CorruptDataError, match=rf"more than {MAX_KEYS_PER_HASH} keys of type "
                                                      rf"{type(keys[0]).__name__} that share one hash value"):
        decode_extra(blob, "rank-0.extra", allow_pickle=False)
    assert time.process_time() - begin < 0.5


def test_keys_of_one_hash_up_to_the_limit_and_ordinary_keys_round_trip():
    extra = {
        "colliding": dict.fromkeys(colliding_keys("big int", MAX_KEYS_PER_HASH), 1),
        "ints": {i: i for i in range(-3, 10_000)},  # -1 and -2 share a hash: ordinary
        "floats": {i / 7: i for i in range(1000)},
        "tuples": {(i, str(i)): i for i in range(1000)},
    }
    skeleton = encode_skeleton({"w": 0}, allow_pickle=False)
    back = decode_extra(encode_extra(skeleton, extra, 1, allow_pickle=False), "rank-0.extra", allow_pickle=False)
    assert back.extra == extra


def test_save_refuses_keys_the_load_would_refuse_naming_the_key(tmp_path):
    keys = colliding_keys("big int", MAX_KEYS_PER_HASH + 1)
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError,
                           match=rf"extra=\.\.\.\)\['table'\]\[{keys[-1]}\] is a int that shares its hash"):
            ck.save(1, {"w": torch.zeros(2)}, extra={"table": dict.fromkeys(keys, 0)})
        assert ck.save(2, {"w": torch.zeros(2)}, extra={"table": dict.fromkeys(keys[:-1], 0)}).wait()
        assert ck.load_latest({"w": torch.zeros(2)}) == (2, {"table": dict.fromkeys(keys[:-1], 0)})


def test_tensors_stored_as_bytes_are_capped_on_load_and_on_save():
    one = b"A\x05uint8\x01\x01\x01\x07"
    blob = record(b"l" + varint(MAX_ARRAYS + 1) + one * (MAX_ARRAYS + 1))
    with pytest.raises(ettkit.CorruptDataError, match=f"more than {MAX_ARRAYS} tensors as bytes"):
        decode_extra(blob, "rank-0.extra", allow_pickle=False)
    skeleton = encode_skeleton({"w": 0}, allow_pickle=False)
    with pytest.raises(ettkit.InvalidArgumentError, match=f"beyond the {MAX_ARRAYS} tensors a record stores"):
        encode_extra(skeleton, [torch.ones(1)] * (MAX_ARRAYS + 1), 1, allow_pickle=False)
    tensors = [torch.full((1,), i % 256, dtype=torch.uint8) for i in range(MAX_ARRAYS)]
    back = decode_extra(encode_extra(skeleton, tensors, 1, allow_pickle=False), "r", allow_pickle=False)
    assert all(torch.equal(a, b) for a, b in zip(back.extra, tensors))


# ---- under allow_pickle=True (issue #61 item 5) -----------------------------------------------------------------


def _pickled_leaf(reduce_value) -> bytes:
    """A record whose extra= is one pickled leaf reducing to `reduce_value` (a callable and its arguments)."""

    class Leaf:
        def __reduce__(self):
            return reduce_value

    import pickle

    data = pickle.dumps(Leaf(), protocol=pickle.HIGHEST_PROTOCOL)
    return record(b"P" + varint(len(data)) + data)


def _deflated(data: bytes) -> bytes:
    """`data` (a torch.save zip) with every member compressed (DEFLATE), as torch.save never writes it."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def test_a_deflate_bomb_in_a_pickled_tensor_storage_is_refused_before_it_inflates():
    import io

    inflated = 32 << 20
    buf = io.BytesIO()
    torch.save(torch.zeros(inflated, dtype=torch.uint8).untyped_storage(), buf)
    bomb = _deflated(buf.getvalue())
    assert len(bomb) < inflated // 500  # a 1000:1 ratio: 2 MB of record made 2 GiB before
    blob = _pickled_leaf((torch.storage._load_from_bytes, (bomb,)))
    with pytest.raises(ettkit.CorruptDataError, match=r"storage holds a compressed member .* would inflate to"):
        decode_extra(blob, "rank-0.extra", allow_pickle=True)
    # The same storage stored, as torch.save writes it, loads: the refusal is of the compression.
    plain = _pickled_leaf((torch.storage._load_from_bytes, (buf.getvalue(),)))
    assert decode_extra(plain, "rank-0.extra", allow_pickle=True).extra.nbytes() == inflated


def test_a_pickled_tensor_with_backward_hooks_is_refused():
    from collections import OrderedDict

    from torch import _utils

    storage = torch.zeros(4).storage()  # a TypedStorage: what _rebuild_tensor_v2 takes
    hooks = OrderedDict({0: torch.Size})  # an allowed callable, which would run (and fail) in backward
    for args, name in (((storage, 0, (4,), (1,), True, hooks), "_rebuild_tensor_v2"),
                       ((torch.zeros(4), True, hooks), "_rebuild_parameter")):
        blob = _pickled_leaf((getattr(_utils, name), args))
        with pytest.raises(ettkit.CorruptDataError, match="carries backward hooks"):
            decode_extra(blob, "rank-0.extra", allow_pickle=True)
    plain = _pickled_leaf((_utils._rebuild_tensor_v2, (storage, 0, (4,), (1,), False, OrderedDict())))
    assert torch.equal(decode_extra(plain, "rank-0.extra", allow_pickle=True).extra, torch.zeros(4))


@pytest.mark.parametrize("container", ["dict", "set", "frozenset", "OrderedDict", "set opcodes",
                                       "frozenset opcodes"])
def test_a_pickled_container_of_keys_sharing_one_hash_is_refused_at_once(container):
    # The record's own dicts are bounded above; a pickled leaf's dicts and sets are built by the unpickler,
    # and were as quadratic (allow_pickle=True).
    import pickle

    keys = colliding_keys("big int", KEYS)
    if container == "dict":  # EMPTY_DICT, MARK, key value ..., SETITEMS: how a dict pickles
        body = b"".join(pickle.dumps(k, 2)[2:-1] + b"K\x00" for k in keys)
        data = b"\x80\x02}(" + body + b"u."
    elif container.endswith("opcodes"):  # EMPTY_SET, MARK, keys, ADDITEMS; or MARK, keys, FROZENSET
        body = b"".join(pickle.dumps(k, 2)[2:-1] for k in keys)
        data = b"\x80\x04\x8f(" + body + b"\x90." if container == "set opcodes" else b"\x80\x04(" + body + b"\x91."
    else:  # built here from the list, never as the container (that would take quadratic time here)
        data = pickle.dumps(_Keys(container, keys), protocol=pickle.HIGHEST_PROTOCOL)
    blob = record(b"P" + varint(len(data)) + data)
    begin = time.process_time()
    with pytest.raises(ettkit.CorruptDataError, match=rf"more than {MAX_KEYS_PER_HASH} keys of type int that share"):
        decode_extra(blob, "rank-0.extra", allow_pickle=True)
    assert time.process_time() - begin < 1.0


class _Keys:
    """Pickles as the container `kind` of `keys` (the opcodes a pickle of that container holds) without
    building it."""

    def __init__(self, kind, keys):
        self.kind, self.keys = kind, keys

    def __reduce_ex__(self, protocol):
        import collections

        if self.kind == "OrderedDict":  # OrderedDict() then SETITEMS, as an OrderedDict pickles
            return (collections.OrderedDict, (), None, None, iter((k, 0) for k in self.keys))
        return ({"set": set, "frozenset": frozenset}[self.kind], (self.keys,))
