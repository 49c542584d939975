"""ettkit's shard metadata against TorchRec itself (issue #24): the real `torchrec` package, not a restatement.

For every generator TorchRec has (data_parallel, table_wise, row_wise with and without ZCH buckets,
column_wise with ranks and with size_per_rank, table_row_wise, grid_shard) and for TorchRec's
`calculate_shard_sizes_and_offsets` with a column block (the planner's min_partition, also
table_column_wise), randomized cases with a fixed seed: rows not divisible by the ranks, rows fewer than the
ranks, odd widths, fp32/fp16/bf16, world sizes 1-128 with 1-8 ranks per host, cpu and cuda placements.
ettkit's shards, ranks, placements, ``ShardedTensorMetadata``, ``local_shards(r)``, ``to_torchrec_dict`` and
``from_torchrec`` of TorchRec's plan object and of its ``_serialize()`` JSON must equal TorchRec's, in
TorchRec's order. Where ettkit deliberately differs, the test asserts the documented error or warning
(docs/sharding.md, "Strict and compat mode" and "Always errors"), and nothing else may differ.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from dataclasses import dataclass, field

import ettkit
import pytest
import torch
from ettkit import sharding as S
from torchrec_gate import import_torchrec

import_torchrec()

import torchrec.distributed.sharding_plan as T  # noqa: E402
from torch.distributed._shard.sharded_tensor import TensorProperties  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.types import ShardingPlan as TorchRecPlan  # noqa: E402
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
SHARDER = EmbeddingBagCollectionSharder()


@dataclass
class Case:
    """One table: TorchRec's generator and the ettkit Table that states the same intent."""

    name: str
    rows: int
    cols: int
    data_type: DataType
    kind: str  # the generator, e.g. "row_wise_zch"
    generator: object
    table_args: dict = field(default_factory=dict)  # ettkit Table(...) keyword arguments


def random_topology(rng: random.Random) -> tuple[int, int, str]:
    per_host = rng.choice([1, 2, 3, 4, 8])
    hosts = rng.randint(1, 128 // per_host)
    return hosts * per_host, per_host, rng.choice(["cpu", "cuda"])


def random_case(rng: random.Random, index: int, world: int, per_host: int) -> Case:
    hosts = world // per_host
    rows = rng.choice([1, 2, 3, 5, 7, 10, 100, 1000, 4096, rng.randint(1, 5000), rng.randint(1, world + 3)])
    cols = rng.choice([4, 8, 12, 16, 20, 36, 64, 100, 128, 136, 256, 384, 4 * rng.randint(1, 96)])
    data_type = rng.choice(list(DTYPES))
    kind = rng.choice(
        ["data_parallel", "table_wise", "row_wise", "row_wise_zch", "column_wise", "column_wise_sizes",
         "table_row_wise", "grid_shard"]
    )
    name = f"t{index}"
    if kind == "data_parallel":
        return Case(name, rows, cols, data_type, kind, T.data_parallel(), {"sharding_type": "data_parallel"})
    if kind == "table_wise":
        r = rng.randrange(world)
        return Case(name, rows, cols, data_type, kind, T.table_wise(rank=r), {"sharding_type": "table_wise",
                                                                             "ranks": [r]})
    if kind == "row_wise":
        return Case(name, rows, cols, data_type, kind, T.row_wise(), {"sharding_type": "row_wise"})
    if kind == "row_wise_zch":
        buckets = rng.choice([1, 2, world, world + 1, 2 * world, 3 * world + 1, rng.randint(1, 4 * world)])
        rows = buckets * rng.randint(1, 6)
        return Case(name, rows, cols, data_type, kind, T.row_wise(num_buckets=buckets),
                    {"sharding_type": "row_wise", "num_buckets": buckets})
    if kind == "column_wise":
        ranks = [rng.randrange(world) for _ in range(rng.randint(1, min(8, world)))]
        return Case(name, rows, cols, data_type, kind, T.column_wise(ranks=ranks),
                    {"sharding_type": "column_wise", "ranks": ranks})
    if kind == "column_wise_sizes":
        # size_per_rank: an explicit uneven column split; ettkit takes it as an explicit shard list.
        n = rng.randint(1, min(6, world, cols))
        cuts = sorted(rng.sample(range(1, cols), n - 1)) if n > 1 else []
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, cols])]
        offsets = [0, *cuts]
        shards = [(0, off, rows, size, r) for r, (off, size) in enumerate(zip(offsets, sizes))]
        return Case(name, rows, cols, data_type, kind, T.column_wise(size_per_rank=sizes),
                    {"sharding_type": "column_wise", "shards": shards})
    if kind == "table_row_wise":
        host = rng.randrange(hosts)
        return Case(name, rows, cols, data_type, kind, T.table_row_wise(host_index=host),
                    {"sharding_type": "table_row_wise", "ranks": S.host_ranks(host, per_host)})
    blocks = cols // S.torchrec_column_block(cols)  # as many hosts as column blocks, mostly; else a mismatch
    count = blocks if blocks <= hosts and rng.random() < 0.7 else rng.randint(1, min(hosts, 4))
    host_list = rng.sample(range(hosts), count)
    return Case(name, rows, cols, data_type, kind, T.grid_shard(host_indexes=host_list),
                {"sharding_type": "grid_shard", "ranks": S.host_ranks(host_list, per_host)})


def torchrec_sharding(case: Case, world: int, per_host: int, device: str):
    """TorchRec's ParameterSharding for the case (what construct_module_sharding_plan calls), or the exception."""
    config = EmbeddingBagConfig(name=case.name, feature_names=[f"f_{case.name}"], embedding_dim=case.cols,
                                num_embeddings=case.rows, data_type=case.data_type)
    ebc = EmbeddingBagCollection(tables=[config], device="meta")
    # The unsharded EmbeddingBagCollection makes every non-FP32 table float16 (a BF16 config too); the sharded
    # module's tensors take the config's dtype (data_type_to_dtype), and so does ettkit's metadata.
    param = SHARDER.shardable_parameters(ebc)[case.name]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config, case.generator(param, per_host, world, device, SHARDER)
    except Exception as e:  # noqa: BLE001 - TorchRec's own errors are what the test compares against
        return config, e


def ettkit_table(case: Case) -> S.Table:
    args = dict(case.table_args)
    kind = args.pop("sharding_type")
    ranks = args.pop("ranks", [])
    return S.Table(case.name, case.rows, case.cols, case.data_type, kind, ranks, **args)


def torchrec_shards(ps) -> list[tuple[list[int], list[int], str]]:
    return [(list(s.shard_offsets), list(s.shard_sizes), str(s.placement)) for s in ps.sharding_spec.shards]


def ettkit_shards(md: S.GlobalMetadata, name: str) -> list[tuple[list[int], list[int], str]]:
    return [(list(s.offsets), list(s.sizes), s.placement) for s in md.tables[name].shards]


def build(table: S.Table, world: int, per_host: int, device: str, strict: bool):
    try:
        return S.build_global_metadata(S.ShardingPlan([table], world, per_host, device), strict=strict)
    except ettkit.InvalidArgumentError as e:
        return e


def check_deliberate_difference(case: Case, trec, compat, strict, world: int, per_host: int) -> str:
    """The documented differences; returns which one, or fails. ``trec`` is TorchRec's result or exception."""
    if case.kind == "column_wise" and isinstance(trec, ValueError) and "cannot be evenly divided" in str(trec):
        # Always an error, both sides: cols % len(ranks) != 0.
        for got in (compat, strict):
            assert isinstance(got, ettkit.InvalidArgumentError), got
            assert f"column dim of {case.cols} cannot be evenly divided across {len(case.table_args['ranks'])} ranks" \
                in str(got)
        return "column_wise: cols not divisible by the ranks (both raise)"
    if case.kind == "row_wise_zch" and isinstance(trec, ValueError) and "Number of buckets" in str(trec):
        # TorchRec 1.9 refuses fewer buckets than ranks; compat builds empty shards and lists the sharp edge.
        buckets = case.table_args["num_buckets"]
        assert buckets < world
        assert isinstance(compat, S.GlobalMetadata), compat
        assert any(f"num_buckets={buckets} over {world} ranks" in w for w in compat.warnings), compat.warnings
        sizes = [s.sizes[0] for s in compat.tables[case.name].shards]
        assert sizes == [case.rows // buckets] * buckets + [0] * (world - buckets)
        assert isinstance(strict, ettkit.InvalidArgumentError) and "fewer than the" in str(strict)
        return "row_wise: fewer ZCH buckets than ranks (TorchRec raises; compat warns, strict raises)"
    if case.kind == "grid_shard":
        hosts = len(case.table_args["ranks"]) // per_host
        for got in (compat, strict):
            assert isinstance(got, ettkit.InvalidArgumentError), got
            assert f"grid_shard has {hosts} hosts' ranks but column block" in str(got), str(got)
        if isinstance(trec, IndexError):
            return "grid_shard: more hosts than column blocks (TorchRec IndexError; ettkit raises)"
        # Fewer hosts than column blocks: TorchRec builds shards for the first hosts' blocks only, and the
        # remaining columns belong to no shard. ettkit's rejection is the point: prove the columns are lost.
        covered = max(o[1] + s[1] for o, s, _ in torchrec_shards(trec))
        assert covered < case.cols, (covered, case.cols)
        return "grid_shard: fewer hosts than column blocks (TorchRec loses columns; ettkit raises)"
    pytest.fail(f"{case}: undocumented difference: TorchRec {trec!r}; ettkit compat {compat!r}, strict {strict!r}")


def compare_case(case: Case, world: int, per_host: int, device: str, outcomes: dict) -> tuple | None:
    """Compares one table; returns (config, ParameterSharding, table) when both sides built it."""
    config, trec = torchrec_sharding(case, world, per_host, device)
    table = ettkit_table(case)
    compat = build(table, world, per_host, device, strict=False)
    strict = build(table, world, per_host, device, strict=True)
    if isinstance(trec, Exception) or isinstance(compat, Exception):
        what = check_deliberate_difference(case, trec, compat, strict, world, per_host)
        outcomes[what] = outcomes.get(what, 0) + 1
        return None
    md = compat
    shards = md.tables[case.name].shards
    # Ranks, in TorchRec's order, and for sharded tables every shard with its placement string.
    assert [s.rank for s in shards] == trec.ranks, case
    assert md.tables[case.name].dtype == DTYPES[case.data_type]
    if case.kind == "data_parallel":
        assert trec.sharding_spec is None
        assert all(s.offsets == (0, 0) and s.sizes == (case.rows, case.cols) for s in shards)
    else:
        assert ettkit_shards(md, case.name) == torchrec_shards(trec), case
        # The ShardedTensorMetadata a ShardedTensor of this table gets (TorchRec builds it from the spec).
        expected = trec.sharding_spec.build_metadata(
            torch.Size([case.rows, case.cols]), TensorProperties(dtype=DTYPES[case.data_type])
        )
        got = md.to_sharded_tensor_metadata(case.name)
        assert got.size == expected.size
        assert got.tensor_properties.dtype == expected.tensor_properties.dtype
        assert got.shards_metadata == expected.shards_metadata
        for r in set(trec.ranks):
            mine = [ls.shard for ls in md.local_shards(r) if ls.table == case.name]
            theirs = [(list(s.shard_offsets), list(s.shard_sizes), str(s.placement))
                      for s, rank in zip(trec.sharding_spec.shards, trec.ranks) if rank == r]
            assert [(list(s.offsets), list(s.sizes), s.placement) for s in mine] == theirs
    # Strict mode: the same layout where compat listed no sharp edge, the documented error where it did.
    if md.warnings:
        assert isinstance(strict, ettkit.InvalidArgumentError), (case, md.warnings)
        what = f"{case.kind}: equal to TorchRec in compat mode with a warning; strict raises"
        outcomes[what] = outcomes.get(what, 0) + 1
    else:
        assert isinstance(strict, S.GlobalMetadata), (case, strict)
        assert ettkit_shards(strict, case.name) == ettkit_shards(md, case.name)
    outcomes["equal"] = outcomes.get("equal", 0) + 1
    return config, trec, table


def compare_whole_plan(built: list[tuple], world: int, per_host: int, device: str) -> None:
    """from_torchrec of TorchRec's plan object and of its _serialize() JSON; to_torchrec_dict back."""
    configs = [c for c, _, _ in built]
    module_plan = {c.name: ps for c, ps, _ in built}
    plan = TorchRecPlan({"sparse.ebc": _module_sharding_plan(module_plan)})
    source = plan._serialize()
    expected = S.build_global_metadata(S.ShardingPlan([t for _, _, t in built], world, per_host, device))
    for form in (plan, source, json.dumps(source)):
        converted = S.from_torchrec(form, world_size=world, ranks_per_host=per_host, tables=configs,
                                    device=device if all(ps.sharding_spec is None for ps in module_plan.values())
                                    else None)
        assert converted.device == device
        md = S.build_global_metadata(converted)
        for c, ps, table in built:
            name = f"sparse.ebc.{c.name}"
            assert md.tables[name].table.dtype == table.dtype
            assert [(s.offsets, s.sizes, s.rank, s.placement) for s in md.tables[name].shards] == [
                (s.offsets, s.sizes, s.rank, s.placement) for s in expected.tables[c.name].shards]
            # A layout ettkit's rule reproduces stays compact; ZCH buckets and size_per_rank are explicit.
            compact = table.shards is None and table.num_buckets is None
            if compact and ps.sharding_type != "data_parallel":
                assert converted.table(name).shards is None, (name, converted.table(name))
        # Every rank's one call for all sharded tables equals TorchRec's build_metadata table by table.
        every = md.all_sharded_tensor_metadata()
        assert set(every) == {f"sparse.ebc.{c.name}" for c, ps, _ in built if ps.sharding_spec is not None}
        for c, ps, _ in built:
            if ps.sharding_spec is not None:
                assert every[f"sparse.ebc.{c.name}"] == ps.sharding_spec.build_metadata(
                    torch.Size([c.num_embeddings, c.embedding_dim]), TensorProperties(dtype=DTYPES[c.data_type]))
        back = S.to_torchrec_dict(md)["plan"]["sparse.ebc"]
        for param, entry in source["plan"]["sparse.ebc"].items():
            assert {**back[param], "compute_kernel": entry["compute_kernel"]} == entry, param


def _module_sharding_plan(per_param: dict):
    from torchrec.distributed.types import EmbeddingModuleShardingPlan

    out = EmbeddingModuleShardingPlan()
    out.update(per_param)
    return out


def test_every_generator_on_randomized_plans_matches_torchrec():
    rng = random.Random(24)
    outcomes: dict[str, int] = {}
    tables = 0
    for plan_index in range(150):
        world, per_host, device = random_topology(rng)
        cases = [random_case(rng, i, world, per_host) for i in range(rng.randint(1, 6))]
        built = []
        for case in cases:
            tables += 1
            result = compare_case(case, world, per_host, device, outcomes)
            if result is not None:
                built.append(result)
        if built:
            compare_whole_plan(built, world, per_host, device)
    print(f"\n{tables} tables in 150 plans:", json.dumps(outcomes, indent=1, sort_keys=True))
    # The generator really exercised the rules and every documented difference, not one easy path.
    assert outcomes["equal"] >= 350
    for needle in ("cols not divisible", "fewer ZCH buckets", "more hosts than column blocks",
                   "fewer hosts than column blocks", "with a warning; strict raises"):
        assert any(needle in k for k in outcomes), (needle, outcomes)


def test_calculate_shard_sizes_and_offsets_with_a_column_block():
    """The planner's path: TorchRec's calculate_shard_sizes_and_offsets with col_wise_shard_dim (min_partition)
    against an ettkit Table whose column_block is `torchrec_column_block(cols, min_partition)`."""
    rng = random.Random(1024)
    checked = 0
    for _ in range(400):
        per_host = rng.choice([1, 2, 3, 4, 8])
        world = per_host * rng.randint(1, 128 // per_host)
        rows = rng.choice([1, 3, 7, 100, 1000, rng.randint(1, 3000)])
        cols = rng.choice([8, 12, 64, 100, 128, 136, 256, 384, 512, 4 * rng.randint(1, 200), rng.randint(1, 300)])
        min_partition = rng.choice([None, 4, 8, 16, 32, 64, 128, rng.randint(1, 300)])
        kind = rng.choice(["column_wise", "table_column_wise", "grid_shard", "row_wise", "table_row_wise",
                           "table_wise", "data_parallel"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sizes, offsets = T.calculate_shard_sizes_and_offsets(
                torch.empty(rows, cols, device="meta"), world, per_host, kind, min_partition
            )
        block = S.torchrec_column_block(cols, min_partition)
        blocks = cols // block
        if kind in ("column_wise", "table_column_wise"):
            first = rng.randrange(world // per_host) * per_host
            ranks = [first + (j % per_host) for j in range(blocks)]  # table_column_wise: one host
            table = S.Table("t", rows, cols, "float32", kind, ranks, block)
        elif kind == "grid_shard":
            if blocks > world // per_host:
                continue  # more column blocks than hosts: no grid plan exists for this topology
            table = S.Table("t", rows, cols, "float32", kind, S.host_ranks(list(range(blocks)), per_host), block)
        elif kind == "table_row_wise":
            table = S.Table("t", rows, cols, "float32", kind, S.host_ranks(0, per_host))
        elif kind == "table_wise":
            table = S.Table("t", rows, cols, "float32", kind, [0])
        else:
            table = S.Table("t", rows, cols, "float32", kind)
        md = S.build_global_metadata(S.ShardingPlan([table], world, per_host), strict=True)
        got = md.tables["t"].shards
        assert [list(s.sizes) for s in got] == sizes, (kind, rows, cols, world, per_host, min_partition)
        assert [list(s.offsets) for s in got] == offsets, (kind, rows, cols, world, per_host, min_partition)
        checked += 1
    assert checked >= 350


def test_zero_rows_torchrec_divides_by_zero_compat_gives_empty_shards():
    # TorchRec's configs refuse 0 rows outright; its split functions raise ZeroDivisionError for row splits.
    for kind in ("row_wise", "table_row_wise", "grid_shard"):
        with pytest.raises(ZeroDivisionError):
            T.calculate_shard_sizes_and_offsets(torch.empty(0, 8, device="meta"), 4, 2, kind, 4)
    with pytest.raises(ZeroDivisionError):
        EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=8, num_embeddings=0)
    md = S.build_global_metadata(S.ShardingPlan([S.Table("t", 0, 8, "float32", "row_wise")], 4, 2))
    assert [(s.offsets, s.sizes) for s in md.tables["t"].shards] == [((0, 0), (0, 8))] * 4
    assert "ZeroDivisionError" in md.warnings[0]
    with pytest.raises(ettkit.InvalidArgumentError, match="has 0 rows"):
        S.build_global_metadata(S.ShardingPlan([S.Table("t", 0, 8, "float32", "row_wise")], 4, 2), strict=True)


def test_grid_with_fewer_hosts_than_column_blocks_loses_columns_in_torchrec():
    # 1000 x 256, block 128 (the default search) = 2 column blocks, but one host: TorchRec builds the first
    # block's shards only and columns 128..255 belong to no shard. ettkit refuses, in both modes.
    config = EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=256, num_embeddings=1000)
    ebc = EmbeddingBagCollection(tables=[config], device="meta")
    plan = T.construct_module_sharding_plan(ebc, {"t": T.grid_shard(host_indexes=[0])}, local_size=4,
                                            world_size=8, device_type="cuda")
    shards = plan["t"].sharding_spec.shards
    assert {tuple(s.shard_offsets)[1] for s in shards} == {0}
    assert sum(s.shard_sizes[0] * s.shard_sizes[1] for s in shards) == 1000 * 128  # half the table
    for strict in (False, True):
        with pytest.raises(ettkit.InvalidArgumentError, match="grid_shard has 1 hosts' ranks but column block 128"):
            S.build_global_metadata(
                S.ShardingPlan([S.Table("t", 1000, 256, "float32", "grid_shard", S.host_ranks(0, 4))], 8, 4),
                strict=strict,
            )


def test_from_torchrec_of_an_all_data_parallel_plan_needs_the_device(caplog):
    config = EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=16, num_embeddings=100)
    ebc = EmbeddingBagCollection(tables=[config], device="meta")
    module_plan = T.construct_module_sharding_plan(ebc, {"t": T.data_parallel()}, local_size=2, world_size=4,
                                                   device_type="cuda")
    with caplog.at_level(logging.WARNING, logger="ettkit.sharding"):
        plan = S.from_torchrec({"ebc": module_plan}, world_size=4, ranks_per_host=2, tables=[config])
    assert plan.device == "cpu"  # nothing in the plan says cuda
    assert "pass device='cuda'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ettkit.sharding"):
        plan = S.from_torchrec({"ebc": module_plan}, world_size=4, ranks_per_host=2, tables=[config],
                               device="cuda")
    assert plan.device == "cuda" and "pass device" not in caplog.text
    md = S.build_global_metadata(plan)
    assert [s.placement for s in md.tables["ebc.t"].shards] == [f"rank:{r}/cuda:{r % 2}" for r in range(4)]
