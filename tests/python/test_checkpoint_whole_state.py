"""Whole-state capture (#22 item 2): a save holds the state an optimizer created after the state dict was
captured, Statefuls (modules, optimizers, objects with state_dict()/load_state_dict()) are saved through
their state dicts and restored in place, what cannot be saved as tensors is refused by key, and a load that
does not match names every key that differs."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ettkit
from ettkit.checkpoint import AsyncCheckpointer

TRAINER = os.path.join(os.path.dirname(__file__), "whole_state_trainer.py")


def assert_same(a, b, where=""):
    """Bit-for-bit equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), (where, b)
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def run_trainer(style, run_dir, steps, kill_at, out):
    os.makedirs(out, exist_ok=True)
    return subprocess.run([sys.executable, TRAINER, style, str(run_dir), str(steps), str(kill_at), str(out)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("style", ["readme", "dcp"])
def test_sigkill_after_durable_save_resumes_model_and_adam_moments_bit_for_bit(tmp_path, style):
    # First process: trains, saves every 5 steps, dies by SIGKILL right after step 10 is durable.
    first = run_trainer(style, tmp_path / "run", 16, 10, tmp_path / "a")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    expected = torch.load(tmp_path / "a" / "expected.pt")
    assert expected["step"] == 10 and len(expected["optim"]["state"]) == 6  # Adam state for every parameter
    assert set(expected["optim"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # Second process: the same script resumes from the checkpoint and trains to the end.
    second = run_trainer(style, tmp_path / "run", 16, -1, tmp_path / "a")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = torch.load(tmp_path / "a" / "resumed.pt")
    assert resumed["step"] == 10
    assert_same(expected["model"], resumed["model"], "model")
    assert_same(expected["optim"]["state"], resumed["optim"]["state"], "optim.state")
    assert_same(expected["optim"]["param_groups"], resumed["optim"]["param_groups"], "optim.param_groups")
    # The file holds the moments under the state dict's names.
    on_disk = load_file(str(tmp_path / "run" / "ckpt" / "step-10" / "rank-0.safetensors"))
    assert torch.equal(on_disk["optim.state.0.exp_avg"], expected["optim"]["state"][0]["exp_avg"])
    assert torch.equal(on_disk["optim.state.5.step"], expected["optim"]["state"][5]["step"])
    # And the resumed run ends where an uninterrupted one does.
    ref = run_trainer(style, tmp_path / "ref", 16, -1, tmp_path / "r")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_same(torch.load(tmp_path / "r" / "final.pt"), torch.load(tmp_path / "a" / "final.pt"), "final")
    # The report of the killed and resumed job: its phases add up to E2E, ETT% is training's share of it,
    # and the README's trainer shows its compile (overlapped start) and its checkpoint blocking.
    from ettkit import ett

    r = ett.build_report(tmp_path / "run")
    assert len(r["attempts"]) == 2 and r["failures"] == 1
    assert sum(r["phases"].values()) == pytest.approx(r["e2e_s"], rel=1e-9, abs=1e-6)
    assert r["ett_pct"] == pytest.approx(100 * r["phases"]["training"] / r["e2e_s"], rel=1e-9)
    assert r["phases"]["checkpoint_blocking"] > 0
    if style == "readme":
        assert r["phases"]["compile"] > 0


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    opt.zero_grad()
    model(torch.randn(8, 6, generator=g)).square().mean().backward()
    opt.step()


def snapshot(model, opt):
    import copy

    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(opt.state_dict())}


def keep_only_steps_up_to(path, step):
    for p in os.listdir(path):
        if p.startswith("step-") and int(p[5:]) > step:
            shutil.rmtree(os.path.join(path, p))


@pytest.mark.parametrize("style", ["readme", "dcp"])
def test_state_grows_after_the_first_save_and_every_step_loads(tmp_path, style):
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.nbytes for b in model.buffers())
    expected = {}
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        ck.attach(model=model, optimizer=opt)
        if style == "readme":
            # (A captured scheduler state dict would be a stale copy: only attached optimizers' are live.)
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
        else:
            state = {"model": model, "optim": opt, "sched": sched}
        ck.save(0, state).wait()  # before any step: no optimizer state yet
        expected[0] = snapshot(model, opt)
        assert ck.arena_bytes == params * 4 + buffers
        for step in (1, 2, 3):
            train_step(model, opt, step)
            sched.step()
            ck.save(step, state).wait()
            expected[step] = snapshot(model, opt)
        # Adam's moments (two per parameter element) and one float32 step per parameter tensor appeared.
        assert ck.arena_bytes == 3 * params * 4 + buffers + 6 * 4
        assert ck.plan_builds == 2 and ck.arena_allocations == 2  # grew once, then reused
    saved = load_file(str(tmp_path / "step-3" / "rank-0.safetensors"))
    assert torch.equal(saved["optim.state.2.exp_avg_sq"], expected[3]["optim"]["state"][2]["exp_avg_sq"])
    assert expected[3]["optim"]["param_groups"][0]["lr"] == pytest.approx(1e-2 / 8)
    for step in (3, 2, 1, 0):
        keep_only_steps_up_to(tmp_path, step)
        fresh = small_model()
        with torch.no_grad():
            for p in fresh.parameters():
                p.fill_(7.0)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
        if style == "readme":
            ck = AsyncCheckpointer(tmp_path, recorder=None)
            ck.attach(model=fresh, optimizer=fresh_opt)
            target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        else:
            ck = AsyncCheckpointer(tmp_path, recorder=None)
            target = {"model": fresh, "optim": fresh_opt, "sched": fresh_sched}
        with ck:
            assert ck.load_latest(target)[0] == step
        got = snapshot(fresh, fresh_opt)
        assert_same(expected[step]["model"], got["model"], f"step {step} model")
        assert_same(expected[step]["optim"], got["optim"], f"step {step} optim")
        if style == "dcp":
            assert fresh_sched.last_epoch == step and fresh_sched.get_last_lr() == [1e-2 * 0.5 ** step]
        else:
            # The captured dicts now show the restored optimizer (live tensors, current hyperparameters).
            assert target["optim"]["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.5 ** step)
            if step:
                assert target["optim"]["state"][0]["exp_avg"] is fresh_opt.state[fresh[0].weight]["exp_avg"]


def test_growth_is_bounded_by_the_memory_budget(tmp_path):
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = sum(t.nbytes for t in model.state_dict().values())
    with AsyncCheckpointer(tmp_path / "tight", recorder=None, memory_budget_bytes=first + 100) as ck:
        ck.attach(model=model, optimizer=opt)
        state = {"model": model, "optim": opt}
        assert ck.save(0, state).wait()
        train_step(model, opt, 1)
        with pytest.raises(ettkit.InvalidArgumentError, match=f"memory_budget_bytes={first + 100}"):
            ck.save(1, state)
        assert ck.arena_bytes == first and ck.arena_allocations == 1  # the refused growth allocated nothing
    grown = first + 2 * sum(p.nbytes for p in model.parameters()) + 6 * 4
    with AsyncCheckpointer(tmp_path / "two", recorder=None, memory_budget_bytes=2 * grown,
                           double_buffer=True) as ck:
        state = {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-2)}
        assert ck.save(0, state).wait() and ck.num_arenas == 2 and ck.arena_bytes == first
        train_step(model, state["optim"], 2)
        assert ck.save(1, state).wait()
        assert ck.num_arenas == 2 and ck.arena_bytes == grown and ck.arena_allocations == 4


def test_unchanged_structure_keeps_the_fast_path_with_statefuls(tmp_path):
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        ck.attach(model=model, optimizer=opt)
        state = {"model": model, "optim": opt}
        train_step(model, opt, 1)
        ck.save(1, state).wait()
        names = ck._names
        for step in (2, 3, 4):
            train_step(model, opt, step)
            ck.save(step, state).wait()
        assert ck._names is names  # the names crossed into C++ once
        assert ck.plan_builds == 1 and ck.arena_allocations == 1
        code = ck._skeleton_code
        ck.save(5, state).wait()
        assert ck._skeleton_code is code  # param_groups unchanged: the skeleton's encoding is reused


def test_captured_dicts_are_matched_to_the_optimizer_they_came_from(tmp_path):
    import copy

    a, b = small_model(), small_model()
    opt_a, opt_b = torch.optim.Adam(a.parameters(), lr=1e-2), torch.optim.Adam(b.parameters(), lr=1e-3)
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        ck.attach(model=[a, b], optimizer=[opt_a, opt_b])
        # Captured before the first step, two same-shaped attached optimizers: which is which is unknowable.
        before = {"a": opt_a.state_dict(), "b": opt_b.state_dict()}
        ambiguous = r"'a' looks like the state_dict\(\) of more than one attached optimizer"
        with pytest.raises(ettkit.InvalidArgumentError, match=ambiguous):
            ck.save(1, before)
        train_step(a, opt_a, 1)
        train_step(b, opt_b, 2)
        # With state, each dict shares it with its own optimizer; a deep copy shares nothing and is saved as is.
        frozen = copy.deepcopy(opt_b.state_dict())
        state = {"a": opt_a.state_dict(), "b": opt_b.state_dict(), "frozen": frozen}
        train_step(a, opt_a, 3)
        train_step(b, opt_b, 4)
        opt_b.load_state_dict(state["b"])  # new per-parameter dicts holding the same tensors
        train_step(b, opt_b, 5)
        ck.save(2, state).wait()
    saved = load_file(str(tmp_path / "step-2" / "rank-0.safetensors"))
    assert torch.equal(saved["a.state.0.exp_avg"], opt_a.state[a[0].weight]["exp_avg"])
    assert torch.equal(saved["b.state.0.exp_avg"], opt_b.state[b[0].weight]["exp_avg"])
    assert torch.equal(saved["b.state.0.step"], torch.tensor(3.0))
    assert torch.equal(saved["frozen.state.0.step"], torch.tensor(1.0))  # the copy, at its own step
    assert state["b"]["state"][0] is opt_b.state[b[0].weight]  # refreshed in place
    assert state["frozen"]["state"][0]["step"] == 1


class Counter:
    """A DCP-style Stateful whose state_dict() returns copies: only load_state_dict() restores it."""

    def __init__(self):
        self.total = torch.zeros(4)
        self.seen = 0
        self.tag = "fresh"

    def state_dict(self):
        return {"total": self.total.clone(), "meta": {"seen": self.seen, "tag": self.tag}}

    def load_state_dict(self, sd):
        self.total = sd["total"].clone()
        self.seen = sd["meta"]["seen"]
        self.tag = sd["meta"]["tag"]


def test_custom_stateful_nested_is_saved_by_its_state_dict_and_restored(tmp_path):
    c = Counter()
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        state = {"train": {"counter": c, "epoch": 3}, "w": torch.ones(2)}
        for step in (1, 2):
            c.total += step
            c.seen += 1
            c.tag = f"after-{step}"
            ck.save(step, state).wait()
    saved = load_file(str(tmp_path / "step-2" / "rank-0.safetensors"))
    assert set(saved) == {"train.counter.total", "w"}
    assert torch.equal(saved["train.counter.total"], torch.full((4,), 3.0))
    raw = (tmp_path / "step-2" / "rank-0.extra").read_bytes()
    assert b"Counter" not in raw  # saved through its state dict, not pickled whole
    fresh = Counter()
    target = {"train": {"counter": fresh, "epoch": 0}, "w": torch.zeros(2)}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.load_latest(target)[0] == 2
    assert target["train"]["counter"] is fresh and target["train"]["epoch"] == 3
    assert torch.equal(fresh.total, torch.full((4,), 3.0)) and fresh.seen == 2 and fresh.tag == "after-2"


class Opaque:
    def __init__(self, payload):
        self.payload = payload


@pytest.mark.parametrize("leaf,match", [
    (Opaque(torch.zeros(100_000)),
     r"'meta\.blob' is a test_checkpoint_whole_state\.Opaque whose pickle takes \d+ bytes"),
    (bytes(100_000), r"'meta\.blob' is a bytes of 100000"),
    (lambda: 1, r"'meta\.blob' is a function that cannot be pickled"),
])
def test_leaf_that_cannot_be_saved_as_tensors_is_refused_by_key(tmp_path, leaf, match):
    # Refused even where pickling is allowed: too large for the skeleton, or not picklable at all.
    with AsyncCheckpointer(tmp_path, recorder=None, allow_pickle=True) as ck, \
            torch.serialization.safe_globals([Opaque]):
        with pytest.raises(ettkit.InvalidArgumentError, match=match) as err:
            ck.save(1, {"w": torch.ones(3), "meta": {"blob": leaf}})
        assert "state_dict()/load_state_dict()" in str(err.value) and "extra=" in str(err.value)
        # Small plain values, small (registered) objects and large plain values in extra= still work.
        meta = {"lr": 0.1, "name": "x", "dt": torch.float16, "box": Opaque(1)}
        h = ck.save(2, {"w": torch.ones(3), "meta": meta}, extra={"anything": bytes(100_000)})
        assert h.wait()
    assert os.listdir(tmp_path).count("step-1") == 0


def test_load_mismatch_names_every_key_that_differs(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(1, {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(3), "d": torch.ones(1)}).wait()
        target = {"a": torch.zeros(2), "c": torch.zeros(4), "e": torch.zeros(1), "f": torch.zeros(1)}
        with pytest.raises(ettkit.InvalidArgumentError) as err:
            ck.load_latest(target)
    msg = str(err.value)
    assert "missing in the checkpoint: 'e', 'f'" in msg
    assert "unexpected in the checkpoint (the state dict lacks them): 'b', 'd'" in msg
    assert "'c' is F32 [4] in the state dict, F32 [3] in the checkpoint" in msg
    assert torch.equal(target["a"], torch.zeros(2))  # nothing copied


def test_stateful_mismatch_names_keys_and_copies_nothing(tmp_path):
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, opt, 1)
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(1, {"model": model, "optim": opt}).wait()
    other = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))  # no BatchNorm
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        unexpected = (r"unexpected in the checkpoint .*: "
                      r"'model\.1\.num_batches_tracked', 'model\.1\.running_mean'")
        with pytest.raises(ettkit.InvalidArgumentError, match=unexpected) as err:
            ck.load_latest({"model": other, "optim": torch.optim.Adam(other.parameters())})
        assert "missing in the checkpoint: 'model.1.weight'" not in str(err.value)
        assert "'model.1.weight' is F32 [3, 5] in the state dict, F32 [5] in the checkpoint" in str(err.value)
        assert_same(before, other.state_dict())
        # An optimizer over other parameters, and a state without the saved optimizer at all.
        lone = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
        groups = r"optimizer at 'optim' has parameter groups of sizes \[1\]; the checkpoint's has \[6\]"
        with pytest.raises(ettkit.InvalidArgumentError, match=groups):
            ck.load_latest({"model": small_model(), "optim": lone})
        with pytest.raises(ettkit.InvalidArgumentError, match=r"no state dict at 'sched'"):
            ck.load_latest({"model": small_model(), "optim": torch.optim.Adam(small_model().parameters()),
                            "sched": Counter()})


def test_dcp_style_attached_overlapped_saves_commit_the_state_at_save(tmp_path):
    # The fences find the module's parameters and the optimizer's state through the Stateful path too:
    # every committed step equals the state at its save() call, byte for byte.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.BatchNorm1d(2048),
                                torch.nn.Linear(2048, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    handles, expected = [], {}
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        ck.attach(model=model, optimizer=opt)
        assert ck.overlapped
        state = {"model": model, "optim": opt}
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
        for step in range(1, 9):
            opt.zero_grad()
            model(x + step).sum().backward()
            opt.step()
            want = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
            for i, st in opt.state_dict()["state"].items():
                want.update({f"optim.state.{i}.{f}": v.clone() for f, v in st.items()})
            expected[step] = want
            handles.append(ck.save(step, state))
        for h in handles:
            assert h.wait()
    for step, want in expected.items():
        got = load_file(str(tmp_path / f"step-{step}" / "rank-0.safetensors"))
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), (step, k)
