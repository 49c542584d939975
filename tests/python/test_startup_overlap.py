"""warm_compile and overlapped_start: compile on a fast batch, overlapped with the first real batch, with
no recompile in the first real steps and no trace of the warm-up in training. Backend aot_eager: the
properties under test are Dynamo's and AOTAutograd's (guards, lazy backward, thread-local config), not
Inductor's code generation."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
import threading

import ettkit
import numpy as np
import pytest
import torch
import torch._dynamo
from ettkit import ett
from ettkit.startup import (
    BatchSpec,
    CompileCache,
    Dim,
    StageGraph,
    compiled_graphs,
    overlapped_start,
    warm_compile,
)
from startup_helpers import RecDataset, TinyRec, declared_spec, loss_fn, make_batch, train_steps
from torch.utils.data import DataLoader

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), f"{k} changed"


# ---- warm_compile --------------------------------------------------------------------------------------


def test_warm_compile_leaves_parameters_buffers_grads_and_rng_untouched():
    torch.manual_seed(0)
    model = TinyRec()
    compiled = torch.compile(model, backend=BACKEND)
    # A gradient that is being accumulated must survive the warm-up, value and object.
    model.fc2.weight.grad = torch.full_like(model.fc2.weight, 0.5)
    grad_obj = model.fc2.weight.grad
    before = _state(model)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    report = warm_compile(compiled, declared_spec().fast_batch(), loss_fn)
    assert report.backward and report.graphs >= 1 and report.seconds > 0
    _assert_same(before, _state(model))  # parameters and buffers (BatchNorm statistics, num_batches_tracked)
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    assert np.array_equal(np.random.get_state()[1], rng[2])
    assert model.fc2.weight.grad is grad_obj and torch.all(grad_obj == 0.5)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "fc2.weight")


def test_training_after_warm_compile_is_bit_for_bit_the_same():
    batches = [make_batch(8, seed=s) for s in range(3)]
    spec = BatchSpec.from_batch(batches[0])  # static shapes: the same graph a lazy compile would make

    def run(warm: bool):
        torch.manual_seed(0)
        model = TinyRec()
        compiled = torch.compile(model, backend=BACKEND)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if warm:
            warm_compile(compiled, spec.fast_batch(), loss_fn)
        train_steps(compiled, opt, batches)  # dropout draws from the global RNG, BatchNorm updates buffers
        return _state(model), torch.get_rng_state()

    warm_state, warm_rng = run(True)
    torch._dynamo.reset()
    lazy_state, lazy_rng = run(False)
    _assert_same(warm_state, lazy_state)
    assert torch.equal(warm_rng, lazy_rng)


def test_after_warm_compile_the_first_real_steps_do_not_compile():
    spec = declared_spec(dynamic=True)
    model = TinyRec()
    compiled = torch.compile(model, backend=BACKEND)
    warm_compile(compiled, spec.fast_batch(), loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graphs = compiled_graphs()
    with torch.compiler.set_stance("fail_on_recompile"):  # forward and the (lazy) backward already exist
        train_steps(compiled, opt, [make_batch(n, seed=n) for n in (8, 32, 3)])
    assert compiled_graphs() == graphs


def test_warm_compile_rejects_a_non_scalar_loss_and_still_restores():
    model = TinyRec()
    before = _state(model)
    with pytest.raises(ettkit.InvalidArgumentError, match="scalar tensor"):
        warm_compile(torch.compile(model, backend=BACKEND), declared_spec().fast_batch(), lambda out, b: out)
    _assert_same(before, _state(model))
    assert all(p.grad is None for p in model.parameters())


class ItemModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 1)

    def forward(self, batch):
        scale = batch["dense"].abs().max().item()  # a graph break unless capture_scalar_outputs=True
        return self.fc(batch["dense"]).squeeze(1) * scale


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def test_a_compile_stage_sees_the_callers_compile_config():
    # The torch >= 2.12 trap: compile config is a ContextVar. Compiled on a plain thread, the model graph-
    # breaks at .item() although the caller enabled capture_scalar_outputs; in a StageGraph stage it doesn't.
    batch = make_batch(8)
    results = {}
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        before = _graph_breaks()
        compiled = torch.compile(ItemModel(), backend=BACKEND)
        t = threading.Thread(target=lambda: warm_compile(compiled, batch, loss_fn))
        t.start()
        t.join()
        results["plain_thread"] = _graph_breaks() - before
        torch._dynamo.reset()
        before = _graph_breaks()
        compiled = torch.compile(ItemModel(), backend=BACKEND)
        graph = StageGraph()
        graph.add("compile", lambda: warm_compile(compiled, batch, loss_fn), runs_dynamo=True)
        graph.run()
        results["stage"] = _graph_breaks() - before
        with torch.compiler.set_stance("fail_on_recompile"):
            loss_fn(compiled(batch), batch).backward()  # the caller's thread reuses the stage's graph
    assert results == {"plain_thread": 1, "stage": 0}


# ---- overlapped_start ----------------------------------------------------------------------------------


def _loader(n=70, batch_size=16, gate=None, **dataset_kwargs):
    # 70 samples in batches of 16: the last batch has 6, which the dynamic batch dim must absorb.
    return DataLoader(RecDataset(n, gate=gate, **dataset_kwargs), batch_size=batch_size, num_workers=2)


def test_overlapped_start_happy_path(tmp_path):
    gate = multiprocessing.get_context("fork").Event()

    def loss_opening_the_gate(out, batch):
        gate.set()  # runs inside the warm compile: the workers' first samples wait for it
        return loss_fn(out, batch)

    torch.manual_seed(0)
    model = TinyRec()
    loader = _loader(gate=gate)
    spec = declared_spec(dynamic=True)
    with ett.Recorder(tmp_path, rank=0, world_size=1, launcher_phases_from_env=False) as rec:
        result = overlapped_start(
            model, loader, spec, loss_opening_the_gate, compile_kwargs={"backend": BACKEND}, recorder=rec
        )
        compiled, first, report, batches = result
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        steps = 0
        with torch.compiler.set_stance("fail_on_recompile"):
            for batch in itertools.chain([first], batches):
                train_steps(compiled, opt, [batch])
                steps += 1
        rec.flush()
        with open(rec.ledger_path) as f:
            phases = {json.loads(line).get("name") for line in f}
    assert steps == 5 and report.recompiles == 0
    expected_first = next(iter(DataLoader(RecDataset(70), batch_size=16)))
    assert all(torch.equal(first[k], expected_first[k]) for k in expected_first)
    stages = report.stages.stages
    assert stages["loader_iter"].forks and stages["loader_iter"].worker == -1
    fetch, comp = stages["get_first_batch_data"], stages["compile"]
    # The first batch could only arrive after the compile began (the gate), and its fetch began before
    # the compile ended: the two overlapped.
    assert fetch.end_s > comp.begin_s and fetch.begin_s < comp.end_s
    assert report.time_to_start_s < report.compile_s + report.first_batch_s
    assert report.stages.saved_s > 0
    assert report.warm.backward and report.warm.graphs >= 1
    assert report.cache is None and report.spec_mismatch == []
    assert {"preproc_creation", "get_first_batch_data", "compile"} <= phases
    assert report.summary()["recompiles"] == 0


def test_overlapped_start_names_the_field_when_the_first_batch_does_not_match():
    loader = _loader(dense_dtype=torch.float64)
    spec = declared_spec(dynamic=True)
    with pytest.raises(ettkit.errors.BatchMismatchError, match="field 'dense' has dtype torch.float64"):
        overlapped_start(TinyRec(), loader, spec, loss_fn, compile_kwargs={"backend": BACKEND})


def test_a_guard_inductor_puts_on_a_declared_dynamic_dim_falls_back_to_soft_dims_with_a_warning(tmp_path, monkeypatch):
    # Inductor (the default backend, not aot_eager) decomposes TinyRec's backward matmul through its
    # 16 -> 1 head on CPU only for small batches, and guards on it: batch + 16 <= 32. No graph serves the
    # declared Dim(2, 256), so the strict compile fails with Dynamo's ConstraintViolationError; the start
    # must compile anyway (soft dims), say which guard, and count the recompile a batch outside it costs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="specialized a dynamic dim"):
        compiled, first, report, batches = overlapped_start(TinyRec(), _loader(), declared_spec(dynamic=True),
                                                           loss_fn, recorder=None)
    assert "generated guard" in report.dynamic_dims_specialized
    assert "<= 16" in report.dynamic_dims_specialized  # the fast batch has the min size (2): small-batch path
    assert report.summary()["dynamic_dims_specialized"] == report.dynamic_dims_specialized
    opt = torch.optim.SGD(compiled.parameters(), lr=0.05)
    train_steps(compiled, opt, [first, next(batches)])  # 16 rows: inside the guard, the warm graph serves them
    assert report.recompiles == 0
    train_steps(compiled, opt, [make_batch(64)])  # outside it: one recompile, visible in the report
    assert report.recompiles >= 1


def test_a_declared_range_the_compile_keeps_does_not_warn(recwarn):
    compiled, first, report, batches = overlapped_start(TinyRec(), _loader(), declared_spec(dynamic=True), loss_fn,
                                                       compile_kwargs={"backend": BACKEND}, recorder=None)
    del batches
    assert report.dynamic_dims_specialized is None
    assert not [w for w in recwarn if "specialized" in str(w.message)]


@pytest.mark.parametrize("dynamic_dims", [{"*": 0}, {"*": {0: Dim(None, 4)}}], ids=["default-range", "min-only"])
def test_an_unbounded_dynamic_dim_compiles_and_serves_larger_batches(dynamic_dims):
    # torch 2.14's mark_dynamic(min=...) without max fails inside Dynamo ("not simple sympy type NoneType"):
    # the README's from_batch(..., dynamic_dims={"*": 0}) hit it.
    spec = BatchSpec.from_batch(make_batch(8), dynamic_dims=dynamic_dims)
    compiled, first, report, batches = overlapped_start(TinyRec(), _loader(), spec, loss_fn,
                                                       compile_kwargs={"backend": BACKEND}, recorder=None)
    del batches
    opt = torch.optim.SGD(compiled.parameters(), lr=0.05)
    train_steps(compiled, opt, [first, make_batch(200)])
    assert report.recompiles == 0 and report.dynamic_dims_specialized is None


class CastingRec(TinyRec):
    def forward(self, batch):
        return super().forward(dict(batch, dense=batch["dense"].float()))  # runs on any float dtype


def test_overlapped_start_lenient_mode_warns_and_the_recompile_shows_in_the_report():
    loader = _loader(dense_dtype=torch.float64)
    spec = declared_spec(dynamic=True)  # says float32: the fast batch compiles a float32 graph
    with pytest.warns(RuntimeWarning, match="will recompile"):
        compiled, first, report, batches = overlapped_start(
            CastingRec(), loader, spec, loss_fn, compile_kwargs={"backend": BACKEND}, strict=False
        )
    del batches
    assert any("dtype torch.float64" in p for p in report.spec_mismatch)
    assert report.recompiles == 0
    loss_fn(compiled(first), first).backward()
    assert report.recompiles == 1


def test_a_failed_compile_names_the_stage_and_stops_the_workers():
    loader = _loader()
    before = set(multiprocessing.active_children())

    def broken_loss(out, batch):
        raise KeyError("labels")

    with pytest.raises(ettkit.errors.StageError) as info:
        overlapped_start(TinyRec(), loader, declared_spec(), broken_loss, compile_kwargs={"backend": BACKEND})
    assert info.value.stage == "compile"
    assert isinstance(info.value.__cause__, KeyError)
    left = [p for p in multiprocessing.active_children() if p not in before and p.is_alive()]
    assert not left, "DataLoader workers left running"


def test_overlapped_start_reports_a_cache_miss(tmp_path):
    model = TinyRec()
    spec = declared_spec()
    cache = CompileCache(tmp_path / "cache", model=model, spec=spec)
    _, _, report, batches = overlapped_start(
        model, _loader(), spec, loss_fn, cache, compile_kwargs={"backend": BACKEND}
    )
    del batches
    assert report.cache.status == "miss"
    assert "cache_load" in report.stages.stages
    assert report.compile_s >= report.stages.stages["compile"].duration_s
