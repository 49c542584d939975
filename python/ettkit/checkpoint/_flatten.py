"""Flattening nested state dicts into (names, tensors) plus a picklable skeleton, and back.

The skeleton is the state dict with every tensor replaced by the :data:`TENSOR` placeholder; tensors
appear in the skeleton in the same order as in ``names``/``tensors`` (dict insertion order, then list
order), so :func:`rebuild` needs no names. This walk runs inside ``save()`` - on the training loop's
critical path - once per tensor: it does the least per tensor it can (no ``detach()``, no per-tensor
objects in the skeleton; the C++ stager reads the tensors' storage without autograd).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError


class _TensorSlot:
    """Where a tensor was in the skeleton. One instance; pickled as a reference to it."""

    __slots__ = ()

    def __reduce__(self):
        return "TENSOR"

    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _TensorSlot()

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def _reject(obj: Any, name: str) -> None:
    raise InvalidArgumentError(
        f"state dict entry '{name}' is a {type(obj).__name__}; only plain tensors are staged "
        "(use DCP with ettkit.checkpoint.DcpStager for DTensor/ShardedTensor)")


# Leaf types whose value cannot change behind an unchanged identity: a skeleton made only of these can be
# compared with ``==`` against the previous save's and its pickle reused.
_VALUE_TYPES = frozenset((int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device))


def flatten(state_dict: Any) -> tuple[list[str], list[torch.Tensor], Any, bool]:
    """Walks dicts, lists and tuples; tensors become dotted names (``model.layer.weight``,
    ``optim.state.0.exp_avg``); everything else stays in the skeleton. Returns ``(names, tensors,
    skeleton, comparable)``; ``comparable`` is False when a leaf is an object that could change in place
    (then ``==`` on skeletons proves nothing). Call :func:`check_unique` on names not seen before."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    add_name, add_tensor = names.append, tensors.append
    opaque: list[bool] = []

    def walk(obj: Any, prefix: str) -> Any:
        # Containers: one loop over (key, value) for dicts, lists and tuples; tensor children are handled
        # inline rather than by recursion, since this runs once per tensor on the save path.
        is_dict = isinstance(obj, dict)
        if is_dict or isinstance(obj, (list, tuple)):
            out = {}
            for k, v in (obj.items() if is_dict else enumerate(obj)):
                key = f"{prefix}.{k}" if prefix else str(k)
                if isinstance(v, _Tensor):
                    if type(v) is not _Tensor and not isinstance(v, _Parameter):
                        _reject(v, key)
                    add_name(key)
                    add_tensor(v)
                    out[k] = TENSOR
                else:
                    out[k] = walk(v, key)
            if is_dict:
                return out
            return list(out.values()) if isinstance(obj, list) else tuple(out.values())
        if isinstance(obj, _Tensor):
            if type(obj) is not _Tensor and not isinstance(obj, _Parameter):
                _reject(obj, prefix)
            add_name(prefix)
            add_tensor(obj)
            return TENSOR
        if type(obj) not in _VALUE_TYPES:
            opaque.append(True)
        return obj

    skeleton = walk(state_dict, "")
    return names, tensors, skeleton, not opaque


# Names a safetensors header gives a meaning of its own: a tensor under one could never be read back.
RESERVED_NAMES = frozenset({"__metadata__"})


def check_unique(names: list[str]) -> None:
    """Two paths can flatten to one name ({"a.b": t} and {"a": {"b": t}}): refuse rather than overwrite.
    Names safetensors reserves are refused too."""
    unique = set(names)
    for reserved in RESERVED_NAMES & unique:
        raise InvalidArgumentError(
            f"state dict key '{reserved}' is reserved: safetensors keeps the file's metadata under that name, so "
            "a tensor saved as it could never be read back; rename it")
    if len(unique) != len(names):
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise InvalidArgumentError(f"state dict key '{n}' appears twice after flattening")
            seen.add(n)


def restore_non_tensors(target: Any, saved: Any) -> None:
    """Copies non-tensor leaves of ``saved`` into the mutable containers of ``target`` in place."""
    if isinstance(target, dict) and isinstance(saved, dict):
        for k, v in saved.items():
            if k not in target or v is TENSOR:
                continue
            if isinstance(v, (dict, list, tuple)) and isinstance(target[k], (dict, list)):
                restore_non_tensors(target[k], v)
            elif not isinstance(target[k], torch.Tensor):
                target[k] = v
    elif isinstance(target, list) and isinstance(saved, (list, tuple)):
        for i, v in enumerate(saved[: len(target)]):
            if v is TENSOR:
                continue
            if isinstance(v, (dict, list, tuple)) and isinstance(target[i], (dict, list)):
                restore_non_tensors(target[i], v)
            elif not isinstance(target[i], torch.Tensor):
                target[i] = v


def rebuild(skeleton: Any, tensors: list) -> Any:
    """The skeleton with its TENSOR placeholders replaced by ``tensors``, in flatten order."""
    it = iter(tensors)

    def build(x: Any) -> Any:
        if x is TENSOR:
            return next(it)
        if isinstance(x, dict):
            return {k: build(v) for k, v in x.items()}
        if isinstance(x, list):
            return [build(v) for v in x]
        if isinstance(x, tuple):
            return tuple(build(v) for v in x)
        return x

    return build(skeleton)
