"""What a start that compiles nothing still pays, per way of loading compiled code (issue #62): the three
models of benchmarks/startup.py, each loaded in fresh processes three ways.

A warm start (``CompileCache(precompile=True)`` with a file) compiles nothing, yet its compile stage was
longer than the first real batch in ``make demo``: importing torch's compile stack (Dynamo, AOTAutograd,
Inductor's lowering and code caches, sympy, networkx, DTensor) is most of it. The options for taking that
import off the critical path, each measured from ``import torch`` done to the first output in hand:

* ``precompiled`` — ettkit's precompiled tier: ``CompileCache.load_precompiled()`` (``aot_compile``'s
  artifact: forward *and* backward; training), then one forward and backward. Imports the compile stack.
* ``aoti_python`` — an AOTInductor package of the same model in eval mode (``torch.export`` +
  ``aoti_compile_and_package``), loaded with ``torch._inductor.aoti_load_package``, then one forward.
  Forward only: AOTInductor has no backward, so this serves inference and eval, not training.
* ``aoti_cpp`` — the same package through torch's C++ loader (``torch._C._aoti.AOTIModelPackageLoader``)
  directly: the floor of loading compiled code with nothing of the compile stack imported.

Per process: ``load_s`` (to the loaded callable), ``first_call_s`` (its first call), ``modules`` (how many
modules the load imported) and ``trains`` (whether the loaded code has a backward). Medians over ``--runs``
fresh processes per option; a setup process per model compiles both artifacts and is not counted.

    python benchmarks/startup_load_options.py [--runs 3] [--models rec,transformer,dlrm] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIONS = ("precompiled", "aoti_python", "aoti_cpp")

# One process: setup (compile both artifacts) or one option's load. argv: mode, model, workdir, cfg JSON.
CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
mode, model_name, work, cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
cfg = dict(cfg, model=model_name)
package = os.path.join(work, "model.pt2")
before = len(sys.modules)
out = {"mode": mode, "model": model_name, "import_torch_s": t_torch - t0}


def built():
    from ettkit import startup
    from startup_models import build_model

    torch.manual_seed(0)
    model = build_model(cfg)
    b = cfg["batch_size"]
    spec = startup.BatchSpec({
        "ids": startup.TensorSpec((b, cfg["num_ids"]), torch.int64, value_range=(0, cfg["vocab"] - 1)),
        "dense": startup.TensorSpec((b, cfg["dense"]), torch.float32),
        "label": startup.TensorSpec((b,), torch.float32, value_range=(0, 1)),
    })
    cache = startup.CompileCache(os.path.join(work, "cache"), model=model, spec=spec, config={}, precompile=True)
    return model, spec, cache


if mode == "setup":
    from ettkit import startup
    model, spec, cache = built()
    loss = lambda o, batch: torch.nn.functional.binary_cross_entropy_with_logits(o, batch["label"])
    _, _, report, _ = startup.overlapped_start(model, [spec.fast_batch(1)], spec, loss, cache, recorder=None)
    saved = report.precompiled_save is not None and report.precompiled_save.written
    model.eval()
    batch = spec.fast_batch(1)
    ep = torch.export.export(model, (batch,))
    torch._inductor.aoti_compile_and_package(ep, package_path=package)
    out.update(precompiled_saved=saved, aoti_package=os.path.exists(package))
elif mode == "precompiled":
    model, spec, cache = built()  # the model is built in every option's process: not counted in load_s
    batch = spec.fast_batch(1)
    t1 = time.perf_counter()
    n0 = len(sys.modules)
    result, fn = cache.load_precompiled()
    t2 = time.perf_counter()
    if fn is None:
        raise SystemExit(f"no precompiled forward: {result.status} {result.reason}")
    from ettkit.startup.precompiled import PrecompiledModel

    PrecompiledModel(model, fn, origin="loaded")(batch).float().sum().backward()  # as overlapped_start runs it
    t3 = time.perf_counter()
    out.update(load_s=t2 - t1, first_call_s=t3 - t2, modules=len(sys.modules) - n0, trains=True)
else:
    model, spec, cache = built()
    batch = spec.fast_batch(1)
    t1 = time.perf_counter()
    n0 = len(sys.modules)
    if mode == "aoti_python":
        fn = torch._inductor.aoti_load_package(package)
        t2 = time.perf_counter()
        fn(batch)
    else:
        loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
        t2 = time.perf_counter()
        import torch.utils._pytree as pytree  # imported by torch itself: no module added

        flat = [x for x in pytree.tree_flatten(((batch,), {}))[0] if isinstance(x, torch.Tensor)]
        loader.boxed_run(flat)  # what AOTICompiledModel.__call__ does, without torch._inductor
    t3 = time.perf_counter()
    out.update(load_s=t2 - t1, first_call_s=t3 - t2, modules=len(sys.modules) - n0, trains=False)
print(json.dumps(out))
"""


def run_child(mode: str, model: str, work: str, cfg: dict) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, f"inductor-{mode}-{time.monotonic_ns()}"),
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, model, work, json.dumps(cfg)], capture_output=True,
                          text=True, env=env, timeout=900, cwd=HERE)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} of {model} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_row(rows: list) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in ("import_torch_s", "load_s", "first_call_s", "modules")}


def main() -> None:
    sys.path.insert(0, HERE)
    from startup import QUICK

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="fresh processes per option (default 3)")
    p.add_argument("--models", default="rec,transformer,dlrm")
    p.add_argument("--quick", action="store_true", help="one process per option, the rec model only")
    p.add_argument("--json", help="every process's figures and the medians")
    args = p.parse_args()
    runs, models = (1, ["rec"]) if args.quick else (args.runs, args.models.split(","))
    cfg = {k: v for k, v in QUICK.items() if k in ("batch_size", "num_ids", "vocab", "emb_dim", "dense", "hidden")}
    cfg["hidden"] = [64, 32]
    results: dict = {}
    for model in models:
        with tempfile.TemporaryDirectory(prefix=f"ettkit-load-options-{model}-") as work:
            setup = run_child("setup", model, work, cfg)
            if not (setup["precompiled_saved"] and setup["aoti_package"]):
                raise SystemExit(f"setup of {model} did not write both artifacts: {setup}")
            # Interleaved, so that a load spike on a shared machine hits every option alike.
            rows = {o: [] for o in OPTIONS}
            for _ in range(runs):
                for option in OPTIONS:
                    rows[option].append(run_child(option, model, work, cfg))
        results[model] = {o: {"median": median_row(r), "runs": r, "trains": r[0]["trains"]} for o, r in rows.items()}
        for option in OPTIONS:
            m = results[model][option]["median"]
            print(f"{model:12s} {option:12s} load {m['load_s']:6.3f} s  first call {m['first_call_s']:6.3f} s  "
                  f"modules imported {m['modules']:5.0f}  trains: {results[model][option]['trains']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cfg": cfg, "runs": runs, "results": results, "when": time.time()}, f, indent=1)


if __name__ == "__main__":
    main()
