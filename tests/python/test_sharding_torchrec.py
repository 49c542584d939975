"""Interop with TorchRec plans, tested on the JSON / dict form (TorchRec is not needed) and on duck-typed
ParameterSharding objects built from torch's own ShardMetadata / EnumerableShardingSpec; with the real
TorchRec objects when TorchRec is importable."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import ettkit
import pytest
from ettkit import sharding as S
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec_gate import import_torchrec


def torchrec_json_32_ranks() -> dict:
    """The `_serialize()` JSON of TorchRec's test_construct_module_sharding_plan (world 32, local 8)."""

    def shards(items):
        return [{"shard_offsets": o, "shard_sizes": s, "placement": p} for o, s, p in items]

    return {
        "plan": {
            "sparse.ebc": {
                "table_0": {
                    "sharding_type": "data_parallel",
                    "compute_kernel": "dense",
                    "ranks": list(range(32)),
                },
                "table_1": {
                    "sharding_type": "table_wise",
                    "compute_kernel": "dense",
                    "ranks": [1],
                    "shards": shards([([0, 0], [1024, 256], "rank:1/cuda:1")]),
                },
                "table_2": {
                    "sharding_type": "row_wise",
                    "compute_kernel": "dense",
                    "ranks": list(range(32)),
                    "shards": shards([([32 * i, 0], [32, 256], f"rank:{i}/cuda:{i % 8}") for i in range(32)]),
                },
                "table_3": {
                    "sharding_type": "column_wise",
                    "compute_kernel": "dense",
                    "ranks": [8, 9],
                    "shards": shards(
                        [([0, 0], [1024, 128], "rank:8/cuda:0"), ([0, 128], [1024, 128], "rank:9/cuda:1")]
                    ),
                },
                "table_4": {
                    "sharding_type": "table_row_wise",
                    "compute_kernel": "dense",
                    "ranks": list(range(24, 32)),
                    "shards": shards(
                        [([128 * j, 0], [128, 256], f"rank:{24 + j}/cuda:{j}") for j in range(8)]
                    ),
                },
                "table_5": {
                    "sharding_type": "grid_shard",
                    "compute_kernel": "dense",
                    "ranks": list(range(16)),
                    "shards": shards(
                        [
                            ([128 * j, 128 * b], [128, 128], f"rank:{8 * b + j}/cuda:{j}")
                            for b in range(2)
                            for j in range(8)
                        ]
                    ),
                },
            }
        }
    }


CONFIGS = {f"table_{i}": (1024, 256, "FP16") for i in range(6)}  # TorchRec DataType names


def test_json_plan_converts_to_compact_tables_and_back():
    source = torchrec_json_32_ranks()
    for form in (source, json.dumps(source)):
        plan = S.from_torchrec(form, world_size=32, ranks_per_host=8, tables=CONFIGS)
        assert plan.device == "cuda"
        assert [t.name for t in plan.tables] == [f"sparse.ebc.table_{i}" for i in range(6)]
        # Every table is reproduced by ettkit's rule, so none needs an explicit shard list.
        assert all(t.shards is None for t in plan.tables)
        assert all(t.dtype == "float16" for t in plan.tables)
        assert plan.table("sparse.ebc.table_3").column_block == 128
        md = S.build_global_metadata(plan, strict=True)
        assert S.to_torchrec_dict(md) == source


def test_duck_typed_parameter_sharding_objects():
    def ps(kind, ranks, items):
        spec = EnumerableShardingSpec([ShardMetadata(o, s, p) for o, s, p in items]) if items else None
        return SimpleNamespace(sharding_type=kind, compute_kernel="dense", ranks=ranks, sharding_spec=spec)

    module_plan = {
        "t_rw": ps(
            "row_wise",
            [0, 1, 2],
            [
                ([0, 0], [334, 8], "rank:0/cpu"),
                ([334, 0], [334, 8], "rank:1/cpu"),
                ([668, 0], [332, 8], "rank:2/cpu"),
            ],
        ),
        "t_dp": ps("data_parallel", [0, 1, 2], None),
    }
    sharding_plan = SimpleNamespace(plan={"model.ebc": module_plan})
    plan = S.from_torchrec(
        sharding_plan, world_size=3, ranks_per_host=3, tables={"t_dp": (7, 8, "float32")}, dtype="bfloat16"
    )
    rw = plan.table("model.ebc.t_rw")
    assert (rw.rows, rw.cols, rw.dtype, rw.ranks, rw.shards) == (1000, 8, "bfloat16", (), None)
    assert plan.table("model.ebc.t_dp").rows == 7
    # One module's {param: ParameterSharding}, names unqualified.
    plan = S.from_torchrec(
        module_plan,
        world_size=3,
        ranks_per_host=3,
        tables={"t_dp": (7, 8, "float32")},
        dtype="float32",
        qualify=False,
    )
    assert [t.name for t in plan.tables] == ["t_rw", "t_dp"]


def test_layouts_outside_the_rules_become_explicit_shards():
    # A planner's uneven row split (device memory [1, 1, 1] -> 333, 333, 334) and
    # column_wise(size_per_rank=[30, 40, 30]) (TorchRec test_column_wise_size_per_rank).
    source = {
        "plan": {
            "": {
                "uneven": {
                    "sharding_type": "row_wise",
                    "ranks": [0, 1, 2],
                    "shards": [
                        {"shard_offsets": [0, 0], "shard_sizes": [333, 4], "placement": "rank:0/cuda:0"},
                        {"shard_offsets": [333, 0], "shard_sizes": [333, 4], "placement": "rank:1/cuda:1"},
                        {"shard_offsets": [666, 0], "shard_sizes": [334, 4], "placement": "rank:2/cuda:2"},
                    ],
                },
                "cw": {
                    "sharding_type": "column_wise",
                    "ranks": [0, 1, 2],
                    "shards": [
                        {"shard_offsets": [0, 0], "shard_sizes": [1024, 30], "placement": "rank:0/cuda:0"},
                        {"shard_offsets": [0, 30], "shard_sizes": [1024, 40], "placement": "rank:1/cuda:1"},
                        {"shard_offsets": [0, 70], "shard_sizes": [1024, 30], "placement": "rank:2/cuda:2"},
                    ],
                },
            }
        }
    }
    plan = S.from_torchrec(source, world_size=3, ranks_per_host=3, dtype="float32")
    assert plan.table("uneven").shards == ((0, 0, 333, 4, 0), (333, 0, 333, 4, 1), (666, 0, 334, 4, 2))
    assert plan.table("cw").shards is not None
    md = S.build_global_metadata(plan, strict=True)
    assert S.to_torchrec_dict(md)["plan"][""]["cw"]["shards"] == [
        {**s, "placement": s["placement"]} for s in source["plan"][""]["cw"]["shards"]
    ]
    assert S.decode(S.encode(plan)) == plan  # explicit layouts travel through the codec too


def test_bad_torchrec_plans():
    source = torchrec_json_32_ranks()
    with pytest.raises(
        ettkit.InvalidArgumentError, match="table 'sparse.ebc.table_0': a TorchRec plan carries no dtype"
    ):
        S.from_torchrec(source, world_size=32, ranks_per_host=8)
    with pytest.raises(
        ettkit.InvalidArgumentError, match="table 'sparse.ebc.table_0': data_parallel entries carry no shards"
    ):
        S.from_torchrec(source, world_size=32, ranks_per_host=8, dtype="float32")
    overlapping = {
        "plan": {
            "": {
                "t": {
                    "sharding_type": "row_wise",
                    "ranks": [0, 1],
                    "shards": [
                        {"shard_offsets": [0, 0], "shard_sizes": [6, 4], "placement": "rank:0/cpu"},
                        {"shard_offsets": [5, 0], "shard_sizes": [5, 4], "placement": "rank:1/cpu"},
                    ],
                }
            }
        }
    }
    plan = S.from_torchrec(overlapping, world_size=2, ranks_per_host=2, dtype="float32")
    with pytest.raises(ettkit.InvalidArgumentError, match="table 't': .* overlap"):
        S.build_global_metadata(plan)
    with pytest.raises(ettkit.InvalidArgumentError, match="from_torchrec takes"):
        S.from_torchrec(42, world_size=2, ranks_per_host=2)


def test_placement_rank_quirk_uses_ranks(caplog):
    # TorchRec's inference placement_helper puts every CPU shard on "rank:0/cpu" while ranks say otherwise.
    source = {
        "plan": {
            "": {
                "t": {
                    "sharding_type": "column_wise",
                    "ranks": [0, 1],
                    "shards": [
                        {"shard_offsets": [0, 0], "shard_sizes": [8, 2], "placement": "rank:0/cpu"},
                        {"shard_offsets": [0, 2], "shard_sizes": [8, 2], "placement": "rank:0/cpu"},
                    ],
                }
            }
        }
    }
    with caplog.at_level(logging.WARNING, logger="ettkit.sharding"):
        plan = S.from_torchrec(source, world_size=2, ranks_per_host=2, dtype="float32")
    assert "disagree" in caplog.text
    assert [s.rank for s in S.build_global_metadata(plan).tables["t"].shards] == [0, 1]


def test_real_torchrec_plan_when_installed():
    # torchrec_gate: a skip where TorchRec is not expected, a failure where `make build` installed it.
    import_torchrec()
    import torchrec.distributed.sharding_plan as trec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: F401
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(name=f"table_{i}", feature_names=[f"f{i}"], embedding_dim=256, num_embeddings=1024)
        for i in range(6)
    ]
    module_plan = trec.construct_module_sharding_plan(
        EmbeddingBagCollection(tables=configs, device="meta"),
        per_param_sharding={
            "table_0": trec.data_parallel(),
            "table_1": trec.table_wise(rank=1),
            "table_2": trec.row_wise(),
            "table_3": trec.column_wise(ranks=[8, 9]),
            "table_4": trec.table_row_wise(host_index=3),
            "table_5": trec.grid_shard(host_indexes=[0, 1]),
        },
        local_size=8,
        world_size=32,
        device_type="cuda",
    )
    plan = S.from_torchrec(module_plan, world_size=32, ranks_per_host=8, tables=configs)
    assert all(t.shards is None for t in plan.tables)
    expected = torchrec_json_32_ranks()["plan"]["sparse.ebc"]
    got = S.to_torchrec_dict(S.build_global_metadata(plan))["plan"][""]
    assert {k: {**v, "compute_kernel": "dense"} for k, v in got.items()} == expected
