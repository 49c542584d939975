"""ettkit.sharding in one process: TorchRec's published expectations, DTensor's local shapes, the
pure-Python restatement of TorchRec's rules, every kind of bad input, the codec, and the views in PyTorch's
metadata types."""

from __future__ import annotations

import json
import pickle
import random

import ettkit
import pytest
import torch
from ettkit import sharding as S
from ettkit.sharding import reference
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed._shard.sharding_spec._internals import check_tensor
from torch.distributed.tensor import Shard as DTensorShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

# ---- helpers ----------------------------------------------------------------------------------------------


def shards_of(md, name):
    return [(s.offsets, s.sizes, s.rank, s.placement) for s in md.tables[name].shards]


def build_one(table, world_size, ranks_per_host=None, device="cpu", strict=False):
    plan = S.ShardingPlan([table], world_size, ranks_per_host or world_size, device)
    return S.build_global_metadata(plan, strict=strict)


def torchrec_32_rank_plan(dtype="float16"):
    """torchrec/distributed/tests/test_sharding_plan.py::test_construct_module_sharding_plan."""
    return S.ShardingPlan(
        [
            S.Table("table_0", 1024, 256, dtype, "data_parallel"),
            S.Table("table_1", 1024, 256, dtype, "table_wise", [1]),
            S.Table("table_2", 1024, 256, dtype, "row_wise"),
            S.Table("table_3", 1024, 256, dtype, "column_wise", [8, 9]),
            S.Table("table_4", 1024, 256, dtype, "table_row_wise", S.host_ranks(3, 8)),
            S.Table("table_5", 1024, 256, dtype, "grid_shard", S.host_ranks([0, 1], 8)),
        ],
        world_size=32,
        ranks_per_host=8,
        device="cuda",
    )


# TorchRec's expected shards for that plan, written out as its test lists them.
TORCHREC_32_EXPECTED = {
    "table_1": [([0, 0], [1024, 256], "rank:1/cuda:1")],
    "table_2": [([32 * i, 0], [32, 256], f"rank:{i}/cuda:{i % 8}") for i in range(32)],
    "table_3": [([0, 0], [1024, 128], "rank:8/cuda:0"), ([0, 128], [1024, 128], "rank:9/cuda:1")],
    "table_4": [([128 * j, 0], [128, 256], f"rank:{24 + j}/cuda:{j}") for j in range(8)],
    "table_5": [([128 * j, 0], [128, 128], f"rank:{j}/cuda:{j}") for j in range(8)]
    + [([128 * j, 128], [128, 128], f"rank:{8 + j}/cuda:{j}") for j in range(8)],
}


# ---- TorchRec's published expectations ---------------------------------------------------------------------


def test_torchrec_32_rank_mixed_plan():
    md = S.build_global_metadata(torchrec_32_rank_plan(), strict=True)
    for name, expected in TORCHREC_32_EXPECTED.items():
        got = [(list(s.offsets), list(s.sizes), s.placement) for s in md.tables[name].shards]
        assert got == expected, name
    dp = md.tables["table_0"].shards
    assert [s.rank for s in dp] == list(range(32))
    assert all(s.offsets == (0, 0) and s.sizes == (1024, 256) for s in dp)
    assert md.tables["table_2"].dtype == torch.float16


@pytest.mark.parametrize(
    "rows, n, sizes, offsets",
    [
        (1000, 3, [334, 334, 332], [0, 334, 668]),
        (10, 4, [3, 3, 3, 1], [0, 3, 6, 9]),
        (5, 4, [2, 2, 1, 0], [0, 2, 4, 5]),
        (5, 8, [1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 5, 5]),
        (9, 4, [3, 3, 3, 0], [0, 3, 6, 9]),
        (1000, 16, [63] * 15 + [55], [63 * i for i in range(16)]),
    ],
)
def test_row_wise_ceil_rule(rows, n, sizes, offsets):
    md = build_one(S.Table("t", rows, 64, "float32", "row_wise"), n, strict=True)
    shards = md.tables["t"].shards
    assert [s.sizes[0] for s in shards] == sizes
    assert [s.offsets[0] for s in shards] == offsets
    assert [s.rank for s in shards] == list(range(n))


def test_column_wise_and_enumerator_cases():
    md = build_one(
        S.Table("table_0", 4096, 64, "float32", "column_wise", [0, 1]), 2, device="cuda", strict=True
    )
    assert shards_of(md, "table_0") == [
        ((0, 0), (4096, 32), 0, "rank:0/cuda:0"),
        ((0, 32), (4096, 32), 1, "rank:1/cuda:1"),
    ]
    # test_enumerators.py EXPECTED_CW_SHARD_SIZES with min_partition 20/20/20/40.
    for (rows, cols, min_partition), expected in zip(
        [(100, 20, 20), (110, 40, 20), (120, 60, 20), (130, 80, 40)],
        [[[100, 20]], [[110, 20]] * 2, [[120, 20]] * 3, [[130, 40]] * 2],
    ):
        block = S.torchrec_column_block(cols, min_partition)
        k = cols // block
        md = build_one(
            S.Table("t", rows, cols, "float32", "table_column_wise", [0] * k, block), 8, 4, strict=True
        )
        assert [list(s.sizes) for s in md.tables["t"].shards] == expected


def test_table_row_wise_and_grid_examples():
    md = build_one(S.Table("t", 1000, 64, "float32", "table_row_wise", [4]), 8, 4)
    assert [(s.offsets[0], s.sizes[0], s.rank) for s in md.tables["t"].shards] == [
        (0, 250, 4),
        (250, 250, 5),
        (500, 250, 6),
        (750, 250, 7),
    ]
    md = build_one(S.Table("g", 1000, 64, "float32", "grid_shard", S.host_ranks([0, 1], 4), 32), 8, 4)
    assert [(s.offsets, s.rank) for s in md.tables["g"].shards] == [
        ((0, 0), 0),
        ((250, 0), 1),
        ((500, 0), 2),
        ((750, 0), 3),
        ((0, 32), 4),
        ((250, 32), 5),
        ((500, 32), 6),
        ((750, 32), 7),
    ]
    md = build_one(S.Table("g", 1000, 64, "float32", "grid_shard", S.host_ranks([1, 0], 3), 32), 6, 3)
    assert [s.sizes[0] for s in md.tables["g"].shards] == [334, 334, 332] * 2
    assert md.tables["g"].size == torch.Size([1000, 64])  # never L * first shard's rows (1002)


def test_zch_buckets():
    md = build_one(S.Table("z", 100, 8, "float32", "row_wise", num_buckets=10), 8, strict=True)
    assert [s.sizes[0] for s in md.tables["z"].shards] == [20, 20, 10, 10, 10, 10, 10, 10]


# ---- DTensor and the Python restatement agree with the C++ builder ------------------------------------------


def test_row_wise_matches_dtensor_local_shape_and_offset():
    rng = random.Random(7)
    cases = [(0, 3), (1, 8), (5, 8), (9, 4), (18, 8), (1000, 3), (1000, 128)]
    cases += [(rng.randrange(0, 5000), rng.randrange(1, 65)) for _ in range(400)]
    for rows, n in cases:
        md = build_one(S.Table("t", rows, 8, "float32", "row_wise"), n)
        for r, shard in enumerate(md.tables["t"].shards):
            shape, offset = _compute_local_shape_and_global_offset((rows, 8), (n,), [r], [DTensorShard(0)])
            assert shard.sizes == tuple(shape), (rows, n, r)
            assert shard.offsets == tuple(offset), (rows, n, r)


def test_grid_rows_match_dtensor_per_host():
    for rows, L in [(1000, 3), (17, 4), (3, 8)]:
        md = build_one(S.Table("g", rows, 64, "float32", "grid_shard", S.host_ranks([0, 0], L), 32), L, L)
        for j, shard in enumerate(md.tables["g"].shards[:L]):
            shape, offset = _compute_local_shape_and_global_offset((rows, 32), (L,), [j], [DTensorShard(0)])
            assert (shard.sizes[0], shard.offsets[0]) == (shape[0], offset[0])


def _random_table(rng, i, world_size, L):
    kind = rng.choice(S.SHARDING_TYPES)
    rows = rng.choice([0, 1, 5, 7, 100, 1000, rng.randrange(1, 100000)])
    cols = rng.choice([4, 16, 20, 64, 100, 128, 256, 384])
    hosts = world_size // L
    ranks, block = [], None
    if kind == "table_wise":
        ranks = [rng.randrange(world_size)]
    elif kind == "row_wise" and rng.random() < 0.3:
        ranks = rng.sample(range(world_size), rng.randrange(1, world_size + 1))
    elif kind in ("column_wise", "table_column_wise"):
        n = rng.choice([d for d in range(1, 9) if cols % d == 0])
        ranks = [rng.randrange(world_size) for _ in range(n)]  # block from TorchRec's search (may degenerate)
    elif kind == "table_row_wise":
        ranks = S.host_ranks(rng.randrange(hosts), L)[: rng.choice([1, L])]
    elif kind == "grid_shard":
        block = rng.choice([d for d in (4, 16, 32, 64, cols) if cols % d == 0])
        ranks = S.host_ranks([rng.randrange(hosts) for _ in range(cols // block)], L)
    return S.Table(f"t{i}", rows, cols, "float32", kind, ranks, block)


def test_builder_matches_python_restatement_on_random_plans():
    rng = random.Random(11)
    for trial in range(40):
        L = rng.choice([1, 2, 4])
        world_size = L * rng.choice([1, 2, 4])
        plan = S.ShardingPlan([_random_table(rng, i, world_size, L) for i in range(25)], world_size, L)
        md = S.build_global_metadata(plan)
        for t in plan.tables:
            got = [
                (s.offsets[0], s.offsets[1], s.sizes[0], s.sizes[1], s.rank) for s in md.tables[t.name].shards
            ]
            assert got == reference.expand_table(t, world_size, L), (trial, t)


def test_local_shards_index():
    plan = S.mixed_plan(50, 8, 4, seed=3)
    md = S.build_global_metadata(plan)
    seen = 0
    for rank in range(8):
        for local in md.local_shards(rank):
            assert local.shard == md.tables[local.table].shards[local.index]
            assert local.shard.rank == rank
            seen += 1
    assert seen == md.total_shards == sum(len(t.shards) for t in md.tables.values())
    with pytest.raises(ettkit.InvalidArgumentError, match="outside the world of 8 ranks"):
        md.local_shards(8)


# ---- bad input: each a clear error naming the table and the field ---------------------------------------------


def explicit(rows, cols, shards, world_size=4, strict=False):
    return build_one(
        S.Table("emb", rows, cols, "float32", "row_wise", shards=shards), world_size, strict=strict
    )


def test_overlapping_shards():
    with pytest.raises(
        ettkit.InvalidArgumentError, match=r"table 'emb': shards\[0\] .* and shards\[1\] .* overlap"
    ):
        explicit(1000, 64, [(0, 0, 600, 64, 0), (500, 0, 500, 64, 1)])


def test_shards_out_of_bounds():
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match=r"table 'emb': shards\[1\] starts at row 500 with 600 rows, beyond the table's 1000 rows",
    ):
        explicit(1000, 64, [(0, 0, 500, 64, 0), (500, 0, 600, 64, 1)])


def test_gaps():
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match=r"table 'emb': rows \[400, 500\) x cols \[0, 64\) are not covered by any shard",
    ):
        explicit(1000, 64, [(0, 0, 400, 64, 0), (500, 0, 500, 64, 1)])


def test_rank_outside_world():
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match=r"table 'emb': ranks\[0\] = 4 is outside the world of 4 ranks \(valid: 0..3\)",
    ):
        build_one(S.Table("emb", 10, 8, "float32", "table_wise", [4]), 4)
    with pytest.raises(
        ettkit.InvalidArgumentError, match=r"table 'emb': shards\[1\] is on rank 7, outside the world"
    ):
        explicit(10, 8, [(0, 0, 5, 8, 0), (5, 0, 5, 8, 7)])


def test_zero_rows_in_strict_mode():
    table = S.Table("user_id", 0, 64, "float32", "row_wise")
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match="row_wise plan for table 'user_id' has 0 rows; a row_wise table needs at least 1 row",
    ):
        build_one(table, 4, strict=True)
    md = build_one(table, 4)  # compat: TorchRec would divide by zero; ettkit gives empty shards and says so
    assert all(s.sizes == (0, 64) for s in md.tables["user_id"].shards)
    assert "ZeroDivisionError" in md.warnings[0]


def test_unknown_sharding_type():
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match="table 'emb': sharding_type 'diagonal' is not a sharding type; use one of data_parallel",
    ):
        S.Table("emb", 10, 8, "float32", "diagonal")
    with pytest.raises(ValueError, match="table 'emb': dtype 'complex32' is not supported"):
        S.Table("emb", 10, 8, "complex32", "row_wise")


def test_column_block_that_does_not_divide_columns():
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match="table 'emb': column_block=20 does not divide cols=64; use a divisor of 64",
    ):
        build_one(S.Table("emb", 10, 64, "float32", "column_wise", [0, 1], 20), 2)
    with pytest.raises(
        ettkit.InvalidArgumentError, match="column dim of 65 cannot be evenly divided across 2 ranks"
    ):
        build_one(S.Table("emb", 10, 65, "float32", "column_wise", [0, 1]), 2)


def test_silent_column_degeneration_strict_and_compat():
    table = S.Table("emb", 10, 100, "float32", "column_wise", [0, 1, 2, 3])
    with pytest.raises(ettkit.InvalidArgumentError, match="silently becomes 1 shard"):
        build_one(table, 4, strict=True)
    md = build_one(table, 4)
    assert [(s.sizes, s.rank) for s in md.tables["emb"].shards] == [((10, 100), 0)]
    assert md.warnings


def test_plan_level_errors():
    with pytest.raises(ettkit.InvalidArgumentError, match="table 't' appears twice"):
        S.ShardingPlan([S.Table("t", 1, 1, "float32", "row_wise")] * 2, 2, 2)
    with pytest.raises(ettkit.InvalidArgumentError, match="ranks_per_host=4 does not divide world_size=6"):
        S.ShardingPlan([], 6, 4)
    with pytest.raises(ettkit.InvalidArgumentError, match="ShardingPlan takes ettkit.sharding.Table"):
        S.ShardingPlan([("t", 1, 1)], 1, 1)
    with pytest.raises(ettkit.InvalidArgumentError, match="device 'tpu' is not a device type"):
        S.ShardingPlan([], 1, 1, "tpu")
    assert issubclass(ettkit.InvalidArgumentError, ValueError)


# ---- the codec --------------------------------------------------------------------------------------------------


def test_codec_round_trip_and_size():
    plan = S.mixed_plan(1000, 128, 8, seed=5)
    data = S.encode(plan)
    assert S.decode(data) == plan
    assert S.decode(bytearray(data)) == plan and S.decode(memoryview(data)) == plan
    assert S.decode(data).tables == plan.tables
    assert S.plan_hash(S.decode(data)) == plan.hash()
    # The target: at most a tenth of the pickled expanded plan (what TorchRec broadcasts).
    small = S.mixed_plan(200, 8, 4, seed=5)
    assert len(S.encode(small)) * 10 <= len(pickle.dumps(S.torchrec_style_plan(small)))
    assert len(data) < 20 * 1000
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_a_tiny_plan_cannot_expand_to_gigabytes():
    # ~160 bytes on the wire; 16.7 million shards (~800 MB on every rank) if the build expanded it.
    tables = [S.Table(f"t{i}", 10, 4, "float32", "data_parallel") for i in range(16)]
    data = S.encode(S.ShardingPlan(tables, world_size=1 << 20, ranks_per_host=8))
    assert len(data) < 300
    with pytest.raises(
        ettkit.InvalidArgumentError,
        match=r"table 't4' \(data_parallel, up to 1048576 shards\) brings the plan to 5242880 shards, "
        r"more than max_shards=4194304",
    ):
        S.build_global_metadata(S.decode(data))
    assert S.DEFAULT_MAX_SHARDS == 4194304
    small = S.ShardingPlan(tables[:2], world_size=4, ranks_per_host=2)
    assert S.build_global_metadata(small, max_shards=8).total_shards == 8
    with pytest.raises(ettkit.InvalidArgumentError, match=r"table 't1' .* more than max_shards=7"):
        S.build_global_metadata(small, max_shards=7)
    with pytest.raises(ettkit.InvalidArgumentError, match=r"max_shards=0 is out of range; valid: 1\.\.134217728"):
        S.build_global_metadata(small, max_shards=0)


def test_codec_corrupt_truncated_and_wrong_version():
    data = S.encode(torchrec_32_rank_plan())
    with pytest.raises(ettkit.CorruptDataError, match="truncated"):
        S.decode(data[:-5])
    with pytest.raises(ettkit.CorruptDataError, match="shorter than the 24-byte header"):
        S.decode(data[:10])
    with pytest.raises(ettkit.CorruptDataError, match="format version 3; this ettkit reads version 1"):
        S.decode(data[:4] + b"\x03\x00" + data[6:])
    damaged = bytearray(data)
    damaged[40] ^= 0x10
    with pytest.raises(ettkit.CorruptDataError, match="checksum"):
        S.decode(bytes(damaged))
    with pytest.raises(ettkit.CorruptDataError, match="magic"):
        S.decode(b"PK\x03\x04" + data[4:])
    # A body that passes the checksum but names an impossible table: the error names table and field.
    one = S.encode(S.ShardingPlan([S.Table("user_id", 10, 8, "float32", "table_wise", [1])], 2, 2))
    resealed = bytearray(one)
    at = one.index(b"user_id") + len(b"user_id") + 1  # flags, then the sharding type
    resealed[at] = 42
    with pytest.raises(
        ettkit.CorruptDataError,
        match=r"table 0 \('user_id'\): sharding type 42 is unknown \(field sharding_type",
    ):
        S.decode(ettkit._C.sharding._reseal_for_testing(bytes(resealed)))


# ---- views in PyTorch's types ---------------------------------------------------------------------------------


def test_sharded_tensor_metadata_passes_torch_validation():
    md = S.build_global_metadata(torchrec_32_rank_plan("float16"))
    for name in ("table_1", "table_2", "table_3", "table_4", "table_5"):
        stm = md.to_sharded_tensor_metadata(name, requires_grad=True)
        assert stm.size == torch.Size([1024, 256])
        assert stm.tensor_properties.dtype == torch.float16 and stm.tensor_properties.requires_grad
        EnumerableShardingSpec(stm.shards_metadata)  # torch's own overlap check
        check_tensor(stm.shards_metadata, stm.size)  # torch's bounds and volume check
        assert [str(s.placement) for s in stm.shards_metadata] == [s[2] for s in TORCHREC_32_EXPECTED[name]]
    with pytest.raises(ettkit.InvalidArgumentError, match="table 'table_0' is data_parallel"):
        md.to_sharded_tensor_metadata("table_0")



def _constructed(md, name, requires_grad=False):
    """The ShardedTensorMetadata of ``name`` made with torch's own constructors: what the fast path must equal."""
    from torch.distributed import _remote_device
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata, TensorProperties

    t = md.tables[name]
    return ShardedTensorMetadata(
        [ShardMetadata(list(s.offsets), list(s.sizes), _remote_device(s.placement)) for s in t.shards],
        t.size, TensorProperties(dtype=t.dtype, requires_grad=requires_grad))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_all_sharded_tensor_metadata_equals_torchs_constructors_table_by_table(device):
    plan = torchrec_32_rank_plan("float16")
    plan = S.ShardingPlan([*plan.tables, S.Table("explicit", 7, 4, "bfloat16", "row_wise",
                                                   shards=[(0, 0, 5, 4, 3), (5, 0, 2, 4, 31)])],
                          plan.world_size, plan.ranks_per_host, device)
    md = S.build_global_metadata(plan)
    every = md.all_sharded_tensor_metadata(requires_grad=True)
    sharded = [t.name for t in plan.tables if t.sharding_type != "data_parallel"]
    assert list(every) == sharded  # plan order, data_parallel left out
    for name in sharded:
        expected = _constructed(md, name, requires_grad=True)
        assert every[name] == expected, name
        assert md.to_sharded_tensor_metadata(name, requires_grad=True) == expected
        assert md.to_shard_metadata(name) == expected.shards_metadata
        assert [str(m.placement) for m in every[name].shards_metadata] == [s.placement for s in md.tables[name].shards]
    assert every["explicit"].tensor_properties.dtype == torch.bfloat16
    assert [m.shard_offsets for m in every["explicit"].shards_metadata] == [[0, 0], [5, 0]]
    assert str(every["explicit"].shards_metadata[1].placement) == (
        "rank:31/cuda:7" if device == "cuda" else "rank:31/cpu")
    # torch's own checks accept what the fast path made without running ShardMetadata.__init__.
    for stm in every.values():
        EnumerableShardingSpec(stm.shards_metadata)
        check_tensor(stm.shards_metadata, stm.size)


def test_sharded_tensor_metadata_objects_belong_to_the_caller():
    md = S.build_global_metadata(torchrec_32_rank_plan())
    first = md.to_sharded_tensor_metadata("table_3")
    first.shards_metadata[0].shard_offsets[0] = 999  # a caller that edits its copy
    first.shards_metadata[0].shard_sizes.append(1)
    again = md.all_sharded_tensor_metadata()["table_3"]
    assert again == _constructed(md, "table_3")
    assert again.shards_metadata[0] is not first.shards_metadata[0]


def test_sharded_tensor_metadata_without_the_fast_path_is_the_same(monkeypatch):
    from ettkit.sharding import metadata as M

    md = S.build_global_metadata(torchrec_32_rank_plan())
    fast = md.all_sharded_tensor_metadata()
    slow = M._torch_types()._replace(fast=False, setters=())  # a torch whose ShardMetadata has other fields
    monkeypatch.setattr(M, "_torch_types", lambda: slow)
    assert S.build_global_metadata(torchrec_32_rank_plan()).all_sharded_tensor_metadata() == fast


def test_sharded_tensor_metadata_leaves_the_garbage_collector_as_it_was(monkeypatch):
    import gc

    from ettkit.sharding import metadata as M

    md = S.build_global_metadata(torchrec_32_rank_plan())
    seen = []
    real = md._c.torch_shard_metadata

    class Probe:  # records whether collection was paused while the objects were made
        def torch_shard_metadata(self, *args):
            seen.append(gc.isenabled())
            return real(*args)

        def __getattr__(self, name):
            return getattr(real.__self__, name)

    object.__setattr__(md, "_c", Probe())
    was = gc.isenabled()
    try:
        gc.enable()
        md.all_sharded_tensor_metadata()
        assert seen and not any(seen) and gc.isenabled()
        gc.disable()
        md.to_sharded_tensor_metadata("table_2")
        assert not gc.isenabled()  # a caller that had it off keeps it off
        gc.enable()
        monkeypatch.setattr(M.GlobalMetadata, "_torch_shards", lambda self, i: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            md.all_sharded_tensor_metadata()
        assert gc.isenabled()  # restored on an error too
    finally:
        (gc.enable if was else gc.disable)()


def test_placements_are_parsed_once_and_only_for_the_ranks_that_hold_a_shard(monkeypatch):
    """A plan over 2^20 ranks whose tables sit on three of them: three placements parsed, not a million, each
    shared by every shard of its rank and by later calls."""
    import torch.distributed as dist

    made = []
    real = dist._remote_device

    def counting(text):
        made.append(text)
        return real(text)

    monkeypatch.setattr(dist, "_remote_device", counting)
    plan = S.ShardingPlan([S.Table("t", 8, 4, "float32", "table_wise", [777_777]),
                           S.Table("c", 8, 64, "float32", "column_wise", [3, 5, 3, 5], 16)], 1 << 20, 8, "cuda")
    md = S.build_global_metadata(plan)
    stm = md.to_sharded_tensor_metadata("t")
    assert made == ["rank:777777/cuda:1"] and str(stm.shards_metadata[0].placement) == "rank:777777/cuda:1"
    first = md.all_sharded_tensor_metadata()
    assert sorted(made) == ["rank:3/cuda:3", "rank:5/cuda:5", "rank:777777/cuda:1"]
    cols = first["c"].shards_metadata
    assert [str(m.placement) for m in cols] == ["rank:3/cuda:3", "rank:5/cuda:5"] * 2
    assert cols[0].placement is cols[2].placement  # one object per rank
    assert md.all_sharded_tensor_metadata()["c"].shards_metadata[1].placement is cols[1].placement
    assert len(made) == 3


def test_dcp_chunks():
    md = build_one(S.Table("t", 5, 8, torch.bfloat16, "row_wise"), 8)
    chunks = md.to_dcp_chunks("t")
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((i, 0), (1, 8)) for i in range(5)]
    assert len(md.to_dcp_chunks("t", include_empty=True)) == 8
    tsm = md.to_tensor_storage_metadata("t")
    assert tsm.size == torch.Size([5, 8]) and tsm.properties.dtype == torch.bfloat16
    dp = build_one(S.Table("d", 5, 8, "float32", "data_parallel"), 4)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in dp.to_dcp_chunks("d")] == [((0, 0), (5, 8))]


def test_records_ett_phase(tmp_path):
    from ettkit import ett

    rec = ett.init(tmp_path, rank=0, world_size=1)
    try:
        S.build_global_metadata(torchrec_32_rank_plan())
    finally:
        rec.close("clean")
    lines = [json.loads(line) for line in (tmp_path / "ett" / "rank-0.jsonl").read_text().splitlines()]
    phases = [r for r in lines if r.get("t") == "phase" and r.get("name") == "launcher_init/sharding"]
    assert len(phases) == 1 and phases[0]["e"] >= phases[0]["b"]
