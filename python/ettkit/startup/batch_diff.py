"""Comparing a batch with its :class:`.BatchSpec` (:meth:`.BatchSpec.diff`): every difference that would
fail a Dynamo guard (a recompile) or a declared value range, as a sentence naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .batch_structure import (
    CONSTANT_TYPES, Constant, children, dim_name, join, resolve_device, same_constant, show,
)
from .tensor_spec import Dim, TensorSpec, dense_strides, fmt_range

__all__ = ["diff_batch"]


def diff_batch(structure: Any, batch: Any) -> list:
    """The differences between ``batch`` and the spec ``structure``; empty when the batch matches."""
    diff = _BatchDiff()
    diff.value(structure, batch, "")
    return diff.problems


class _BatchDiff:
    """One walk over a batch beside its spec: the problems found, the size each dynamic dim name took first
    (fields that share a Dim must agree) and the storages seen (the spec has no aliasing)."""

    def __init__(self):
        self.problems: list = []
        self.dim_sizes: dict = {}  # dim name -> (size, path) seen first in this batch
        self.storages: dict = {}

    def value(self, spec, x, path):
        if isinstance(spec, TensorSpec):
            self.tensor(spec, x, path)
        elif isinstance(spec, (Constant, *CONSTANT_TYPES)):
            expected = spec.value if isinstance(spec, Constant) else spec
            if type(x) is not type(expected) or not same_constant(x, expected):
                self.problems.append(
                    f"{show(path)} is {x!r} ({type(x).__name__}); the spec has the constant {expected!r} "
                    f"({type(expected).__name__}): Dynamo guards Python constants by value"
                )
        elif self.same_container(spec, x, path):
            for (k, s), (_, v) in zip(children(spec), children(x)):
                self.value(s, v, join(path, k))

    def same_container(self, spec, x, path) -> bool:
        """Whether ``x`` has the container type, keys (in order) or length of ``spec``; else says why."""
        if type(x) is not type(spec):
            self.problems.append(f"{show(path)} is a {type(x).__name__}; the spec expects a {type(spec).__name__}")
            return False
        if isinstance(spec, Mapping):
            keys, want = list(x.keys()), list(spec.keys())
            if keys == want:
                return True
            if sorted(map(str, keys)) == sorted(map(str, want)):
                self.problems.append(
                    f"{show(path)} has keys {keys} in this order; the spec expects {want}: Dynamo guards "
                    "on dict key order when the model iterates over the dict (build it in the same order)"
                )
            else:
                missing = [k for k in want if k not in x]
                extra = [k for k in keys if k not in spec]
                self.problems.append(
                    f"{show(path)} has keys {keys}; the spec expects {want}"
                    + (f" (missing {missing})" if missing else "")
                    + (f" (unexpected {extra})" if extra else "")
                )
            return False
        if len(x) != len(spec):
            self.problems.append(f"{show(path)} has {len(x)} items; the spec expects {len(spec)}")
            return False
        return True

    def tensor(self, spec: TensorSpec, t, path):
        where, problems = show(path), self.problems
        if not isinstance(t, torch.Tensor):
            problems.append(f"{where} is a {type(t).__name__}; the spec expects a tensor {spec.describe()}")
            return
        if type(t) is not torch.Tensor:
            problems.append(f"{where} is a {type(t).__name__}; the spec expects a plain torch.Tensor")
        if t.dtype != spec.dtype:
            problems.append(f"{where} has dtype {t.dtype}; the spec expects {spec.dtype}")
        want_device = resolve_device(spec.device)
        if t.device != want_device:
            problems.append(f"{where} is on {t.device}; the spec expects {want_device}")
        if t.requires_grad != spec.requires_grad:
            problems.append(f"{where} has requires_grad={t.requires_grad}; the spec expects {spec.requires_grad}")
        if t.dim() != len(spec.shape):
            problems.append(f"{where} has {t.dim()} dims {tuple(t.shape)}; the spec expects {len(spec.shape)}")
            return
        if self.same_shape(spec, t, path) and t.layout == torch.strided:
            self.check_strides(spec, t, where)
        self.check_aliasing(t, path)
        self.check_values(spec, t, where)

    def same_shape(self, spec: TensorSpec, t: torch.Tensor, path: str) -> bool:
        """Whether every size of ``t`` fits its static size or Dim (and agrees with the other fields of that
        Dim); else says which do not."""
        where, shape_ok = show(path), True
        for i, (size, d) in enumerate(zip(t.shape, spec.shape)):
            size = int(size)
            if isinstance(d, Dim):
                name = dim_name(spec, path, i)
                if not d.contains(size):
                    shape_ok = False
                    self.problems.append(
                        f"{where} has size {size} in dynamic dim {i} ({d.describe()}); sizes outside "
                        f"[{d.min}, {'inf' if d.max is None else d.max}] compile a new graph"
                    )
                elif name in self.dim_sizes and self.dim_sizes[name][0] != size:
                    shape_ok = False
                    self.problems.append(
                        f"{where} has size {size} in dim {i} but {show(self.dim_sizes[name][1])} has "
                        f"{self.dim_sizes[name][0]}; both are Dim {name!r}, one symbol in the compiled graph"
                    )
                else:
                    self.dim_sizes.setdefault(name, (size, path))
            elif size != d:
                shape_ok = False
                self.problems.append(
                    f"{where} has size {size} in static dim {i}; the spec expects {d} (shape "
                    f"{tuple(t.shape)} vs {spec.describe()})"
                )
        return shape_ok

    def check_strides(self, spec: TensorSpec, t: torch.Tensor, where: str) -> None:
        want = spec.stride if spec.stride is not None else dense_strides(t.shape, spec.dim_order)
        if tuple(t.stride()) != tuple(want):
            layout = "contiguous" if spec.stride is None and spec.dim_order is None else f"{want}"
            self.problems.append(
                f"{where} has strides {tuple(t.stride())}; the spec expects {layout} strides {tuple(want)}: "
                "Dynamo guards on strides (call .contiguous() or declare the layout)"
            )

    def check_aliasing(self, t: torch.Tensor, path: str) -> None:
        if t.numel() > 0 and t.layout == torch.strided and t.device.type != "meta":
            key = t.untyped_storage().data_ptr()
            if key in self.storages:
                self.problems.append(
                    f"{show(path)} shares storage with {show(self.storages[key])}; the spec (and the fast batch) "
                    "has no aliasing, which Dynamo guards on"
                )
            self.storages.setdefault(key, path)

    def check_values(self, spec: TensorSpec, t: torch.Tensor, where: str) -> None:
        if (
            spec.value_range is not None
            and t.numel() > 0
            and t.dtype != torch.bool
            and not t.is_complex()
            and t.device.type != "meta"
        ):
            lo, hi = torch.aminmax(t.detach().reshape(-1))
            lo, hi = lo.item(), hi.item()
            if lo < spec.value_range[0] or hi > spec.value_range[1]:
                self.problems.append(
                    f"values of {where} range over {fmt_range(lo, hi)}; the spec allows "
                    f"{fmt_range(*spec.value_range)}"
                )
