"""Elastic restore (#20): loading a sharded state at another world size, ettkit against DCP, in the same run.

    python benchmarks/reshard.py [--quick] [--mib 256] [--tables 8] [--from-ranks 4] [--to-ranks 2]
                                 [--planning-ranks 8] [--planning-tables 200] [--repeats 3] [--json FILE]

reshard_load_s[from=F,to=T,mib=M]: F gloo ranks save the same row-wise sharded tables (ShardedTensors,
M MiB in all) with ettkit's AsyncCheckpointer and with dcp.save; then T ranks load them into their own
row-wise layout with load_latest (checksums verified) and with dcp.load (DCP's own checkpoint of the same
state), interleaved, warm page cache. The time is the slowest rank's, median over the repeats.
save_s[ranks=R,tables=N]: R ranks save N small row-wise tables (16 x 8 each): ettkit's save -> committed
(no planning: each rank writes its shards and votes through the Store) against dcp.save (which gathers
every rank's save plan to rank 0 and scatters it back before writing). Medians over the repeats.
replan_load_s[from=2,to=3,mib=M] (when TorchRec imports): a TorchRec DistributedModelParallel over an
EmbeddingBagCollection of --tables tables (M MiB of weights, as much again of fused Adagrad momentum) saved by
2 ranks under plan A (table-wise, row-wise, column-wise), loaded by 3 ranks under plan C (every table placed
otherwise): load_latest of {"model": dmp, "optim": dmp.fused_optimizer} against dcp.load of their state dicts
(DCP's own checkpoint of the same state); both results asserted equal.
mesh2d_load_s[from=2x2,to=4,mib=M]: DTensors on a 2 x 2 mesh (HSDP (Replicate(), Shard(0)) and FSDP + TP
(Shard(0), Shard(1)), M MiB in all) saved by 4 ranks, loaded by the same 4 ranks on a 1-D mesh (Shard(0)):
another layout at the same world size; load_latest against dcp.load, values asserted.
plain_load_s[from=2,to=1,mib=M] (with TorchRec): the re-plan's step (plan A, 2 ranks) loaded whole by one
process into plain tensors, every table and its fused Adagrad momentum (load_latest(partial=True) against
dcp.load of the same plain state from DCP's checkpoint); both results asserted equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


def _tables(n_tables: int, rows: int, cols: int, world: int, rank: int, fill: bool):
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    out = {}
    chunk = -(-rows // world)
    lo, hi = min(rank * chunk, rows), min(rank * chunk + chunk, rows)
    for t in range(n_tables):
        shards = []
        if hi > lo:
            local = (torch.arange(lo * cols, hi * cols, dtype=torch.float32).reshape(hi - lo, cols) + t
                     if fill else torch.zeros(hi - lo, cols))
            shards.append(Shard(local, ShardMetadata([lo, 0], [hi - lo, cols], f"rank:{rank}/cpu")))
        out[f"t{t}"] = init_from_local_shards(shards, [rows, cols])
    return out


def _replan_generators(tables: int, world: int, replan: bool) -> dict:
    """Plan A at 2 ranks: table-wise, row-wise and column-wise in turn; plan C (at 3 ranks) places every table
    otherwise: row-wise, column-wise, table-wise."""
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    kinds = ("table", "row", "col") if not replan else ("row", "col", "table")
    out = {}
    for t in range(tables):
        kind = kinds[t % 3]
        out[f"t{t}"] = (table_wise(rank=t % world) if kind == "table" else row_wise() if kind == "row"
                        else column_wise(ranks=list(range(world))))
    return out


def _dmp(tables: int, rows: int, cols: int, world: int, replan: bool):
    import torch
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = [torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=cols, num_embeddings=rows,
                                           feature_names=[f"f{t}"]) for t in range(tables)]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.05})
    plan = construct_module_sharding_plan(ebc, _replan_generators(tables, world, replan), local_size=world,
                                          world_size=world, device_type="cpu")
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}))


def _local_shards(state: dict) -> dict:
    """``key@offsets`` -> this rank's local shard of every ShardedTensor in a (nested) state dict."""
    out = {}

    def walk(x, prefix):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif hasattr(x, "local_shards"):
            for sh in x.local_shards():
                out[f"{prefix}@{sh.metadata.shard_offsets}"] = sh.tensor

    walk(state, "")
    return out


def _mesh_state(mesh, rows: int, cols: int, fill: bool) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    layouts = ({"hsdp": (Replicate(), Shard(0)), "fsdp_tp": (Shard(0), Shard(1))} if mesh.ndim == 2
               else {"hsdp": (Shard(0),), "fsdp_tp": (Shard(0),)})
    out = {}
    for i, (name, placements) in enumerate(layouts.items()):
        shape, off = compute_local_shape_and_global_offset((rows, cols), mesh, placements)
        if fill:
            local = (torch.arange(off[0], off[0] + shape[0], dtype=torch.float32)[:, None] * cols
                     + torch.arange(off[1], off[1] + shape[1], dtype=torch.float32)[None, :] + i)
        else:
            local = torch.zeros(shape)
        out[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size((rows, cols)),
                                       stride=(cols, 1))
    return out


def _mesh_holds(state: dict, cols: int) -> bool:
    import torch
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for i, t in enumerate(state.values()):
        shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        want = (torch.arange(off[0], off[0] + shape[0], dtype=torch.float32)[:, None] * cols
                + torch.arange(off[1], off[1] + shape[1], dtype=torch.float32)[None, :] + i)
        if not torch.equal(t.to_local(), want):
            return False
    return True


def _replan_phase(a, ettkit_dir: str, dcp_dir: str) -> dict:
    """Plan A saved at 2 ranks (phase replan-save) or loaded under plan C (replan-load), ettkit and DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torchrec

    from ettkit.checkpoint import AsyncCheckpointer

    cols = 96  # column-wise over 2 and over 3 ranks (TorchRec splits columns evenly)
    rows = max(48, a.mib * (1 << 20) // (4 * cols * a.tables))
    model = _dmp(a.tables, rows, cols, a.world, replan=a.phase == "replan-load")
    if a.phase == "replan-save":
        torch.manual_seed(0)
        ids = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(a.tables)], values=torch.randint(0, rows, (a.tables * 64,)),
            lengths=torch.full((a.tables * 64,), 1, dtype=torch.int32))
        model(ids).values().sum().backward()  # the fused Adagrad: the momentum is not zero
        with AsyncCheckpointer(ettkit_dir, recorder=None) as ck:
            ck.save(1, {"model": model, "optim": model.fused_optimizer}).wait()
        dcp.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, checkpoint_id=dcp_dir)
        return {}
    times = {"ettkit": [], "dcp": []}
    got = {}
    for _ in range(a.repeats):
        for variant in ("ettkit", "dcp"):
            fresh = _dmp(a.tables, rows, cols, a.world, replan=True)
            dist_barrier()
            t = time.perf_counter()
            if variant == "ettkit":
                with AsyncCheckpointer(ettkit_dir, recorder=None, read_only=True) as ck:
                    ck.load_latest({"model": fresh, "optim": fresh.fused_optimizer})
                    assert ck.resharded_from == 2
            else:
                sd = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
                dcp.load(sd, checkpoint_id=dcp_dir)
                fresh.fused_optimizer.load_state_dict(sd["optim"])
            times[variant].append(_slowest(time.perf_counter() - t))
            got[variant] = {k: v.clone() for k, v in _local_shards(
                {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}).items()}
        # Both loaded the same values into the same shards (weights and momentum).
        assert got["ettkit"].keys() == got["dcp"].keys() and got["ettkit"]
        assert all(torch.equal(got["ettkit"][k], got["dcp"][k]) for k in got["ettkit"])
    return {**{k: statistics.median(v) for k, v in times.items()}, "rows": rows}


def _plain_phase(a, ettkit_dir: str, dcp_dir: str) -> dict:
    """The re-plan phase's step (plan A, 2 ranks) loaded whole by one process into plain tensors: every table,
    and its fused Adagrad momentum into torch.optim.Adagrad's ``sum`` by value (evaluation, export)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import AsyncCheckpointer

    cols = 96
    rows = max(48, a.mib * (1 << 20) // (4 * cols * a.tables))

    def fresh() -> dict:
        weights = {f"embedding_bags.t{t}.weight": torch.zeros(rows, cols) for t in range(a.tables)}
        momentum = {f"embedding_bags.t{t}.weight": {f"t{t}.momentum1": torch.zeros(rows, cols)}
                    for t in range(a.tables)}
        return {"model": weights, "optim": {"state": momentum}}

    times = {"ettkit": [], "dcp": []}
    got = {}
    for _ in range(a.repeats):
        for variant in ("ettkit", "dcp"):
            state = fresh()
            t = time.perf_counter()
            if variant == "ettkit":
                with AsyncCheckpointer(ettkit_dir, recorder=None, read_only=True) as ck:
                    ck.load_latest(state, partial=True)  # partial: the fused optimizer's param_groups left out
                    assert ck.resharded_from == 2
            else:
                dcp.load(state, checkpoint_id=dcp_dir)
            times[variant].append(time.perf_counter() - t)
            got[variant] = state
        for key in ("model", "optim"):  # both read the same values, and not zeros
            mine, theirs = got["ettkit"][key], got["dcp"][key]
            flat = ([(mine[k], theirs[k]) for k in mine] if key == "model" else
                    [(mine["state"][k][m], theirs["state"][k][m]) for k in mine["state"] for m in mine["state"][k]])
            assert all(torch.equal(x, y) for x, y in flat) and any(x.any() for x, _ in flat), key
    return {**{k: statistics.median(v) for k, v in times.items()}, "rows": rows}


def _mesh_phase(a, ettkit_dir: str, dcp_dir: str) -> dict:
    """DTensors saved on a 2 x 2 mesh (mesh-save) or loaded on a 1-D mesh of as many ranks (mesh-load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ettkit.checkpoint import AsyncCheckpointer

    cols = 64
    rows = max(8, a.mib * (1 << 20) // (4 * cols * 2))
    if a.phase == "mesh-save":
        state = {"dt": _mesh_state(init_device_mesh("cpu", (2, a.world // 2)), rows, cols, fill=True)}
        with AsyncCheckpointer(ettkit_dir, recorder=None) as ck:
            ck.save(1, state).wait()
        dcp.save(state, checkpoint_id=dcp_dir)
        return {}
    mesh = init_device_mesh("cpu", (a.world,))
    times = {"ettkit": [], "dcp": []}
    for _ in range(a.repeats):
        for variant in ("ettkit", "dcp"):
            fresh = {"dt": _mesh_state(mesh, rows, cols, fill=False)}
            dist_barrier()
            t = time.perf_counter()
            if variant == "ettkit":
                with AsyncCheckpointer(ettkit_dir, recorder=None, read_only=True) as ck:
                    ck.load_latest(fresh)
                    assert ck.resharded_from == a.world
            else:
                dcp.load(fresh, checkpoint_id=dcp_dir)
            times[variant].append(_slowest(time.perf_counter() - t))
            assert _mesh_holds(fresh["dt"], cols), variant
    return {**{k: statistics.median(v) for k, v in times.items()}, "rows": rows}


def dist_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _slowest(dt: float) -> float:
    import torch
    import torch.distributed as dist

    x = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x.item())


def rank_main(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import AsyncCheckpointer

    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
    result = {}
    if a.phase.startswith(("replan", "mesh")):
        kind = a.phase.split("-")[0]
        run = _plain_phase if a.phase == "replan-plain" else _replan_phase if kind == "replan" else _mesh_phase
        result = run(a, os.path.join(a.root, f"{kind}-ettkit"), os.path.join(a.root, f"{kind}-dcp"))
    elif a.phase in ("save", "load"):
        cols = 64
        rows = max(a.from_ranks * a.to_ranks, a.mib * (1 << 20) // (4 * cols * a.tables))
        state = {"tables": _tables(a.tables, rows, cols, a.world, a.rank, fill=a.phase == "save")}
        ettkit_dir, dcp_dir = os.path.join(a.root, "ettkit"), os.path.join(a.root, "dcp")
        if a.phase == "save":
            with AsyncCheckpointer(ettkit_dir, recorder=None) as ck:
                ck.save(1, state).wait()
            dcp.save(state, checkpoint_id=dcp_dir)
        else:
            times = {"ettkit": [], "dcp": []}
            for _ in range(a.repeats):
                for variant in ("ettkit", "dcp"):
                    fresh = {"tables": _tables(a.tables, rows, cols, a.world, a.rank, fill=False)}
                    dist.barrier()
                    t = time.perf_counter()
                    if variant == "ettkit":
                        with AsyncCheckpointer(ettkit_dir, recorder=None, read_only=True) as ck:
                            ck.load_latest(fresh)
                            assert ck.resharded_from == a.from_ranks
                    else:
                        dcp.load(fresh, checkpoint_id=dcp_dir)
                    times[variant].append(_slowest(time.perf_counter() - t))
                    for name, st in fresh["tables"].items():  # both loaded the same values
                        for s in st.local_shards():
                            o = s.metadata.shard_offsets[0]
                            want = torch.arange(o * cols, (o + s.tensor.shape[0]) * cols, dtype=torch.float32)
                            assert torch.equal(s.tensor.reshape(-1), want + int(name[1:])), (variant, name)
            result = {k: statistics.median(v) for k, v in times.items()}
            result["rows"] = rows
    else:  # planning: many small tables
        times = {"ettkit": [], "dcp": []}
        state = {"tables": _tables(a.planning_tables, 16 * a.world, 8, a.world, a.rank, fill=True)}
        for i in range(a.repeats):
            for variant in ("ettkit", "dcp"):
                dist.barrier()
                t = time.perf_counter()
                if variant == "ettkit":
                    with AsyncCheckpointer(os.path.join(a.root, "plan-ettkit"), recorder=None, keep_last=1) as ck:
                        ck.save(i + 1, state).wait()
                else:
                    dcp.save(state, checkpoint_id=os.path.join(a.root, f"plan-dcp-{i}"))
                times[variant].append(_slowest(time.perf_counter() - t))
        result = {k: statistics.median(v) for k, v in times.items()}
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _spawn(a, phase: str, world: int, root: str) -> dict:
    out = os.path.join(root, f"{phase}.json")
    init = "file://" + os.path.join(root, f"rendezvous-{phase}")
    args = ["--phase", phase, "--world", str(world), "--init", init, "--root", root, "--out", out,
            "--mib", str(a.mib), "--tables", str(a.tables), "--from-ranks", str(a.from_ranks),
            "--to-ranks", str(a.to_ranks), "--planning-tables", str(a.planning_tables), "--repeats", str(a.repeats)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), *args])
             for r in range(world)]
    codes = [p.wait(timeout=1800) for p in procs]
    if codes != [0] * world:
        raise SystemExit(f"reshard benchmark: the {phase} ranks exited with {codes}")
    with open(out) as f:
        return json.load(f)


def _torchrec_imports() -> bool:
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - fbgemm ops that do not load count as "not installed"
        print(f"replan_load_s: skipped, TorchRec does not import here ({e!r})")
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 4 -> 2 ranks; planning at 4 ranks, 50 tables")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--from-ranks", type=int, default=4)
    ap.add_argument("--to-ranks", type=int, default=2)
    ap.add_argument("--planning-ranks", type=int, default=8)
    ap.add_argument("--planning-tables", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    for hidden in ("--rank", "--world", "--init", "--root", "--out", "--phase"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        a.rank, a.world = int(a.rank), int(a.world)
        rank_main(a)
        return 0
    if a.quick:
        a.mib, a.planning_ranks, a.planning_tables = 32, 4, 50
    root = tempfile.mkdtemp(prefix="ettkit-reshard-bench-")
    try:
        _spawn(a, "save", a.from_ranks, root)
        load = _spawn(a, "load", a.to_ranks, root)
        plan = _spawn(a, "planning", a.planning_ranks, root)
        _spawn(a, "mesh-save", 4, root)
        mesh = _spawn(a, "mesh-load", 4, root)
        replan = plain = None
        if _torchrec_imports():
            _spawn(a, "replan-save", 2, root)
            replan = _spawn(a, "replan-load", 3, root)
            plain = _spawn(a, "replan-plain", 1, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        f"reshard_load_s[from={a.from_ranks},to={a.to_ranks},mib={a.mib}]": {
            "ettkit": load["ettkit"], "dcp": load["dcp"], "dcp_over_ettkit": load["dcp"] / load["ettkit"]},
        f"save_s[ranks={a.planning_ranks},tables={a.planning_tables}]": {
            "ettkit": plan["ettkit"], "dcp": plan["dcp"], "dcp_over_ettkit": plan["dcp"] / plan["ettkit"]},
        f"mesh2d_load_s[from=2x2,to=4,mib={a.mib}]": {
            "ettkit": mesh["ettkit"], "dcp": mesh["dcp"], "dcp_over_ettkit": mesh["dcp"] / mesh["ettkit"]},
    }
    if replan is not None:
        results[f"replan_load_s[from=2,to=3,mib={a.mib}]"] = {
            "ettkit": replan["ettkit"], "dcp": replan["dcp"], "dcp_over_ettkit": replan["dcp"] / replan["ettkit"]}
        results[f"plain_load_s[from=2,to=1,mib={a.mib}]"] = {
            "ettkit": plain["ettkit"], "dcp": plain["dcp"], "dcp_over_ettkit": plain["dcp"] / plain["ettkit"]}
    bench_common.print_table("elastic restore (gloo ranks on this machine; slowest rank, medians)", results)
    if a.json:
        bench_common.write_json(a.json, "reshard", {k: v for k, v in vars(a).items() if k != "json"}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
