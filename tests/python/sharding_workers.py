"""Worker processes of test_sharding_dist.py (a separate module so torch.multiprocessing's spawn can import it).

Every rank asserts; a failed assertion on any rank fails the spawning test with that rank's traceback.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _init(rank: int, world_size: int, init_file: str) -> None:
    os.environ.setdefault("ETTKIT_LOG_LEVEL", "error")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def _sorted_by_rank(md, name):
    # The all-gather path lists shards rank by rank (in plan order within a rank); ettkit keeps plan order.
    shards = md.tables[name].shards
    return [(list(s.offsets), list(s.sizes), s.placement) for s in sorted(shards, key=lambda s: s.rank)]


def scenarios(rank: int, world_size: int, init_file: str) -> None:
    import ettkit
    from ettkit import sharding as S

    _init(rank, world_size, init_file)
    try:
        L = 2 if world_size % 2 == 0 else 1
        expected = S.mixed_plan(120, world_size, L, seed=world_size, device="cpu")

        # 1. One broadcast of the compact plan; every rank decodes the same plan (and checks the hash).
        plan = S.broadcast_plan(expected if rank == 0 else None, verify=True)
        assert plan == expected and plan.hash() == expected.hash()
        md = S.build_global_metadata(plan)
        assert S.check_consistent(md) == md.hash()

        # 2. The plan larger than the first chunk takes the two-broadcast path; src may be any rank.
        src = world_size - 1
        again = S.broadcast_plan(expected if rank == src else None, src=src, first_chunk_bytes=64)
        assert again == expected

        # 3. The metadata built locally equals what the all-gather baseline assembles.
        expanded = S.torchrec_style_plan(expected) if rank == 0 else None
        gathered = S.allgather_baseline(expanded)
        sharded = [t.name for t in plan.tables if t.sharding_type != "data_parallel"]
        assert sorted(gathered) == sorted(sharded)
        for name in sharded:
            stm = gathered[name]
            assert [
                (s.shard_offsets, s.shard_sizes, str(s.placement)) for s in stm.shards_metadata
            ] == _sorted_by_rank(md, name), name
            assert stm.size == md.tables[name].size
            assert stm.tensor_properties.dtype == md.tables[name].dtype
        assert sum(len(gathered[n].shards_metadata) for n in sharded) == sum(
            len(md.tables[n].shards) for n in sharded
        )

        # 4. ShardedTensor accepts the metadata with no collective, for a row-wise and a grid table.
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        for name in [
            next(t.name for t in plan.tables if t.sharding_type == kind)
            for kind in ("row_wise", "grid_shard", "column_wise")
        ]:
            stm = md.to_sharded_tensor_metadata(name)
            locals_ = [ls for ls in md.local_shards(rank) if ls.table == name]
            shard_metadata = md.to_shard_metadata(name)
            local = [
                Shard(torch.zeros(ls.shard.sizes, dtype=md.tables[name].dtype), shard_metadata[ls.index])
                for ls in locals_
            ]
            st = ShardedTensor._init_from_local_shards_and_global_metadata(local, stm)
            assert tuple(st.size()) == tuple(md.tables[name].size)
            assert len(st.local_shards()) == len(locals_)

        # 5. Ranks that built their plans from different inputs (TorchRec's backed-out dtype bug: dtype from
        #    a rank's own shard) are caught by the 16-byte check on every rank.
        tables = list(expected.tables)
        if rank == 1:
            t = tables[0]
            tables[0] = S.Table(t.name, t.rows, t.cols, "float64", t.sharding_type, t.ranks, t.column_block)
        divergent = S.ShardingPlan(tables, world_size, L)
        try:
            S.check_consistent(divergent)
        except ettkit.CorruptDataError as e:
            assert "differs across ranks" in str(e)
        else:
            raise AssertionError("divergent plans were not detected")

        # 6. A source without a plan makes every rank fail instead of hanging.
        try:
            S.broadcast_plan(None)
        except ettkit.InvalidArgumentError as e:
            assert "ShardingPlan" in str(e)
        else:
            raise AssertionError("broadcast_plan(None) on the source did not raise")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def nccl_scenario(rank: int, world_size: int, init_file: str) -> None:
    """broadcast_plan and check_consistent over NCCL: the byte tensor and the hash travel on the GPU."""
    from ettkit import sharding as S

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        expected = S.mixed_plan(300, world_size, 1, seed=3, device="cuda")
        plan = S.broadcast_plan(expected if rank == 0 else None, verify=True)
        assert plan == expected
        again = S.broadcast_plan(expected if rank == 0 else None, first_chunk_bytes=100)  # two broadcasts
        assert again == expected
        md = S.build_global_metadata(plan)
        assert S.check_consistent(md) == md.hash()
        assert all(s.placement.endswith("/cuda:0") for t in md.tables.values() for s in t.shards)
    finally:
        dist.destroy_process_group()
