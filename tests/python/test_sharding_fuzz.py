"""Mutation fuzzing of the plan decoder from Python: seeded, bounded in CI (a few seconds), long in the slow
run (``pytest -m slow``; ETTKIT_FUZZ_SECONDS overrides its length). Inputs are resealed (length and checksum
rewritten) so the damage reaches the parser. Every input must decode or raise CorruptDataError: no crash,
no hang, no other exception. The C++ suite runs a faster loop of the same kind (codec_test.cpp)."""

from __future__ import annotations

import os
import random
import time

import ettkit
import pytest
from ettkit import sharding as S

_reseal = ettkit._C.sharding._reseal_for_testing


def _corpus() -> list[bytes]:
    plans = [S.mixed_plan(n, ws, L, seed=n) for n, ws, L in [(3, 2, 2), (8, 8, 4), (20, 16, 4)]]
    plans.append(
        S.ShardingPlan(
            [
                S.Table("uneven", 10, 4, "float16", "row_wise", shards=[(0, 0, 3, 4, 0), (3, 0, 7, 4, 1)]),
                S.Table("zch", 100, 8, "float32", "row_wise", num_buckets=10),
            ],
            2,
            1,
        )
    )
    return [S.encode(p) for p in plans]


def _mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(24, max(25, len(b)))
        op = rng.randrange(6)
        if op == 0 and at < len(b):
            b[at] ^= 1 << rng.randrange(8)
        elif op == 1 and at < len(b):
            b[at] = rng.randrange(256)
        elif op == 2:
            b[at:at] = bytes([rng.randrange(256)])
        elif op == 3 and at < len(b):
            del b[at]
        elif op == 4:
            del b[max(24, at) :]
        else:
            other = rng.choice(corpus)
            start = rng.randrange(len(other))
            chunk = other[start : start + rng.randint(1, 16)]
            b[at : at + len(chunk)] = chunk
    return _reseal(bytes(b)) if rng.random() < 0.9 else bytes(b)


def _fuzz(seconds: float, seed: int) -> tuple[int, int]:
    corpus = _corpus()
    rng = random.Random(seed)
    decoded = rejected = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = _mutate(rng, rng.choice(corpus), corpus)
        try:
            plan = S.decode(data)
        except ettkit.CorruptDataError:
            rejected += 1
            continue
        assert S.decode(S.encode(plan)) == plan
        decoded += 1
    return decoded, rejected


def test_decoder_fuzz_bounded():
    decoded, rejected = _fuzz(2.0, seed=1)
    assert rejected > 1000 and decoded > 0


@pytest.mark.slow
def test_decoder_fuzz_long():
    seconds = float(os.environ.get("ETTKIT_FUZZ_SECONDS", "300"))
    seed = int(time.time())
    decoded, rejected = _fuzz(seconds, seed=seed)
    print(
        f"decoder fuzz (seed {seed}, {seconds:.0f} s): {decoded} decoded, {rejected} rejected as CorruptData"
    )
    assert rejected > 0
