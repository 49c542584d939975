"""When to save (``every="auto"`` before and after its first measurement) and which step is the latest
(``latest_step``, read-only). Deterministic: the policy's clock and measured costs are injected."""

from __future__ import annotations

import os

import pytest
import torch
from ettkit.checkpoint import AUTO_UNMEASURED_INTERVAL_S, AsyncCheckpointer, latest_step
from ettkit.ett import recommend_interval


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "n": torch.tensor(step)}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_auto_saves_once_to_measure_then_waits_for_the_measurement_then_follows_the_advisor(tmp_path):
    clock = FakeClock()
    costs = {"committed": 0, "blocking": 0.0, "durable": 0.0}
    with AsyncCheckpointer(tmp_path, recorder=None, every="auto", preempt_signals=(),
                           mtbf_prior_s=3600) as ck:
        ck._clock = clock
        ck._injected_costs = lambda tier="disk": (costs["committed"], costs["blocking"], costs["durable"])
        assert ck.should_save(1)  # nothing saved yet: the first save measures what a save costs
        ck.save(1, state(1)).wait()
        # Not measured yet (as while the first save still persists, or after it failed): the conservative
        # default interval, not a save at every step as before.
        assert ck.auto_interval_s() == AUTO_UNMEASURED_INTERVAL_S
        clock.now += 1.0
        assert not ck.should_save(2)
        clock.now += AUTO_UNMEASURED_INTERVAL_S - 2.0
        assert not ck.should_save(3)
        clock.now += 1.0
        assert ck.should_save(4)
        ck.save(4, state(4)).wait()
        # Measured: Daly's first-order interval from the blocking time, never below the time to durable.
        costs.update(committed=1, blocking=2.0, durable=30.0)
        expected = max(recommend_interval(2.0, 3600.0, 0.0, "daly"), 30.0)
        assert ck.auto_interval_s() == pytest.approx(expected)
        clock.now += expected - 0.5
        assert not ck.should_save(5)
        clock.now += 1.0
        assert ck.should_save(6)
        costs.update(blocking=1e-6, durable=45.0)  # a save cheaper than it takes to become durable
        assert ck.auto_interval_s() == pytest.approx(max(recommend_interval(1e-4, 3600.0, 0.0, "daly"), 45.0))


def test_every_auto_with_real_costs_does_not_save_at_every_step(tmp_path):
    clock = FakeClock()
    with AsyncCheckpointer(tmp_path, recorder=None, every="auto", preempt_signals=(),
                           mtbf_prior_s=3600) as ck:
        ck._clock = clock
        saved = []
        for step in range(1, 50):
            if ck.should_save(step):
                ck.save(step, state(step))
                saved.append(step)
            clock.now += 0.01  # 10 ms steps: far less than any interval
        ck.wait()
        assert saved == [1]
        assert ck.saves_committed == 1 and ck.auto_interval_s() >= ck.mean_time_to_durable_s


def test_latest_step_is_the_newest_commit_and_reads_only(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert latest_step(ckpt) is None  # no directory
    ckpt.mkdir()
    assert latest_step(ckpt) is None  # nothing committed
    with AsyncCheckpointer(ckpt, recorder=None, keep_last=0, preempt_signals=()) as ck:
        ck.save(5, state(5)).wait()
        ck.save(2, state(2)).wait()  # committed last: newest, though the smaller number
        assert latest_step(ckpt) == 2  # beside the live writer, which holds the directory lock
    (ckpt / "step-9").mkdir()  # never committed (no manifest)
    (ckpt / "step-8").mkdir()
    (ckpt / "step-8" / "manifest.json").write_text("{torn")
    before = sorted(os.listdir(ckpt))
    assert latest_step(str(ckpt)) == 2
    assert sorted(os.listdir(ckpt)) == before  # nothing created, removed or locked
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True, preempt_signals=()) as ck:
        with pytest.warns(RuntimeWarning):  # step-9 and step-8 are reported as not loadable
            restored = ck.load_latest(state(0))
    assert restored[0] == latest_step(ckpt)


def test_two_intervals_memory_between_disk_saves(tmp_path):
    # every=6 (disk), every_memory=2: the policy's saves alternate tiers, and save() without a tier follows it.
    shm = tmp_path / "shm"
    shm.mkdir()
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, every=6, every_memory=2, memory_tier=shm, job_id="j",
                           preempt_signals=()) as ck:
        tiers = {}
        for step in range(1, 13):
            tier = ck.due(step)
            assert ck.should_save(step) == (tier is not None)
            if tier:
                h = ck.save(step, state(step))
                assert h.tier == tier
                h.wait()
                tiers[step] = tier
        assert tiers == {2: "memory", 4: "memory", 6: "disk", 8: "memory", 10: "memory", 12: "disk"}
        assert ck.saves_committed == 2 and ck.memory_saves_committed == 4
        # An explicit tier wins; a save outside the policy goes to disk.
        assert ck.save(13, state(13)).tier == "disk"
        assert ck.save(14, state(14), tier="memory").tier == "memory"
        ck.wait()
        assert latest_step(tmp_path / "ck") == 13


def test_every_memory_auto_measures_its_own_tier(tmp_path):
    clock = FakeClock()
    shm = tmp_path / "shm"
    shm.mkdir()
    costs = {"disk": (0, 0.0, 0.0), "memory": (0, 0.0, 0.0)}
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, every=100, every_memory="auto", memory_tier=shm,
                           job_id="j", preempt_signals=(), mtbf_prior_s=3600) as ck:
        ck._clock = clock
        ck._injected_costs = lambda tier="disk": costs[tier]
        assert ck.due(1) == "memory"  # the first memory save measures the tier
        ck.save(1, state(1)).wait()
        assert ck.auto_interval_s("memory") == AUTO_UNMEASURED_INTERVAL_S
        costs["memory"] = (1, 0.004, 0.3)
        expected = max(recommend_interval(0.004, 3600.0, 0.0, "daly"), 0.3)
        assert ck.auto_interval_s("memory") == pytest.approx(expected)
        clock.now += expected - 0.5
        assert ck.due(2) is None
        clock.now += 1.0
        assert ck.due(3) == "memory"
        assert ck.due(100) == "disk"  # the disk interval is due: disk wins the step
    # The memory interval is the tier's own: real costs, every save measured.
    with AsyncCheckpointer(tmp_path / "ck2", recorder=None, every_memory=2, memory_tier=shm, job_id="j2",
                           preempt_signals=()) as ck:
        ck.save(2, state(2)).wait()
        committed, blocking, durable = ck._measured_costs("memory")
        assert committed == 1 and blocking > 0 and durable > 0
        assert ck._measured_costs("disk")[0] == 0


def test_every_memory_needs_a_memory_tier_and_a_valid_interval(tmp_path):
    from ettkit import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="every_memory=2 needs a memory tier"):
        AsyncCheckpointer(tmp_path, recorder=None, every_memory=2)
    with pytest.raises(InvalidArgumentError, match="every_memory=-1"):
        AsyncCheckpointer(tmp_path, recorder=None, every_memory=-1, memory_tier=True, job_id="j")
