"""One tensor of a batch spec: :class:`Dim` (a dynamic dimension) and :class:`TensorSpec` (a tensor's
metadata as Dynamo guards it). :mod:`ettkit.startup.batch_spec` builds batch specs of these."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..errors import InvalidArgumentError

__all__ = ["Dim", "TensorSpec", "contiguous_strides", "dense_strides", "fmt_range"]


@dataclasses.dataclass(frozen=True)
class Dim:
    """A dynamic dimension. ``name`` groups dims that always have the same size (one symbol in the graph);
    ``hint`` is the size used in the fast batch (default: the sample's size, else ``min``)."""

    name: str | None = None
    min: int = 2
    max: int | None = None
    hint: int | None = None

    def __post_init__(self):
        if self.min < 2:
            raise InvalidArgumentError(
                f"Dim {self.name!r} has min={self.min}; dynamic dims need min >= 2 because Dynamo specializes "
                "sizes 0 and 1 (a batch of 1 would compile a separate graph)"
            )
        if self.max is not None and self.max < self.min:
            raise InvalidArgumentError(f"Dim {self.name!r} has max={self.max} < min={self.min}")
        if self.hint is not None and not self.contains(self.hint):
            raise InvalidArgumentError(
                f"Dim {self.name!r} has hint={self.hint} outside [{self.min}, {self.max}]"
            )

    def contains(self, size: int) -> bool:
        return size >= self.min and (self.max is None or size <= self.max)

    def describe(self) -> str:
        return f"Dim({self.name!r}, {self.min}..{'inf' if self.max is None else self.max})"


def contiguous_strides(sizes: Sequence[int]) -> tuple:
    strides = [0] * len(sizes)
    acc = 1
    for i in range(len(sizes) - 1, -1, -1):
        strides[i] = acc
        acc *= max(int(sizes[i]), 1)
    return tuple(strides)


def dense_strides(sizes: Sequence[int], dim_order: Sequence[int] | None) -> tuple:
    """Strides of a dense tensor whose dims are laid out outermost-first in ``dim_order``."""
    if dim_order is None:
        return contiguous_strides(sizes)
    permuted = contiguous_strides([sizes[d] for d in dim_order])
    strides = [0] * len(sizes)
    for pos, d in enumerate(dim_order):
        strides[d] = permuted[pos]
    return tuple(strides)


def fmt_range(lo, hi) -> str:
    return f"[{lo}, {hi}]"


class TensorSpec:
    """The guarded metadata of one tensor field, and how to fill it in a fast batch.

    ``shape``: ints (static) and :class:`Dim` (dynamic). ``stride``: exact strides (static shapes only);
    ``dim_order``: a dense layout given as the dims from outermost to innermost (e.g. ``(0, 2, 3, 1)`` for
    channels-last); neither means contiguous. ``value_range``: inclusive ``(low, high)`` of the values, checked
    by :meth:`BatchSpec.check` and used by the fast batch (declare it for index tensors: an id outside an
    embedding table is an error, not a guard failure). ``fill_range``: only used to fill the fast batch
    (captured from a sample, where the observed range is no bound on other batches).
    """

    __slots__ = (
        "device",
        "dim_order",
        "dtype",
        "fill_range",
        "requires_grad",
        "shape",
        "stride",
        "value_range",
    )

    def __init__(
        self,
        shape: Sequence[int | Dim],
        dtype: torch.dtype = torch.float32,
        *,
        device: str | torch.device = "cpu",
        stride: Sequence[int] | None = None,
        dim_order: Sequence[int] | None = None,
        value_range: tuple | None = None,
        fill_range: tuple | None = None,
        requires_grad: bool = False,
    ):
        self.shape = tuple(shape)
        for i, s in enumerate(self.shape):
            if isinstance(s, bool) or not isinstance(s, (int, Dim)) or (isinstance(s, int) and s < 0):
                raise InvalidArgumentError(f"shape entry {i} is {s!r}; use a size >= 0 or a Dim")
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype {dtype!r} is not a torch.dtype")
        self.dtype = dtype
        self.device = torch.device(device)
        if stride is not None and dim_order is not None:
            raise InvalidArgumentError("give either stride (exact) or dim_order (dense layout), not both")
        if stride is not None:
            stride = tuple(int(s) for s in stride)
            if len(stride) != len(self.shape):
                raise InvalidArgumentError(
                    f"stride {stride} has {len(stride)} entries for {len(self.shape)} dims"
                )
            if any(isinstance(s, Dim) for s in self.shape):
                raise InvalidArgumentError(
                    "exact strides need static sizes; describe a dense layout with dim_order for dynamic dims"
                )
        if dim_order is not None:
            dim_order = tuple(int(d) for d in dim_order)
            if sorted(dim_order) != list(range(len(self.shape))):
                raise InvalidArgumentError(
                    f"dim_order {dim_order} is not a permutation of 0..{len(self.shape) - 1}"
                )
            if dim_order == tuple(range(len(self.shape))):
                dim_order = None  # contiguous
        self.stride = stride
        self.dim_order = dim_order
        for name, rng in (("value_range", value_range), ("fill_range", fill_range)):
            if rng is not None and (len(rng) != 2 or rng[0] > rng[1]):
                raise InvalidArgumentError(f"{name} {rng!r} must be (low, high) with low <= high")
        self.value_range = None if value_range is None else tuple(value_range)
        self.fill_range = None if fill_range is None else tuple(fill_range)
        self.requires_grad = bool(requires_grad)

    def describe(self) -> str:
        dims = ", ".join(d.describe() if isinstance(d, Dim) else str(d) for d in self.shape)
        parts = [f"({dims})", str(self.dtype).replace("torch.", ""), str(self.device)]
        if self.stride is not None:
            parts.append(f"stride={self.stride}")
        if self.dim_order is not None:
            parts.append(f"dim_order={self.dim_order}")
        if self.value_range is not None:
            parts.append(f"values={fmt_range(*self.value_range)}")
        if self.requires_grad:
            parts.append("requires_grad")
        return "Tensor" + "[" + ", ".join(parts) + "]"

    __repr__ = describe
