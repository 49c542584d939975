"""State passed by value (#47 item 3): every entry of a saved state is either restored or refused, never
silently left behind. A property over state shapes x by object / by value x attach before / after
load_latest: a job saves at step SAVE_AT, an uninterrupted run goes on to STEPS; a fresh process (new objects)
resumes from the checkpoint. Either a save or load raises InvalidArgumentError naming the fix, or every
entry equals the state at the save and the resumed losses equal the uninterrupted ones bit for bit.

By value is the README user's form: the state is put together once, before load_latest and the loop, from
``x.state_dict()`` of each Stateful; after load_latest the user hands each dict to ``x.load_state_dict``."""

import copy
import itertools

import pytest
import torch

import ettkit
from ettkit.checkpoint import AsyncCheckpointer, DataPosition

STEPS, SAVE_AT = 9, 4
SHAPES = ("module", "optimizer", "scheduler", "plain", "list", "tensor", "data")
# The shapes a by-value dict cannot carry: a copy that leads back to no object (refused naming the fix).
COPIES = {"scheduler", "data"}
TRAINING = ("module", "optimizer", "scheduler", "data")  # what the losses depend on
DATA = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]


class Job:
    """One process's objects: model with BatchNorm, Adam, StepLR, a DataPosition over DATA, plain values."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.data = DataPosition()
        self.plain = {"seen": 0, "cfg": {"name": "run", "scale": 1.5}, "pair": (0, "a")}
        self.list = [0.0, None]
        self.tensor = torch.zeros(4)  # an EMA of the loss, updated in place
        self.batches = None

    def state(self, shapes, by_value):
        """``shapes`` in the form under test; the other objects that training depends on by object (so that
        the resumed losses are comparable whatever the shapes)."""
        objs = {"module": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "data": self.data, "plain": self.plain, "list": self.list, "tensor": self.tensor}
        state = {k: objs[k].state_dict() if by_value and hasattr(objs[k], "load_state_dict") else objs[k]
                 for k in shapes}
        state.update({k: objs[k] for k in TRAINING if k not in shapes})
        return state

    def after_load(self, state, shapes, by_value):
        """What a by-value user does after load_latest: hand each dict to its object."""
        if by_value:
            for k in shapes:
                obj = {"module": self.model, "optimizer": self.optimizer}.get(k)
                if obj is not None:
                    obj.load_state_dict(state[k])

    def step(self):
        if self.batches is None:
            self.batches = iter(self.data.iterate(DATA * 10))
        x = next(self.batches)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        with torch.no_grad():
            self.tensor.mul_(0.5).add_(loss.detach())
        self.plain["seen"] += 1
        self.plain["pair"] = (self.plain["seen"], "b")
        self.list[0] = float(loss.detach())
        self.list.append(self.plain["seen"])  # grows: the resumed list is shorter than the saved one
        return loss.detach().clone()

    def warm_up(self):
        """A stepped optimizer before the load: a compile on a synthetic batch steps it once (overlapped_start)."""
        self.model(torch.ones(2, 3)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def snapshot(self, shapes):
        """Every entry of the state as the user expects it back: each object's state, deep-copied."""
        objs = {"module": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "data": self.data, "plain": self.plain, "list": self.list, "tensor": self.tensor}
        out = {}
        for k in sorted(shapes):
            o = objs[k]
            out[k] = copy.deepcopy(o.state_dict() if hasattr(o, "load_state_dict") else o)
        return out


def assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, a, b)
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def run(directory, shapes, by_value, attach_first, resume, warm_up=False):
    """The README's loop: state put together once, attach and load_latest in the given order, a save at
    SAVE_AT. Returns (losses of the steps it ran, the snapshot at the save or after the load)."""
    job = Job()
    if warm_up:
        job.warm_up()
    state = job.state(shapes, by_value)
    with AsyncCheckpointer(directory, recorder=None) as ck:
        if attach_first:
            ck.attach(model=job.model, optimizer=job.optimizer)
        restored = ck.load_latest(state)
        if not attach_first:
            ck.attach(model=job.model, optimizer=job.optimizer)
        assert (restored is not None) == resume
        snap = None
        if resume:
            job.after_load(state, shapes, by_value)
            snap = job.snapshot(set(shapes) | set(TRAINING))
        losses = {}
        for step in range(restored[0] + 1 if restored else 0, STEPS):
            losses[step] = job.step()
            if step == SAVE_AT and not resume:
                ck.save(step, state).wait()
                snap = job.snapshot(set(shapes) | set(TRAINING))
    return losses, snap


CASES = [(shapes, by_value, attach_first, warm)
         for n in (1, 2, len(SHAPES))
         for shapes in itertools.combinations(SHAPES, n)
         for by_value, attach_first in itertools.product((False, True), (True, False))
         if n != 2 or ("optimizer" in shapes and by_value)  # pairs: each shape by value beside the optimizer
         for warm in ((False, True) if "optimizer" in shapes and n != 2 else (False,))]


@pytest.mark.parametrize("shapes,by_value,attach_first,warm_up", CASES,
                         ids=lambda v: "+".join(v) if isinstance(v, tuple) else str(v))
def test_every_saved_entry_is_restored_or_refused(tmp_path, shapes, by_value, attach_first, warm_up):
    expect_refusal = by_value and bool(COPIES & set(shapes))
    try:
        full, at_save = run(tmp_path, shapes, by_value, attach_first, resume=False)
        resumed, at_load = run(tmp_path, shapes, by_value, attach_first, resume=True, warm_up=warm_up)
    except ettkit.InvalidArgumentError as e:
        assert expect_refusal, f"refused a state that can be restored: {e}"
        assert "itself, not its state_dict()" in str(e), str(e)
        return
    assert not expect_refusal, "a copy that leads back to no object was saved and loaded: a silent resume"
    assert_same(at_save, at_load)  # every entry, as it was at the save
    assert list(resumed) == list(range(SAVE_AT + 1, STEPS))
    for step, loss in resumed.items():
        assert torch.equal(loss, full[step]), (step, loss, full[step])


def test_fresh_optimizer_state_dict_by_value_is_filled_with_the_saved_moments(tmp_path):
    # The second failure: attach after load_latest, a fresh optimizer's state_dict() was refused as
    # "unexpected in the checkpoint: 'optim.state.0.exp_avg'". Now the dict gets the saved moments.
    job = Job()
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        for _ in range(3):
            job.step()
        ck.save(3, {"optim": job.optimizer}).wait()
    fresh = Job()
    state = {"optim": fresh.optimizer.state_dict()}
    assert state["optim"]["state"] == {}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.load_latest(state)[0] == 3
    for i, p in enumerate(job.model.parameters()):
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state["optim"]["state"][i][field], job.optimizer.state[p][field])
    assert state["optim"]["param_groups"][0]["lr"] == job.optimizer.param_groups[0]["lr"] == 0.05 * 0.5
    fresh.optimizer.load_state_dict(state["optim"])  # the user's part
    p0 = next(fresh.model.parameters())
    assert torch.equal(fresh.optimizer.state[p0]["exp_avg"], job.optimizer.state[next(job.model.parameters())]["exp_avg"])


def test_filled_dict_stays_live_after_load_state_dict_and_attach(tmp_path):
    # The dict load_latest filled is recognised as the attached optimizer's at the next save, even when
    # load_state_dict copied its tensors (here: forced by a dtype change the optimizer undoes).
    job = Job()
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        job.step()
        ck.save(1, {"optim": job.optimizer}).wait()
    fresh = Job()
    state = {"optim": fresh.optimizer.state_dict()}
    with AsyncCheckpointer(tmp_path, recorder=None, keep_last=0) as ck:
        ck.load_latest(state)
        for st in state["optim"]["state"].values():  # copies that share nothing with the optimizer's state
            st["exp_avg"] = st["exp_avg"].double()
        fresh.optimizer.load_state_dict(state["optim"])
        ck.attach(optimizer=fresh.optimizer)
        for _ in range(2):
            fresh.step()
        ck.save(3, state).wait()
        assert state["optim"]["state"][0]["step"] == 3  # refreshed in place from the optimizer
        again = {"optim": Job().optimizer.state_dict()}
        ck.load_latest(again)
    assert torch.equal(again["optim"]["state"][0]["step"], torch.tensor(3.0))


@pytest.mark.parametrize("make,key,noun", [
    (lambda j: j.scheduler.state_dict(), "sched", "scheduler"),
    (lambda j: j.data.state_dict(), "pos", "data_position"),
    (lambda j: torch.amp.GradScaler("cpu").state_dict(), "scaler", "scaler"),
])
def test_copied_state_dict_is_refused_at_save_and_load_naming_the_fix(tmp_path, make, key, noun):
    # The first failure: {"sched": scheduler.state_dict()} put together before training saved the
    # scheduler at last_epoch 0 at every save and "resumed" it there, with no warning.
    job = Job()
    fix = f"Pass the {noun} object itself, not its state_dict(): {{'{key}': {noun}}}"
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match=rf"'{key}' is .*{noun}") as err:
            ck.save(1, {"model": job.model, key: make(job)})
        assert fix in str(err.value)
        with pytest.raises(ettkit.InvalidArgumentError) as err:
            ck.load_latest({"model": job.model, key: make(job)})
        assert fix in str(err.value)
    # Inside a Stateful's own state dict, or a user's dict with the same keys, nothing is refused.
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(2, {"data": job.data, "mine": {"epoch": 1, "batches": 2}}).wait()


def test_plain_entry_the_checkpoint_lacks_is_refused_before_anything_is_copied(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        ck.save(1, {"w": torch.ones(2), "meta": {"seen": 5, "hist": [1, 2, 3]}}).wait()
        target = {"w": torch.zeros(2), "meta": {"seen": 0, "hist": [], "added": "x"}}
        with pytest.raises(ettkit.InvalidArgumentError, match=r"'meta\.added' is in the state, not in the checkpoint"):
            ck.load_latest(target)
        assert torch.equal(target["w"], torch.zeros(2)) and target["meta"]["seen"] == 0  # nothing restored
        with pytest.raises(ettkit.InvalidArgumentError, match="the state is a tuple"):
            ck.load_latest((torch.zeros(2), 1))
        target = {"w": torch.zeros(2), "meta": {"seen": 0, "hist": [9, 9, 9, 9]}}
        ck.load_latest(target)
    assert target["meta"] == {"seen": 5, "hist": [1, 2, 3]}  # a list takes the saved length
