"""Seeded synthetic plans of mixed sharding types, for tests and ``benchmarks/shard_metadata.py``."""

from __future__ import annotations

import random

from .plan import ShardingPlan, Table

__all__ = ["mixed_plan"]

# Share of each sharding type in a mixed plan (roughly a recommendation model's mix: many small
# table-wise tables, large row-wise ones, some column and grid splits).
_MIX = (
    ("table_wise", 30),
    ("row_wise", 25),
    ("data_parallel", 10),
    ("column_wise", 10),
    ("table_row_wise", 10),
    ("table_column_wise", 5),
    ("grid_shard", 10),
)


def mixed_plan(
    num_tables: int,
    world_size: int,
    ranks_per_host: int,
    seed: int = 0,
    device: str = "cpu",
    prefix: str = "sparse.ebc.embedding_bags.t",
) -> ShardingPlan:
    """A deterministic plan of ``num_tables`` tables of mixed types, shapes and dtypes."""
    rng = random.Random(seed)
    kinds = [k for k, w in _MIX for _ in range(w)]
    hosts = world_size // ranks_per_host
    tables = []
    for i in range(num_tables):
        kind = rng.choice(kinds)
        rows = int(10 ** rng.uniform(3, 7))
        cols = rng.choice((16, 32, 64, 128, 256))
        dtype = rng.choice(("float32", "float16", "bfloat16"))
        name = f"{prefix}{i:05d}"
        ranks: list[int] = []
        block = None
        if kind == "table_wise":
            ranks = [rng.randrange(world_size)]
        elif kind in ("column_wise", "table_column_wise"):
            block = min(cols, rng.choice((16, 32, 64)))
            host = rng.randrange(hosts)
            pool = (
                range(host * ranks_per_host, (host + 1) * ranks_per_host)
                if kind == "table_column_wise"
                else range(world_size)
            )
            ranks = [rng.choice(pool) for _ in range(cols // block)]
        elif kind == "table_row_wise":
            host = rng.randrange(hosts)
            ranks = list(range(host * ranks_per_host, (host + 1) * ranks_per_host))
        elif kind == "grid_shard":
            block = min(cols, rng.choice((16, 32, 64)))
            for _ in range(cols // block):
                host = rng.randrange(hosts)
                ranks.extend(range(host * ranks_per_host, (host + 1) * ranks_per_host))
        tables.append(Table(name, rows, cols, dtype, kind, ranks, block))
    return ShardingPlan(tables, world_size, ranks_per_host, device)
