"""Capturing a :class:`.BatchSpec` from a sample batch (:meth:`.BatchSpec.from_batch`): everything Dynamo
guards on, recorded from one batch, with the dims ``dynamic_dims`` names made dynamic."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .batch_structure import (
    CONSTANT_TYPES, Constant, children, container_kind, join, rebuild, rebuildable_mapping, show,
)
from .tensor_spec import Dim, TensorSpec, contiguous_strides, dense_strides

__all__ = ["capture_batch"]


def _parse_dynamic_dims(dynamic_dims) -> dict:
    """{path or '*': {dim: Dim}} from the user's shorthand."""
    if dynamic_dims is None:
        return {}
    if not isinstance(dynamic_dims, Mapping):
        raise InvalidArgumentError(
            f"dynamic_dims must map a field path (or '*' for every tensor) to dims, got {type(dynamic_dims).__name__}; "
            "e.g. {'*': 0} for a dynamic batch dimension"
        )
    out = {}
    for path, spec in dynamic_dims.items():
        if isinstance(spec, bool) or spec is None:
            raise InvalidArgumentError(
                f"dynamic_dims[{path!r}] = {spec!r}; give a dim index, a list or {{dim: Dim}}"
            )
        if isinstance(spec, int):
            spec = {spec: None}
        elif isinstance(spec, (list, tuple)):
            spec = {d: None for d in spec}
        elif not isinstance(spec, Mapping):
            raise InvalidArgumentError(
                f"dynamic_dims[{path!r}] = {spec!r}; give a dim index, a list or {{dim: Dim}}"
            )
        dims = {}
        for d, v in spec.items():
            if isinstance(v, tuple):
                v = Dim(None, *v)
            if v is not None and not isinstance(v, Dim):
                raise InvalidArgumentError(
                    f"dynamic_dims[{path!r}][{d}] = {v!r}; use a Dim, (min, max) or None"
                )
            dims[int(d)] = v
        out[str(path).strip("/")] = dims
    return out


def capture_batch(batch: Any, dynamic_dims: Mapping | None) -> Any:
    """The spec structure of ``batch`` (see :meth:`.BatchSpec.from_batch`)."""
    capture = _BatchCapture(_parse_dynamic_dims(dynamic_dims))
    structure = capture.value(batch, "")
    unknown = set(capture.dyn) - capture.used - {"*"}
    if unknown:
        raise InvalidArgumentError(
            f"dynamic_dims names {sorted(unknown)}, which are not tensor fields of the batch; "
            "paths look like 'features/ids' (list and tuple items by index)"
        )
    return structure


class _BatchCapture:
    """One walk over a sample batch: ``dyn`` the parsed dynamic dims, ``used`` the paths it met, and the
    storages seen (aliasing fields are refused: real batches from a DataLoader do not alias)."""

    def __init__(self, dyn: dict):
        self.dyn = dyn
        self.used: set = set()
        self.seen_storage: dict = {}

    def value(self, x, path):
        if isinstance(x, torch.Tensor):
            return self.tensor(x, path)
        if isinstance(x, CONSTANT_TYPES):
            return Constant(x)
        kind = container_kind(x)
        if kind is None:
            raise InvalidArgumentError(
                f"{show(path)} is a {type(x).__name__}; a batch spec covers dicts, lists, tuples, namedtuples, "
                "tensors and Python constants (convert dataclasses to a dict)"
            )
        if isinstance(x, Mapping) and type(x) not in (dict,) and not rebuildable_mapping(x):
            raise InvalidArgumentError(
                f"{show(path)} is a {type(x).__name__}; use a dict or OrderedDict"
            )
        return rebuild(x, [self.value(v, join(path, k)) for k, v in children(x)])

    def tensor(self, t, path):
        if type(t) is not torch.Tensor:
            raise InvalidArgumentError(
                f"{show(path)} is a {type(t).__name__}; only plain torch.Tensor fields are supported "
                "(Dynamo guards on the Python type)"
            )
        if t.layout != torch.strided:
            raise InvalidArgumentError(
                f"{show(path)} has layout {t.layout}; only strided tensors are supported"
            )
        self.check_aliasing(t, path)
        shape = self.shape(t, path)
        stride, dim_order = _layout(t, shape, path)
        return TensorSpec(
            shape,
            t.dtype,
            device=t.device,
            stride=stride,
            dim_order=dim_order,
            fill_range=_fill_range(t),
            requires_grad=t.requires_grad,
        )

    def check_aliasing(self, t, path):
        if t.numel() > 0 and t.device.type != "meta":
            key = t.untyped_storage().data_ptr()
            if key in self.seen_storage:
                raise InvalidArgumentError(
                    f"fields '{self.seen_storage[key]}' and '{path}' share storage; Dynamo guards on aliasing and "
                    "real batches from a DataLoader do not alias: copy one of them"
                )
            self.seen_storage[key] = path

    def shape(self, t, path) -> list:
        """The tensor's sizes, a :class:`Dim` for each dim ``dynamic_dims`` names (by path or ``"*"``)."""
        dyn = self.dyn
        dims = {}
        dims.update({d: v for d, v in dyn.get("*", {}).items() if d < t.dim()})
        own = dyn.get(path)
        if own is not None:
            self.used.add(path)
            for d in own:
                if d >= t.dim():
                    raise InvalidArgumentError(
                        f"dynamic_dims: {show(path)} has {t.dim()} dims, no dim {d}"
                    )
            dims.update(own)
        shape = []
        for d, size in enumerate(t.shape):
            if d not in dims:
                shape.append(int(size))
                continue
            given = dims[d]
            default_name = (
                f"*:{d}" if d in dyn.get("*", {}) and (own is None or d not in own) else f"{path}:{d}"
            )
            name = given.name if given is not None and given.name else default_name
            lo = given.min if given is not None else 2
            hi = given.max if given is not None else None
            hint = given.hint if given is not None and given.hint is not None else int(size)
            if hint < lo or (hi is not None and hint > hi):
                hint = lo
            shape.append(Dim(name, lo, hi, hint))
        return shape


def _layout(t: torch.Tensor, shape: list, path: str) -> tuple:
    """``(stride, dim_order)``: both None for a contiguous tensor, a ``dim_order`` for another dense layout,
    the exact ``stride`` otherwise (static dims only)."""
    strides = tuple(t.stride())
    stride = dim_order = None
    if strides != contiguous_strides(t.shape):
        order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
        if dense_strides(t.shape, order) == strides:
            dim_order = order
        else:
            if any(isinstance(s, Dim) for s in shape):
                raise InvalidArgumentError(
                    f"{show(path)} has strides {strides}, which are not a dense layout; its dims cannot "
                    "be dynamic (make the tensor contiguous in the collate function)"
                )
            stride = strides
    return stride, dim_order


def _fill_range(t: torch.Tensor) -> tuple | None:
    """The sample's value range (it only fills the fast batch), or None."""
    if t.numel() > 0 and t.dtype != torch.bool and not t.is_complex() and t.device.type != "meta":
        lo_v, hi_v = torch.aminmax(t.detach().reshape(-1))
        lo_v, hi_v = lo_v.item(), hi_v.item()
        if math.isfinite(lo_v) and math.isfinite(hi_v):
            return (lo_v, hi_v)
    return None
