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


def _fuzz(seed: int, *, inputs: int | None = None, seconds: float | None = None) -> tuple[int, int]:
    """Decodes mutated inputs: `inputs` of them (a fixed amount of work, so the verdict does not depend on the
    machine's speed), or as many as fit in `seconds` (the long run)."""
    corpus = _corpus()
    rng = random.Random(seed)
    decoded = rejected = 0
    deadline = time.monotonic() + seconds if seconds is not None else None
    n = 0
    while (n < inputs) if inputs is not None else (time.monotonic() < deadline):
        n += 1
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
    decoded, rejected = _fuzz(seed=1, inputs=20_000)
    # Seeded: the same 20,000 inputs every run. Most damage is caught (rejected); some survives as another
    # valid plan, which must then round-trip.
    assert rejected > 1000 and decoded > 0, (decoded, rejected)


# A bounded part of the long run for every CI run: other seeds than the bounded test's, a fixed amount of
# work each (CI_FUZZ_INPUTS: 5.5 s and 6.9 s on the 2-core VM beside a C++ build); `make test-slow` runs the
# long one.
CI_FUZZ_INPUTS = 40_000


@pytest.mark.parametrize("seed", [2, 3])
def test_decoder_fuzz_ci_part_of_the_long_run(seed):
    decoded, rejected = _fuzz(seed=seed, inputs=CI_FUZZ_INPUTS)
    assert rejected > CI_FUZZ_INPUTS // 2 and decoded > 0, (decoded, rejected)


@pytest.mark.slow
def test_decoder_fuzz_long():
    seconds = float(os.environ.get("ETTKIT_FUZZ_SECONDS", "300"))
    seed = int(time.time())
    decoded, rejected = _fuzz(seed=seed, seconds=seconds)
    print(
        f"decoder fuzz (seed {seed}, {seconds:.0f} s): {decoded} decoded, {rejected} rejected as CorruptData"
    )
    assert rejected > 0
