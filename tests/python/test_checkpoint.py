"""AsyncCheckpointer: round trip, formats, bad input and injected faults."""

import json
import os
import subprocess
import sys

import pytest
import torch

import ettkit
import ettkit.ett  # noqa: F401  (ettkit.ett is a submodule: import it, do not rely on another test)
from ettkit.checkpoint import AsyncCheckpointer, DcpStager, latest_step, parse_every

SCRIPT = os.path.join(os.path.dirname(__file__), "checkpoint_script.py")


def make_state(step: int, n: int = 6, big: int = 50_000):
    g = torch.Generator().manual_seed(step)
    model = {f"layer{i}.weight": torch.randn(big if i == 0 else 100 + i, generator=g) for i in range(n)}
    model["bn.num_batches_tracked"] = torch.tensor(step, dtype=torch.int64)
    model["half"] = torch.randn(33, generator=g).to(torch.bfloat16)
    model["mask"] = torch.rand(17, generator=g) > 0.5
    return {"model": model, "optim": {"state": {0: {"step": torch.tensor(float(step))}},
                                      "param_groups": [{"lr": 0.1 * step, "params": [0]}]}}


def zeros_like_state(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"state": {0: {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0.0, "params": [0]}]}}


def assert_state_equal(a, b):
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert torch.equal(a["optim"]["state"][0]["step"], b["optim"]["state"][0]["step"])


def test_round_trip_in_place_extra_and_non_tensor_state(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        for step in (1, 2):
            h = ck.save(step, make_state(step), extra={"epoch": step})
            assert h.wait() and h.durable and h.error is None and h.staged
        target = zeros_like_state(make_state(2))
        step, extra = ck.load_latest(target)
    assert (step, extra) == (2, {"epoch": 2})
    assert_state_equal(target, make_state(2))
    assert target["optim"]["param_groups"][0]["lr"] == pytest.approx(0.2)
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "step-1", "step-2"]
    assert open(tmp_path / "latest").read() == "step-2\n"
    manifest = json.loads((tmp_path / "step-2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"rank-0.safetensors", "rank-0.extra"}
    assert len(manifest["files"]["rank-0.safetensors"]["xxh3"]) == 16


def test_safetensors_file_readable_by_safetensors(tmp_path):
    from safetensors.torch import load_file

    state = make_state(5)
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(5, state).wait()
    loaded = load_file(str(tmp_path / "step-5" / "rank-0.safetensors"))
    assert set(loaded) == {f"model.{k}" for k in state["model"]} | {"optim.state.0.step"}
    for k, v in state["model"].items():
        assert loaded[f"model.{k}"].dtype == v.dtype and torch.equal(loaded[f"model.{k}"], v)


def test_plan_cached_arena_reused_and_rebuilt_on_structure_change(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=2) as ck:
        for s in range(1, 6):
            ck.save(s, make_state(s)).wait()
        assert ck.plan_builds == 1 and ck.arena_allocations == 1
        arena = ck.arena_bytes
        assert arena == sum(t.nbytes for t in ettkit.checkpoint._flatten.flatten(make_state(1))[1])
        bigger = make_state(6)
        bigger["model"]["extra"] = torch.ones(1000)
        ck.save(6, bigger).wait()
        assert ck.plan_builds == 2 and ck.arena_allocations == 2 and ck.arena_bytes == arena + 4000
        assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "step-5", "step-6"]  # keep_last=2


def test_nothing_committed_returns_none_and_cleans_temporaries(tmp_path):
    (tmp_path / ".tmp-step-7-deadbeefdeadbeef").mkdir()
    (tmp_path / ".tmp-step-7-deadbeefdeadbeef" / "rank-0.safetensors").write_bytes(b"torn")
    (tmp_path / "step-9").mkdir()  # no manifest: never committed
    with pytest.raises(ettkit.CorruptCheckpointError, match="step 9.*manifest.json' is missing"):
        AsyncCheckpointer(tmp_path, recorder=None).load_latest(make_state(1))
    assert not (tmp_path / ".tmp-step-7-deadbeefdeadbeef").exists()
    empty = tmp_path / "empty"
    assert AsyncCheckpointer(empty, recorder=None).load_latest(make_state(1)) is None


def _save_steps(path, steps):
    with AsyncCheckpointer(path, recorder=None, keep_last=0) as ck:
        for s in steps:
            ck.save(s, make_state(s), extra=s).wait()


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_newest_step_falls_back_with_warning(tmp_path, damage):
    _save_steps(tmp_path, [1, 2])
    f = tmp_path / "step-2" / "rank-0.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[:-10]))
    else:
        (tmp_path / "step-2" / "manifest.json").write_text("{not json")
    target = zeros_like_state(make_state(1))
    with pytest.warns(RuntimeWarning, match="step 1"):
        step, extra = AsyncCheckpointer(tmp_path, recorder=None).load_latest(target)
    assert (step, extra) == (1, 1)
    assert_state_equal(target, make_state(1))


def test_flipped_byte_undetected_without_verification_but_all_corrupt_raises(tmp_path):
    _save_steps(tmp_path, [1, 2])
    for s in (1, 2):
        f = tmp_path / f"step-{s}" / "rank-0.safetensors"
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    # Without verification the size checks pass and the newest step loads (the documented trade-off).
    assert AsyncCheckpointer(tmp_path, recorder=None, verify_on_load=False).load_latest(
        zeros_like_state(make_state(2)))[0] == 2
    with pytest.raises(ettkit.CorruptCheckpointError, match="XXH3"):
        AsyncCheckpointer(tmp_path, recorder=None).load_latest(zeros_like_state(make_state(2)))


@pytest.mark.parametrize("change,match", [
    (lambda s: s["model"].pop("layer1.weight"), "model.layer1.weight"),
    (lambda s: s["model"].__setitem__("layer2.weight", torch.zeros(5)), "model.layer2.weight.*shape"),
    (lambda s: s["model"].__setitem__("layer3.weight", torch.zeros(103, dtype=torch.float64)),
     "model.layer3.weight.*dtype"),
    (lambda s: s["model"].__setitem__("new", torch.zeros(3)), "'model.new'"),
])
def test_mismatched_state_dict_names_the_key(tmp_path, change, match):
    _save_steps(tmp_path, [1])
    target = zeros_like_state(make_state(1))
    change(target)
    with pytest.raises(ettkit.InvalidArgumentError, match=match):
        AsyncCheckpointer(tmp_path, recorder=None).load_latest(target)


def test_failed_write_reports_io_error_and_keeps_previous_step(tmp_path):
    """A real failed write: the file-size limit (RLIMIT_FSIZE) makes write(2) fail with EFBIG."""
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, SCRIPT, "diskfull", str(tmp_path / "ck"), str(out)], check=True, timeout=120)
    res = json.loads(out.read_text())
    assert res["err"] and "rank-0.safetensors" in res["err"] and "File too large" in res["err"]
    assert res["handle_error"] == "IoError" and res["durable"] is False
    assert res["dirs"] == ["step-1", "step-3"]
    target = zeros_like_state(make_state(3))
    assert AsyncCheckpointer(tmp_path / "ck", recorder=None).load_latest(target)[0] == 3
    # The ETT report does not read as a job whose saves all went well: the failed one is counted, and the
    # interval is the checkpointer's every=2 (recorded by it, not repeated by the trainer).
    from ettkit import ett

    report = ett.build_report(tmp_path / "run")
    ckpt = report["checkpoints"]
    assert (ckpt["count"], ckpt["failed"], ckpt["refused"]) == (3, 1, 0)
    assert ckpt["tiers"]["disk"]["failed"] == 1
    ledger = [json.loads(x) for x in (tmp_path / "run" / "ett" / "rank-0.jsonl").read_text().splitlines()]
    assert [(r["key"], r["value"]) for r in ledger if r["t"] == "config"] == [("checkpoint_interval_steps", 2.0)]
    assert [(r["name"], r["step"]) for r in ledger if r["t"] == "bg" and r["name"] == "checkpoint_failed"] == [
        ("checkpoint_failed", 2)]
    assert "1 FAILED, nothing committed" in ett.format_report(report)


def test_close_records_its_wait_for_the_last_save(tmp_path):
    """Leaving the with-block waits for the save still being written: a shutdown/checkpoint_drain phase, not
    unattributed time. The writer is held with save 1's bytes written (the test hook), so close() finds that
    save unfinished whatever the machine's load; close() ends the hold and waits for the commit."""
    from ettkit import ett

    with ett.Recorder(tmp_path / "run", rank=0, world_size=1):
        with AsyncCheckpointer(tmp_path / "ck", every="10min") as ck:
            ck._c._hold_commits_for_testing(True)
            held = ck.save(1, {"w": torch.ones(1 << 16)})
            assert not held.durable  # held: it cannot have committed
        assert held.durable  # close() ended the hold and waited for the commit
        # Nothing queued at close: nothing recorded. The writer wakes save 1's waiter before it counts the
        # save done; close() once read that count and recorded a drain of nothing (issue #48: two drain
        # records under make test's load). Several closes right after a wait give that window more chances.
        for i in range(20):
            with AsyncCheckpointer(tmp_path / f"ck-{i}") as ck:
                ck.save(1, {"w": torch.ones(4)}).wait()
    lines = [json.loads(x) for x in (tmp_path / "run" / "ett" / "rank-0.jsonl").read_text().splitlines()]
    drains = [r for r in lines if r["t"] == "phase" and r["name"] == "shutdown/checkpoint_drain"]
    persists = [r for r in lines if r["t"] == "bg" and r["name"] == "checkpoint_persist"]
    assert len(drains) == 1 and len(persists) == 21
    assert drains[0]["e"] >= persists[0]["e"] > drains[0]["b"]  # it ends once step 1 is committed
    assert [r["key"] for r in lines if r["t"] == "config"] == ["checkpoint_interval_s"]
    report = ett.build_report(tmp_path / "run")
    assert report["checkpoints"]["interval_source"] == "configured"


def test_on_busy_skip_and_error(tmp_path):
    # Event-driven: the test hook holds the writer with save 1's bytes written and its one arena still held,
    # so every later save finds the arena busy, whatever the machine's load.
    state = {"w": torch.randn(1 << 16)}
    with AsyncCheckpointer(tmp_path / "skip", recorder=None, on_busy="skip") as ck:
        ck._c._hold_commits_for_testing(True)
        first = ck.save(1, state)
        later = [ck.save(s, state) for s in range(2, 6)]
        assert all(h.skipped and not h.durable for h in later)
        ck._c._hold_commits_for_testing(False)
        assert first.wait() and first.durable and not first.skipped
        assert all(not h.wait() for h in later)
        after = ck.save(6, state)  # the arena is free again: not skipped
        assert after.wait() and not after.skipped
    assert latest_step(str(tmp_path / "skip")) == 6
    assert sorted(p for p in os.listdir(tmp_path / "skip") if p.startswith("step-")) == ["step-1", "step-6"]
    with AsyncCheckpointer(tmp_path / "err", recorder=None, on_busy="error") as ck:
        ck._c._hold_commits_for_testing(True)
        ck.save(1, state)
        with pytest.raises(ettkit.InvalidArgumentError, match="on_busy='error'"):
            ck.save(2, state)
        ck._c._hold_commits_for_testing(False)
    with pytest.raises(ValueError, match="on_busy"):
        AsyncCheckpointer(tmp_path, on_busy="drop")


def test_memory_budget_and_double_buffer(tmp_path):
    state = {"w": torch.randn(100_000)}
    with pytest.raises(ettkit.InvalidArgumentError, match="memory_budget_bytes=1000"):
        AsyncCheckpointer(tmp_path, recorder=None, memory_budget_bytes=1000).save(1, state)
    with AsyncCheckpointer(tmp_path, recorder=None, double_buffer=True, memory_budget_bytes=10**6) as ck:
        ck.save(1, state).wait()
        assert ck.num_arenas == 2
    with AsyncCheckpointer(tmp_path, recorder=None, double_buffer=True, memory_budget_bytes=500_000) as ck:
        ck.save(2, state).wait()
        assert ck.num_arenas == 1  # the budget fits one arena only


def test_attach_prehook_waits_for_staging(tmp_path):
    model = torch.nn.Linear(2000, 2000)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        ck.attach(opt)
        for step in range(1, 6):
            model(torch.randn(2, 2000)).sum().backward()
            expected = model.weight.detach().clone()
            ck.save(step, {"model": model.state_dict()})
            opt.step()  # the pre-hook waits until the copy is done, so the saved value is `expected`
            opt.zero_grad()
            target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
            ck.wait()
            assert ck.load_latest(target)[0] == step
            assert torch.equal(target["model"]["weight"], expected)


def test_should_save_policies(tmp_path):
    assert parse_every(100) == ("steps", 100.0)
    assert parse_every("90s") == ("seconds", 90.0) and parse_every("2min") == ("seconds", 120.0)
    for bad in (0, -3, "soon", "10 parsecs", True):
        with pytest.raises(ValueError, match="every="):
            parse_every(bad)
    with AsyncCheckpointer(tmp_path, recorder=None, every=3, preempt_signals=()) as ck:
        assert [s for s in range(1, 10) if ck.should_save(s)] == [3, 6, 9]
    with AsyncCheckpointer(tmp_path, recorder=None, every="auto", preempt_signals=(), mtbf_prior_s=3600) as ck:
        assert ck.should_save(1)  # nothing measured yet: save to measure
        ck.save(1, make_state(1)).wait()
        interval = ck.auto_interval_s()
        blocking = ck.mean_blocking_s
        # Daly first order with the measured blocking time, never below the time to durable.
        # (R = 0 without a recorder, so Daly's first order is sqrt(2*delta*M); delta floored at 0.1 ms.)
        expected = max((2 * max(blocking, 1e-4) * 3600) ** 0.5, ck.mean_time_to_durable_s)
        assert interval == pytest.approx(expected, rel=1e-6)
        assert not ck.should_save(2)


def test_ett_records_blocking_staging_and_persist(tmp_path):
    rec = ettkit.ett.Recorder(tmp_path / "run")
    with AsyncCheckpointer(tmp_path / "ck", recorder=rec) as ck:
        for s in (1, 2):
            ck.save(s, make_state(s)).wait()
    rec.close()
    records = [json.loads(line) for line in open(rec.ledger_path) if line.strip()]

    def steps_of(name):
        return sorted(r.get("step") for r in records if (r.get("phase") or r.get("name")) == name)

    # Each save left its staging and persist records, with its step; its blocking time at least once.
    assert steps_of("checkpoint_staging") == [1, 2] and steps_of("checkpoint_persist") == [1, 2]
    assert set(steps_of("checkpoint_blocking")) == {1, 2}
    report = ettkit.ett.build_report(tmp_path / "run")
    assert report["checkpoints"]["count"] == 2


def test_a_save_that_blocks_twice_counts_as_one_checkpoint(tmp_path):
    # The save call and the optimizer's wait for its copies are two checkpoint_blocking records of one step.
    rec = ettkit.ett.Recorder(tmp_path / "run")
    big = {"w": torch.randn(8 << 20)}  # 32 MiB: the copy threads are still busy when wait_staged() runs
    with AsyncCheckpointer(tmp_path / "ck", recorder=rec) as ck:
        for s in (1, 2, 3):
            h = ck.save(s, big)
            ck.wait_staged()
            h.wait()
            rec.step(s)
    rec.close()
    records = [json.loads(line) for line in open(rec.ledger_path) if line.strip()]
    blocking = [r for r in records if r.get("name") == "checkpoint_blocking" or r.get("phase") == "checkpoint_blocking"]
    assert {r.get("step") for r in blocking} == {1, 2, 3}
    report = ettkit.ett.build_report(tmp_path / "run")
    assert report["checkpoints"]["count"] == 3
    assert report["checkpoint_blocking_s"]["measured"] > 0


def test_dcp_async_save_with_dcp_stager_round_trips(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(1000, 100), "b": torch.randn(7)}, "step": 3}
    stager = DcpStager()
    for i in range(2):
        res = dcp.async_save(state, checkpoint_id=str(tmp_path / f"c{i}"), async_stager=stager, no_dist=True)
        fut = getattr(res, "upload_completion", res)
        fut.result()
    assert stager.arena_allocations == 1
    target = {"model": {"w": torch.zeros(1000, 100), "b": torch.zeros(7)}, "step": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "c1"), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and torch.equal(target["model"]["b"], state["model"]["b"])
    stager.close()


def test_extra_is_stored_in_the_data_format_not_a_pickle(tmp_path):
    from ettkit.checkpoint._skeleton_codec import decode_extra

    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(1, make_state(1), extra={"rng": [1, 2, 3]}).wait()
    raw = (tmp_path / "step-1" / "rank-0.extra").read_bytes()
    assert raw.startswith(b"ettkit-py-extra-v2\n")
    record = decode_extra(raw, "rank-0.extra", allow_pickle=False)
    assert record.extra == {"rng": [1, 2, 3]} and record.world_size == 1
    assert record.skeleton["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_commit_through_the_store_and_load_back(tmp_path, world):
    init = f"file://{tmp_path / 'rendezvous'}"  # no port to race for with other processes
    procs = [subprocess.Popen([sys.executable, SCRIPT, "rank", str(tmp_path / "ck"), str(r), str(world), init],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (r, err.decode()[-3000:])
        assert f"rank-ok {r}".encode() in out
    manifest = json.loads((tmp_path / "ck" / "step-3" / "manifest.json").read_text())
    assert manifest["world_size"] == world
    assert set(manifest["files"]) == {f"rank-{r}.{e}" for r in range(world) for e in ("safetensors", "extra")}
    assert sorted(p for p in os.listdir(tmp_path / "ck") if p.startswith("step")) == ["step-2", "step-3"]


class Box:
    """A non-tensor leaf that changes in place (its identity stays, its value does not)."""

    def __init__(self, value):
        self.value = value


def test_unchanged_structure_reuses_names_but_never_stale_values(tmp_path):
    # save() hands names and the pickled skeleton over only when they change: values that change in place,
    # plain or opaque, must still reach the checkpoint.
    box = Box(1)
    state = {"w": torch.ones(10), "opt": {"param_groups": [{"lr": 0.1}]}, "box": box}
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0, allow_pickle=True) as ck, \
            torch.serialization.safe_globals([Box]):
        ck.save(1, state).wait()
        state["w"].add_(1)
        state["opt"]["param_groups"][0]["lr"] = 0.05
        box.value = 2
        ck.save(2, state).wait()
        state["extra_tensor"] = torch.full((3,), 7.0)  # structure change: new names
        ck.save(3, state).wait()
        target = {"w": torch.zeros(10), "opt": {"param_groups": [{"lr": 0.0}]}, "box": None,
                  "extra_tensor": torch.zeros(3)}
        assert ck.load_latest(target)[0] == 3
    assert torch.equal(target["extra_tensor"], torch.full((3,), 7.0))
    assert torch.equal(target["w"], torch.full((10,), 2.0))
    assert target["opt"]["param_groups"][0]["lr"] == 0.05 and target["box"].value == 2
    from safetensors.torch import load_file

    step2 = load_file(str(tmp_path / "step-2" / "rank-0.safetensors"))
    assert set(step2) == {"w"} and torch.equal(step2["w"], torch.full((10,), 2.0))
    from ettkit.checkpoint._skeleton_codec import decode_extra

    with torch.serialization.safe_globals([Box]):
        skeleton = decode_extra((tmp_path / "step-2" / "rank-0.extra").read_bytes(), "rank-0.extra",
                                allow_pickle=True).skeleton
    assert skeleton["opt"]["param_groups"][0]["lr"] == 0.05 and skeleton["box"].value == 2


def test_parameters_that_require_grad_save_and_load_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(5, 8)).sum().backward()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    state = {"model": model.state_dict(keep_vars=True), "optim": opt.state_dict()}
    assert state["model"]["0.weight"].requires_grad
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(1, state).wait()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        restored = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
        opt2 = torch.optim.Adam(restored.parameters(), lr=1e-3)
        restored(torch.randn(5, 8)).sum().backward()
        opt2.step()  # materialize the optimizer state so it can be loaded in place
        target = {"model": restored.state_dict(keep_vars=True), "optim": opt2.state_dict()}
        assert ck.load_latest(target)[0] == 1
    for k, v in restored.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert restored[0].weight.requires_grad and restored[0].weight.grad_fn is None
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
