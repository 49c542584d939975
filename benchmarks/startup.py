"""Time to Start: compile overlapped with the first batch (ettkit) against compiling after it (plain PyTorch),
and a warm restart through ettkit's CompileCache, measured in the same run.

The run: a recommendation-style model (embedding + MLP with BatchNorm and Dropout) compiled with
``torch.compile`` (Inductor, CPU), trained with SGD on batches from a ``DataLoader`` with 2 worker processes
over a dataset stored on disk (``.npy`` files, memory-mapped), whose first batch takes a set time (each
worker's first read sleeps ``--first-batch-s``: a cold object store, a streaming dataset's first shard).

Variants, each in a fresh process (compile caches are process-global) with an empty
``TORCHINDUCTOR_CACHE_DIR`` in a fresh temporary directory:

* ``sequential`` — the plain way: ``it = iter(loader); batch = next(it)``, then ``torch.compile`` and the
  first step compiles forward and backward lazily;
* ``overlapped`` — ``ettkit.startup.overlapped_start`` with a cold :class:`CompileCache`, which it saves after
  the first steps;
* ``overlapped_warm`` — the same with the cache file the ``overlapped`` process of the same repeat wrote
  (a restart of that job), in a new, empty Inductor cache dir: the MegaCache tier;
* ``precompiled_cold`` — ``overlapped_start`` with ``CompileCache(precompile=True)`` and no file: the
  forward and backward are precompiled (``aot_compile``) on the fast batch and saved;
* ``precompiled_warm`` — a restart of that job: it loads the precompiled forward (no Dynamo, AOTAutograd or
  Inductor), in a new, empty Inductor cache dir: the precompiled tier;
* ``precompiled_warm_imported`` — the same, with torch's compile stack (Dynamo, Inductor's lowering, codegen
  and code caches) imported before the clock starts (``imports_s``): what the precompiled load costs beyond
  the imports that any compile, and any load of compiled code, pays;
* ``precompiled_shared_first`` — the first start of *another* job of the same model: its own cache
  directory and Inductor cache dir are empty, and ``CompileCache(shared_dir=...)`` finds the file the
  ``precompiled_cold`` job left in the shared compile cache (docs/startup.md, "A warm first start"),
  verifies its HMAC, copies it and loads it.

``--model`` picks the model: ``rec`` (the default: embedding + MLP with BatchNorm and Dropout),
``transformer`` (a 2-layer transformer encoder over the ids as tokens) or ``dlrm`` (one embedding table per
id column, a bottom MLP, pairwise dot interactions, a top MLP). Figures of another model than ``rec`` are
keyed ``[model=...]`` in the JSON.

Metrics (JSON ``results``; medians over ``--repeats``):

* ``time_to_start_s`` (sequential / overlapped / overlapped_warm): from "model and loader built" to the end
  of the first real training step, minus one steady step: when the first step would have started had it
  cost a steady step. Includes every compile the first step still does.
* ``compile_s`` (cold / warm / warm_megacache / cold_precompile / warm_precompiled): the compile stage of
  overlapped / overlapped_warm (twice: ``warm`` is the older name) / precompiled_cold / precompiled_warm (cache
  load + warm compile on the fast batch: Dynamo, AOTAutograd, Inductor, g++; or the precompiled load).
* ``first_batch_s`` (ettkit): iter(loader) + next() in the overlapped run.
* ``first_step_residual_s`` (ettkit): first real step minus the median steady step (steps 5..N), overlapped.
* ``recompiles`` (ettkit): graphs compiled during the first 10 real steps, worst over all overlapped runs.
* ``compile_s.warm_precompiled_imported`` and ``imports_s.compile_stack``: the precompiled_warm_imported
  run's compile stage, and its import of the compile stack before it.

``--megacache-only`` keeps the compiled CPU kernels out of the cache file (``CompileCache(kernels=False)``):
the warm restart then rebuilds every kernel with g++, which shows what bundling them is worth.

Usage::

    python benchmarks/startup.py                 # full: 3 repeats (about 5 minutes on 2 cores)
    python benchmarks/startup.py --quick         # < 1 minute: a smaller model, 1 repeat
    python benchmarks/startup.py --json out.json
    python benchmarks/startup.py --quick --model transformer
    python benchmarks/startup.py --quick --ranks 4    # compile once per job against once per rank
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

FULL = {
    "repeats": 3,
    "first_batch_s": 15.0,
    "batch_size": 64,
    "num_ids": 8,
    "vocab": 20000,
    "emb_dim": 32,
    "dense": 16,
    "hidden": [256, 128, 64],
    "steps": 15,
    "num_workers": 2,
}
QUICK = {
    "repeats": 1,
    "first_batch_s": 2.0,
    "batch_size": 32,
    "num_ids": 4,
    "vocab": 1000,
    "emb_dim": 8,
    "dense": 8,
    "hidden": [],
    "steps": 11,
    "num_workers": 2,
}
VARIANTS = (
    "sequential",
    "overlapped",
    "overlapped_warm",
    "precompiled_cold",
    "precompiled_warm",
    "precompiled_warm_imported",
    "precompiled_shared_first",
)
MODELS = ("rec", "transformer", "dlrm")
SHARED_VARIANTS = ("precompiled_cold", "precompiled_shared_first")


# ---- the child: one variant in a fresh process ------------------------------------------------------------


def _child(variant: str, cfg: dict, data_dir: str, cache_dir: str, out_file: str) -> None:
    t_enter = time.perf_counter()
    import numpy as np
    import torch
    import torch.nn.functional as F
    from ettkit import startup
    from torch.utils.data import DataLoader, Dataset

    class DiskDataset(Dataset):
        """Samples memory-mapped from .npy files; each worker's first read takes ``delay_s`` longer."""

        def __init__(self, root, delay_s):
            self.root, self.delay_s = root, delay_s
            self.n = int(np.load(os.path.join(root, "label.npy"), mmap_mode="r").shape[0])
            self.arrays = None

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if self.arrays is None:  # first read in this worker: open the files, pay the cold start
                time.sleep(self.delay_s)
                self.arrays = {
                    k: np.load(os.path.join(self.root, f"{k}.npy"), mmap_mode="r")
                    for k in ("ids", "dense", "label")
                }
            a = self.arrays
            return {
                "ids": torch.from_numpy(np.array(a["ids"][i])),
                "dense": torch.from_numpy(np.array(a["dense"][i])),
                "label": torch.tensor(float(a["label"][i])),
            }

    def loss_fn(out, batch):
        return F.binary_cross_entropy_with_logits(out, batch["label"])

    class ToDevice:
        """The loader's batches moved to the GPU. iter() creates the DataLoader's iterator at once, so its
        workers start prefetching when the caller asks for the iterator, as with a plain DataLoader."""

        def __init__(self, loader, device):
            self.loader, self.device = loader, device

        def __len__(self):
            return len(self.loader)

        def __getattr__(self, name):  # num_workers, multiprocessing_context: overlapped_start forks first
            if name == "loader":
                raise AttributeError(name)
            return getattr(self.loader, name)

        def __iter__(self):
            it = iter(self.loader)
            return ({k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in it)

    device = cfg.get("device", "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    # The model classes live in a module of their own: a precompiled artifact refers to its model's class by
    # import path, which a class local to this function would not have.
    from startup_models import build_model

    model = build_model(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(
        DiskDataset(data_dir, cfg["first_batch_s"]),
        batch_size=cfg["batch_size"],
        num_workers=cfg["num_workers"],
        drop_last=True,
        pin_memory=device == "cuda",
    )
    if device == "cuda":
        loader = ToDevice(loader, device)
    b = cfg["batch_size"]
    spec = startup.BatchSpec(
        {
            "ids": startup.TensorSpec((b, cfg["num_ids"]), torch.int64, device=device,
                                      value_range=(0, cfg["vocab"] - 1)),
            "dense": startup.TensorSpec((b, cfg["dense"]), torch.float32, device=device),
            "label": startup.TensorSpec((b,), torch.float32, device=device, value_range=(0, 1)),
        }
    )
    out = {"variant": variant, "imports_s": time.perf_counter() - t_enter}

    if variant == "precompiled_warm_imported":
        t_imp = time.perf_counter()
        import torch._dynamo.aot_compile  # noqa: F401
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.codegen.wrapper  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        import torch._inductor.lowering  # noqa: F401
        import torch._inductor.select_algorithm  # noqa: F401

        out["compile_stack_import_s"] = time.perf_counter() - t_imp
    t0 = time.perf_counter()  # model and loader built; nothing iterated, nothing compiled
    if variant == "sequential":
        it = iter(loader)
        first = next(it)
        out["first_batch_s"] = time.perf_counter() - t0
        compiled = torch.compile(model)
    else:
        store, rank = None, 0
        if os.environ.get("ETTKIT_BENCH_STORE"):  # --ranks: one rank of a job that compiles once
            import torch.distributed as dist

            rank = int(os.environ["ETTKIT_BENCH_RANK"])
            store = dist.FileStore(os.environ["ETTKIT_BENCH_STORE"], int(os.environ["ETTKIT_BENCH_WORLD"]))
        cache = startup.CompileCache(
            cache_dir,
            model=model,
            spec=spec,
            config={"backend": "inductor"},
            kernels=cfg["kernels"],
            precompile=variant.startswith("precompiled"),
            store=store,
            rank=rank,
            # The job that compiles cold fills the shared cache; another job's first start reads it.
            shared_dir=os.environ.get("ETTKIT_BENCH_SHARED_DIR") if variant in SHARED_VARIANTS else None,
            job=f"bench-{variant}",
        )
        compiled, first, report, it = startup.overlapped_start(
            model, loader, spec, loss_fn, cache, recorder=None
        )
        loaded = report.precompiled if report.cache_tier == "precompiled" else report.cache
        out.update(
            first_batch_s=report.first_batch_s,
            compile_s=report.compile_s,
            start_s=report.time_to_start_s,
            cache=report.cache_tier,
            cache_artifacts=dict(loaded.artifacts),
            precompile_fallback=report.precompile_fallback,
            stages=report.stages.to_dict()["stages"],
        )

    graphs_before = startup.compiled_graphs()
    step_ends, durations = [], []
    batches = [first] + [next(it) for _ in range(cfg["steps"] - 1)]
    for i, batch in enumerate(batches):
        s = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(compiled(batch), batch).backward()
        opt.step()
        sync()  # a GPU step ends when its kernels do
        e = time.perf_counter()
        durations.append(e - s)
        step_ends.append(e)
        if i == 9:
            out["recompiles"] = startup.compiled_graphs() - graphs_before
    steady = statistics.median(durations[4:])
    out.update(
        step_s=durations,
        steady_step_s=steady,
        first_step_s=durations[0],
        first_step_residual_s=durations[0] - steady,
        time_to_start_s=(step_ends[0] - t0) - steady,
    )
    if variant == "sequential":
        out["compile_s"] = durations[0] - steady  # the lazy compile inside the first step
    else:
        # The start saves the cache itself after a torch.compile (report.cache_save); this later save writes
        # only what compiled since (the steps' recompiles), so the file was written if either wrote it.
        saved = cache.save()
        at_start = report.cache_save
        out.update(
            cache_saved=saved.written or bool(at_start and at_start.written),
            cache_saved_at_start=None if at_start is None else at_start.written,
            cache_bytes=saved.bytes if saved.written or at_start is None else at_start.bytes,
            cache_stats=cache.stats(),
        )
    with open(out_file, "w") as f:
        json.dump(out, f)


# ---- the driver ---------------------------------------------------------------------------------------------

_BENCH_SECRET = secrets.token_hex(32)


def _machine() -> dict:
    import importlib.metadata

    # Versions from package metadata: importing torch here would add seconds to every run of the driver.
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": importlib.metadata.version("torch"),
    }
    try:
        for line in subprocess.run(
            ["lscpu"], check=False, capture_output=True, text=True, timeout=10
        ).stdout.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["ettkit"] = importlib.metadata.version("ettkit")
    except importlib.metadata.PackageNotFoundError:
        pass
    info["load_average_at_start"] = list(os.getloadavg())
    return info


def _write_dataset(root: str, cfg: dict) -> None:
    import numpy as np

    n = cfg["batch_size"] * (cfg["steps"] + 2 * cfg["num_workers"] + 2)
    rng = np.random.default_rng(0)
    np.save(
        os.path.join(root, "ids.npy"), rng.integers(0, cfg["vocab"], size=(n, cfg["num_ids"]), dtype=np.int64)
    )
    np.save(os.path.join(root, "dense.npy"), rng.standard_normal((n, cfg["dense"]), dtype=np.float32))
    np.save(os.path.join(root, "label.npy"), rng.integers(0, 2, size=n).astype(np.float32))


def _run_variant(variant: str, cfg: dict, root: str, data_dir: str, cache_dir: str, tag: str) -> dict:
    out_file = os.path.join(root, f"{tag}-{variant}.json")
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, f"{tag}-{variant}-inductor")  # fresh, empty
    env["TRITON_CACHE_DIR"] = os.path.join(root, f"{tag}-{variant}-triton")  # GPU kernels: fresh too
    env.pop("TORCH_COMPILE_FORCE_DISABLE_CACHES", None)
    env.setdefault("ETTKIT_LOG_LEVEL", "error")
    # The shared compile cache of this repeat, and its secret (one per benchmark run, unless one is set).
    env["ETTKIT_BENCH_SHARED_DIR"] = os.path.join(root, f"{tag}-shared-cache")
    os.makedirs(env["ETTKIT_BENCH_SHARED_DIR"], mode=0o750, exist_ok=True)
    env.setdefault("ETTKIT_COMPILE_CACHE_SECRET", _BENCH_SECRET)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--config",
        json.dumps(cfg),
        "--data-dir",
        data_dir,
        "--cache-dir",
        cache_dir,
        "--out",
        out_file,
    ]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{proc.stderr[-4000:]}")
    with open(out_file) as f:
        return json.load(f)


def _run_ranks(
    world: int, once: bool, cfg: dict, root: str, data_dir: str, tag: str, rank0_cache: str | None = None
) -> dict:
    """`world` ranks of one job started together, each with its own cache and Inductor dirs (its own node):
    with `once`, they share one precompile through a FileStore; without, each rank precompiles.
    `rank0_cache`: rank 0's cache dir (a restart where rank 0's node kept its file and the others are new)."""
    procs = []
    # What a launcher does for compile once per job: one secret for every rank, outside the Store (which has no
    # authentication); CompileCache signs and verifies the shared file with it.
    import secrets

    share_secret = secrets.token_hex(32)
    t0 = time.perf_counter()
    for rank in range(world):
        cache_dir = rank0_cache if rank == 0 and rank0_cache else os.path.join(root, f"{tag}-rank{rank}-cache")
        out_file = os.path.join(root, f"{tag}-rank{rank}.json")
        env = dict(os.environ)
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, f"{tag}-rank{rank}-inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(root, f"{tag}-rank{rank}-triton")
        env.setdefault("ETTKIT_LOG_LEVEL", "error")
        if once:
            env.update(ETTKIT_BENCH_STORE=os.path.join(root, f"{tag}-store"), ETTKIT_BENCH_RANK=str(rank),
                       ETTKIT_BENCH_WORLD=str(world), ETTKIT_COMPILE_SHARE_SECRET=share_secret)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "precompiled_cold", "--config", json.dumps(cfg),
               "--data-dir", data_dir, "--cache-dir", cache_dir, "--out", out_file]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                      out_file))
    results = []
    for proc, out_file in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"rank run failed:\n{err[-4000:]}")
        with open(out_file) as f:
            results.append(json.load(f))
    return {
        "wall_s": time.perf_counter() - t0,
        "compile_s": [r["compile_s"] for r in results],
        "time_to_start_s": [r["time_to_start_s"] for r in results],
        "cache": [r["cache"] for r in results],
    }


def _main_ranks(args, cfg: dict) -> None:
    machine = _machine()
    root = tempfile.mkdtemp(prefix="ettkit-startup-ranks-")
    modes = ("each", "once", "new_nodes_each", "new_nodes_once")
    runs: dict = {m: [] for m in modes}
    try:
        data_dir = os.path.join(root, "data")
        os.makedirs(data_dir)
        _write_dataset(data_dir, cfg)
        for r in range(cfg["repeats"]):
            # A cold start of the job, each rank compiling or compiling once; then a restart where rank 0's node
            # kept its file (warm) and the other ranks run on new nodes (no file), without and with sharing.
            for mode in modes:  # the same repeat, one after the other
                rank0_cache = os.path.join(root, f"r{r}-once-rank0-cache") if mode.startswith("new_nodes") else None
                res = _run_ranks(args.ranks, mode.endswith("once"), cfg, root, data_dir, f"r{r}-{mode}", rank0_cache)
                runs[mode].append(res)
                print(f"  repeat {r + 1}/{cfg['repeats']} {mode:<5} wall {res['wall_s']:6.2f} s  compile_s per rank "
                      f"{[round(x, 2) for x in res['compile_s']]}  tiers {res['cache']}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    def med(mode, f):
        return statistics.median(f(r) for r in runs[mode])

    results = {
        f"compile_s[ranks={args.ranks}]": {
            "each_rank_max": med("each", lambda r: max(r["compile_s"])),
            "once_rank0": med("once", lambda r: r["compile_s"][0]),
            "once_others_max": med("once", lambda r: max(r["compile_s"][1:])),
        },
        f"time_to_start_s[ranks={args.ranks}]": {
            "each_max": med("each", lambda r: max(r["time_to_start_s"])),
            "once_max": med("once", lambda r: max(r["time_to_start_s"])),
            "new_nodes_each_max": med("new_nodes_each", lambda r: max(r["time_to_start_s"][1:])),
            "new_nodes_once_max": med("new_nodes_once", lambda r: max(r["time_to_start_s"][1:])),
        },
    }
    print(f"\ncompile once per job, {args.ranks} ranks on one machine ({cfg['repeats']} repeat(s), medians; "
          f"{machine.get('cpu', '?')}, {machine['cpus']} CPUs)")
    for metric, values in results.items():
        for k, v in values.items():
            print(f"  {metric:<28} {k:<16} {v:8.2f}")
    ratio = results[f"time_to_start_s[ranks={args.ranks}]"]["once_max"] / results[
        f"time_to_start_s[ranks={args.ranks}]"]["each_max"]
    print(f"  slowest rank's time to start, once / each = {ratio:.3f}")
    tts = results[f"time_to_start_s[ranks={args.ranks}]"]
    print(f"  restart on new nodes, slowest new rank: once / each = "
          f"{tts['new_nodes_once_max'] / tts['new_nodes_each_max']:.3f}")
    if args.json:
        doc = {"benchmark": "startup_ranks", "machine": machine, "config": dict(cfg, ranks=args.ranks, runs=runs),
               "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="smaller model and first-batch delay, 1 repeat (< 1 min)"
    )
    ap.add_argument("--json", help="write the results to this file (the layout of docs/benchmarks.md)")
    ap.add_argument("--repeats", type=int, help="override the number of repeats")
    ap.add_argument("--first-batch-s", type=float, help="override the first-batch delay")
    ap.add_argument(
        "--megacache-only",
        action="store_true",
        help="CompileCache(kernels=False): no compiled CPU kernels in the cache file, MegaCache only",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--model", choices=MODELS, default="rec", help="the model compiled (default: rec)")
    ap.add_argument("--ranks", type=int, help="N ranks of one job on this machine: each rank precompiling "
                    "against compile once per job (CompileCache(store=...)); cold starts only")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the model and batches on the GPU, Inductor generating Triton kernels; the warm "
                         "restart loads them from the CompileCache (tools/gpu_check.sh)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, json.loads(args.config), args.data_dir, args.cache_dir, args.out)
        return

    cfg = dict(QUICK if args.quick else FULL)
    cfg["device"] = args.device
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("startup --device cuda: torch sees no CUDA device")
        if not args.quick:  # within the GPU check's budget: one repeat, a shorter cold first batch
            cfg.update(repeats=1, first_batch_s=5.0)
    if args.repeats:
        cfg["repeats"] = args.repeats
    if args.first_batch_s is not None:
        cfg["first_batch_s"] = args.first_batch_s
    cfg["kernels"] = not args.megacache_only
    cfg["model"] = args.model
    if args.ranks:
        if args.ranks < 2:
            raise SystemExit(f"--ranks must be at least 2, not {args.ranks}")
        cfg["num_workers"] = 1  # N ranks' loaders on a few cores: the compile is what is compared
        _main_ranks(args, cfg)
        return
    machine = _machine()
    root = tempfile.mkdtemp(prefix="ettkit-startup-bench-")
    t_start = time.perf_counter()
    runs = {v: [] for v in VARIANTS}
    try:
        data_dir = os.path.join(root, "data")
        os.makedirs(data_dir)
        _write_dataset(data_dir, cfg)
        for r in range(cfg["repeats"]):
            for variant in VARIANTS:
                # A cold variant writes the file its warm variant reads (a restart of that job).
                tier = "precompile" if variant.startswith("precompiled") else "compile"
                cache_dir = os.path.join(root, f"r{r}-{tier}-cache")
                if variant == "precompiled_shared_first":  # another job: nothing of its own yet
                    cache_dir = os.path.join(root, f"r{r}-another-job-cache")
                res = _run_variant(variant, cfg, root, data_dir, cache_dir, f"r{r}")
                runs[variant].append(res)
                print(
                    f"  repeat {r + 1}/{cfg['repeats']} {variant:<16} time_to_start {res['time_to_start_s']:7.2f} s"
                    f"  compile {res['compile_s']:6.2f} s  first batch {res['first_batch_s']:6.2f} s"
                    + (f"  cache {res['cache']}" if "cache" in res else ""),
                    flush=True,
                )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    def med(variant, key):
        return statistics.median(r[key] for r in runs[variant])

    results = {
        "time_to_start_s": {v: med(v, "time_to_start_s") for v in VARIANTS},
        "compile_s": {
            "cold": med("overlapped", "compile_s"),
            "warm": med("overlapped_warm", "compile_s"),
            "warm_megacache": med("overlapped_warm", "compile_s"),
            "cold_precompile": med("precompiled_cold", "compile_s"),
            "warm_precompiled": med("precompiled_warm", "compile_s"),
            "warm_precompiled_imported": med("precompiled_warm_imported", "compile_s"),
            "first_start_shared": med("precompiled_shared_first", "compile_s"),
        },
        "imports_s": {"compile_stack": med("precompiled_warm_imported", "compile_stack_import_s")},
        "first_batch_s": {"ettkit": med("overlapped", "first_batch_s")},
        "first_step_residual_s": {"ettkit": med("overlapped", "first_step_residual_s")},
        "recompiles": {
            "ettkit": max(r["recompiles"] for v in VARIANTS[1:] for r in runs[v])
        },
    }
    tiers = {v: [r.get("cache") for r in runs[v]] for v in VARIANTS[1:]}
    fallbacks = sorted({r["precompile_fallback"] for v in VARIANTS[3:] for r in runs[v] if r.get("precompile_fallback")})
    machine["load_average_at_end"] = list(os.getloadavg())
    config = dict(
        cfg,
        quick=args.quick,
        variants=list(VARIANTS),
        wall_s=round(time.perf_counter() - t_start, 1),
        backend="inductor",
        device=args.device,
        cache_tiers=tiers,
        precompile_fallbacks=fallbacks,
        samples={
            v: {
                k: [round(r[k], 4) for r in runs[v]]
                for k in (
                    "time_to_start_s",
                    "compile_s",
                    "first_batch_s",
                    "first_step_residual_s",
                    "steady_step_s",
                )
            }
            for v in VARIANTS
        },
    )

    compile_s = results["compile_s"]
    precompiled_ratio = compile_s["warm_precompiled"] / compile_s["cold"]
    keys = []
    if args.device == "cuda":
        keys.append("device=cuda")
    if args.model != "rec":
        keys.append(f"model={args.model}")
    suffix = f"[{','.join(keys)}]" if keys else ""
    if args.device == "cuda":  # GPU figures apart from the CPU ones: every metric keyed [device=cuda]
        results = {f"{metric}{suffix}": v for metric, v in results.items()}
        tts = results[f"time_to_start_s{suffix}"]
        warm_gain = 1 - compile_s["warm"] / compile_s["cold"]
        print(f"\nstartup on the GPU: time to start {tts}; warm compile faster than cold by {100 * warm_gain:.1f}% "
              f"(target >= 50%); precompiled warm / cold = {precompiled_ratio:.3f} (target <= 0.10); tiers {tiers}; "
              f"recompiles {results[f'recompiles{suffix}']['ettkit']} (target 0)")
        config["cache_status"] = {v: [r.get("cache") for r in runs[v]] for v in ("overlapped", "overlapped_warm")}
        config["cache_artifacts"] = {v: [r.get("cache_artifacts") for r in runs[v]]
                                     for v in ("overlapped", "overlapped_warm")}
        if args.json:
            doc = {"benchmark": "startup", "machine": machine, "config": config, "results": results}
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2, sort_keys=True)
        return
    tts = results["time_to_start_s"]
    bound = max(results["compile_s"]["cold"], results["first_batch_s"]["ettkit"])
    print(
        f"\nstartup benchmark ({'quick' if args.quick else 'full'}; {cfg['repeats']} repeat(s), medians; "
        f"{machine.get('cpu', '?')}, {machine['cpus']} CPUs, torch {machine['torch']})"
    )
    print(f"  {'metric':<24} {'variant':<16} {'value':>10}")
    for metric, variants in results.items():
        for variant, value in variants.items():
            print(
                f"  {metric:<24} {variant:<16} {value:>10.3f}"
                if isinstance(value, float)
                else f"  {metric:<24} {variant:<16} {value:>10}"
            )
    print("\ntargets")
    print(
        f"  overlapped / max(compile cold, first batch) = {tts['overlapped']:.2f} / {bound:.2f} = "
        f"{tts['overlapped'] / bound:.3f}  (target <= 1.10)"
    )
    per_run = [r["time_to_start_s"] / max(r["compile_s"], r["first_batch_s"]) for r in runs["overlapped"]]
    config["overlap_ratio_per_run"] = [round(x, 4) for x in per_run]
    print(
        f"  the same, per run (its own compile and first batch): median {statistics.median(per_run):.3f}, "
        f"worst {max(per_run):.3f}"
    )
    print(f"  overlapped / sequential                      = {tts['overlapped'] / tts['sequential']:.3f}")
    print(
        f"  overlapped_warm / sequential                 = {tts['overlapped_warm'] / tts['sequential']:.3f}"
    )
    warm_gain = 1 - results["compile_s"]["warm"] / results["compile_s"]["cold"]
    print(f"  warm (MegaCache) compile faster than cold by  {100 * warm_gain:.1f}%  (target >= 50%)")
    print(f"  warm (precompiled) compile / cold             {precompiled_ratio:.3f}  (target <= 0.10)")
    per_repeat = [w["compile_s"] / c["compile_s"] for w, c in zip(runs["precompiled_warm"], runs["overlapped"])]
    config["precompiled_ratio_per_repeat"] = [round(x, 4) for x in per_repeat]
    print(f"  the same, per repeat                          {', '.join(f'{x:.3f}' for x in per_repeat)}")
    imported = results["compile_s"]["warm_precompiled_imported"]
    print(f"  the same with the compile stack imported      {imported / results['compile_s']['cold']:.3f}"
          f"  ({imported:.2f} s after {results['imports_s']['compile_stack']:.2f} s of imports)")
    print(f"  cache tiers                                   {tiers}")
    if fallbacks:
        print(f"  precompiled tier not used: {fallbacks}")
    print(f"  recompiles in the first 10 real steps         {results['recompiles']['ettkit']}  (target 0)")
    print(
        f"  wall time {config['wall_s']} s; load average at start {machine['load_average_at_start'][0]:.2f}, "
        f"at end {machine['load_average_at_end'][0]:.2f}"
    )
    results = {f"{metric}{suffix}": v for metric, v in results.items()}
    if args.json:
        doc = {"benchmark": "startup", "machine": machine, "config": config, "results": results}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
