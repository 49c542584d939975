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
    if a.phase in ("save", "load"):
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
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        f"reshard_load_s[from={a.from_ranks},to={a.to_ranks},mib={a.mib}]": {
            "ettkit": load["ettkit"], "dcp": load["dcp"], "dcp_over_ettkit": load["dcp"] / load["ettkit"]},
        f"save_s[ranks={a.planning_ranks},tables={a.planning_tables}]": {
            "ettkit": plan["ettkit"], "dcp": plan["dcp"], "dcp_over_ettkit": plan["dcp"] / plan["ettkit"]},
    }
    bench_common.print_table("elastic restore (gloo ranks on this machine; slowest rank, medians)", results)
    if a.json:
        bench_common.write_json(a.json, "reshard", {k: v for k, v in vars(a).items() if k != "json"}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
