"""BatchSpec and fast batches: the spec's rules match Dynamo's guards.

The unit tests check the spec against itself; the guard tests compile on a fast batch (aot_eager: the
guards are Dynamo's, whatever the backend) and show that each difference ``spec.check`` reports is one that
makes Dynamo recompile, and that batches the spec accepts do not.
"""

from __future__ import annotations

import collections

import ettkit
import pytest
import torch
import torch._dynamo
from ettkit.startup import BatchSpec, Dim, TensorSpec, compiled_graphs
from startup_helpers import TinyRec, declared_spec, make_batch

Pair = collections.namedtuple("Pair", ["left", "right"])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- capture and fast batch ----------------------------------------------------------------------------


def test_fast_batch_of_a_captured_spec_matches_the_sample():
    sample = make_batch(8)
    spec = BatchSpec.from_batch(sample)
    rng = torch.get_rng_state()
    fast = spec.fast_batch(seed=3)
    assert torch.equal(torch.get_rng_state(), rng), "fast_batch must not consume the global RNG"
    assert list(fast) == ["ids", "dense", "label"]
    for key in sample:
        assert fast[key].shape == sample[key].shape
        assert fast[key].dtype == sample[key].dtype
        assert fast[key].stride() == sample[key].stride()
    spec.check(fast)
    spec.check(sample)
    # Values stay inside the sample's range (an embedding index never exceeds what the sample used).
    assert fast["ids"].min() >= sample["ids"].min() and fast["ids"].max() <= sample["ids"].max()
    # Deterministic per seed; fields never alias.
    assert all(torch.equal(a, b) for a, b in zip(fast.values(), spec.fast_batch(seed=3).values()))
    ptrs = {t.untyped_storage().data_ptr() for t in fast.values()}
    assert len(ptrs) == 3


def test_layouts_are_preserved():
    nhwc = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    transposed = torch.randn(6, 4).t()
    sliced = torch.randn(4, 10)[:, ::2]  # not dense: exact strides
    spec = BatchSpec.from_batch({"img": nhwc, "t": transposed, "s": sliced})
    fast = spec.fast_batch()
    assert fast["img"].stride() == nhwc.stride()
    assert fast["t"].stride() == transposed.stride()
    assert fast["s"].stride() == sliced.stride()
    spec.check(fast)
    with pytest.raises(ettkit.errors.BatchMismatchError, match="field 'img' has strides"):
        spec.check({"img": nhwc.contiguous(), "t": transposed, "s": sliced})


def test_declared_nested_spec_with_constants():
    B = Dim("batch", min=2, max=64)
    spec = BatchSpec(
        {
            "features": {
                "ids": TensorSpec((B, 4), torch.int64, value_range=(0, 9)),
                "mask": TensorSpec((B, 4), torch.bool),
            },
            "pair": Pair(TensorSpec((B,)), TensorSpec((3,), torch.float64)),
            "lengths": [TensorSpec((B,), torch.int32, value_range=(1, 4))],
            "mode": "train",
            "scale": 2,
        }
    )
    fast = spec.fast_batch()
    assert isinstance(fast["pair"], Pair)
    assert fast["mode"] == "train" and fast["scale"] == 2
    assert fast["features"]["mask"].dtype == torch.bool
    assert int(fast["features"]["ids"].max()) <= 9 and int(fast["lengths"][0].min()) >= 1
    spec.check(fast)
    assert "features/ids" in spec.fields()
    assert "Dim('batch', 2..64)" in spec.describe()


def test_distinct_dynamic_dims_get_distinct_sizes():
    # Equal sizes would be one symbol to Dynamo (duck sizing), and a real batch with different sizes would
    # then recompile.
    spec = BatchSpec(
        {
            "tokens": TensorSpec((Dim("batch", hint=8), Dim("seq", hint=8))),
            "label": TensorSpec((Dim("batch"),)),
        }
    )
    fast = spec.fast_batch()
    assert fast["tokens"].shape[0] == fast["label"].shape[0]
    assert fast["tokens"].shape[0] != fast["tokens"].shape[1]


def test_capture_rejects_what_it_cannot_reproduce():
    t = torch.randn(4, 2)
    with pytest.raises(ettkit.InvalidArgumentError, match="share storage"):
        BatchSpec.from_batch({"a": t, "b": t[:2]})
    with pytest.raises(ettkit.InvalidArgumentError, match="Parameter"):
        BatchSpec.from_batch({"w": torch.nn.Parameter(t)})
    with pytest.raises(ettkit.InvalidArgumentError, match="field 'x' is a set"):
        BatchSpec.from_batch({"x": {1, 2}})
    with pytest.raises(ettkit.InvalidArgumentError, match="not tensor fields"):
        BatchSpec.from_batch({"a": t}, dynamic_dims={"b": 0})
    with pytest.raises(ettkit.InvalidArgumentError, match="min >= 2"):
        Dim("batch", min=1)
    with pytest.raises(ettkit.InvalidArgumentError, match="not a dense layout"):
        BatchSpec.from_batch({"s": torch.randn(4, 10)[:, ::2]}, dynamic_dims={"*": 0})


# ---- check(): every guarded property, named by field ----------------------------------------------------


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda b: b.update(dense=b["dense"].double()),
            "field 'dense' has dtype torch.float64; the spec expects torch.float32",
        ),
        (lambda b: b.update(dense=b["dense"].t().contiguous().t()), "field 'dense' has strides"),
        (lambda b: b.update(ids=b["ids"][:, :2]), "field 'ids' has size 2 in static dim 1"),
        (lambda b: b.update(dense=b["dense"].requires_grad_()), "field 'dense' has requires_grad=True"),
        (lambda b: b.update(ids=b["ids"] + 100), "values of field 'ids' range over"),
        (lambda b: b.update(extra=torch.ones(1)), "unexpected ['extra']"),
        (lambda b: b.pop("label"), "missing ['label']"),
        (
            lambda b: b.update(label=b["label"][:-1]),
            "field 'label' has size 7 in dim 0 but field 'ids' has 8",
        ),
        (lambda b: b.update(dense=torch.empty(8, 6, device="meta")), "field 'dense' is on meta"),
    ],
    ids=[
        "dtype",
        "stride",
        "static-shape",
        "requires-grad",
        "value-range",
        "extra-key",
        "missing-key",
        "dim-symbol",
        "device",
    ],
)
def test_check_names_the_field_that_differs(mutate, expected):
    spec = declared_spec()
    batch = make_batch(8)
    mutate(batch)
    with pytest.raises(ettkit.errors.BatchMismatchError) as info:
        spec.check(batch)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_check_reports_key_order_size_range_aliasing_and_constants():
    spec = declared_spec()
    batch = make_batch(8)
    reordered = {"dense": batch["dense"], "ids": batch["ids"], "label": batch["label"]}
    with pytest.raises(ettkit.errors.BatchMismatchError, match="Dynamo guards on dict key order"):
        spec.check(reordered)
    with pytest.raises(ettkit.errors.BatchMismatchError, match="size 1 in dynamic dim 0"):
        spec.check(make_batch(1))
    aliased = dict(batch, label=batch["dense"][:, 0])
    assert any("shares storage with field 'dense'" in p for p in spec.diff(aliased))
    const = BatchSpec({"x": TensorSpec((2,)), "flag": True, "items": [TensorSpec((2,))]})
    problems = const.diff({"x": torch.rand(2), "flag": 1, "items": []})
    assert any("field 'flag' is 1 (int); the spec has the constant True (bool)" in p for p in problems)
    assert any("field 'items' has 0 items; the spec expects 1" in p for p in problems)
    assert const.diff((torch.rand(2),)) == ["the batch is a tuple; the spec expects a dict"]


# ---- the same rules, proven against Dynamo ------------------------------------------------------------


class IteratingModel(torch.nn.Module):
    """Iterates over the batch dict: Dynamo then guards on its key order (a model that only indexes by
    key does not, so for it the spec's key-order rule is conservative)."""

    def forward(self, batch):
        return torch.cat([v.float().reshape(v.shape[0], -1) for v in batch.values()], dim=1).sum(1)


def _compiled_on_fast_batch(spec, model=None):
    model = model if model is not None else TinyRec(dropout=0.0)
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(spec.fast_batch()).sum()
    if out.requires_grad:
        out.backward()
    return compiled


def test_batches_the_spec_accepts_do_not_recompile():
    spec = declared_spec(dynamic=True)
    compiled = _compiled_on_fast_batch(spec)
    graphs = compiled_graphs()
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (16, 5, 64, 2):  # one graph for every batch size in [2, 256]
            batch = make_batch(n, seed=n)
            spec.check(batch)
            compiled(batch).sum().backward()
    assert compiled_graphs() == graphs


@pytest.mark.parametrize(
    "mutate, field, model",
    [
        (lambda b: b.update(dense=b["dense"].double()), "dtype", TinyRec),
        (lambda b: b.update(dense=b["dense"].t().contiguous().t()), "strides", TinyRec),
        (lambda b: b.update(ids=b["ids"][:, :2].contiguous()), "static dim", TinyRec),
        (lambda b: {"dense": b["dense"], "ids": b["ids"], "label": b["label"]}, "key order", IteratingModel),
        (lambda b: make_batch(1), "dynamic dim", TinyRec),
    ],
    ids=["dtype", "stride", "static-shape", "key-order", "batch-of-one"],
)
def test_what_check_rejects_dynamo_recompiles(mutate, field, model):
    spec = declared_spec(dynamic=True)
    compiled = _compiled_on_fast_batch(spec, model(dropout=0.0) if model is TinyRec else model())
    batch = make_batch(8)
    batch = mutate(batch) or batch
    assert spec.diff(batch), f"spec.check accepted a batch with a different {field}"
    with (
        torch.compiler.set_stance("fail_on_recompile"),
        pytest.raises(RuntimeError, match="Detected recompile"),
    ):
        compiled(batch)


def test_grad_mode_is_reported_as_a_recompile():
    # Grad mode is not part of a batch: Dynamo's global-state guard catches it, and compiled_graphs() (the
    # start-up report's recompile count) shows it.
    spec = declared_spec(dynamic=True)
    compiled = _compiled_on_fast_batch(spec)
    batch = make_batch(8)
    spec.check(batch)
    with (
        torch.no_grad(),
        torch.compiler.set_stance("fail_on_recompile"),
        pytest.raises(RuntimeError, match="grad_mode"),
    ):
        compiled(batch)
    before = compiled_graphs()
    with torch.no_grad():
        compiled(batch)
    assert compiled_graphs() == before + 1
