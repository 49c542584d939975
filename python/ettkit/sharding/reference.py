"""A plain-Python restatement of TorchRec's split rules (torchrec/distributed/sharding_plan.py).

It is independent of the C++ builder on purpose: the all-gather baseline expands plans with it (standing
in for TorchRec's planner output), and the tests compare it with the C++ builder over random plans. It is
written for clarity, not speed, and implements compat mode only (TorchRec's behaviour, including its sharp
edges); explicit shard lists are passed through.
"""

from __future__ import annotations

from .plan import Table

__all__ = ["expand_table", "find_base_dim", "row_wise_sizes"]

MIN_CW_DIM = 128


def row_wise_sizes(rows: int, n: int) -> list[int]:
    """TorchRec's even row-wise split: ceil blocks, then the remainder, then zeros."""
    if rows == 0:
        return [0] * n  # TorchRec divides by zero here; DTensor's convention
    block = -(-rows // n)
    last_rank = rows // block
    last_block = rows - block * last_rank
    return [block if r < last_rank else (last_block if r == last_rank else 0) for r in range(n)]


def bucketed_sizes(rows: int, n: int, num_buckets: int) -> list[int]:
    bucket = rows // num_buckets
    per, extra = divmod(num_buckets, n)
    return [bucket * (per + (1 if r < extra else 0)) for r in range(n)]


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


def find_base_dim(lower_bound: int, dim: int) -> int:
    """TorchRec's linear scan for the first multiple of 4 in [lower_bound, dim) that divides dim."""
    for i in range(max(lower_bound, 1), dim):
        if dim % i == 0 and i % 4 == 0:
            return i
    return dim


def column_block(cols: int, min_partition: int | None) -> int:
    return min(find_base_dim(min_partition or MIN_CW_DIM, cols), cols)


def expand_table(table: Table, world_size: int, ranks_per_host: int) -> list[tuple[int, int, int, int, int]]:
    """(row_offset, col_offset, rows, cols, rank) of every shard of ``table``, in TorchRec's plan order."""
    if table.shards:
        return list(table.shards)
    rows, cols, ranks, L = table.rows, table.cols, list(table.ranks), ranks_per_host
    kind = table.sharding_type
    if kind == "data_parallel":
        return [(0, 0, rows, cols, r) for r in range(world_size)]
    if kind == "table_wise":
        return [(0, 0, rows, cols, ranks[0])]
    if kind == "row_wise":
        ranks = ranks or list(range(world_size))
        sizes = (
            bucketed_sizes(rows, len(ranks), table.num_buckets)
            if table.num_buckets
            else row_wise_sizes(rows, len(ranks))
        )
        return [(o, 0, s, cols, r) for o, s, r in zip(_offsets(sizes), sizes, ranks)]
    if kind == "table_row_wise":
        first = ranks[0] // L * L
        sizes = row_wise_sizes(rows, L)
        return [(o, 0, s, cols, first + j) for j, (o, s) in enumerate(zip(_offsets(sizes), sizes))]
    if kind in ("column_wise", "table_column_wise"):
        block = table.column_block or column_block(cols, cols // len(ranks))
        # zip() truncation: TorchRec silently drops ranks beyond the number of blocks.
        return [(0, j * block, rows, block, r) for j, r in zip(range(cols // block), ranks)]
    if kind == "grid_shard":
        block = table.column_block or column_block(cols, None)
        sizes = row_wise_sizes(rows, L)
        out = []
        for b in range(cols // block):
            for j, (o, s) in enumerate(zip(_offsets(sizes), sizes)):
                out.append((o, b * block, s, block, ranks[b * L + j]))
        return out
    raise ValueError(f"unknown sharding type {kind!r}")
