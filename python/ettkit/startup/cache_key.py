"""The key of a :class:`ettkit.startup.CompileCache`: what must match for a compiled artifact to be reused.

The torch build, Triton, Python, the machine (CPU ISA or GPU, and the GPU index: Inductor bakes it in) and a
fingerprint of the model, its batch spec and compile configuration. The key names every file of the cache
(local, shared) and, without the GPU index, the Store key under which the ranks of a job meet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["CacheKey", "compile_fingerprint"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _machine_key(device: torch.device | None) -> dict:
    key = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "triton": _version("triton") or _version("pytorch-triton"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cache_key_tag": os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", ""),
    }
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        key["cuda"] = torch.version.cuda or ""
        key["gpu"] = f"{props.name} sm_{props.major}{props.minor}"
        # Inductor's GPU artifacts bake in the device index (pytorch #108971): one cache per local rank.
        key["device_index"] = index
    return key


def _class_source_hash(cls: type) -> str:
    try:
        return hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def compile_fingerprint(model: Any = None, spec: Any = None, config: Mapping | None = None) -> str:
    """A stable hash of what decides the compiled graphs: the module tree (classes, and the source of
    classes not from torch), parameter and buffer names, shapes, dtypes and flags, train/eval mode, the batch
    spec's description and a compile configuration (e.g. the ``torch.compile`` keyword arguments)."""
    h = hashlib.sha256()

    def feed(*parts):
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    if model is not None:
        module = getattr(model, "_orig_mod", model)
        if isinstance(module, torch.nn.Module):
            for name, m in module.named_modules():
                cls = type(m)
                feed("module", name, f"{cls.__module__}.{cls.__qualname__}", m.training)
                if not cls.__module__.startswith("torch."):
                    feed(_class_source_hash(cls))
            for name, p in module.named_parameters():
                feed("param", name, tuple(p.shape), p.dtype, p.device.type, p.requires_grad)
            for name, b in module.named_buffers():
                feed("buffer", name, tuple(b.shape), b.dtype, b.device.type)
        else:
            feed("callable", getattr(module, "__qualname__", type(module).__qualname__))
    if spec is not None:
        feed("spec", spec.describe() if hasattr(spec, "describe") else repr(spec))
    if config:
        feed("config", json.dumps(config, sort_keys=True, default=repr))
    return h.hexdigest()


def _model_device(model: Any, device: torch.device | str | None) -> torch.device | None:
    """``device``, else the device of the model's first parameter (None for a model without one)."""
    if device is None and isinstance(model, torch.nn.Module):
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else None
    return torch.device(device) if device is not None else None


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """The key's fields, its hash, and the names it gives the cache's files and Store key."""

    fields: dict
    key: str  # sha256 of the fields: every file's header carries it, a file under another key is "stale"
    share_key: str  # the Store key of compile once per job: the fields without the GPU index

    @classmethod
    def of(cls, *, fingerprint: str | None, model: Any, spec: Any, config: Mapping | None,
           device: torch.device | str | None) -> CacheKey:
        fields = _machine_key(_model_device(model, device))
        if fingerprint is None:
            fingerprint = compile_fingerprint(model, spec, config)
        fields["fingerprint"] = fingerprint
        key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        # Every rank of a job meets under one Store key; a rank whose full key differs (another GPU model)
        # finds the shared file stale and compiles.
        shared = {k: v for k, v in fields.items() if k != "device_index"}
        share_hash = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()
        return cls(fields, key, "ettkit/precompiled/" + share_hash[:24])

    @property
    def megacache_name(self) -> str:
        return f"megacache-{self.key[:24]}.bin"

    @property
    def precompiled_name(self) -> str:
        return f"precompiled-{self.key[:24]}.bin"

    @property
    def shared_name(self) -> str:
        return f"precompiled-{self.key[:24]}.shared"
