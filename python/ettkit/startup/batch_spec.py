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
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import BatchMismatchError, InvalidArgumentError
from .tensor_spec import Dim, TensorSpec, contiguous_strides, dense_strides, fmt_range

__all__ = ["BatchSpec", "Dim", "TensorSpec"]

_CONSTANT_TYPES = (bool, int, float, str, bytes, type(None))


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: Any


# ---- structure walking ---------------------------------------------------------------------------------


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _join(path: str, key) -> str:
    return f"{path}/{key}" if path else str(key)


def _show(path: str) -> str:
    return f"field '{path}'" if path else "the batch"


def _container_kind(x) -> str | None:
    if isinstance(x, Mapping):
        return "mapping"
    if _is_namedtuple(x):
        return "namedtuple"
    if isinstance(x, (list, tuple)):
        return "sequence"
    return None


def _children(x) -> Iterator[tuple]:
    if isinstance(x, Mapping):
        yield from x.items()
    else:
        yield from enumerate(x)


def _rebuild(template, values: list):
    cls = type(template)
    if isinstance(template, Mapping):
        return cls(zip(template.keys(), values))
    if _is_namedtuple(template):
        return cls._make(values)
    return cls(values)


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
        dyn = _parse_dynamic_dims(dynamic_dims)
        used = set()
        seen_storage: dict = {}

        def capture(x, path):
            if isinstance(x, torch.Tensor):
                return capture_tensor(x, path)
            if isinstance(x, _CONSTANT_TYPES):
                return _Constant(x)
            kind = _container_kind(x)
            if kind is None:
                raise InvalidArgumentError(
                    f"{_show(path)} is a {type(x).__name__}; a batch spec covers dicts, lists, tuples, namedtuples, "
                    "tensors and Python constants (convert dataclasses to a dict)"
                )
            if isinstance(x, Mapping) and type(x) not in (dict,) and not _rebuildable_mapping(x):
                raise InvalidArgumentError(
                    f"{_show(path)} is a {type(x).__name__}; use a dict or OrderedDict"
                )
            return _rebuild(x, [capture(v, _join(path, k)) for k, v in _children(x)])

        def capture_tensor(t, path):
            if type(t) is not torch.Tensor:
                raise InvalidArgumentError(
                    f"{_show(path)} is a {type(t).__name__}; only plain torch.Tensor fields are supported "
                    "(Dynamo guards on the Python type)"
                )
            if t.layout != torch.strided:
                raise InvalidArgumentError(
                    f"{_show(path)} has layout {t.layout}; only strided tensors are supported"
                )
            if t.numel() > 0 and t.device.type != "meta":
                key = t.untyped_storage().data_ptr()
                if key in seen_storage:
                    raise InvalidArgumentError(
                        f"fields '{seen_storage[key]}' and '{path}' share storage; Dynamo guards on aliasing and real "
                        "batches from a DataLoader do not alias: copy one of them"
                    )
                seen_storage[key] = path
            dims = {}
            dims.update({d: v for d, v in dyn.get("*", {}).items() if d < t.dim()})
            own = dyn.get(path)
            if own is not None:
                used.add(path)
                for d in own:
                    if d >= t.dim():
                        raise InvalidArgumentError(
                            f"dynamic_dims: {_show(path)} has {t.dim()} dims, no dim {d}"
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
            strides = tuple(t.stride())
            stride = dim_order = None
            if strides != contiguous_strides(t.shape):
                order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
                if dense_strides(t.shape, order) == strides:
                    dim_order = order
                else:
                    if any(isinstance(s, Dim) for s in shape):
                        raise InvalidArgumentError(
                            f"{_show(path)} has strides {strides}, which are not a dense layout; its dims cannot "
                            "be dynamic (make the tensor contiguous in the collate function)"
                        )
                    stride = strides
            fill = None
            if t.numel() > 0 and t.dtype != torch.bool and not t.is_complex() and t.device.type != "meta":
                lo_v, hi_v = torch.aminmax(t.detach().reshape(-1))
                lo_v, hi_v = lo_v.item(), hi_v.item()
                if math.isfinite(lo_v) and math.isfinite(hi_v):
                    fill = (lo_v, hi_v)
            return TensorSpec(
                shape,
                t.dtype,
                device=t.device,
                stride=stride,
                dim_order=dim_order,
                fill_range=fill,
                requires_grad=t.requires_grad,
            )

        structure = capture(batch, "")
        unknown = set(dyn) - used - {"*"}
        if unknown:
            raise InvalidArgumentError(
                f"dynamic_dims names {sorted(unknown)}, which are not tensor fields of the batch; "
                "paths look like 'features/ids' (list and tuple items by index)"
            )
        return cls(structure)

    def _validate(self, x, path):
        if isinstance(x, (TensorSpec, _Constant)):
            return
        if isinstance(x, _CONSTANT_TYPES):
            return
        if _container_kind(x) is None:
            raise InvalidArgumentError(
                f"{_show(path)} of the spec is a {type(x).__name__}; use TensorSpec, a constant, or a dict / list / "
                "tuple of them"
            )
        for k, v in _children(x):
            self._validate(v, _join(path, k))

    def _leaves(self, x=None, path="") -> Iterator[tuple]:
        x = self._structure if x is None and path == "" else x
        if isinstance(x, (TensorSpec, _Constant, *_CONSTANT_TYPES)):
            yield path, x
            return
        for k, v in _children(x):
            yield from self._leaves(v, _join(path, k))

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
            if isinstance(x, _Constant):
                return x.value
            if isinstance(x, _CONSTANT_TYPES):
                return x
            return _rebuild(x, [build(v, _join(path, k)) for k, v in _children(x)])

        return build(self._structure, "")

    def _dim_name(self, spec: TensorSpec, path: str, i: int) -> str:
        d = spec.shape[i]
        return d.name or f"{path}:{i}"

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
        device = _resolve_device(spec.device)
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
        problems: list = []
        dim_sizes: dict = {}  # dim name -> (size, path) seen first in this batch
        storages: dict = {}

        def walk(spec, x, path):
            if isinstance(spec, TensorSpec):
                tensor(spec, x, path)
            elif isinstance(spec, (_Constant, *_CONSTANT_TYPES)):
                expected = spec.value if isinstance(spec, _Constant) else spec
                if type(x) is not type(expected) or not _same_constant(x, expected):
                    problems.append(
                        f"{_show(path)} is {x!r} ({type(x).__name__}); the spec has the constant {expected!r} "
                        f"({type(expected).__name__}): Dynamo guards Python constants by value"
                    )
            else:
                if type(x) is not type(spec):
                    problems.append(
                        f"{_show(path)} is a {type(x).__name__}; the spec expects a {type(spec).__name__}"
                    )
                    return
                if isinstance(spec, Mapping):
                    keys, want = list(x.keys()), list(spec.keys())
                    if keys != want:
                        if sorted(map(str, keys)) == sorted(map(str, want)):
                            problems.append(
                                f"{_show(path)} has keys {keys} in this order; the spec expects {want}: Dynamo guards "
                                "on dict key order when the model iterates over the dict (build it in the same order)"
                            )
                        else:
                            missing = [k for k in want if k not in x]
                            extra = [k for k in keys if k not in spec]
                            problems.append(
                                f"{_show(path)} has keys {keys}; the spec expects {want}"
                                + (f" (missing {missing})" if missing else "")
                                + (f" (unexpected {extra})" if extra else "")
                            )
                        return
                elif len(x) != len(spec):
                    problems.append(f"{_show(path)} has {len(x)} items; the spec expects {len(spec)}")
                    return
                for (k, s), (_, v) in zip(_children(spec), _children(x)):
                    walk(s, v, _join(path, k))

        def tensor(spec: TensorSpec, t, path):
            where = _show(path)
            if not isinstance(t, torch.Tensor):
                problems.append(
                    f"{where} is a {type(t).__name__}; the spec expects a tensor {spec.describe()}"
                )
                return
            if type(t) is not torch.Tensor:
                problems.append(f"{where} is a {type(t).__name__}; the spec expects a plain torch.Tensor")
            if t.dtype != spec.dtype:
                problems.append(f"{where} has dtype {t.dtype}; the spec expects {spec.dtype}")
            want_device = _resolve_device(spec.device)
            if t.device != want_device:
                problems.append(f"{where} is on {t.device}; the spec expects {want_device}")
            if t.requires_grad != spec.requires_grad:
                problems.append(
                    f"{where} has requires_grad={t.requires_grad}; the spec expects {spec.requires_grad}"
                )
            if t.dim() != len(spec.shape):
                problems.append(
                    f"{where} has {t.dim()} dims {tuple(t.shape)}; the spec expects {len(spec.shape)}"
                )
                return
            shape_ok = True
            for i, (size, d) in enumerate(zip(t.shape, spec.shape)):
                size = int(size)
                if isinstance(d, Dim):
                    name = self._dim_name(spec, path, i)
                    if not d.contains(size):
                        shape_ok = False
                        problems.append(
                            f"{where} has size {size} in dynamic dim {i} ({d.describe()}); sizes outside "
                            f"[{d.min}, {'inf' if d.max is None else d.max}] compile a new graph"
                        )
                    elif name in dim_sizes and dim_sizes[name][0] != size:
                        shape_ok = False
                        problems.append(
                            f"{where} has size {size} in dim {i} but {_show(dim_sizes[name][1])} has "
                            f"{dim_sizes[name][0]}; both are Dim {name!r}, one symbol in the compiled graph"
                        )
                    else:
                        dim_sizes.setdefault(name, (size, path))
                elif size != d:
                    shape_ok = False
                    problems.append(
                        f"{where} has size {size} in static dim {i}; the spec expects {d} (shape "
                        f"{tuple(t.shape)} vs {spec.describe()})"
                    )
            if shape_ok and t.layout == torch.strided:
                want = spec.stride if spec.stride is not None else dense_strides(t.shape, spec.dim_order)
                if tuple(t.stride()) != tuple(want):
                    layout = "contiguous" if spec.stride is None and spec.dim_order is None else f"{want}"
                    problems.append(
                        f"{where} has strides {tuple(t.stride())}; the spec expects {layout} strides {tuple(want)}: "
                        "Dynamo guards on strides (call .contiguous() or declare the layout)"
                    )
            if t.numel() > 0 and t.layout == torch.strided and t.device.type != "meta":
                key = t.untyped_storage().data_ptr()
                if key in storages:
                    problems.append(
                        f"{where} shares storage with {_show(storages[key])}; the spec (and the fast batch) has no "
                        "aliasing, which Dynamo guards on"
                    )
                storages.setdefault(key, path)
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
                    problems.append(
                        f"values of {where} range over {fmt_range(lo, hi)}; the spec allows "
                        f"{fmt_range(*spec.value_range)}"
                    )

        walk(self._structure, batch, "")
        return problems

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
        return {p: (v.value if isinstance(v, _Constant) else v) for p, v in self._leaves()}

    def describe(self) -> str:
        """A stable one-line-per-field description (also used to fingerprint compile caches)."""
        lines = []
        for path, leaf in self._leaves():
            if isinstance(leaf, TensorSpec):
                lines.append(f"{path or '<batch>'}: {leaf.describe()}")
            else:
                value = leaf.value if isinstance(leaf, _Constant) else leaf
                lines.append(f"{path or '<batch>'}: {type(value).__name__} {value!r}")
        containers = []
        self._describe_containers(self._structure, "", containers)
        return "\n".join(containers + lines)

    def _describe_containers(self, x, path, out):
        if isinstance(x, (TensorSpec, _Constant, *_CONSTANT_TYPES)):
            return
        keys = list(x.keys()) if isinstance(x, Mapping) else len(x)
        out.append(f"{path or '<batch>'}: {type(x).__module__}.{type(x).__qualname__} {keys!r}")
        for k, v in _children(x):
            self._describe_containers(v, _join(path, k), out)

    def __repr__(self) -> str:
        return "BatchSpec(\n  " + self.describe().replace("\n", "\n  ") + "\n)"


def _rebuildable_mapping(x) -> bool:
    try:
        type(x)(zip(x.keys(), x.values()))
        return True
    except Exception:  # noqa: BLE001 - any failure means we cannot rebuild it
        return False


def _same_constant(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _storage_size(shape: Sequence[int], stride: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _resolve_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
