"""The bound save (issue #65, _state_binding.py): a state walked once, then guarded. Each test changes the state
the way training code does between two saves and proves that the bound checkpointer writes exactly the files
a walked save writes (byte for byte: the safetensors file and the extra record), whether the change kept the
binding (a learning rate, a step count, a tensor's values, its storage swapped under the same object) or
broke it (a tensor, parameter, buffer or submodule replaced, added or removed, keys reordered, an
optimizer's lazy state created, hooks registered). A stale binding may cost a walk, never a wrong file.

The reference is a fresh checkpointer per save: its first save always walks.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from ettkit.checkpoint import AsyncCheckpointer
from ettkit.checkpoint._extra_encode import encode_skeleton
from ettkit.checkpoint._flatten import flatten_state

_ids = itertools.count()


def _files(directory: Path, step: int) -> tuple[bytes, bytes]:
    d = directory / f"step-{step}"
    return (d / "rank-0.extra").read_bytes(), (d / "rank-0.safetensors").read_bytes()


class Pair:
    """A bound checkpointer, and the walked reference every save is compared with."""

    def __init__(self, root: Path):
        self.root = root
        self.ck = AsyncCheckpointer(root / "bound", keep_last=1000, recorder=None, preempt_signals=())
        self.step = 0

    def save(self, state) -> bool:
        """Saves ``state`` both ways, compares the files; returns whether the bound checkpointer used its
        binding."""
        self.step += 1
        before = self.ck._bound.saves
        self.ck.save(self.step, state).wait()
        used = self.ck._bound.saves > before
        ref_dir = self.root / f"ref-{next(_ids)}"
        with AsyncCheckpointer(ref_dir, recorder=None, preempt_signals=()) as ref:
            ref.save(self.step, state).wait()
        assert _files(self.root / "bound", self.step) == _files(ref_dir, self.step), f"step {self.step} differs"
        return used

    def settle(self, state) -> None:
        """Saves until the binding is used again (a changed structure binds at its second walk)."""
        assert any(self.save(state) for _ in range(3)), "the state was never bound again"

    def close(self) -> None:
        self.ck.close()


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    yield p
    p.close()


def plain_state() -> dict:
    g = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(4, 3, generator=g) for i in range(3)}
    return {"model": params,
            "optim": {k: {"exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.ones(4, 3)} for k in params},
            "buffers": [torch.arange(5.0), (torch.ones(2), "tag")],
            "step": 0, "note": "run-a", "nothing": None}


def _replace_tensor(s):
    s["model"]["layer1.weight"] = torch.full((4, 3), 7.0)


def _add_key(s):
    s["model"]["layer9.weight"] = torch.ones(2)


def _remove_key(s):
    del s["optim"]["layer0.weight"]


def _reorder_keys(s):
    s["model"]["layer0.weight"] = s["model"].pop("layer0.weight")


def _replace_list_item(s):
    s["buffers"][0] = torch.arange(6.0)


def _replace_tuple(s):
    s["buffers"][1] = (torch.zeros(2), "tag")


def _tensor_where_a_value_was(s):
    s["step"] = torch.tensor(5)


def _value_where_a_tensor_was(s):
    s["model"]["layer2.weight"] = 3


def _new_root_same_contents(s):
    return dict(s)


# (name, change, still bound: the save right after uses the binding)
PLAIN_CHANGES = [
    ("value", lambda s: s.update(step=s["step"] + 1, note="run-b", nothing=1.5), True),
    ("values_in_place", lambda s: s["model"]["layer0.weight"].mul_(2).sum().item() and None, True),
    ("storage_swapped", lambda s: s["model"]["layer0.weight"].set_(torch.zeros(5, 5)), True),
    ("resized", lambda s: s["optim"]["layer1.weight"]["exp_avg"].resize_(20), True),
    ("data_assigned", lambda s: setattr(s["model"]["layer2.weight"], "data", torch.ones(2, 2, 2)), True),
    ("dtype_changed", lambda s: setattr(s["model"]["layer2.weight"], "data", torch.ones(4, 3, dtype=torch.float16)), True),
    ("new_root", _new_root_same_contents, True),
    ("tensor_replaced", _replace_tensor, False),
    ("key_added", _add_key, False),
    ("key_removed", _remove_key, False),
    ("keys_reordered", _reorder_keys, False),
    ("list_item_replaced", _replace_list_item, False),
    ("tuple_replaced", _replace_tuple, False),
    ("tensor_where_a_value_was", _tensor_where_a_value_was, False),
    ("value_where_a_tensor_was", _value_where_a_tensor_was, False),
]


@pytest.mark.parametrize("name,change,still_bound", PLAIN_CHANGES, ids=[c[0] for c in PLAIN_CHANGES])
def test_a_plain_state_changed_between_saves_is_saved_as_a_walk_would(pair, name, change, still_bound):
    state = plain_state()
    pair.ck.prepare(state, wait=True)
    assert pair.save(state)  # prepare() bound it: the first save is checked, not walked
    new = change(state)
    state = new if type(new) is dict else state
    assert pair.save(state) is still_bound
    pair.settle(state)  # and once changed, bound again
    assert pair.save(state)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.1))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


def training(optimizer: str = "adamw"):
    torch.manual_seed(0)
    model = Net()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: its per-parameter state holds no tensor
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def train_step(model, opt, sched):
    model(torch.randn(8, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _swap_param(model, opt, sched):
    model.fc.weight = torch.nn.Parameter(torch.ones(4, 3))


def _direct_table_edit(model, opt, sched):
    model.fc._parameters["bias"] = torch.nn.Parameter(torch.full((4,), 2.0))


def _buffer_reassigned(model, opt, sched):
    model.bn.running_mean = torch.full((4,), 3.0)


def _buffer_added(model, opt, sched):
    model.register_buffer("counter", torch.tensor([1.0]))


def _buffer_made_persistent(model, opt, sched):
    model._non_persistent_buffers_set.discard("scratch")


def _submodule_added(model, opt, sched):
    model.extra = torch.nn.Linear(2, 2)


def _submodule_replaced(model, opt, sched):
    model.head[0] = torch.nn.Linear(4, 2)


def _module_hook(model, opt, sched):
    def hook(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "hooked"] = torch.tensor([42.0])
    model.fc.register_state_dict_post_hook(hook)


def _optimizer_hook(model, opt, sched):
    def hook(optimizer, state_dict):
        state_dict["param_groups"][0]["hooked"] = True
        return state_dict
    opt.register_state_dict_post_hook(hook)


def _moment_replaced(model, opt, sched):
    p = next(iter(opt.state))
    opt.state[p]["exp_avg"] = torch.full_like(opt.state[p]["exp_avg"], 5.0)


def _group_added(model, opt, sched):
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "lr": 0.5})


def _group_key_added(model, opt, sched):
    opt.param_groups[0]["custom"] = 1


def _params_list_edited(model, opt, sched):
    opt.param_groups[0]["params"].reverse()


MODULE_CHANGES = [
    ("train_step", train_step, True),  # values, the LR, the scheduler's counters, Adam's step counts
    ("lr_set", lambda m, o, s: o.param_groups[0].update(lr=0.123, betas=(0.8, 0.9)), True),
    ("param_data_assigned", lambda m, o, s: setattr(m.fc.weight, "data", torch.zeros(4, 3)), True),
    ("param_swapped", _swap_param, False),
    ("parameter_table_edited", _direct_table_edit, False),
    ("buffer_reassigned", _buffer_reassigned, False),
    ("buffer_added", _buffer_added, False),
    ("buffer_made_persistent", _buffer_made_persistent, False),
    ("submodule_added", _submodule_added, False),
    ("submodule_replaced", _submodule_replaced, False),
    ("moment_replaced", _moment_replaced, False),
    ("group_added", _group_added, False),
    ("group_key_added", _group_key_added, False),
    ("params_list_edited", _params_list_edited, False),
]


@pytest.mark.parametrize("name,change,still_bound", MODULE_CHANGES, ids=[c[0] for c in MODULE_CHANGES])
def test_a_module_and_optimizer_changed_between_saves_are_saved_as_a_walk_would(pair, name, change, still_bound):
    model, opt, sched = training()
    train_step(model, opt, sched)
    state = {"model": model, "optim": opt, "sched": sched, "step": 1}
    pair.ck.prepare(state, wait=True)
    assert pair.save(state)
    change(model, opt, sched)
    state = {"model": model, "optim": opt, "sched": sched, "step": 2}  # a new dict, as a loop writes it
    assert pair.save(state) is still_bound
    pair.settle(state)
    train_step(model, opt, sched)
    assert pair.save(state)


@pytest.mark.parametrize("change", [_module_hook, _optimizer_hook], ids=["module_hook", "optimizer_hook"])
def test_a_state_dict_hook_registered_later_unbinds_the_state_for_good(pair, change):
    model, opt, sched = training()
    train_step(model, opt, sched)
    state = {"model": model, "optim": opt}
    pair.ck.prepare(state, wait=True)
    assert pair.save(state)
    change(model, opt, sched)
    # What the hook adds is in every later save; the walk, not the binding, makes them.
    assert not any(pair.save(state) for _ in range(4))


def test_an_optimizers_lazy_state_rebinds_at_its_first_step(pair):
    model, opt, sched = training()
    state = {"model": model, "optim": opt}
    pair.ck.prepare(state, wait=True)  # before the first step: no moments yet
    assert pair.save(state)
    train_step(model, opt, sched)  # AdamW creates exp_avg, exp_avg_sq and step for every parameter
    assert not pair.save(state)
    pair.settle(state)


def test_an_optimizer_whose_per_parameter_state_holds_no_tensor_is_bound(pair):
    model, opt, sched = training("sgd")
    train_step(model, opt, sched)
    state = {"model": model, "optim": opt, "sched": sched}
    pair.ck.prepare(state, wait=True)
    for _ in range(3):
        assert pair.save(state)
        train_step(model, opt, sched)


def test_a_state_that_is_built_afresh_every_save_backs_off_from_binding(pair):
    """``{"model": dict(model.state_dict())}`` holds new tensor objects at every save: no binding holds, and
    the checkpointer binds ever more rarely (2, 4, ... 64 saves apart) rather than at every save."""
    model, opt, sched = training()
    binds = 0
    for _ in range(12):
        assert not pair.save({"model": dict(model.state_dict())})
        binds += pair.ck._bound.binding is not None
    assert 1 <= binds <= 4, binds


@pytest.mark.parametrize("make", [plain_state, lambda: {"model": training()[0], "step": 3}], ids=["plain", "module"])
def test_the_template_with_its_holes_filled_is_the_whole_skeletons_encoding(make):
    """What a bound save encodes, across many values of the tensor-free parts, is what encode_skeleton makes."""
    from ettkit.checkpoint._state_binding import bind

    state = make()
    names, tensors, skeleton, _, _ = flatten_state(state)
    code = encode_skeleton(skeleton, allow_pickle=False)
    binding = bind(state, names, tensors, skeleton, code, allow_pickle=False, find_optimizer=None)
    assert binding is not None and binding.islands
    for value in (1, -2 ** 70, 2.5, "x" * 300, None, True, [1, 2, 3], (1.0, "a"), {"k": [None, {}]}, b"\x00"):
        state["step"] = value
        want = encode_skeleton(flatten_state(state)[2], allow_pickle=False)
        assert binding.refresh(state, None) == want, value


def test_a_value_the_format_refuses_is_refused_naming_its_key_as_without_the_binding(pair):
    from ettkit import InvalidArgumentError

    state = plain_state()
    pair.ck.prepare(state, wait=True)
    assert pair.save(state)
    state["note"] = object()
    with pytest.raises(InvalidArgumentError, match="note"):
        pair.ck.save(99, state)
    state["note"] = "x" * (10 ** 7)
    with pytest.raises(InvalidArgumentError, match="note"):
        pair.ck.save(99, state)
    state["note"] = "fine"
    pair.settle(state)


def test_the_binding_lets_go_of_the_state_at_close(tmp_path):
    import gc
    import weakref

    state = plain_state()
    probe = state["model"]["layer0.weight"]
    ref = weakref.ref(probe)
    ck = AsyncCheckpointer(tmp_path, recorder=None, preempt_signals=())
    ck.prepare(state, wait=True)
    ck.save(1, state).wait()
    del state, probe
    gc.collect()
    assert ref() is not None  # the binding holds it (docs/checkpoint.md, "The bound save")
    ck.close()
    gc.collect()
    assert ref() is None


def test_an_attached_model_and_optimizer_are_bound_and_their_saves_overlap_training(pair):
    """attach(): the saves return before their copies are done, the fences order the writers, and a bound
    save of an attached model and optimizer writes what a walk writes, step after step."""
    model, opt, sched = training()
    train_step(model, opt, sched)
    pair.ck.attach(model=model, optimizer=opt)
    state = {"model": model, "optim": opt, "sched": sched}
    pair.ck.prepare(state, wait=True)
    for _ in range(4):
        assert pair.save(state)
        train_step(model, opt, sched)
