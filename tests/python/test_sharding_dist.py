"""ettkit.sharding across 2 and 4 gloo ranks: broadcast_plan (one and two chunks, any source rank), the
16-byte consistency check, equality with the all-gather baseline, ShardedTensor construction from the
local metadata, and failures that reach every rank instead of hanging. The scenarios live in
sharding_workers.py."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

import sharding_workers


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharding_across_gloo_ranks(tmp_path, world_size):
    mp.spawn(sharding_workers.scenarios, args=(world_size, str(tmp_path / "init")), nprocs=world_size, join=True)
