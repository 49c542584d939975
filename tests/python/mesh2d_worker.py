"""One rank of a gloo job that saves DTensors laid out on a 1-D or 2-D mesh, or loads them into another
layout, run by test_checkpoint_mesh2d.py.

python mesh2d_worker.py RANK WORLD INIT CKPT_DIR save|load|dcp MESH OUT_DIR

MESH is the mesh shape: "2x2", "4x1", "1x4", "2x1" (2-D) or "4", "2" (1-D). Five 10 x 6 tensors, each laid out as HSDP
(Replicate(), Shard(0)), FSDP + TP (Shard(0), Shard(1)), (Shard(1), Replicate()), two Shard(0) on one
dimension, and replicated on every dimension; on a 1-D mesh as Shard(0), Shard(1), Shard(1), Shard(0) and
Replicate(). Every value is a function of its global position and the step, so a loading rank knows what
its piece must hold. With MESH2D_PER_RANK=1 the state also holds per-rank state: a plain tensor and a
non-tensor leaf whose values are the rank's own (set when saving at 4 ranks and loading at 4 ranks in any
layout: each rank must get its own back). `save` saves step 5; `load` loads the newest step and writes
OUT_DIR/load-<rank>.json: whether each local tensor holds its values, and the error of a load that must be
refused. `dcp` loads the step with dcp.load through EttkitStorageReader and writes the same file (without the
refusal).
"""

import json
import os
import sys

import ettkit
import torch
import torch.distributed as dist
from ettkit.checkpoint import AsyncCheckpointer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

ROWS, COLS, STEP = 10, 6, 5
LAYOUTS_2D = {"hsdp": (Replicate(), Shard(0)), "fsdp_tp": (Shard(0), Shard(1)), "col_rep": (Shard(1), Replicate()),
              "nested": (Shard(0), Shard(0)), "rep": (Replicate(), Replicate())}
LAYOUTS_1D = {"hsdp": (Shard(0),), "fsdp_tp": (Shard(1),), "col_rep": (Shard(1),), "nested": (Shard(0),),
              "rep": (Replicate(),)}


def full(name: str, step: int, rows: int = ROWS) -> torch.Tensor:
    base = 1000 * list(LAYOUTS_2D).index(name)
    return torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS) + base + 10000 * step


def dtensor(values: torch.Tensor, mesh, placements) -> DTensor:
    # Built from this rank's piece (no collective): the values are a function of the position.
    shape, offsets = compute_local_shape_and_global_offset(values.shape, mesh, placements)
    local = values[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=values.shape, stride=values.stride())


def holds(t: DTensor, name: str, step: int) -> bool:
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    want = full(name, step)[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]]
    return tuple(t._local_tensor.shape) == tuple(want.shape) and torch.equal(t._local_tensor, want)


def state_on(mesh, saving: bool, rows: int = ROWS) -> dict:
    layouts = LAYOUTS_2D if mesh.ndim == 2 else LAYOUTS_1D
    state = {"dt": {name: dtensor(full(name, STEP, rows) if saving else torch.zeros(rows, COLS), mesh, p)
                    for name, p in layouts.items()}}
    if os.environ.get("MESH2D_PER_RANK") == "1":
        rank = dist.get_rank()
        state["mine"] = {"t": torch.full((3,), float(rank) if saving else -1.0), "who": rank if saving else -1}
    return state


def refusal(ck: AsyncCheckpointer, state: dict) -> str:
    try:
        ck.load_latest(state)
    except ettkit.InvalidArgumentError as e:
        return str(e)
    return "loaded"


def main() -> int:
    rank, world, init, ckpt, mode, shape, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                 sys.argv[5], sys.argv[6], sys.argv[7])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", tuple(int(d) for d in shape.split("x")))
    state = state_on(mesh, saving=mode == "save")
    if mode == "dcpstage":
        # DCP's async save with ettkit's stager, on this 2-D mesh; the local tensors are written right after
        # async_save returns: what DCP writes is the staged copy. Then dcp.load into a 4 x 1 and a 1-D mesh.
        import torch.distributed.checkpoint as dcp
        from ettkit.checkpoint import DcpStager

        saving = state_on(mesh, saving=True)
        fut = dcp.async_save(saving, checkpoint_id=ckpt, async_stager=DcpStager())
        for t in saving["dt"].values():
            t._local_tensor.add_(100)
        fut.result()
        ok = {}
        for other in ("4x1", "4"):
            target = state_on(init_device_mesh("cpu", tuple(int(d) for d in other.split("x"))), saving=False)
            dcp.load(target, checkpoint_id=ckpt)
            ok[other] = {n: holds(t, n, STEP) for n, t in target["dt"].items()}
        with open(os.path.join(out, f"load-{rank}.json"), "w") as f:
            json.dump({"step": STEP, "ok": ok}, f)
        dist.destroy_process_group()
        return 0
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from ettkit.checkpoint import EttkitStorageReader

        dcp.load(state, storage_reader=EttkitStorageReader(ckpt))
        with open(os.path.join(out, f"load-{rank}.json"), "w") as f:
            json.dump({"step": STEP, "ok": {n: holds(t, n, STEP) for n, t in state["dt"].items()}}, f)
        dist.destroy_process_group()
        return 0
    with AsyncCheckpointer(ckpt, recorder=None, preempt_signals=()) as ck:
        if mode == "save":
            ck.save(STEP, state).wait()
        else:
            # Refused before anything is copied: another global shape (names the key).
            errors = {"shape": refusal(ck, state_on(mesh, saving=False, rows=ROWS + 2))}
            step, _ = ck.load_latest(state)
            result = {"step": step, "ok": {n: holds(t, n, step) for n, t in state["dt"].items()},
                      "mine": ({"t": state["mine"]["t"].tolist(), "who": state["mine"]["who"]}
                               if "mine" in state else None),
                      "resharded_from": ck.resharded_from, "errors": errors,
                      "placements": {n: [repr(p) for p in t.placements] for n, t in state["dt"].items()}}
            with open(os.path.join(out, f"load-{rank}.json"), "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
