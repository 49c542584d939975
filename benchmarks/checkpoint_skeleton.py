"""The non-tensor record of a checkpoint (``rank-<r>.extra``): ettkit's pickle-free format vs the pickle it
replaced, in the same run.

    python benchmarks/checkpoint_skeleton.py [--quick] [--json FILE] [--tensors N] [--repeats R]

The states: a model of N/4 one-element parameters (default N = 10,000 tensors) with Adam stepped once, passed
as objects (``{"model": model, "optim": opt, "epoch": 3}``), and the two states benchmarks/checkpoint.py
--quick saves (1GB_large: 12 tensors; 256MB_small: 4,000), each flattened by the checkpointer's own walk;
extra= ``{"epoch": 3, "rng": torch.get_rng_state()}`` (the RNG state: pickled by the former format, stored as
a tensor's bytes by the current one). Metrics (CPU milliseconds, median of --repeats; bytes):

- ``encode_ms``: a save whose skeleton changed (the first save, a new parameter group): the skeleton and the
  record encoded; ``record_ms``: every other save (the skeleton's encoding is reused, only extra= and the
  record are encoded: what save() adds to the blocking time);
- ``decode_ms``: what a load does with the record of each candidate step (former: the two pickle.loads of
  the record and the one of its world size; current: one decode); ``decode_ms[former_format_opt_in]``: the
  former record read the way ettkit reads it now, under ``allow_pickle=True`` (the restricted unpickler);
- ``record_bytes``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import print_table, write_json  # noqa: E402

from ettkit.checkpoint._flatten import flatten_state  # noqa: E402
from ettkit.checkpoint._skeleton_codec import MAGIC_PICKLE, decode_extra, encode_extra, encode_skeleton  # noqa: E402


def skeleton_of(tensors: int):
    """The checkpointer's skeleton of a model + Adam state holding ``tensors`` tensors."""
    params = tensors // 4
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in range(params))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model:
        p.grad = torch.ones(1)
    opt.step()
    names, _, skeleton, comparable, _ = flatten_state({"model": model, "optim": opt, "epoch": 3})
    assert comparable and len(names) == 4 * params, len(names)
    return skeleton


def former_encode(skeleton, extra) -> bytes:
    """The former save path: the skeleton pickled, then the record."""
    blob = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    return former_record(blob, extra)


def former_record(skeleton_blob: bytes, extra) -> bytes:
    return MAGIC_PICKLE + pickle.dumps({"skeleton_pickle": skeleton_blob, "extra": extra, "world_size": 1},
                                       protocol=pickle.HIGHEST_PROTOCOL)


def former_decode(blob: bytes):
    """The former load path per candidate: _decode_extra (two pickle.loads) and _saved_world_size (one)."""
    payload = pickle.loads(memoryview(blob)[len(MAGIC_PICKLE):])
    value = pickle.loads(payload["skeleton_pickle"]), payload["extra"]
    world = pickle.loads(memoryview(blob)[len(MAGIC_PICKLE):]).get("world_size")
    return value, world


def median_ms(fn, repeats: int) -> float:
    """Median CPU time of ``fn`` (single-threaded work: the process's CPU time is its time, whatever else
    the machine runs; wall time on a loaded machine moved 5x between runs)."""
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def measure(skeleton, extra, repeats: int) -> dict:
    """Each metric's {variant: value} for one skeleton, the variants interleaved metric by metric."""
    code = encode_skeleton(skeleton, allow_pickle=False)
    former_skeleton = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    current = encode_extra(code, extra, 1, allow_pickle=False)
    former = former_record(former_skeleton, extra)
    # Both read back to the same values (the RNG state compared as a tensor).
    mine, theirs = decode_extra(current, "current", allow_pickle=False), former_decode(former)[0]
    assert mine.skeleton == theirs[0] and torch.equal(mine.extra["rng"], theirs[1]["rng"])
    assert decode_extra(former, "former", allow_pickle=True).skeleton == theirs[0]
    return {
        "encode_ms": {
            "former_pickle": median_ms(lambda: former_encode(skeleton, extra), repeats),
            "current": median_ms(lambda: encode_extra(encode_skeleton(skeleton, allow_pickle=False), extra, 1,
                                                      allow_pickle=False), repeats)},
        "record_ms": {
            "former_pickle": median_ms(lambda: former_record(former_skeleton, extra), repeats),
            "current": median_ms(lambda: encode_extra(code, extra, 1, allow_pickle=False), repeats)},
        "decode_ms": {
            "former_pickle": median_ms(lambda: former_decode(former), repeats),
            "current": median_ms(lambda: decode_extra(current, "current", allow_pickle=False), repeats),
            "former_format_opt_in": median_ms(lambda: decode_extra(former, "former", allow_pickle=True), repeats)},
        "record_bytes": {"former_pickle": len(former), "current": len(current)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (7 if args.quick else 21)
    extra = {"epoch": 3, "rng": torch.get_rng_state()}
    import checkpoint as bench  # benchmarks/checkpoint.py: its states, as its --quick run saves them

    skeletons = {f"tensors={args.tensors}": skeleton_of(args.tensors)}
    for case in ("1GB_large", "256MB_small"):
        skeletons[f"checkpoint.py --quick {case}"] = flatten_state(bench.make_state(case, True))[2]
    results: dict = {}
    for case, skeleton in skeletons.items():
        for metric, variants in measure(skeleton, extra, repeats).items():
            results[f"{metric}[{case}]"] = variants
    print_table(f"checkpoint record (median of {repeats})", results)
    if args.json:
        write_json(args.json, "checkpoint_skeleton", {"quick": args.quick, "tensors": args.tensors,
                                                      "repeats": repeats, "torch": torch.__version__}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
