"""Local shard-metadata builder: one broadcast of a compact plan, then every rank builds the global shard
metadata itself, bit-exact with TorchRec's split rules (docs/sharding.md)::

    from ettkit import sharding

    if rank == 0:
        plan = sharding.ShardingPlan(
            [sharding.Table("user_id", 10_000_000, 128, torch.float16, "row_wise"),
             sharding.Table("item_id", 1_000_000, 64, "float32", "table_wise", [3]),
             sharding.Table("ads", 4096, 256, "float32", "column_wise", [1, 2])],
            world_size=8, ranks_per_host=4, device="cuda")
    plan = sharding.broadcast_plan(plan if rank == 0 else None)      # one byte-tensor broadcast
    md = sharding.build_global_metadata(plan, strict=True)           # local, no collectives
    md.tables["user_id"].shards                                      # offsets, sizes, rank, placement
    md.local_shards(rank)                                            # this rank's shards
    md.to_sharded_tensor_metadata("user_id")                         # torch.distributed._shard
    md.to_dcp_chunks("user_id")                                      # torch.distributed.checkpoint

Errors are :class:`~ettkit.InvalidArgumentError` (a ValueError) naming the table and field, and
:class:`~ettkit.CorruptDataError` for damaged plan bytes.
"""

from .collective import (
    DEFAULT_FIRST_CHUNK_BYTES,
    allgather_baseline,
    allgather_metadata,
    broadcast_plan,
    check_consistent,
    torchrec_style_plan,
)
from .metadata import DEFAULT_MAX_SHARDS, GlobalMetadata, LocalShard, Shard, TableMetadata, build_global_metadata
from .plan import SHARDING_TYPES, ShardingPlan, Table, decode, encode, plan_hash
from .synthetic import mixed_plan
from .torchrec_interop import from_torchrec, to_torchrec_dict

__all__ = [
    "DEFAULT_FIRST_CHUNK_BYTES",
    "DEFAULT_MAX_SHARDS",
    "SHARDING_TYPES",
    "GlobalMetadata",
    "LocalShard",
    "Shard",
    "ShardingPlan",
    "Table",
    "TableMetadata",
    "allgather_baseline",
    "allgather_metadata",
    "broadcast_plan",
    "build_global_metadata",
    "check_consistent",
    "decode",
    "encode",
    "from_torchrec",
    "host_ranks",
    "mixed_plan",
    "plan_hash",
    "to_torchrec_dict",
    "torchrec_column_block",
    "torchrec_style_plan",
]


def host_ranks(hosts, ranks_per_host: int) -> list[int]:
    """The ranks of ``hosts`` (an index or a list), host after host: TorchRec's ``table_row_wise(host_index)``
    and ``grid_shard(host_indexes)`` ranks. ``host_ranks([0, 1], 8)`` is ``[0, ..., 15]``."""
    if isinstance(hosts, int):
        hosts = [hosts]
    return [h * ranks_per_host + j for h in hosts for j in range(ranks_per_host)]


def torchrec_column_block(cols: int, min_partition: int | None = None) -> int:
    """TorchRec's column-block choice for ``cols`` columns and a ``min_partition`` (None: MIN_CW_DIM = 128)."""
    from .. import _C

    return _C.sharding.torchrec_column_block(cols, min_partition or 0)
