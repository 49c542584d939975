"""One rank of a job that saves tensors in one kind of layout and loads them in the other (#46), run by
test_checkpoint_layout_kinds.py: a sharded step read whole (a plain model on one process, a data-parallel
table on every rank) and a step saved whole read as shards (a one-process model restored into DTensors and
ShardedTensors at several ranks).

python layout_kind_worker.py RANK WORLD INIT CKPT_DIR MODE OUT_DIR

WORLD 1 runs without a process group. Modes:
- ``save_sharded``: row-wise, column-wise and table-wise ShardedTensors, DTensors with Shard(0), Shard(1) and
  Replicate() on a 1-D mesh, and a plain replica, as step 5;
- ``load_whole``: all of them into plain tensors; ``load_whole_wrong``: the same with one table a row
  larger (refused, nothing copied);
- ``save_whole``: plain tensors, one of them different on every rank (per-rank state), as step 5;
- ``load_sharded``: the replicas into a DTensor (Shard(0)) and a column-wise ShardedTensor;
  ``load_sharded_wrong``: the DTensor a row larger; ``load_per_rank_sharded``: the per-rank tensor as a
  DTensor (both refused). The loads are partial (the per-rank tensor left out).
Every value is a function of its global position, so each rank knows what it must hold. Writes
OUT_DIR/<mode>-<rank>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import reshard_worker as R
from ettkit import InvalidArgumentError
from ettkit.checkpoint import AsyncCheckpointer

ROWS, COLS = R.ROWS, R.COLS
KINDS = {"tables": ("row", "col", "tab"), "dtensors": ("dt_row", "dt_col", "dt_rep")}


def values(kind: str, rank: int = 0) -> torch.Tensor:
    if kind in ("row", "col", "tab", "dt_row", "dt_col", "dt_rep"):
        return R.full(kind, 5)
    base = {"rep": 7000, "w_dt": 8000, "w_st": 9000, "per_rank": 100000 * (rank + 1)}[kind]
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + base


def main() -> int:
    rank, world, init, ckpt, mode, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
                                          sys.argv[6])
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    report: dict = {}
    with AsyncCheckpointer(ckpt, recorder=None) as ck:
        if mode == "save_sharded":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
            state = {"tables": {k: R.sharded(k, world, rank, values(k)) for k in KINDS["tables"]},
                     "dtensors": {k: R.dtensor(k, mesh, values(k)) for k in KINDS["dtensors"]},
                     "rep": values("rep")}
            ck.save(5, state).wait()
        elif mode == "save_whole":
            state = {"w_dt": values("w_dt"), "w_st": values("w_st"), "per_rank": values("per_rank", rank)}
            ck.save(5, state).wait()
        elif mode in ("load_whole", "load_whole_wrong"):
            state = {group: {k: torch.zeros(ROWS, COLS) for k in kinds} for group, kinds in KINDS.items()}
            state["rep"] = torch.zeros(ROWS, COLS)
            if mode == "load_whole_wrong":
                state["tables"]["col"] = torch.zeros(ROWS + 1, COLS)
            try:
                step, _ = ck.load_latest(state)
                report["step"] = step
            except InvalidArgumentError as e:
                report["refused"] = str(e)
            report["equal"] = sorted(f"{g}.{k}" for g, kinds in KINDS.items() for k in kinds
                                     if torch.equal(state[g][k], values(k)))
            report["equal"] += ["rep"] if torch.equal(state["rep"], values("rep")) else []
            report["untouched"] = sorted(f"{g}.{k}" for g, kinds in KINDS.items() for k in kinds
                                         if not state[g][k].any())
            report["resharded_from"] = ck.resharded_from
            report["bytes"] = ck.reshard_bytes
        else:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
            rows = ROWS + 1 if mode == "load_sharded_wrong" else ROWS
            dt = R.dtensor("dt_row", mesh, torch.zeros(rows, COLS))
            state = {"w_dt": dt, "w_st": R.sharded("col", world, rank, torch.zeros(ROWS, COLS))}
            if mode == "load_per_rank_sharded":
                state = {"w_dt": state["w_dt"], "w_st": state["w_st"],
                         "per_rank": R.dtensor("dt_row", mesh, torch.zeros(ROWS, COLS))}
            try:
                # The step also holds the per-rank tensor: partial=True leaves it unread where the state lacks it.
                step, _ = ck.load_latest(state, partial=True)
                report["step"] = step
            except InvalidArgumentError as e:
                report["refused"] = str(e)
            shape, offsets = R.compute_local_shape_and_global_offset(state["w_dt"].shape, mesh,
                                                                      state["w_dt"].placements)
            local = state["w_dt"]._local_tensor
            want = values("w_dt")
            report["w_dt"] = bool(torch.equal(local, want[offsets[0]:offsets[0] + shape[0]])) if rows == ROWS else None
            report["w_dt_untouched"] = not local.any()
            report["w_st"] = all(torch.equal(s.tensor, values("w_st")[
                s.metadata.shard_offsets[0]:s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0],
                s.metadata.shard_offsets[1]:s.metadata.shard_offsets[1] + s.metadata.shard_sizes[1]])
                for s in state["w_st"].local_shards())
            report["w_st_shards"] = len(state["w_st"].local_shards())
            report["resharded_from"] = ck.resharded_from
    with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
        json.dump(report, f)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
