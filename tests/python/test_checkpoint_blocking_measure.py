"""Issue #63 item 2: the checkpoint blocking the ETT ledger records is the whole ``save()`` call the training
thread made, as the user times it with ``perf_counter`` around the call. Before, the ledger counted only the
C++ part: the Python walk and encoding of a state of many tensors (most of the call) were counted as training
(a user timed 3.55 ms per save, the report said 0.47 ms)."""

from __future__ import annotations

import time

import torch
from ettkit import ett
from ettkit.checkpoint import AsyncCheckpointer


def test_the_ledgers_blocking_is_the_whole_save_call(tmp_path):
    # 2,000 small tensors: the Python part of save() is most of the call.
    state = {"params": {f"p{i}": torch.full((4,), float(i)) for i in range(2000)}, "step": 0}
    timed = []
    with ett.Recorder(tmp_path / "run", rank=0, world_size=1) as rec:
        with AsyncCheckpointer(tmp_path / "ckpt", recorder=rec, keep_last=1) as ck:
            for step in range(1, 6):
                state["step"] = step
                t0 = time.perf_counter()
                handle = ck.save(step, state)
                timed.append(time.perf_counter() - t0)
                handle.wait()
    report = ett.build_report(str(tmp_path / "run"))
    blocking = report["checkpoint_blocking_s"]["measured"]
    assert report["checkpoints"]["count"] == 5
    # The ledger's interval ends inside the call and begins at its first line: the same interval as the
    # user's but for the call's entry and return (microseconds against milliseconds).
    assert 0.75 * sum(timed) <= blocking <= sum(timed) * 1.0001, (blocking, timed)
