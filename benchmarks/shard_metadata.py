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
* ``torchrec_init_s[world=8,tables=200]`` (when TorchRec is installed): TorchRec's own path, from "TorchRec
  plan known on rank 0" (built with TorchRec's generators for an EmbeddingBagCollection) to "every sharded
  table's ShardedTensorMetadata ready on every rank": ``torchrec`` (TorchRec 1.9's path:
  ``invoke_on_rank_and_broadcast_result`` of the plan, as ``collective_plan`` does, then
  ``sharding_spec.build_metadata`` per table), ``torchrec_allgather`` (the same broadcast, then
  ``ShardedTensor._init_from_local_shards`` per table, the all-gather TorchRec still uses for virtual
  tables and managed-collision modules) against ``ettkit`` (``from_torchrec`` on rank 0, ``broadcast_plan``,
  ``build_global_metadata``, ``to_sharded_tensor_metadata`` per table) and ``ettkit_plan`` (the same
  without the conversion: a job whose plan is an ettkit plan in the first place). Median over repeats;
  also the broadcast bytes (``torchrec_plan_bytes``).
* ``torchrec_local_ms[world=1024,tables=1000]`` (``world=256,tables=200`` with ``--quick``): the same two
  paths in one process at a simulated world size, without the communication: TorchRec's ``pickle.dumps`` +
  ``pickle.loads`` + ``build_metadata`` against ettkit's ``encode`` + ``decode`` + build +
  ``all_sharded_tensor_metadata`` (``ettkit_plan``; ``ettkit`` adds ``from_torchrec``). Median.

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


def timed(fn) -> float:
    """Seconds from a barrier until ``fn`` is done on every rank (the slowest rank's time, all-reduced)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    # NCCL reduces CUDA tensors only ("No backend type associated with device type cpu", the first GPU run).
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # ready on every rank = the slowest rank
    return float(elapsed)


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


def _torchrec_plan(tables: int, world: int, per_host: int):
    """A TorchRec ShardingPlan of ``tables`` EmbeddingBagCollection tables built with TorchRec's generators
    (seeded mix of every type; fp32/fp16), and the table configs."""
    import random

    import torchrec.distributed.sharding_plan as trec
    from torchrec.distributed.types import ShardingPlan as TorchRecPlan
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    rng = random.Random(tables)
    configs, generators = [], {}
    hosts = world // per_host
    for i in range(tables):
        cols = rng.choice([16, 32, 64, 128, 256])
        rows = rng.randint(1_000, 100_000)
        kind = rng.choice(["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid"])
        if kind == "data_parallel":
            rows, gen = rng.randint(10, 1_000), trec.data_parallel()
        elif kind == "table_wise":
            gen = trec.table_wise(rank=rng.randrange(world))
        elif kind == "row_wise":
            gen = trec.row_wise()
        elif kind == "column_wise":
            gen = trec.column_wise(ranks=[rng.randrange(world) for _ in range(max(1, cols // 32))])
        elif kind == "table_row_wise":
            gen = trec.table_row_wise(host_index=rng.randrange(hosts))
        else:
            cols = 128 * min(hosts, rng.randint(1, 2))
            gen = trec.grid_shard(host_indexes=list(range(cols // 128)))
        configs.append(EmbeddingBagConfig(name=f"table_{i}", feature_names=[f"f{i}"], embedding_dim=cols,
                                          num_embeddings=rows, data_type=rng.choice([DataType.FP32, DataType.FP16])))
        generators[f"table_{i}"] = gen
    ebc = EmbeddingBagCollection(tables=configs, device="meta")
    module_plan = trec.construct_module_sharding_plan(ebc, generators, local_size=per_host, world_size=world,
                                                      device_type="cpu")
    return TorchRecPlan({"sparse.ebc": module_plan}), configs


def _torchrec_worker(rank: int, world: int, init_file: str, tables: int, repeats: int, out_file: str) -> None:
    os.environ.setdefault("ETTKIT_LOG_LEVEL", "error")
    faulthandler.enable()
    import warnings

    warnings.simplefilter("ignore")  # fbgemm's deprecation notices at import
    from ettkit import sharding as S
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, TensorProperties
    from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
    from torchrec.modules.embedding_configs import data_type_to_dtype

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    pg = dist.group.WORLD
    per_host = _ranks_per_host(world)
    plan0, configs = _torchrec_plan(tables, world, per_host)  # every rank has the configs (the model code)
    sizes = {c.name: torch.Size([c.num_embeddings, c.embedding_dim]) for c in configs}
    dtypes = {c.name: data_type_to_dtype(c.data_type) for c in configs}

    def torchrec_init():
        plan = invoke_on_rank_and_broadcast_result(pg, 0, lambda: plan0)
        out = {}
        for name, ps in plan.plan["sparse.ebc"].items():
            if ps.sharding_spec is not None:
                out[name] = ps.sharding_spec.build_metadata(sizes[name], TensorProperties(dtype=dtypes[name]))
        return out

    def torchrec_allgather_init():
        plan = invoke_on_rank_and_broadcast_result(pg, 0, lambda: plan0)
        out = {}
        for name, ps in plan.plan["sparse.ebc"].items():
            if ps.sharding_spec is None:
                continue
            local = [Shard(torch.empty(m.shard_sizes, dtype=dtypes[name]), m)
                     for m in ps.sharding_spec.shards if m.placement.rank() == rank]
            out[name] = ShardedTensor._init_from_local_shards(local, *sizes[name], process_group=pg).metadata()
        return out

    def ettkit_init(converted=None):
        compact = converted
        if rank == 0 and compact is None:
            compact = S.from_torchrec(plan0, world_size=world, ranks_per_host=per_host, tables=configs,
                                      qualify=False)
        md = S.build_global_metadata(S.broadcast_plan(compact))
        return md.all_sharded_tensor_metadata()

    # A job that builds its plan with ettkit in the first place skips the conversion from TorchRec's plan.
    native = (S.from_torchrec(plan0, world_size=world, ranks_per_host=per_host, tables=configs, qualify=False)
              if rank == 0 else None)

    # The three paths agree before anything is timed.
    expected = torchrec_init()
    got = ettkit_init()
    assert set(got) == set(expected)
    for name, m in expected.items():
        assert got[name].shards_metadata == m.shards_metadata and got[name].size == m.size, name
        assert got[name].tensor_properties.dtype == m.tensor_properties.dtype, name
    results = {"ettkit": [], "ettkit_plan": [], "torchrec": [], "torchrec_allgather": []}
    for _ in range(repeats):
        results["ettkit"].append(timed(ettkit_init))
        results["ettkit_plan"].append(timed(lambda: ettkit_init(native)))
        results["torchrec"].append(timed(torchrec_init))
    for _ in range(max(1, repeats // 3)):
        results["torchrec_allgather"].append(timed(torchrec_allgather_init))
    if rank == 0:
        results["plan_bytes"] = {
            "torchrec": len(pickle.dumps(plan0)),
            "ettkit": len(S.encode(native)),
        }
        results["sharded_tables"] = len(expected)
        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def measure_torchrec_init(world: int, tables: int, repeats: int) -> dict | None:
    """TorchRec's own path against ettkit's, or None when TorchRec is not installed."""
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - fbgemm ops that do not load count as "not installed"
        print(f"torchrec_init_s: skipped, TorchRec does not import here ({e!r})")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_torchrec_worker, args=(world, os.path.join(tmp, "init"), tables, repeats, out), nprocs=world,
                 join=True)
        with open(out) as f:
            return json.load(f)


def measure_torchrec_local(world: int, tables: int, per_host: int, repeats: int) -> dict | None:
    """TorchRec's path against ettkit's in one process at a simulated world size: no communication, only what
    every rank does besides it (the sender's serialisation, the receiver's decoding and metadata objects).

    ``torchrec``: ``pickle.dumps`` + ``pickle.loads`` of TorchRec's plan (what ``broadcast_object_list``
    does on both ends), then ``build_metadata`` per sharded table. ``ettkit_plan``: ``encode`` + ``decode``
    + ``build_global_metadata`` + ``all_sharded_tensor_metadata``; ``ettkit``: the same after
    ``from_torchrec``. Both paths' results are asserted equal first; the variants are interleaved and a
    ``gc.collect()`` outside the timing gives each repeat the same heap. None without TorchRec.
    """
    import gc

    try:
        from torch.distributed._shard.sharded_tensor import TensorProperties
        from torchrec.modules.embedding_configs import data_type_to_dtype
    except Exception as e:  # noqa: BLE001 - fbgemm ops that do not load count as "not installed"
        print(f"torchrec_local_ms: skipped, TorchRec does not import here ({e!r})")
        return None
    from ettkit import sharding as S

    plan0, configs = _torchrec_plan(tables, world, per_host)
    sizes = {c.name: torch.Size([c.num_embeddings, c.embedding_dim]) for c in configs}
    dtypes = {c.name: data_type_to_dtype(c.data_type) for c in configs}
    native = S.from_torchrec(plan0, world_size=world, ranks_per_host=per_host, tables=configs, qualify=False)

    def torchrec():
        plan = pickle.loads(pickle.dumps(plan0))
        return {name: ps.sharding_spec.build_metadata(sizes[name], TensorProperties(dtype=dtypes[name]))
                for name, ps in plan.plan["sparse.ebc"].items() if ps.sharding_spec is not None}

    def ettkit_plan(plan=None):
        return S.build_global_metadata(S.decode(S.encode(plan or native))).all_sharded_tensor_metadata()

    def ettkit():
        return ettkit_plan(S.from_torchrec(plan0, world_size=world, ranks_per_host=per_host, tables=configs,
                                           qualify=False))

    expected = torchrec()
    for got in (ettkit_plan(), ettkit()):
        assert list(got) == list(expected)
        for name, m in expected.items():
            assert got[name] == m, name
    out = {"ettkit": [], "ettkit_plan": [], "torchrec": []}
    out["shards"] = sum(len(m.shards_metadata) for m in expected.values())
    out["sharded_tables"] = len(expected)
    out["plan_bytes"] = {"torchrec": len(pickle.dumps(plan0)), "ettkit": len(S.encode(native))}
    del expected, got
    for _ in range(repeats):
        for name, fn in (("torchrec", torchrec), ("ettkit_plan", ettkit_plan), ("ettkit", ettkit)):
            gc.collect()
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


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

    tr = measure_torchrec_init(8, 200, 3 if args.quick else 11)
    if tr is not None:
        case = "world=8,tables=200"
        ours = statistics.median(tr["ettkit"])
        results[f"torchrec_init_s[{case}]"] = {k: statistics.median(tr[k])
                                               for k in ("ettkit", "ettkit_plan", "torchrec", "torchrec_allgather")}
        results[f"torchrec_plan_bytes[{case}]"] = tr["plan_bytes"]
        native = statistics.median(tr["ettkit_plan"])
        for label, mine in ((f"{case} ({tr['sharded_tables']} sharded)", ours), (f"{case}, ettkit plan", native)):
            for base in ("torchrec", "torchrec_allgather"):
                b = statistics.median(tr[base])
                ratio = f"{b / mine:.1f}x faster" if b >= mine else f"{mine / b:.1f}x slower"
                rows.append(("torchrec_init_s", label, f"{mine * 1e3:.2f} ms", f"{b * 1e3:.1f} ms", base, ratio))
        pb = tr["plan_bytes"]
        rows.append(("torchrec_plan_bytes", case, f"{pb['ettkit']:,} B", f"{pb['torchrec']:,} B", "torchrec",
                     f"{pb['torchrec'] / pb['ettkit']:.0f}x smaller"))

    lw, lt = (256, 200) if args.quick else (1024, 1000)
    loc = measure_torchrec_local(lw, lt, 8, 3 if args.quick else 7)
    if loc is not None:
        case = f"world={lw},tables={lt}"
        results[f"torchrec_local_ms[{case}]"] = {k: statistics.median(loc[k]) * 1e3
                                                 for k in ("ettkit", "ettkit_plan", "torchrec")}
        results[f"torchrec_local_shards[{case}]"] = loc["shards"]
        results[f"torchrec_plan_bytes[{case}]"] = loc["plan_bytes"]
        b = statistics.median(loc["torchrec"])
        for label, key in ((f"{case} ({loc['shards']:,} shards)", "ettkit"), (f"{case}, ettkit plan", "ettkit_plan")):
            mine = statistics.median(loc[key])
            ratio = f"{b / mine:.1f}x faster" if b >= mine else f"{mine / b:.1f}x slower"
            rows.append(("torchrec_local_ms", label, f"{mine * 1e3:.1f} ms", f"{b * 1e3:.1f} ms", "torchrec", ratio))

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
