"""Shard-metadata start-up: ettkit (one broadcast of the compact plan + a local build) against the all-gather
baseline (broadcast of the pickled expanded plan + one all_gather_object per table, TorchRec's pre-2024 way),
measured in the same run.

Metrics (JSON keys ``<metric>[<case>]``, variants ``ettkit`` and the baselines):

* ``init_s[world=W,tables=T]``: from "plan known on rank 0" to "metadata ready on every rank" (the slowest
  rank), gloo on this machine; ``ettkit`` vs ``allgather``. Median over repeats.
* ``build_ms[tables=1000,world=128]``: the local build alone in one process; ``ettkit`` vs
  ``python_expand`` (expanding the same plan into torch ShardMetadata objects in Python, as a TorchRec
  planner's output holds it). Median.
* ``plan_bytes[world=W,tables=T]``: the encoded plan vs ``pickle`` (the pickled expanded plan TorchRec
  broadcasts) and ``pickle_compact`` (the pickled ettkit ShardingPlan, i.e. the same compact information).

Usage::

    python benchmarks/shard_metadata.py            # full run
    python benchmarks/shard_metadata.py --quick    # < 1 minute on a 2-core machine
    python benchmarks/shard_metadata.py --json out.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ranks_per_host(world: int) -> int:
    return max(1, world // 2)  # two hosts per world, so host-based types (TWRW, TWCW, grid) vary


def _worker(
    rank: int,
    world: int,
    init_file: str,
    tables_list: list[int],
    repeats: int,
    baseline_repeats: int,
    warm_baseline: bool,
    out_file: str,
    backend: str = "gloo",
) -> None:
    os.environ.setdefault("ETTKIT_LOG_LEVEL", "error")
    faulthandler.enable()  # a rank that dies (e.g. a gloo abort) prints where it was
    from ettkit import sharding as S

    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank; broadcast_plan moves the bytes as a CUDA tensor
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        L = _ranks_per_host(world)
        for tables in tables_list:
            plan0 = S.mixed_plan(tables, world, L, seed=tables) if rank == 0 else None
            expanded0 = S.torchrec_style_plan(plan0) if rank == 0 else None

            def timed(fn) -> float:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # ready on every rank = the slowest rank
                return float(elapsed)

            def ettkit_init(plan0=plan0):
                plan = S.broadcast_plan(plan0)
                S.build_global_metadata(plan)

            def allgather_init(expanded0=expanded0):
                S.allgather_baseline(expanded0)

            timed(ettkit_init)  # warm-up: first collectives, allocator, imports
            if warm_baseline:  # the ettkit warm-up already opened gloo's connections; this warms pickling
                timed(allgather_init)
            ours = [timed(ettkit_init) for _ in range(repeats)]
            base = [timed(allgather_init) for _ in range(baseline_repeats)]
            results[tables] = {"ettkit": ours, "allgather": base}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)


def measure_init(
    world: int, tables_list: list[int], repeats: int, baseline_repeats: int, warm_baseline: bool,
    backend: str = "gloo",
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(
                world,
                os.path.join(tmp, "init"),
                tables_list,
                repeats,
                baseline_repeats,
                warm_baseline,
                out,
                backend,
            ),
            nprocs=world,
            join=True,
        )
        with open(out) as f:
            return {int(k): v for k, v in json.load(f).items()}


def measure_build(tables: int, world: int, repeats: int) -> dict:
    from ettkit import sharding as S

    plan = S.mixed_plan(tables, world, 8, seed=tables)
    S.build_global_metadata(plan)
    ours = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        md = S.build_global_metadata(plan)
        ours.append((time.perf_counter() - t0) * 1e3)
    expand = []
    for _ in range(max(1, repeats // 5)):
        t0 = time.perf_counter()
        S.torchrec_style_plan(plan)
        expand.append((time.perf_counter() - t0) * 1e3)
    data = S.encode(plan)
    decode = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        S.decode(data)
        decode.append((time.perf_counter() - t0) * 1e3)
    return {"ettkit": ours, "python_expand": expand, "decode_ms": decode, "shards": md.total_shards}


def measure_bytes(tables: int, world: int) -> dict:
    from ettkit import sharding as S

    plan = S.mixed_plan(tables, world, _ranks_per_host(world) if world <= 8 else 8, seed=tables)
    return {
        "ettkit": len(S.encode(plan)),
        "pickle": len(pickle.dumps(S.torchrec_style_plan(plan))),
        "pickle_compact": len(pickle.dumps(plan)),
    }


def machine() -> dict:
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import ettkit

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ettkit": ettkit.__version__,
        "platform": platform.platform(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def gpu_main(args) -> int:
    """NCCL against gloo for the same plans, world size = the GPUs visible (one GPU allows world size 1 only:
    the broadcast then moves no bytes between ranks, and the figures are the per-call cost of each backend's
    path: the byte tensor's trip to the GPU and back for NCCL, and the local build)."""
    if not torch.cuda.is_available():
        raise SystemExit("shard_metadata --device cuda: torch sees no CUDA device")
    world = torch.cuda.device_count()
    tables_list = [200, 1000]
    repeats, baseline_repeats = (5, 1) if args.quick else (11, 3)
    results: dict = {}
    host = machine()
    host["gpu"] = torch.cuda.get_device_name(0)
    for backend in ("nccl", "gloo"):
        for tables, r in measure_init(world, tables_list, repeats, baseline_repeats, True, backend).items():
            key = f"init_s[world={world},tables={tables},backend={backend}]"
            results[key] = {"ettkit": statistics.median(r["ettkit"]), "allgather": statistics.median(r["allgather"])}
            print(f"{key}: ettkit {results[key]['ettkit'] * 1e3:.3f} ms, allgather {results[key]['allgather'] * 1e3:.3f} ms",
                  flush=True)
    if world == 1:
        print("world size 1: one GPU allows one NCCL rank; the broadcast moves no bytes between ranks")
    if args.json:
        config = {"device": "cuda", "backends": ["nccl", "gloo"], "world": world, "tables": tables_list,
                  "repeats": repeats, "baseline_repeats": baseline_repeats, "quick": args.quick,
                  "note": "world size = visible GPUs" + (" (1: no bytes cross ranks)" if world == 1 else "")}
        with open(args.json, "w") as f:
            json.dump({"benchmark": "shard_metadata", "machine": host, "config": config, "results": results}, f,
                      indent=2)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset that finishes in under a minute")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: broadcast_plan over NCCL against gloo, one rank per GPU (tools/gpu_check.sh)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        return gpu_main(args)

    if args.quick:
        worlds, tables_list, repeats, baseline_repeats, build_repeats = [2, 8], [200], 5, 1, 10
        byte_cases = [(8, 200), (128, 1000)]
    else:
        worlds, tables_list, repeats, baseline_repeats, build_repeats = [2, 4, 8], [200, 1000], 11, 3, 50
        byte_cases = [(w, t) for w in (2, 4, 8, 128) for t in (200, 1000)]
    config = {
        "backend": "gloo",
        "worlds": worlds,
        "tables": tables_list,
        "ranks_per_host": "world/2",
        "repeats": repeats,
        "baseline_repeats": baseline_repeats,
        "build_repeats": build_repeats,
        "baseline_warmup": not args.quick,
        "plan": "ettkit.sharding.mixed_plan(tables, world, ranks_per_host, seed=tables)",
        "quick": args.quick,
    }

    t_start = time.perf_counter()
    host = machine()  # before the run: records the load the machine had when it started
    results: dict[str, dict] = {}
    rows = []
    for world in worlds:
        for tables, r in measure_init(world, tables_list, repeats, baseline_repeats, not args.quick).items():
            ours, base = statistics.median(r["ettkit"]), statistics.median(r["allgather"])
            results[f"init_s[world={world},tables={tables}]"] = {"ettkit": ours, "allgather": base}
            rows.append(
                (
                    "init_s",
                    f"world={world},tables={tables}",
                    f"{ours * 1e3:.2f} ms",
                    f"{base * 1e3:.1f} ms",
                    "allgather",
                    f"{base / ours:.0f}x faster",
                )
            )
    b = measure_build(1000, 128, build_repeats)
    ours, expand, dec = (
        statistics.median(b["ettkit"]),
        statistics.median(b["python_expand"]),
        statistics.median(b["decode_ms"]),
    )
    results["build_ms[tables=1000,world=128]"] = {"ettkit": ours, "python_expand": expand}
    results["decode_ms[tables=1000,world=128]"] = {"ettkit": dec}
    rows.append(
        (
            "build_ms",
            f"tables=1000,world=128 ({b['shards']} shards)",
            f"{ours:.2f} ms",
            f"{expand:.0f} ms",
            "python_expand",
            f"{expand / ours:.0f}x faster",
        )
    )
    rows.append(("decode_ms", "tables=1000,world=128", f"{dec:.3f} ms", "-", "-", "-"))
    for world, tables in byte_cases:
        r = measure_bytes(tables, world)
        results[f"plan_bytes[world={world},tables={tables}]"] = r
        rows.append(
            (
                "plan_bytes",
                f"world={world},tables={tables}",
                f"{r['ettkit']:,} B",
                f"{r['pickle']:,} B",
                "pickle",
                f"{r['pickle'] / r['ettkit']:.0f}x smaller",
            )
        )
        rows.append(
            (
                "plan_bytes",
                f"world={world},tables={tables}",
                f"{r['ettkit']:,} B",
                f"{r['pickle_compact']:,} B",
                "pickle_compact",
                f"{r['pickle_compact'] / r['ettkit']:.1f}x smaller",
            )
        )

    header = ("metric", "case", "ettkit", "baseline", "baseline is", "ettkit vs baseline")
    widths = [max(len(str(x[i])) for x in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    print(fmt.format(*("-" * w for w in widths)))
    for row in rows:
        print(fmt.format(*row))
    print(f"(medians; {time.perf_counter() - t_start:.0f} s total)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "shard_metadata", "machine": host, "config": config, "results": results},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
