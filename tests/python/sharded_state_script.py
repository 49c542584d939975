"""One gloo rank of tests/python/test_checkpoint_sharded.py: ShardedTensor and DTensor state through ettkit.

Usage: ``sharded_state_script.py RANK WORLD INIT_METHOD DIR``. Prints ``ok <rank>`` at the end; any failed
check raises (a non-zero exit with the traceback on stderr).
"""

from __future__ import annotations

import os
import sys

import ettkit
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ettkit.checkpoint import AsyncCheckpointer, DcpStager
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor import distribute_tensor


def sharded(size, dtype, layout, seed):
    """A ShardedTensor of ``size`` whose shards are ``layout``: [(offsets, sizes, rank)], rank r holding its
    own in order. Values: a seeded random tensor of the whole size, so every rank agrees on them."""
    rank = dist.get_rank()
    whole = torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    metas = [ShardMetadata(list(o), list(s), f"rank:{r}/cpu") for o, s, r in layout]
    local = []
    for m, (o, s, r) in zip(metas, layout):
        if r == rank:
            part = whole[tuple(slice(a, a + n) for a, n in zip(o, s))].clone()
            local.append(Shard(part, m))
    md = ShardedTensorMetadata(metas, torch.Size(size), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md), whole


def local_values(st) -> list:
    return [s.tensor.clone() for s in st.local_shards()]


def expect_raises(fn, *needles):
    try:
        fn()
    except ettkit.InvalidArgumentError as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return str(e)
    raise AssertionError(f"no InvalidArgumentError (wanted {needles})")


def main() -> None:
    rank, world, init, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    assert world == 2
    # Rows split 6/4 (uneven); columns of a bf16 tensor in three blocks, rank 1 holding two of them.
    rows = [((0, 0), (6, 5), 0), ((6, 0), (4, 5), 1)]
    cols = [((0, 0), (3, 4), 1), ((0, 4), (3, 4), 0), ((0, 8), (3, 2), 1)]
    emb, emb_whole = sharded((10, 5), torch.float32, rows, seed=1)
    col, col_whole = sharded((3, 10), torch.bfloat16, cols, seed=2)
    dense = torch.arange(4.0)
    state = {"emb": emb, "nested": {"col": col}, "dense": dense, "step_count": 7}

    # ---- the native checkpointer: each rank its local shards, loaded back in place ------------------
    ckdir = os.path.join(base, "native")
    with AsyncCheckpointer(ckdir) as ck:
        ck.save(1, state).wait()
        saved = [local_values(emb), local_values(col), dense.clone()]
        ptrs = [s.tensor.data_ptr() for s in emb.local_shards() + col.local_shards()]
        for s in emb.local_shards() + col.local_shards():
            s.tensor.fill_(-1)
        dense.zero_()
        state["step_count"] = 0
        step, _ = ck.load_latest(state)
        assert step == 1 and state["step_count"] == 7
        for got, want in zip(local_values(emb) + local_values(col), saved[0] + saved[1]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(dense, saved[2])
        assert ptrs == [s.tensor.data_ptr() for s in emb.local_shards() + col.local_shards()]  # in place
        # The saved values are the whole tensor's parts: the file names each by its offsets.
        assert len(col.local_shards()) == (2 if rank == 1 else 1)

    # Another layout at the same world size (rows split 5/5 instead of 6/4): each rank reads its new rows from
    # both ranks' files (resharding), the untouched col from its own.
    with AsyncCheckpointer(ckdir, read_only=True) as ck:
        other, _ = sharded((10, 5), torch.float32, [((0, 0), (5, 5), 0), ((5, 0), (5, 5), 1)], seed=3)
        assert ck.load_latest({**state, "emb": other})[0] == 1
        assert ck.resharded_from == 2
        assert torch.equal(other.local_shards()[0].tensor, emb_whole[5 * rank:5 * rank + 5])
        # Another dtype, another global size (also of a plain tensor where a ShardedTensor was): refused before
        # anything is copied, naming the key.
        wide, _ = sharded((10, 6), torch.float32, [((0, 0), (5, 6), 0), ((5, 0), (5, 6), 1)], seed=3)
        before = local_values(wide)
        msg = expect_raises(lambda: ck.load_latest({**state, "emb": wide}), "'emb'", "another global size",
                            "[10, 5]", "[10, 6]")
        assert "'nested.col'" not in msg, msg
        assert all(torch.equal(a, b) for a, b in zip(before, local_values(wide)))
        half, _ = sharded((3, 10), torch.float16, cols, seed=2)
        expect_raises(lambda: ck.load_latest({**state, "nested": {"col": half}}), "'nested.col'", "torch.float16")
        wide_plain = torch.full((10, 6), -1.0)
        expect_raises(lambda: ck.load_latest({**state, "emb": wide_plain}), "'emb' is [10, 6] in the state",
                      "saved it sharded, its pieces making up [10, 5]")
        assert (wide_plain == -1).all()
        # A plain tensor of the global size reads the whole table from both ranks' pieces (one process's model).
        whole = torch.zeros(10, 5)
        assert ck.load_latest({**state, "emb": whole})[0] == 1
        assert torch.equal(whole, emb_whole)

    # ---- DTensor: Shard(d) on a 1-D mesh saves and loads in place; a Partial one is refused, naming the key
    # and the DCP path --------------------------------------------------------------------------------------
    mesh = init_device_mesh("cpu", (world,))
    whole = torch.randn(8, 3, generator=torch.Generator().manual_seed(4))
    dt = distribute_tensor(whole, mesh, [DShard(0)])
    with AsyncCheckpointer(os.path.join(base, "dtensor")) as ck:
        ck.save(1, {"w": dt}).wait()
        back = distribute_tensor(torch.zeros(8, 3), mesh, [DShard(0)])
        assert ck.load_latest({"w": back})[0] == 1
        assert torch.equal(back.to_local(), dt.to_local()) and back.placements == dt.placements
        from torch.distributed.tensor import DTensor, Partial

        partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()], run_check=False)
        expect_raises(lambda: ck.save(2, {"w": partial}), "'w'", "DTensor", "Partial", "DcpStager")

    # ---- DcpStager under DCP: ShardedTensor and DTensor staged, written, loaded by DCP ---------------
    dcp_state = {"emb": emb, "col": col, "dt": dt, "dense": dense}
    want = {"emb": local_values(emb), "col": local_values(col), "dt": dt.to_local().clone(), "dense": dense.clone()}
    stager = DcpStager()
    fut = dcp.async_save(dcp_state, checkpoint_id=os.path.join(base, "dcp"), async_stager=stager)
    # Writes right after async_save returns: the staged copies are what DCP writes.
    for s in emb.local_shards() + col.local_shards():
        s.tensor.add_(100)
    dt.to_local().add_(100)
    dense.add_(100)
    fut.result()
    stager.close()
    dcp.load(dcp_state, checkpoint_id=os.path.join(base, "dcp"))
    for got, exp in zip(local_values(emb) + local_values(col), want["emb"] + want["col"]):
        assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    assert torch.equal(dt.to_local(), want["dt"]) and torch.equal(dense, want["dense"])
    # DCP's metadata records the whole tensors: a load at another layout reads the right rows.
    other, other_whole = sharded((10, 5), torch.float32, [((0, 0), (5, 5), 0), ((5, 0), (5, 5), 1)], seed=3)
    dcp.load({"emb": other}, checkpoint_id=os.path.join(base, "dcp"))
    lo = 5 * rank
    assert torch.equal(other.local_shards()[0].tensor, emb_whole[lo:lo + 5])
    dist.barrier()
    dist.destroy_process_group()
    print(f"ok {rank}", flush=True)


if __name__ == "__main__":
    main()
