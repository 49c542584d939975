"""The ``.extra`` decoder's worst cases (issue #61 item 4): hand-made hostile records of up to
MAX_RECORD_BYTES (64 MiB), each shaped to make one part of the decoder as slow as the format allows, timed
through ``decode_extra`` (CPU seconds of one decode, the best of ``--repeats``; a refused record counts the
time to refuse it). The bound the issue asks for: every shape decodes or is refused within 2 s.

    python benchmarks/extra_decoder_worst_case.py [--json out.json] [--shapes a,b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time

from ettkit.checkpoint._skeleton_codec import MAGIC, MAX_ARRAYS, MAX_NODES, MAX_RECORD_BYTES, decode_extra
from ettkit.errors import CorruptDataError

P = (1 << 61) - 1  # CPython hashes an int n as n mod P: n and n + k*P share a hash


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def bigint(n: int) -> bytes:
    b = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"I" + varint(len(b)) + b


def record(extra: bytes) -> bytes:
    """A whole record: world_size 1, an empty skeleton, `extra`."""
    return (MAGIC + b"d\x03" + b"s\x0aworld_size" + b"i" + struct.pack("<q", 1) + b"s\x08skeleton" + b"N"
            + b"s\x05extra" + extra)


def dict_of(pairs: list[bytes], count: int) -> bytes:
    return b"d" + varint(count) + b"".join(pairs)


def list_of(items: bytes, count: int) -> bytes:
    return b"l" + varint(count) + items


def colliding_bigint_keys(n: int) -> bytes:
    """One dict of `n` distinct big-int keys with one hash (the issue's case: 40,000 took 8.7 s)."""
    return record(dict_of([bigint((1 << 64) + j * P) + b"N" for j in range(n)], n))


def colliding_long_keys_in_small_dicts() -> bytes:
    """Dicts of 8 colliding keys (under any per-hash cap) of 8 KiB each, differing only in their last digit:
    every comparison reads the whole key."""
    base = 1 << (8 * 8192 - 2)
    keys = [bigint(base + j * P) for j in range(8)]
    one = dict_of([k + b"N" for k in keys], 8)
    count = (MAX_RECORD_BYTES - 1024) // len(one)
    return record(list_of(one * count, count))


def repeated(item: bytes, cost_nodes: int = 1) -> bytes:
    """A list of as many copies of one value as the node and byte limits allow."""
    n = min((MAX_NODES - 16) // cost_nodes, (MAX_RECORD_BYTES - 1024) // len(item))
    return record(list_of(item * n, n))


def key_sets_distinct() -> bytes:
    """As many K dicts (a key set each, kept for R) of one 3-character key as the limits allow."""
    n = (MAX_NODES - 64) // 3
    items = b"".join(b"K\x01\x03\x00\x00\x00\x03" + f"{j % 4096:03x}".encode() for j in range(n))
    return record(list_of(items, n))


SHAPES = {
    "colliding_bigint_keys_40000": lambda: colliding_bigint_keys(40_000),
    "colliding_bigint_keys_node_limit": lambda: colliding_bigint_keys((MAX_NODES - 16) // 2),
    "colliding_long_keys_8_per_dict": colliding_long_keys_in_small_dicts,
    "ints": lambda: repeated(b"i" + struct.pack("<q", 7)),
    "bigints_9_bytes": lambda: repeated(bigint(1 << 64)),
    "strs_1_byte": lambda: repeated(b"s\x01a"),
    "devices": lambda: repeated(b"V\x06cuda:1"),
    "dtypes": lambda: repeated(b"D\x07float32"),
    "sizes_empty": lambda: repeated(b"S\x00"),
    "arrays_1_byte": lambda: repeated(b"A\x05uint8\x01\x01\x01\x07"),
    "arrays_at_the_limit": lambda: record(list_of(
        (b"A\x05uint8\x01" + varint(4000) + varint(4000) + bytes(4000)) * MAX_ARRAYS, MAX_ARRAYS)),
    "one_dict_per_value": lambda: repeated(b"d\x01s\x01aN", 3),
    "key_sets_again": lambda: record(list_of(b"K\x01\x01\x00\x00\x00\x01a" + b"R\x00" * ((MAX_NODES - 64) // 3),
                                             (MAX_NODES - 64) // 3 + 1)),
    "key_sets_distinct": lambda: key_sets_distinct(),
    "floats": lambda: repeated(b"f" + struct.pack("<d", 0.5)),
    "tuples_of_one": lambda: repeated(b"t\x01N", 2),
    "one_huge_bigint": lambda: record(bigint(1 << (8 * (MAX_RECORD_BYTES - 1024) - 2))),
    "nested_lists": lambda: repeated(b"l\x01" * 98 + b"N", 99),
}


def time_decode(blob: bytes, repeats: int) -> tuple[float, str]:
    best, outcome = float("inf"), ""
    for _ in range(repeats):
        t = time.process_time()
        try:
            decode_extra(blob, "worst case", allow_pickle=False)
            outcome = "decoded"
        except CorruptDataError as e:
            outcome = "refused: " + str(e).split(": ", 1)[-1][:120]
        best = min(best, time.process_time() - t)
    return best, outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat of each shape (make bench)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    results = {}
    for name in args.shapes.split(","):
        blob = SHAPES[name]()
        seconds, outcome = time_decode(blob, args.repeats)
        results[name] = {"decode_s": round(seconds, 4), "record_bytes": len(blob) - len(MAGIC), "outcome": outcome}
        print(f"{name:36s} {seconds:8.3f} s  {len(blob) - len(MAGIC):>10,d} B  {outcome}", flush=True)
    worst = max(results.values(), key=lambda r: r["decode_s"])
    print(f"worst: {worst['decode_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "worst_decode_s": worst["decode_s"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
