"""Flattening nested state dicts into (names, tensors) plus a picklable skeleton, and back."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError


class TensorRef:
    """Placeholder for a tensor inside the pickled skeleton."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (TensorRef, (self.name,))


def flatten(state_dict: Any) -> tuple[list[str], list[torch.Tensor], Any]:
    """Walks dicts, lists and tuples; tensors become dotted names (``model.layer.weight``,
    ``optim.state.0.exp_avg``); everything else stays in the skeleton."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: set[str] = set()

    def walk(obj: Any, prefix: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise InvalidArgumentError(
                    f"state dict entry '{prefix}' is a {type(obj).__name__}; only plain tensors are staged "
                    "(use DCP with ettkit.checkpoint.DcpStager for DTensor/ShardedTensor)")
            if prefix in seen:
                raise InvalidArgumentError(f"state dict key '{prefix}' appears twice after flattening")
            seen.add(prefix)
            names.append(prefix)
            tensors.append(obj.detach())
            return TensorRef(prefix)
        if isinstance(obj, dict):
            return {k: walk(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    skeleton = walk(state_dict, "")
    return names, tensors, skeleton


def restore_non_tensors(target: Any, saved: Any) -> None:
    """Copies non-tensor leaves of ``saved`` into the mutable containers of ``target`` in place."""
    if isinstance(target, dict) and isinstance(saved, dict):
        for k, v in saved.items():
            if k not in target:
                continue
            if isinstance(v, TensorRef):
                continue
            if isinstance(v, (dict, list, tuple)) and isinstance(target[k], (dict, list)):
                restore_non_tensors(target[k], v)
            elif not isinstance(target[k], torch.Tensor):
                target[k] = v
    elif isinstance(target, list) and isinstance(saved, (list, tuple)):
        for i, v in enumerate(saved[: len(target)]):
            if isinstance(v, TensorRef):
                continue
            if isinstance(v, (dict, list, tuple)) and isinstance(target[i], (dict, list)):
                restore_non_tensors(target[i], v)
            elif not isinstance(target[i], torch.Tensor):
                target[i] = v


def rebuild(skeleton: Any, by_name: dict[str, torch.Tensor]) -> Any:
    """The skeleton with each TensorRef replaced by ``by_name[ref.name]``."""
    if isinstance(skeleton, TensorRef):
        return by_name[skeleton.name]
    if isinstance(skeleton, dict):
        return {k: rebuild(v, by_name) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [rebuild(v, by_name) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(rebuild(v, by_name) for v in skeleton)
    return skeleton
