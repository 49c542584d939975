"""ettkit.sharding across 2 and 4 gloo ranks: broadcast_plan (one and two chunks, any source rank), the
16-byte consistency check, equality with the all-gather baseline, ShardedTensor construction from the
local metadata, and failures that reach every rank instead of hanging; NCCL on a GPU machine. The
scenarios live in sharding_workers.py."""

from __future__ import annotations


import pytest
import sharding_workers
import torch
import torch.multiprocessing as mp


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharding_across_gloo_ranks(tmp_path, world_size):
    mp.spawn(
        sharding_workers.scenarios, args=(world_size, str(tmp_path / "init")), nprocs=world_size, join=True
    )


@pytest.mark.needs_cuda  # skipped without a GPU; a failure then when ETTKIT_REQUIRE_CUDA=1 (cuda_gate.py)
def test_broadcast_over_nccl(tmp_path):
    world_size = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    assert world_size >= 1, "ETTKIT_REQUIRE_CUDA=1 but no CUDA device is visible"
    mp.spawn(
        sharding_workers.nccl_scenario,
        args=(world_size, str(tmp_path / "init")),
        nprocs=world_size,
        join=True,
    )
