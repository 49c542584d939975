"""``ettkit export --format hf`` against DCP's consolidations, on the same 2-rank FSDP2 GPT-2 state (#67).

python benchmarks/export_hf.py [--layers 6] [--embd 768] [--runs 3] [--dir /tmp/export-bench] [--quick] [--json F]

Two gloo ranks build one GPT-2 (``GPT2LMHeadModel`` from a ``GPT2Config``: vocab 50257, ``--layers`` blocks of
``--embd``), shard it with FSDP2 and save its state dict three ways: an ettkit step (``AsyncCheckpointer``),
a DCP checkpoint (``dcp.save``, DCP's own format) and DCP's Hugging Face format (``HuggingFaceStorageWriter``
with ``save_distributed=True``: per-rank safetensors to be consolidated). Then each conversion into one
consolidated file runs ``--runs`` times, each in a fresh process that imports what it needs first: the call
alone is timed, and its memory is the process's peak RSS (``VmHWM``) above its RSS before the call (torch's
import alone is ~650 MB of RSS here, the same for every case):

- ``ettkit export STEP --format hf OUT`` (checksums verified, one tensor at a time);
- ``dcp_to_torch_save(DCP_DIR, OUT.pt)`` (``torch.distributed.checkpoint.format_utils``: loads the whole state
  into memory, then ``torch.save``);
- ``consolidate_safetensors_files(HF_DIR, OUT, ...)`` (``torch.distributed.checkpoint._consolidate_hf_safetensors``,
  private in torch 2.14: DCP's safetensors consolidation, one process).

Prints one JSON line per conversion with the medians and every run; ``--json`` writes them as one list.
``--quick`` (``make bench``): 2 blocks of 192, one run per conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def save(rank: int, world: int, init: str, root: str, layers: int, embd: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from ettkit.checkpoint import AsyncCheckpointer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=embd, n_head=12))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with AsyncCheckpointer(os.path.join(root, "ettkit"), recorder=None) as ck:
        ck.save(1, {"model": model}).wait()
    sd = model.state_dict()
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))
    # DCP's safetensors writer refuses tensors that share memory: the tied lm_head.weight is left out there.
    hf_sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    dcp.save(hf_sd, storage_writer=HuggingFaceStorageWriter(os.path.join(root, "dcp-hf"), save_distributed=True))
    if rank == 0:
        with open(os.path.join(root, "names.json"), "w") as f:
            json.dump(sorted(hf_sd), f)
    dist.destroy_process_group()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(case: str, src: str, out: str, mapping: str) -> None:
    """One conversion in this fresh process: imports first (their time and memory are not the conversion's),
    then the call, timed; prints wall seconds and the peak RSS above the RSS before the call."""
    if case == "ettkit export":
        from ettkit.integrations.hf_export import export_hf

        def convert():
            export_hf(src, out, tied={}, overwrite=True)
    elif case == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def convert():
            dcp_to_torch_save(src, out)
    else:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        os.makedirs(out, exist_ok=True)  # it writes into the directory, and does not make it

        def convert():
            consolidate_safetensors_files(src, out, json.loads(mapping))
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    convert()
    seconds = time.perf_counter() - start
    print(json.dumps({"s": seconds, "peak_above_start_bytes": (_status_kb("VmHWM") - before) * 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ettkit-export-bench")
    ap.add_argument("--reuse", action="store_true", help="convert the states an earlier run saved in --dir")
    ap.add_argument("--quick", action="store_true", help="2 blocks of width 192, one run per conversion")
    ap.add_argument("--json", help="write the conversions' records here")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.embd, args.runs = 2, 192, 1  # 12 heads: the width a multiple of 12
    records = []
    root = args.dir
    if not (args.reuse and os.path.exists(os.path.join(root, "names.json"))):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        init = f"file://{root}/rdv"
        procs = [subprocess.Popen([sys.executable, __file__, "--save", str(r), "2", init, root, str(args.layers),
                                   str(args.embd)]) for r in range(2)]
        assert [p.wait() for p in procs] == [0, 0]
    names = json.load(open(os.path.join(root, "names.json")))
    mapping = json.dumps({n: 1 for n in names})
    step = os.path.join(root, "ettkit", "step-1")
    size = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step) if f.endswith(".safetensors"))
    cases = {"ettkit export": (step, f"{root}/out-ettkit"),
             "dcp_to_torch_save": (f"{root}/dcp", f"{root}/out-dcp.pt"),
             "dcp consolidate_safetensors_files": (f"{root}/dcp-hf", f"{root}/out-dcp-hf")}
    for name, (src, out) in cases.items():
        runs = []
        for _ in range(args.runs):
            shutil.rmtree(f"{root}/out-dcp-hf", ignore_errors=True)
            p = subprocess.run([sys.executable, __file__, "--child", name, src, out, mapping], capture_output=True,
                               text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{name} failed: {p.stderr[-2000:]}")
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs) \
            if os.path.isdir(out) else os.path.getsize(out)
        records.append({"case": name, "state_bytes": size, "written_bytes": written,
                        "median_s": round(statistics.median(r["s"] for r in runs), 3),
                        "median_peak_mb": round(statistics.median(r["peak_above_start_bytes"] for r in runs) / 2**20),
                        "runs_s": [round(r["s"], 3) for r in runs],
                        "runs_peak_mb": [round(r["peak_above_start_bytes"] / 2**20) for r in runs]})
        print(json.dumps(records[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
    elif len(sys.argv) > 1 and sys.argv[1] == "--save":
        save(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
    else:
        main()
