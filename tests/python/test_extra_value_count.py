"""The .extra decoder's value limit (MAX_NODES, docs/checkpoint.md) counts every value a record holds,
whatever its encoding (issue #68): the ints of a packed int list (tag J), of a plain list (tags l + i) and a
dict's int values count one each, as a None or a str does. A hostile record that spreads its values over several int
lists, each under the limit, is refused at the count, before the container that crosses it is built."""

from __future__ import annotations

import struct

import pytest

import ettkit
from ettkit.checkpoint._skeleton_codec import MAX_NODES, decode_extra, encode_extra, encode_skeleton
from extra_record_bytes import record, varint

HALF = MAX_NODES // 2 + 1  # two of these are over the limit, one is not


def packed_ints(n: int) -> bytes:  # tag J: n int64s in one block (what the encoder writes for a list of ints)
    return b"J" + varint(n) + bytes(8 * n)


def listed_ints(n: int) -> bytes:  # tag l, each item tag i: an int64 each
    return b"l" + varint(n) + (b"i" + bytes(8)) * n


def int_dict(n: int) -> bytes:  # tag d: n int keys (0..n-1), each value an int (tag i)
    return b"d" + varint(n) + b"".join(b"i" + k.to_bytes(8, "little") + b"i" + bytes(8) for k in range(n))


def nones(n: int) -> bytes:
    return b"l" + varint(n) + b"N" * n


# Each record holds more than MAX_NODES values, in two containers that are each under it.
OVER = {
    "two packed int lists": b"l\x02" + packed_ints(HALF) + packed_ints(HALF),
    "a packed int list, then Nones": b"l\x02" + packed_ints(HALF) + nones(HALF),
    "two plain int lists": b"l\x02" + listed_ints(HALF) + listed_ints(HALF),
    "a plain int list, then Nones": b"l\x02" + listed_ints(HALF) + nones(HALF),
    "two dicts of int values": b"l\x02" + int_dict(MAX_NODES // 4 + 1) + int_dict(MAX_NODES // 4 + 1),
}


@pytest.mark.parametrize("name", list(OVER))
def test_values_spread_over_int_lists_count_toward_the_limit(name):
    with pytest.raises(ettkit.CorruptDataError, match=rf"rank-0\.extra does not decode .*more than {MAX_NODES} values"):
        decode_extra(record(OVER[name]), "rank-0.extra", allow_pickle=False)


@pytest.mark.parametrize("where", ["skeleton", "extra"])
def test_int_lists_just_under_the_limit_decode_to_their_values(where):
    # The same shapes with a few hundred values fewer decode, with every int: the refusals above are the
    # count's, not the shapes' (the record's fields and containers take a few values of their own).
    n = m = MAX_NODES // 2 - 200
    value = b"l\x02" + packed_ints(n) + listed_ints(m)
    blob = record(value) if where == "extra" else record(b"N", skeleton=value)
    rec = decode_extra(blob, "rank-0.extra", allow_pickle=False)
    got = rec.extra if where == "extra" else rec.skeleton
    assert [len(x) for x in got] == [n, m]
    assert set(got[0]) == {0} and set(got[1]) == {0}


def test_what_the_encoder_writes_as_int_lists_it_counts_the_same_way():
    # The writer's side of the same rule: a state of int lists over the limit together is refused at save,
    # and one under it round-trips with its values.
    skeleton = encode_skeleton({"epoch": 1}, allow_pickle=False)
    with pytest.raises(ettkit.InvalidArgumentError, match=rf"more than a checkpoint record holds \({MAX_NODES}\)"):
        encode_extra(skeleton, [list(range(HALF)), list(range(HALF))], 1, allow_pickle=False)
    values = [list(range(1000)), [-(2**63), 2**63 - 1]]
    blob = encode_extra(skeleton, values, 1, allow_pickle=False)
    assert b"J" + varint(1000) + struct.pack("<3q", 0, 1, 2) in blob  # written packed
    assert decode_extra(blob, "rank-0.extra", allow_pickle=False).extra == values


def key_set(n: int) -> bytes:  # tag K: n str keys cut from one string by their lengths, each value a slot
    keys = [f"{i:x}" for i in range(n)]
    text = "".join(keys).encode()
    return b"K" + varint(n) + struct.pack(f"<{n}I", *map(len, keys)) + varint(len(text)) + text


# One dict of more entries than half the limit: its keys and values together are over it, and it is refused
# at its count, before an entry is built.
ONE_DICT = {
    "int keys and int values": int_dict(MAX_NODES // 2 + 1),
    "a key set (K)": key_set(MAX_NODES // 2 + 1),
}


@pytest.mark.parametrize("name", list(ONE_DICT))
def test_a_dict_whose_keys_and_values_are_over_the_limit_is_refused_at_its_count(name):
    import tracemalloc

    blob = record(ONE_DICT[name])
    tracemalloc.start()
    try:
        with pytest.raises(ettkit.CorruptDataError, match=rf"more than {MAX_NODES} values"):
            decode_extra(blob, "rank-0.extra", allow_pickle=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # nothing of its 2^19 entries was built
    # Half as many entries decode, each one there.
    half = record(int_dict(MAX_NODES // 4) if name.startswith("int") else key_set(MAX_NODES // 4))
    got = decode_extra(half, "rank-0.extra", allow_pickle=False).extra
    assert len(got) == MAX_NODES // 4
