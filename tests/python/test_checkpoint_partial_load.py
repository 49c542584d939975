"""``load_latest(state, partial=True)``: a part of a step, for evaluation or export (#46: a model without its
optimizer). Whole entries of the state's dicts may be left out and are not read; what the state holds must be
in the step as in a full load (a Stateful, list or tuple whole), and a refusal copies nothing. The same at
another world size and under another sharding plan: tests/python/test_checkpoint_torchrec.py (``partial``)."""

from __future__ import annotations

import pytest
import torch

import ettkit
from ettkit.checkpoint import AsyncCheckpointer


@pytest.fixture()
def step(tmp_path):
    """Step 1 of a model, its Adam optimizer after one step, and a dict of a tensor and a value."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(4, 3)).sum().backward()
    optim.step()
    with AsyncCheckpointer(tmp_path / "ck", recorder=None, preempt_signals=()) as ck:
        ck.save(1, {"model": model, "optim": optim, "meta": {"epoch": 3, "scale": torch.full((2,), 7.0)}},
                extra="x").wait()
    return tmp_path / "ck", model, optim


def reader(directory):
    return AsyncCheckpointer(directory, recorder=None, preempt_signals=(), read_only=True)


def test_a_model_alone_loads_and_nothing_else_is_read(step):
    directory, model, _ = step
    fresh = torch.nn.Linear(3, 2)
    with reader(directory) as ck:
        with pytest.raises(ettkit.InvalidArgumentError) as e:  # a full load names what the state lacks
            ck.load_latest({"model": fresh})
        assert "unexpected in the checkpoint" in str(e.value) and "'optim.state.0.exp_avg'" in str(e.value)
        assert not torch.equal(fresh.weight, model.weight)
        assert ck.load_latest({"model": fresh}, partial=True) == (1, "x")
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_the_optimizer_alone_and_part_of_a_dict_load(step):
    directory, model, optim = step
    other = torch.nn.Linear(3, 2)
    fresh = torch.optim.Adam(other.parameters())
    meta = {"epoch": 0}
    with reader(directory) as ck:
        assert ck.load_latest({"optim": fresh, "meta": meta}, partial=True) == (1, "x")
    assert meta == {"epoch": 3}  # 'meta.scale' left out with its entry
    got, want = fresh.state_dict()["state"], optim.state_dict()["state"]
    assert sorted(got) == sorted(want) == [0, 1]
    for i in want:
        assert all(torch.equal(got[i][k], want[i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_what_the_state_holds_must_be_in_the_step_and_a_refusal_copies_nothing(step):
    directory, _, _ = step
    fresh = torch.nn.Linear(3, 2)
    before = fresh.weight.detach().clone()
    with reader(directory) as ck:
        with pytest.raises(ettkit.InvalidArgumentError) as e:
            ck.load_latest({"model": fresh, "other": torch.zeros(1)}, partial=True)
        assert "missing in the checkpoint: 'other'" in str(e.value)
        assert "unexpected" not in str(e.value)
        with pytest.raises(ettkit.InvalidArgumentError) as e:
            ck.load_latest({"model": torch.nn.Linear(3, 4)}, partial=True)
        assert "'model.weight'" in str(e.value) and "shape" in str(e.value)
    assert torch.equal(fresh.weight, before)


def test_a_stateful_is_loaded_whole_not_in_part(step):
    """A module without the bias the step holds: partial=True leaves out dict entries, never a tensor inside
    a Stateful (its load_state_dict would not see what was left out); refused naming it, nothing copied."""
    directory, _, _ = step
    no_bias = torch.nn.Linear(3, 2, bias=False)
    before = no_bias.weight.detach().clone()
    with reader(directory) as ck:
        with pytest.raises(ettkit.InvalidArgumentError) as e:
            ck.load_latest({"model": no_bias}, partial=True)
    assert "partial=True leaves out whole entries" in str(e.value) and "'model.bias'" in str(e.value)
    assert torch.equal(no_bias.weight, before)


def test_partial_must_be_a_bool(step):
    directory, _, _ = step
    with reader(directory) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match="partial='yes' must be True or False"):
            ck.load_latest({"model": torch.nn.Linear(3, 2)}, partial="yes")
