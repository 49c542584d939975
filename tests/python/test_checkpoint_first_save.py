"""#65: the first save() after prepare() does what a later one does, and the per-save Python work is small.

- The first save after ``prepare()`` runs exactly the Python calls (and C functions called from Python) of a later
  save: nothing is bound, walked, encoded, imported or built for the first time inside it (prepare() did it).
- The generators' states reach the record through ``_C.checkpoint.rng_record()`` (their one encoder), in
  one call.
"""

from __future__ import annotations

import collections
import random
import subprocess
import sys

import pytest
import torch

from ettkit import _C
from ettkit.checkpoint import AsyncCheckpointer, rng_state


def _calls(fn) -> collections.Counter:
    """The Python functions and C functions that ``fn()`` calls, counted (sys.setprofile: deterministic)."""
    seen: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            seen[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        elif event == "c_call":
            seen[("C", getattr(arg, "__qualname__", repr(arg)))] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("shape", ["plain", "module"])
def test_the_first_save_after_prepare_runs_the_calls_of_a_later_one(tmp_path, shape):
    if shape == "plain":
        state = {"model": {f"w{i}": torch.randn(8) for i in range(6)}, "step": 3}
        make = lambda: state  # noqa: E731
    else:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # its state exists from the constructor on
        make = lambda: {"model": model, "optim": opt}  # noqa: E731
    with AsyncCheckpointer(tmp_path, keep_last=1, recorder=None, preempt_signals=(), overlap=True,
                           unfenced_sync_max_bytes=0) as ck:
        ck.prepare(make(), wait=True)
        binding, builds, allocations = ck._bound.binding, ck.plan_builds, ck.arena_allocations
        assert binding is not None
        calls = []
        for step in (1, 2, 3):
            st = make()
            calls.append(_calls(lambda: ck.save(step, st).wait()))
        assert ck._bound.binding is binding and ck._bound.saves == 3  # every save checked, none walked
        assert (ck.plan_builds, ck.arena_allocations) == (builds, allocations)
    first, later = calls[0], calls[1]
    assert later == calls[2]  # the comparison below is of a steady save
    extra = {k: first[k] - later[k] for k in first | later if first[k] != later[k]}
    assert not extra, f"the first save after prepare() differs from a later one in {extra}"


def test_rng_record_follows_the_generators():
    # Its bytes against the pre-#64 Python encoder's: test_rng_record_golden.py.
    random.seed(7)
    torch.manual_seed(3)
    fast = _C.checkpoint.rng_record()
    assert type(fast) is bytes and rng_state.capture_record() == fast
    random.random()  # a draw changes the state: the record with it
    assert _C.checkpoint.rng_record() != fast
    torch.rand(1)
    assert rng_state.capture()["torch"] == torch.get_rng_state().numpy().tobytes()


WITHOUT_NUMPY_RANDOM = r"""
import sys
from ettkit.checkpoint import rng_state
assert "numpy.random" not in sys.modules
assert set(rng_state.capture()) == {"python", "torch"}, "numpy"
assert "numpy.random" not in sys.modules
print("ok")
"""


def test_rng_record_without_numpy_random_neither_saves_nor_imports_it():
    out = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY_RANDOM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _sparse_job():
    """The demo's kind of state (examples/python/demo): sparse embedding tables and Adagrad, two groups."""
    emb = torch.nn.ModuleDict({"a": torch.nn.Embedding(50, 4, sparse=True),
                               "b": torch.nn.EmbeddingBag(30, 4, sparse=True, mode="sum")})
    dense = torch.nn.Linear(4, 1)
    opt = torch.optim.Adagrad([{"params": list(emb.parameters()), "lr": 0.05},
                               {"params": list(dense.parameters()), "lr": 0.005}])
    return emb, dense, opt


def _train_step(emb, dense, opt) -> None:
    ids = torch.randint(0, 30, (6,))
    loss = dense(emb["a"](ids[:2]) + emb["b"](ids.view(2, 3))).square().sum()
    opt.zero_grad()
    loss.backward()  # sparse gradients for the tables: Adagrad's sparse update, in place
    opt.step()


def test_a_sparse_embedding_with_adagrad_is_bound_and_restores_what_it_saved(tmp_path):
    torch.manual_seed(0)
    emb, dense, opt = _sparse_job()
    state = {"model": {"embeddings": emb, "dense": dense}, "optim": opt}
    with AsyncCheckpointer(tmp_path, keep_last=1, recorder=None, preempt_signals=()) as ck:
        ck.attach(model=[emb, dense], optimizer=opt)
        ck.prepare(state, wait=True)
        assert ck._bound.binding is not None  # bound at prepare(): the demo's state is checked, not walked
        for step in (1, 2):
            _train_step(emb, dense, opt)
            ck.save(step, state).wait()
        assert ck._bound.saves == 2
    torch.manual_seed(1)  # other values everywhere: the load must bring back every saved one
    emb2, dense2, opt2 = _sparse_job()
    _train_step(emb2, dense2, opt2)
    with AsyncCheckpointer(tmp_path, read_only=True, recorder=None) as ck:
        assert ck.load_latest({"model": {"embeddings": emb2, "dense": dense2}, "optim": opt2})[0] == 2
    for (k, a), b in zip(list(emb.state_dict().items()) + list(dense.state_dict().items()),
                         list(emb2.state_dict().values()) + list(dense2.state_dict().values())):
        assert torch.equal(a, b), k
    saved, loaded = opt.state_dict(), opt2.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for i, per_param in saved["state"].items():
        assert per_param.keys() == loaded["state"][i].keys() == {"step", "sum"}
        for f, v in per_param.items():
            assert torch.equal(v, loaded["state"][i][f]), (i, f)
