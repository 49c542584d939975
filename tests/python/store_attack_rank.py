"""One rank of a 2-rank gloo job with a peer replica whose TCPStore a stranger can reach, run by
test_security_store.py.

python store_attack_rank.py RANK PORT CKPT_DIR SHM_ROOT OUT_DIR

The test process hosts the job's TCPStore (as torchrun's agent does) and plays a client of it that is not a
rank. Each rank opens its checkpointer with a peer replica (ranks_per_host=1: each rank is a "node"), sets
"ready/<rank>", and waits for "attack-done" before it saves: the stranger's announcements reach the
receivers first. Then a memory save of step 2 (replicated to the partner) and a disk save of step 4. What
the rank saw goes to OUT_DIR/rank-<rank>.json: the replica counters, the replica shelf's steps once the
partner's step 2 is committed there, and the step and values a second checkpointer on the same directory
loads back.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from ettkit.checkpoint import AsyncCheckpointer

WORLD = 2


def state(rank: int, step: int) -> dict:
    return {"w": torch.full((4096,), float(100 * rank + step)), "i": torch.arange(7) * step}


def main() -> int:
    rank, port, ckpt, shm, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    # The test's barrier on a connection of its own: a TCPStore client blocked in wait() holds its connection,
    # and the checkpointer's receiver polls through `store` meanwhile.
    sync = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=WORLD,
                            timeout=timeout)
    result = {}
    with AsyncCheckpointer(ckpt, recorder=None, store=store, memory_tier=shm, job_id="store-attack",
                           peer_replica=True, ranks_per_host=1, commit_timeout_s=60.0) as ck:
        sync.set(f"ready/{rank}", "1")
        sync.wait(["attack-done"])
        # wait() returns once the partner has committed this rank's copy; once both have, each shelf holds the
        # other's (a later disk save retires both).
        assert ck.save(2, state(rank, 2), extra={"rank": rank}, tier="memory").wait()
        sync.set(f"replicated/{rank}", "1")
        sync.wait(["replicated/0", "replicated/1"])
        tier = os.path.join(shm, sorted(os.listdir(shm))[0], f"rank-{rank}", f"replica-of-rank-{1 - rank}")
        result["replica_steps"] = sorted(os.listdir(tier))
        assert ck.save(4, state(rank, 4), extra={"rank": rank}).wait()
        result["replica_stats"] = ck.replica_stats
    # The next load works: a second checkpointer of the same job reads step 4 back.
    with AsyncCheckpointer(ckpt, recorder=None, store=store, commit_timeout_s=60.0) as ck:
        target = {"w": torch.zeros(4096), "i": torch.zeros(7, dtype=torch.long)}
        step, extra = ck.load_latest(target)
        want = state(rank, 4)
        result["loaded"] = {"step": step, "extra": extra,
                            "equal": all(torch.equal(target[k], want[k]) for k in want)}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
