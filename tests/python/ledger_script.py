"""Writes scripted ledgers (the same JSONL format the Recorder writes) for report tests.

The worked example of docs/ett.md ("Worked example"): two attempts, attempt 0 killed after 9
checkpoints, attempt 1 requeued, restored, re-trains 1,200 s and finishes. Times in seconds from T0.
"""

from __future__ import annotations

import json
import os

T0_US = 1_700_000_000_000_000
STEP_S = 100


def us(t_s: float) -> int:
    return T0_US + int(round(t_s * 1_000_000))


class LedgerWriter:
    def __init__(self, run_dir, rank: int = 0, world: int = 1):
        self.path = os.path.join(run_dir, "ett", f"rank-{rank}.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.rank, self.world = rank, world
        self.lines: list[str] = []

    def rec(self, t: str, **fields) -> None:
        self.lines.append(json.dumps({"v": 1, "t": t, **fields}))

    def attempt(self, n: int, ts: float, proc_start: float | None = None) -> None:
        self.rec("attempt", attempt=n, rank=self.rank, world=self.world, pid=1000 + n, host="test", ts=us(ts),
                 proc_start=None if proc_start is None else us(proc_start), restart_count=n, run_id="r", meta={})

    def phase(self, name: str, b: float, e: float, step: int | None = None) -> float:
        f = {"name": name, "b": us(b), "e": us(e)}
        if step is not None:
            f["step"] = step
        self.rec("phase", **f)
        return e

    def step(self, n: int, b: float, e: float) -> float:
        self.rec("step", n=n, b=us(b), e=us(e))
        return e

    def save(self, raw_tail: str = "") -> str:
        with open(self.path, "w") as f:
            f.write("\n".join(self.lines) + "\n" + raw_tail)
        return self.path


def worked_example(run_dir, rank: int = 0, world: int = 1, offset_s: float = 0.0) -> LedgerWriter:
    """The §8.2 example; `offset_s` shifts this rank's records (clock skew between ranks)."""
    w = LedgerWriter(run_dir, rank, world)
    o = offset_s
    # Attempt 0: queue 600, hardware 300, launcher init 180, compile 900.
    w.attempt(0, ts=900 + o)
    w.rec("config", key="checkpoint_interval_s", value=3600.0)
    w.phase("scheduling", 0 + o, 600 + o)
    w.phase("hardware_setup", 600 + o, 900 + o)
    w.phase("launcher_init", 900 + o, 1080 + o)
    t = w.phase("compile", 1080 + o, 1980 + o)
    step = 0
    for _ in range(9):                       # 9 × (36 steps = 3600 s, then a 60 s checkpoint)
        for _ in range(36):
            step += 1
            t = w.step(step, t, t + STEP_S)
        t = w.phase("checkpoint_blocking", t, t + 60, step=step)
    for _ in range(12):                      # 1,200 s of training after the last checkpoint: lost
        step += 1
        t = w.step(step, t, t + STEP_S)
    w.rec("hb", ts=us(t))                    # killed right after step 336; no end record
    # 120 s to detect and tear down, then attempt 1: requeue 900, hardware 300, init 180, restore 240,
    # warm compile 300.
    w.attempt(1, ts=37440 + o)
    w.rec("config", key="checkpoint_interval_s", value=3600.0)
    w.phase("scheduling", 36240 + o, 37140 + o)
    w.phase("hardware_setup", 37140 + o, 37440 + o)
    w.phase("launcher_init", 37440 + o, 37620 + o)
    w.phase("checkpoint_restore", 37620 + o, 37860 + o, step=324)
    t = w.phase("compile", 37860 + o, 38160 + o)
    step = 324
    since_ckpt = 0
    while step < 552:                        # re-train 325..336 (1,200 s), then 216 new steps
        step += 1
        t = w.step(step, t, t + STEP_S)
        since_ckpt += 1
        if since_ckpt == 36:
            t = w.phase("checkpoint_blocking", t, t + 60, step=step)
            since_ckpt = 0
    t = w.phase("shutdown", t, t + 300)
    w.rec("end", ts=us(t), status="clean", detail="")
    return w
