"""Batch specs and fast batches: compile on a synthetic batch that the real batches will not recompile.

Dynamo guards a compiled graph on the *metadata* of its inputs, not on their values: the container
structure (types, dict key **order**, sequence lengths, Python constants by value), and per tensor the
Python type, dtype, device, ``requires_grad``, the sizes and strides of static dimensions and whether
two inputs alias (docs/startup.md, "Declaring a batch spec"). A :class:`BatchSpec` records exactly these
properties; :meth:`BatchSpec.fast_batch` builds a batch with them, and :meth:`BatchSpec.check` names the
first field where a real batch would fail a guard.

A spec is captured from a sample batch (:meth:`BatchSpec.from_batch`) or declared::

    B = Dim("batch", min=2, max=4096)
    spec = BatchSpec({
        "ids": TensorSpec((B, 8), torch.int64, value_range=(0, 99_999)),   # embedding rows
        "dense": TensorSpec((B, 13), torch.float32),
        "label": TensorSpec((B,), torch.float32, value_range=(0, 1)),
    })

Dimensions given as a :class:`Dim` are dynamic (``torch._dynamo.mark_dynamic`` on the fast batch): every
size in ``[min, max]`` runs the same graph. Dims that share a name share one symbol (a batch dimension
across fields). Never let a dynamic dim be 0 or 1: Dynamo specializes those sizes.

Capturing a spec is :mod:`.batch_capture`'s, comparing a batch with it :mod:`.batch_diff`'s; both walk the
structure with :mod:`.batch_structure`'s helpers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import BatchMismatchError, InvalidArgumentError
from .batch_capture import capture_batch
from .batch_diff import diff_batch
from .batch_structure import (
    CONSTANT_TYPES, Constant, children, container_kind, dim_name, join, rebuild, resolve_device, show,
)
from .tensor_spec import Dim, TensorSpec

__all__ = ["BatchSpec", "Dim", "TensorSpec"]


class BatchSpec:
    """The guarded structure of a training batch: nested dicts / lists / tuples (namedtuples included) of
    :class:`TensorSpec` and Python constants."""

    def __init__(self, structure: Any):
        self._structure = structure
        self._validate(structure, "")
        self._dims = self._collect_dims()

    # ---- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_batch(cls, batch: Any, dynamic_dims: Mapping | None = None) -> BatchSpec:
        """Captures the spec of a sample batch. ``dynamic_dims`` maps a field path (``"features/ids"``; list
        and tuple items by index, ``"0"``) or ``"*"`` (every tensor with that dim) to a dim index, a list of
        them, or ``{dim: Dim(...) | (min, max) | None}``. Dims under ``"*"`` share one name per index (a
        batch dimension); a field's own dims are named ``"<path>:<dim>"`` unless the Dim has a name."""
        return cls(capture_batch(batch, dynamic_dims))

    def _validate(self, x, path):
        if isinstance(x, (TensorSpec, Constant)):
            return
        if isinstance(x, CONSTANT_TYPES):
            return
        if container_kind(x) is None:
            raise InvalidArgumentError(
                f"{show(path)} of the spec is a {type(x).__name__}; use TensorSpec, a constant, or a dict / list / "
                "tuple of them"
            )
        for k, v in children(x):
            self._validate(v, join(path, k))

    def _leaves(self, x=None, path="") -> Iterator[tuple]:
        x = self._structure if x is None and path == "" else x
        if isinstance(x, (TensorSpec, Constant, *CONSTANT_TYPES)):
            yield path, x
            return
        for k, v in children(x):
            yield from self._leaves(v, join(path, k))

    def _collect_dims(self) -> dict:
        dims: dict = {}
        for path, leaf in self._leaves():
            if not isinstance(leaf, TensorSpec):
                continue
            for i, d in enumerate(leaf.shape):
                if not isinstance(d, Dim):
                    continue
                name = d.name or f"{path}:{i}"
                prev = dims.get(name)
                if prev is not None and (prev.min, prev.max) != (d.min, d.max):
                    raise InvalidArgumentError(
                        f"Dim {name!r} is declared with ranges [{prev.min}, {prev.max}] and [{d.min}, {d.max}]; "
                        "dims that share a name share one range"
                    )
                if prev is None or (prev.hint is None and d.hint is not None):
                    dims[name] = d
        return dims

    # ---- the fast batch -------------------------------------------------------------------------------

    def _sizes(self) -> dict:
        """One concrete size per dynamic dim name. Distinct names get distinct sizes: Dynamo gives equal
        sizes one symbol (duck sizing) and would then guard on their equality."""
        chosen: dict = {}
        taken: set = set()
        for name in sorted(self._dims):
            d = self._dims[name]
            size = d.hint if d.hint is not None else d.min
            candidates = [size + k for k in range(64)] + [size - k for k in range(1, 64)]
            for c in candidates:
                if d.contains(c) and c not in taken:
                    size = c
                    break
            chosen[name] = size
            taken.add(size)
        return chosen

    def fast_batch(self, seed: int = 0, *, soft: bool = False) -> Any:
        """A synthetic batch with this spec's structure and metadata, filled with values inside the value
        (or sample) ranges; deterministic for a seed; never touches the global RNG. Dynamic dims are marked
        with ``torch._dynamo.mark_dynamic`` so the graph compiled on it serves every size in range: a compile
        that would specialize one (a size-dependent choice of the model or of Inductor) then fails with
        Dynamo's ``ConstraintViolationError`` instead of compiling a narrower graph silently. ``soft=True``
        marks them with ``torch._dynamo.maybe_mark_dynamic`` instead: such a guard is accepted, and sizes
        outside it recompile (what :func:`overlapped_start` falls back to, with a warning)."""
        gen = torch.Generator().manual_seed(seed)
        sizes = self._sizes()

        def build(x, path):
            if isinstance(x, TensorSpec):
                return self._make_tensor(x, path, sizes, gen, soft)
            if isinstance(x, Constant):
                return x.value
            if isinstance(x, CONSTANT_TYPES):
                return x
            return rebuild(x, [build(v, join(path, k)) for k, v in children(x)])

        return build(self._structure, "")

    def _dim_name(self, spec: TensorSpec, path: str, i: int) -> str:
        return dim_name(spec, path, i)

    def _make_tensor(
        self, spec: TensorSpec, path: str, sizes: dict, gen: torch.Generator, soft: bool = False
    ) -> torch.Tensor:
        shape = [
            sizes[self._dim_name(spec, path, i)] if isinstance(d, Dim) else d
            for i, d in enumerate(spec.shape)
        ]
        values = self._values(
            spec, shape if spec.stride is None else [_storage_size(shape, spec.stride)], gen
        )
        device = resolve_device(spec.device)
        if spec.stride is not None:
            t = values.to(device).as_strided(shape, spec.stride)
        elif spec.dim_order is not None:
            order = spec.dim_order
            inverse = [order.index(d) for d in range(len(order))]
            t = values.permute(*order).contiguous().to(device).permute(*inverse)
        else:
            t = values.to(device).contiguous()
        if spec.requires_grad:
            t.requires_grad_(True)
        for i, d in enumerate(spec.shape):
            if not isinstance(d, Dim):
                continue
            if soft:
                torch._dynamo.maybe_mark_dynamic(t, i)
            elif d.max is None and d.min <= 2:
                torch._dynamo.mark_dynamic(t, i)  # Dynamo's own range, [2, inf)
            else:
                # A min without a max fails inside Dynamo (torch 2.14: "not simple sympy type NoneType"): an
                # unbounded dim with a larger min gets sys.maxsize as its max.
                torch._dynamo.mark_dynamic(t, i, min=d.min, max=sys.maxsize if d.max is None else d.max)
        return t

    @staticmethod
    def _values(spec: TensorSpec, shape: list, gen: torch.Generator) -> torch.Tensor:
        rng = spec.value_range or spec.fill_range
        dtype = spec.dtype
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if dtype.is_floating_point or dtype.is_complex:
            lo, hi = rng if rng is not None else (0.0, 1.0)
            base = torch.rand(shape, generator=gen, dtype=torch.float64) * (float(hi) - float(lo)) + float(lo)
            return base.to(dtype)
        lo, hi = (math.ceil(rng[0]), math.floor(rng[1])) if rng is not None else (0, 0)
        return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(dtype)

    # ---- checking -------------------------------------------------------------------------------------

    def diff(self, batch: Any) -> list:
        """Every difference between ``batch`` and the spec that would fail a guard (or a declared value
        range), as readable sentences; empty when the batch matches."""
        return diff_batch(self._structure, batch)

    def check(self, batch: Any) -> None:
        """Raises :class:`ettkit.errors.BatchMismatchError` naming every field of ``batch`` that differs from the
        spec in a way that would fail a Dynamo guard (a recompile) or a declared value range."""
        problems = self.diff(batch)
        if problems:
            more = "" if len(problems) == 1 else "\n  " + "\n  ".join(problems[1:])
            raise BatchMismatchError(f"batch does not match its spec: {problems[0]}{more}")

    def matches(self, batch: Any) -> bool:
        return not self.diff(batch)

    # ---- description ----------------------------------------------------------------------------------

    @property
    def structure(self) -> Any:
        return self._structure

    @property
    def dims(self) -> dict:
        """The dynamic dims by name."""
        return dict(self._dims)

    def fields(self) -> dict:
        """Field path -> TensorSpec or constant, in batch order."""
        return {p: (v.value if isinstance(v, Constant) else v) for p, v in self._leaves()}

    def describe(self) -> str:
        """A stable one-line-per-field description (also used to fingerprint compile caches)."""
        lines = []
        for path, leaf in self._leaves():
            if isinstance(leaf, TensorSpec):
                lines.append(f"{path or '<batch>'}: {leaf.describe()}")
            else:
                value = leaf.value if isinstance(leaf, Constant) else leaf
                lines.append(f"{path or '<batch>'}: {type(value).__name__} {value!r}")
        containers = []
        self._describe_containers(self._structure, "", containers)
        return "\n".join(containers + lines)

    def _describe_containers(self, x, path, out):
        if isinstance(x, (TensorSpec, Constant, *CONSTANT_TYPES)):
            return
        keys = list(x.keys()) if isinstance(x, Mapping) else len(x)
        out.append(f"{path or '<batch>'}: {type(x).__module__}.{type(x).__qualname__} {keys!r}")
        for k, v in children(x):
            self._describe_containers(v, join(path, k), out)

    def __repr__(self) -> str:
        return "BatchSpec(\n  " + self.describe().replace("\n", "\n  ") + "\n)"


def _storage_size(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))
