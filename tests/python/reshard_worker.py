"""One rank of a gloo job that saves a sharded state at one world size or loads it at another, run by
test_checkpoint_reshard.py.

python reshard_worker.py RANK WORLD INIT CKPT_DIR save|load|dcp OUT_DIR [STEP]

The state: three ShardedTensors of a 10 x 6 table laid out row-wise, column-wise (torch.chunk of the rows or
columns over the ranks, some ranks possibly empty) and table-wise (the whole table on one rank), three
DTensors on a 1-D mesh (Shard(0), Shard(1), Replicate()), plus a
replicated Linear and its Adam state after one step (plain tensors, the same on every rank). Every value is
a function of the global position, so a loading rank knows what each of its shards must hold. `save` saves
STEP (default 5); `load` loads the newest valid step and writes OUT_DIR/load-<rank>.json with what it
found. `dcp` loads the tables, the DTensors and the Linear with dcp.load through EttkitStorageReader and
writes OUT_DIR/dcp-<rank>.json.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ettkit.checkpoint import AsyncCheckpointer

ROWS, COLS = 10, 6


def full(kind: str, step: int) -> torch.Tensor:
    base = {"row": 0, "col": 1000, "tab": 2000, "dt_row": 3000, "dt_col": 4000, "dt_rep": 5000}[kind]
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + base + 10000 * step)


def box(kind: str, world: int, rank: int):
    """(offsets, sizes) of this rank's shard, or None."""
    if kind == "tab":
        return ((0, 0), (ROWS, COLS)) if rank == 1 % world else None
    dim = 0 if kind == "row" else 1
    extent = ROWS if dim == 0 else COLS
    chunk = -(-extent // world)
    lo = min(rank * chunk, extent)
    hi = min(lo + chunk, extent)
    if hi <= lo:
        return None
    return ((lo, 0), (hi - lo, COLS)) if dim == 0 else ((0, lo), (ROWS, hi - lo))


def sharded(kind: str, world: int, rank: int, values: torch.Tensor):
    b = box(kind, world, rank)
    shards = []
    if b is not None:
        (o0, o1), (s0, s1) = b
        shards.append(Shard(values[o0:o0 + s0, o1:o1 + s1].clone(),
                            ShardMetadata([o0, o1], [s0, s1], f"rank:{rank}/cpu")))
    return init_from_local_shards(shards, [ROWS, COLS])


DT_PLACEMENT = {"dt_row": DShard(0), "dt_col": DShard(1), "dt_rep": Replicate()}


def dtensor(kind: str, mesh, values: torch.Tensor):
    # Built from this rank's piece (no collective): the values are a function of the position.
    shape, offsets = compute_local_shape_and_global_offset(values.shape, mesh, [DT_PLACEMENT[kind]])
    local = values[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]].clone()
    return DTensor.from_local(local, mesh, [DT_PLACEMENT[kind]], run_check=False, shape=values.shape,
                              stride=values.stride())


def dtensor_ok(kind: str, t, step: int) -> bool:
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    want = full(kind, step)[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]]
    return torch.equal(t._local_tensor, want)


def model_and_optim(trained: bool):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    if trained:
        lin(torch.ones(2, 4)).sum().backward()
        opt.step()
    else:
        with torch.no_grad():
            for p in lin.parameters():
                p.zero_()
    return lin, opt


def main() -> int:
    rank, world, init, ckpt, mode, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
                                          sys.argv[6])
    step = int(sys.argv[7]) if len(sys.argv) > 7 else 5
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    saving = mode == "save"
    tables = {k: sharded(k, world, rank, full(k, step) if saving else torch.zeros(ROWS, COLS))
              for k in ("row", "col", "tab")}
    mesh = init_device_mesh("cpu", (world,))
    dtensors = {k: dtensor(k, mesh, full(k, step) if saving else torch.zeros(ROWS, COLS)) for k in DT_PLACEMENT}
    lin, opt = model_and_optim(trained=saving)
    state = {"tables": tables, "dtensors": dtensors, "model": lin, "optim": opt}
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from ettkit.checkpoint import EttkitStorageReader

        dcp.load({"tables": tables, "dtensors": dtensors, "model": lin.state_dict()},
                 storage_reader=EttkitStorageReader(ckpt))
        ok = {k: all(torch.equal(s.tensor, full(k, step)[s.metadata.shard_offsets[0]:s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0],
                                                          s.metadata.shard_offsets[1]:s.metadata.shard_offsets[1] + s.metadata.shard_sizes[1]])
                     for s in st.local_shards()) for k, st in tables.items()}
        ok.update({k: dtensor_ok(k, t, step) for k, t in dtensors.items()})
        ref_lin, _ = model_and_optim(trained=True)
        ok["model"] = all(torch.equal(a, b) for a, b in zip(lin.state_dict().values(), ref_lin.state_dict().values()))
        with open(os.path.join(out, f"dcp-{rank}.json"), "w") as f:
            json.dump(ok, f)
        dist.destroy_process_group()
        return 0
    with AsyncCheckpointer(ckpt, recorder=None) as ck:
        if saving:
            ck.save(step, state, extra={"step": step, "saved_by": world}).wait()
            ref_lin, ref_opt = model_and_optim(trained=True)
            torch.save({"model": ref_lin.state_dict(), "optim": ref_opt.state_dict()}, os.path.join(out, "reference.pt"))
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                restored = ck.load_latest(state)
            got_step = restored[0]
            ok = {}
            for k, st in tables.items():
                want = full(k, got_step)
                ok[k] = all(torch.equal(s.tensor, want[s.metadata.shard_offsets[0]:s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0],
                                                       s.metadata.shard_offsets[1]:s.metadata.shard_offsets[1] + s.metadata.shard_sizes[1]])
                            for s in st.local_shards())
            for k, t in dtensors.items():
                ok[k] = dtensor_ok(k, t, got_step)
            ref_lin, ref_opt = model_and_optim(trained=True)
            ok["model"] = all(torch.equal(a, b) for a, b in zip(lin.state_dict().values(), ref_lin.state_dict().values()))
            mine, theirs = opt.state_dict(), ref_opt.state_dict()
            ok["optim"] = (mine["param_groups"] == theirs["param_groups"] and set(mine["state"]) == set(theirs["state"])
                           and all(torch.equal(mine["state"][i][n], theirs["state"][i][n])
                                   for i in theirs["state"] for n in theirs["state"][i]))
            shard_bytes = sum(s.tensor.numel() * 4 for st in tables.values() for s in st.local_shards())
            shard_bytes += sum(t._local_tensor.numel() * 4 for t in dtensors.values())
            plain_bytes = sum(t.numel() * t.element_size() for t in lin.state_dict().values())
            plain_bytes += sum(v.numel() * v.element_size() for s in theirs["state"].values() for v in s.values())
            with open(os.path.join(out, f"load-{rank}.json"), "w") as f:
                json.dump({"step": got_step, "extra": restored[1], "ok": ok, "resharded_from": ck.resharded_from,
                           "bytes": ck.reshard_bytes, "needed_bytes": shard_bytes + plain_bytes,
                           "warnings": [str(w.message) for w in caught]}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
