"""What the peer replica costs and gives (#23 item 3), measured on 2 gloo ranks of this machine.

    python benchmarks/peer_replica.py [--quick] [--mib 256] [--json out.json]

Each case runs a 2-rank job (two processes; ranks_per_host=1, so each rank is its own "node" with its own
memory root) that saves the same state to the memory tier `repeats` times with and without a peer replica,
in the same run:
  memory_save_durable_s[peer=off|on]  save() -> handle.wait() (committed in memory; with the replica: also
                                      verified and committed by the partner)
  restore_s[own_memory|from_partner]  load_latest() when the rank's own memory tier holds the step, and when
                                      it is gone and the partner gives its replica back
Medians over the repeats; rank 0's figures (both ranks move the same bytes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402


def rank_main(rank: int, init: str, root: str, mib: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from ettkit.checkpoint import AsyncCheckpointer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    n = mib * (1 << 20) // 4
    state = {"w": torch.randn(n, generator=torch.Generator().manual_seed(rank))}
    shm = os.path.join(root, f"shm-{rank}")
    results = {}
    for peer in (False, True):
        times = []
        ck_dir = os.path.join(root, f"ckpt-{int(peer)}")
        with AsyncCheckpointer(ck_dir, recorder=None, memory_tier=shm, job_id=f"bench-{int(peer)}",
                               peer_replica=peer, ranks_per_host=1 if peer else None) as ck:
            for i in range(repeats):
                dist.barrier()
                t = time.perf_counter()
                ck.save(i + 1, state, tier="memory").wait()
                times.append(time.perf_counter() - t)
            ck.close(discard_memory_tier=False)
        results[f"save_{int(peer)}"] = statistics.median(times)
        results[f"save_{int(peer)}_all"] = times
    # Restores of the last step of the replicated run: own memory, then (rank 1's tier wiped) from the partner.
    ck_dir = os.path.join(root, "ckpt-1")
    own, partner = [], []
    for i in range(repeats):
        for lose in (False, True):
            dist.barrier()
            if lose and rank == 1:
                tier = [d for d in os.listdir(shm) if d.startswith("ettkit-mem-")]
                for d in tier:
                    shutil.rmtree(os.path.join(shm, d, "rank-1"), ignore_errors=True)
            dist.barrier()
            target = {"w": torch.empty(n)}
            with AsyncCheckpointer(ck_dir, recorder=None, memory_tier=shm, job_id="bench-1", peer_replica=True,
                                   ranks_per_host=1) as ck:
                t = time.perf_counter()
                got = ck.load_latest(target)
                dt = time.perf_counter() - t
                assert got is not None and ck.restored_from == "memory", (got, ck.restored_from)
                assert torch.equal(target["w"], state["w"])
                (partner if lose else own).append(dt)
                if lose and rank == 1:
                    assert ck.restored_from_rank == 0
                # Keep the tier (and the partner's replica) for the next repeat: save the step again.
                ck.save(repeats + 1 + 2 * i + int(lose), state, tier="memory").wait()
                ck.close(discard_memory_tier=False)
    results["own"] = statistics.median(own)
    results["partner"] = statistics.median(partner)
    results["all"] = {"own": own, "partner": partner}
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _r(xs):
    return [round(x, 3) for x in xs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.mib, a.repeats = 64, 3
    if a.rank is not None:
        rank_main(a.rank, a.init, a.root, a.mib, a.repeats, a.out)
        return 0
    root = tempfile.mkdtemp(prefix="ettkit-replica-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for r in range(2):
            os.makedirs(os.path.join(root, f"shm-{r}"))
        out = os.path.join(root, "result.json")
        init = "file://" + os.path.join(root, "rendezvous")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--init", init,
                                   "--root", root, "--out", out, "--mib", str(a.mib), "--repeats", str(a.repeats)])
                 for r in range(2)]
        codes = [p.wait(timeout=1800) for p in procs]
        if codes != [0, 0]:
            print(f"peer_replica benchmark: ranks exited with {codes}", file=sys.stderr)
            return 1
        import json

        with open(out) as f:
            r = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    case = f"mib={a.mib}"
    results = {
        f"memory_save_durable_s[{case}]": {"peer_off": r["save_0"], "peer_on": r["save_1"],
                                            "ratio_on_off": r["save_1"] / r["save_0"]},
        f"restore_s[{case}]": {"own_memory": r["own"], "from_partner": r["partner"],
                               "ratio_partner_own": r["partner"] / r["own"]},
    }
    bench_common.print_table("peer replica (2 gloo ranks, medians)", results)
    print("  each repeat (s): saves off", _r(r["save_0_all"]), "on", _r(r["save_1_all"]), "; restores own",
          _r(r["all"]["own"]), "from partner", _r(r["all"]["partner"]))
    if a.json:
        bench_common.write_json(a.json, "peer_replica", {"mib": a.mib, "repeats": a.repeats}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
