"""The structure of a batch, as Dynamo guards it: nested dicts / lists / tuples (namedtuples included) of
tensors and Python constants. The walking helpers that :class:`.BatchSpec`, its capture
(:mod:`.batch_capture`) and its diff (:mod:`.batch_diff`) share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .tensor_spec import TensorSpec

__all__ = [
    "CONSTANT_TYPES", "Constant", "children", "container_kind", "dim_name", "join", "rebuild",
    "rebuildable_mapping", "resolve_device", "same_constant", "show",
]

CONSTANT_TYPES = (bool, int, float, str, bytes, type(None))


@dataclasses.dataclass(frozen=True)
class Constant:
    value: Any


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def join(path: str, key) -> str:
    return f"{path}/{key}" if path else str(key)


def show(path: str) -> str:
    return f"field '{path}'" if path else "the batch"


def container_kind(x) -> str | None:
    if isinstance(x, Mapping):
        return "mapping"
    if _is_namedtuple(x):
        return "namedtuple"
    if isinstance(x, (list, tuple)):
        return "sequence"
    return None


def children(x) -> Iterator[tuple]:
    if isinstance(x, Mapping):
        yield from x.items()
    else:
        yield from enumerate(x)


def rebuild(template, values: list):
    cls = type(template)
    if isinstance(template, Mapping):
        return cls(zip(template.keys(), values))
    if _is_namedtuple(template):
        return cls._make(values)
    return cls(values)


def rebuildable_mapping(x) -> bool:
    try:
        type(x)(zip(x.keys(), x.values()))
        return True
    except Exception:  # noqa: BLE001 - any failure means we cannot rebuild it
        return False


def same_constant(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def resolve_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def dim_name(spec: TensorSpec, path: str, i: int) -> str:
    """The symbol of dynamic dim ``i`` of the field at ``path``: its Dim's name, else ``"<path>:<i>"``."""
    d = spec.shape[i]
    return d.name or f"{path}:{i}"
