"""Issue #63 item 1: a model with dropout resumes bit for bit by default.

A 4-layer MLP with dropout 0.1, AdamW, a cosine schedule with warmup and gradient clipping, saved as
{"model", "optim", "sched", "data"} the README's way, nothing else: every step after the restore must give the
loss the uninterrupted run gave, to the bit. Before the generators were part of the step, every step after the
restore differed (the dropout masks came from wherever the restarted process's generator was, and
iter(DataLoader) drew its base seed from the restored generator). Each step also draws from Python's random and
NumPy, as augmentations do.

The "restart" is a new set of objects after torch.manual_seed(0), as a fresh process of the same script begins.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from ettkit.checkpoint import AsyncCheckpointer, DataPosition

STEPS, SAVE_AT = 24, 9  # 16 samples / batch 4 = 4 batches an epoch: the save falls mid-epoch (epoch 2, batch 1)


def _setup(loader_kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    g = torch.Generator().manual_seed(123)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    if loader_kind == "shuffle":
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        set_epoch = None
    else:  # the README's: a DistributedSampler (one replica here) and worker processes
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
        loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
        set_epoch = sampler.set_epoch
    pos = DataPosition()
    return model, opt, sched, loader, pos, set_epoch


def _train(model, opt, sched, loader, pos, set_epoch, until: int, ck=None, start: int = 0) -> dict:
    losses = {}
    step = start
    for x, y in pos.stream(loader, set_epoch=set_epoch):
        step += 1
        noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3  # augmentation-style draws
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x + noise), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses[step] = loss.item().hex()
        if ck is not None and step == SAVE_AT:
            ck.save(step, {"model": model, "optim": opt, "sched": sched, "data": pos}).wait()
        if step == until:
            break
    return losses


def _run(tmp_path, loader_kind: str, **options) -> tuple[dict, dict]:
    random.seed(1)
    np.random.seed(1)
    whole = _train(*_setup(loader_kind), until=STEPS)
    random.seed(1)
    np.random.seed(1)
    model, opt, sched, loader, pos, set_epoch = _setup(loader_kind)
    with AsyncCheckpointer(tmp_path / "ckpt", recorder=None, **options) as ck:
        first = _train(model, opt, sched, loader, pos, set_epoch, until=SAVE_AT + 3, ck=ck)  # runs past the save
    assert all(first[s] == whole[s] for s in first)
    random.seed(99)  # a restarted process's generators are wherever its start left them
    np.random.seed(99)
    model, opt, sched, loader, pos, set_epoch = _setup(loader_kind)
    torch.rand(17)
    with AsyncCheckpointer(tmp_path / "ckpt", recorder=None, **options) as ck:
        step, _ = ck.load_latest({"model": model, "optim": opt, "sched": sched, "data": pos})
    assert step == SAVE_AT and (pos.epoch, pos.batches) == (2, 1)
    resumed = _train(model, opt, sched, loader, pos, set_epoch, until=STEPS, start=step)
    return whole, resumed


@pytest.mark.parametrize("loader_kind", ["shuffle", "distributed_workers"])
def test_dropout_model_resumes_bit_for_bit_by_default(tmp_path, loader_kind):
    whole, resumed = _run(tmp_path, loader_kind)
    assert list(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    differ = [s for s in resumed if resumed[s] != whole[s]]
    assert differ == [], f"steps after the restore that differ: {differ}"


def test_without_the_generators_the_resume_differs(tmp_path):
    # The opt-out, and the proof that the test above can fail: the dropout masks after the restore differ.
    whole, resumed = _run(tmp_path, "shuffle", rng_state=False)
    assert resumed[SAVE_AT + 1] != whole[SAVE_AT + 1]


def test_a_corrupt_generator_state_makes_the_step_fall_back(tmp_path):
    from ettkit.checkpoint import rng_state
    from ettkit.errors import CorruptDataError

    state = rng_state.capture()
    rng_state.check(state, "x")
    state["torch"] = state["torch"][:-1]
    with pytest.raises(CorruptDataError, match="x: the generator state's field 'torch' is not"):
        rng_state.check(state, "x")
    with pytest.raises(CorruptDataError, match="field 'rng' is not a dict"):
        rng_state.check([1, 2], "x")


def test_rng_state_option_is_checked(tmp_path):
    import ettkit

    with pytest.raises(ettkit.InvalidArgumentError, match="rng_state=1 must be True or False"):
        AsyncCheckpointer(tmp_path / "c", recorder=None, rng_state=1)


def test_a_hostile_generator_state_of_the_right_shape_is_refused_before_any_tensor_is_copied():
    # The right lengths, values the setters refuse: an index past 624 for Python's Mersenne Twister, a NumPy
    # pos out of range. check() refuses them (the step then falls back) instead of load_latest raising after
    # the tensors were overwritten.
    import array

    from ettkit.checkpoint import rng_state
    from ettkit.errors import CorruptDataError

    state = rng_state.capture()
    words = array.array("I", state["python"][1])
    words[-1] = 10_000
    bad_python = dict(state, python=[state["python"][0], words.tobytes(), state["python"][2]])
    with pytest.raises(CorruptDataError, match="field 'python' is not a state its generator takes"):
        rng_state.check(bad_python, "x")
    bad_numpy = dict(state, numpy=["MT19937", state["numpy"][1], 10_000, 0, 0.0])
    with pytest.raises(CorruptDataError, match=r"field 'numpy' is not \[name, 2496 bytes, pos in \[0, 624\]"):
        rng_state.check(bad_numpy, "x")  # NumPy itself takes it, and would read past its key
    with pytest.raises(CorruptDataError, match="field 'numpy'"):
        rng_state.check(dict(state, numpy=["PCG64", state["numpy"][1], 0, 0, 0.0]), "x")


def test_a_hostile_epoch_rng_in_a_data_position_is_refused_by_name():
    import ettkit

    pos = DataPosition()
    with pytest.raises(ettkit.InvalidArgumentError, match="epoch_rng must be"):
        pos.load_state_dict({"epoch": 0, "batches": 1, "epoch_rng": {"torch": b"x", "loader": None}})
    good = torch.get_rng_state().numpy().tobytes()
    with pytest.raises(ettkit.InvalidArgumentError, match="epoch_rng"):
        pos.load_state_dict({"epoch": 0, "batches": 1, "epoch_rng": {"torch": good, "loader": b"\x01" * 7}})
