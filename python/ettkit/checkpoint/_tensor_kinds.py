"""What a value of a state is to a checkpoint: the skeleton's node kinds and the lookups that classify tensors.

A leaf module (it imports nothing of the package): the save walk (_flatten.py), the load checks and merges
(_restore.py), the fences (_attach.py), the optimizer's first-step state (_optim_state.py) and the codec
(_skeleton_codec.py) all ask it what a value is, so none of them needs another. ``TENSOR``, ``ShardedSlot``,
``DTensorSlot`` and ``StatefulSlot`` are the skeleton's nodes; ``owns_storage`` and the type lookups say which
tensors the C++ stager can copy.
"""

from __future__ import annotations

import sys
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
_Size = torch.Size


_PYTHON_KEY = torch._C.DispatchKey.Python
_dispatch_keys = torch._C._dispatch_keys


def owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t``'s own storage holds its values, which is what the C++ stager copies: a ``torch.Tensor``
    or ``nn.Parameter`` (checked by type first, the cost per tensor on the save path), or a subclass of
    either without a ``__torch_dispatch__`` wrapper (TorchRec's ``TableBatchedEmbeddingSlice``, an
    ``as_subclass`` type). A wrapper subclass (DTensor, ShardedTensor, FSDP2's parameters, a Parameter around
    either, all of which ``isinstance(p, nn.Parameter)`` may accept) has the Python dispatch key and a
    placeholder storage with no data: its values are in the tensors it wraps."""
    tt = type(t)
    return tt is _Tensor or tt is _Parameter or not _dispatch_keys(t).has(_PYTHON_KEY)


def type_name(obj: Any) -> str:
    t = type(obj)
    name = f"{t.__module__}.{t.__qualname__}"
    # nn.Parameter(wrapper) returns the wrapper itself, marked: say so, since the user wrote a Parameter.
    return f"{name} (an nn.Parameter)" if t is not _Parameter and getattr(obj, "_is_param", False) else name


def reject(obj: Any, name: str, what: str = "is") -> None:
    raise InvalidArgumentError(
        f"state dict entry '{name}' {what} a {type_name(obj)}; ettkit saves plain tensors (and subclasses "
        "whose storage holds their values), ShardedTensors (TorchRec's sharded tables: each rank its local "
        "shards), DTensors whose placements are Shard(d) or Replicate() (FSDP2's and HSDP's parameters, "
        "TorchRec's local shards) and Parameters around those. Save the plain tensors it wraps instead, or save it with DCP's "
        "own stager (dcp.async_save without ettkit's DcpStager), which asks a subclass that implements DCP's "
        "protocol how to save it")

def sharded_tensor_type() -> Any:
    # Looked up where torch put it, never imported: no ShardedTensor can exist before its module is loaded,
    # and importing torch.distributed's sharding package would cost every save() of a plain model.
    mod = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    return getattr(mod, "ShardedTensor", None)


def shard_name(key: str, offsets: tuple) -> str:
    """The name a local shard of the ShardedTensor at ``key`` is saved under: its offsets in the whole
    tensor (``emb.t1.weight@24,0``), so that each rank's file says which part of the table it holds."""
    return f"{key}@{','.join(str(o) for o in offsets)}"


class ShardedSlot:
    """Where a ``ShardedTensor`` was in the skeleton (TorchRec's sharded embedding tables and their fused
    optimizer state). This rank's local shards are saved as plain tensors named :func:`shard_name`; the
    slot records the whole tensor's ``size`` and ``dtype`` and this rank's ``shards`` as ``(offsets, sizes,
    placement)``; a load compares the size and dtype with the live ShardedTensor's before anything is copied
    (another layout is resharded; another size or dtype is refused). ``key`` and ``live`` (the ShardedTensor itself)
    belong to this process: they are neither compared nor pickled."""

    __slots__ = ("size", "dtype", "shards", "key", "live")

    def __init__(self, size: tuple, dtype: Any, shards: tuple, key: str = "", live: Any = None):
        self.size, self.dtype, self.shards, self.key, self.live = size, dtype, shards, key, live

    def __reduce__(self):
        return (ShardedSlot, (self.size, self.dtype, self.shards))

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, ShardedSlot) and self.size == other.size and self.dtype == other.dtype
                and self.shards == other.shards)

    def __hash__(self) -> int:
        return hash((self.size, self.shards))

    @property
    def kind(self) -> str:
        """``"DTensor"`` or ``"ShardedTensor"``: what was saved, read from the placements the slot records (a
        DTensor's are torch's ``str`` of its placements, which depends on the torch version: ``S(0)``, ``R``,
        ``Shard(dim=0)``, ``Replicate()``, one per mesh dimension joined by ``", "``; a ShardedTensor's
        ``rank:r/device`` or None)."""
        placements = [p for _, _, p in self.shards]
        if placements and all(isinstance(p, str) and not p.startswith("rank:") for p in placements):
            return "DTensor"
        return "ShardedTensor"

    def describe(self) -> str:
        parts = ", ".join(f"{list(sz)} at {list(off)}" for off, sz, _ in self.shards) or "none"
        return f"a {self.kind} {list(self.size)} {self.dtype}, this rank's shards {parts}"

    def __repr__(self) -> str:
        return f"<sharded {self.describe()}>"


class DTensorSlot:
    """Where a ``DTensor`` was in the skeleton of a DCP stage (:class:`ettkit.checkpoint.DcpStager` only: DCP
    writes its metadata; the native checkpointer refuses DTensors). Its local tensor is staged; ``live`` is
    the DTensor, whose spec the staged copy is wrapped in."""

    __slots__ = ("live",)

    def __init__(self, live: Any):
        self.live = live

    def __eq__(self, other: Any) -> bool:
        return False  # never reuse a pickled skeleton across DTensors

    __hash__ = object.__hash__


def dtensor_type() -> Any:
    mod = sys.modules.get("torch.distributed.tensor._api")
    return getattr(mod, "DTensor", None)


def is_local_shards_wrapper(local: Any) -> bool:
    """Whether a DTensor's local tensor is a ``LocalShardsWrapper`` (torch's, or TorchRec's copy of it, which
    TorchRec's DTensor tables and their optimizer state use): several local shards of one rank, each with
    its offsets in the whole tensor. Looked up where they were put, never imported."""
    for module in ("torch.distributed.tensor._shards_wrapper", "torchrec.distributed.shards_wrapper"):
        cls = getattr(sys.modules.get(module), "LocalShardsWrapper", None)
        if cls is not None and isinstance(local, cls):
            return True
    return False


# Leaf types whose value cannot change behind an unchanged identity: a skeleton made only of these can be
# compared with ``==`` against the previous save's and its encoding reused.
VALUE_TYPES = frozenset((int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device,
                          torch.Size))

#: The most a leaf that is not a tensor may take in ``rank-<r>.extra``: a str or bytes value by its length,
#: an object pickled under ``allow_pickle=True`` by its pickle (_skeleton_codec.py). Larger state belongs in
#: tensors (saved tensor by tensor, checksummed, loaded in place) or, deliberately, in ``save(..., extra=...)``.
MAX_LEAF_BYTES = 64 * 1024


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful``: ``state_dict()`` and ``load_state_dict()`` (``nn.Module``, optimizers, LR
    schedulers, ``GradScaler``, user objects). Looked up on the type: a class itself is not stateful."""
    t = type(obj)
    return callable(getattr(t, "state_dict", None)) and callable(getattr(t, "load_state_dict", None))


_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer
_module_state_dict = torch.nn.Module.state_dict


def state_dict_of(obj: Any) -> Any:
    """``obj.state_dict()``; a module's with ``keep_vars=True`` (its parameters as they are: no
    ``detach()`` per tensor on the save path; the stager reads storage without autograd, and a detached
    tensor would share the parameter's storage and version counter anyway)."""
    if isinstance(obj, _Module) and type(obj).state_dict is _module_state_dict:
        return obj.state_dict(keep_vars=True)
    return obj.state_dict()


class StatefulSlot:
    """Where a Stateful (or a captured optimizer state dict) sits in a state, and what its state dict was.

    ``obj``: the object whose ``load_state_dict`` restores it; ``captured``: the plain dict the user holds,
    for a dict captured from an attached optimizer's ``state_dict()`` (refreshed in place), else None;
    ``state``: the state dict taken from ``obj`` by this walk; ``skeleton``: its skeleton."""

    __slots__ = ("prefix", "obj", "captured", "state", "skeleton")

    def __init__(self, prefix: str, obj: Any, captured: Any, state: Any, skeleton: Any):
        self.prefix, self.obj, self.captured = prefix, obj, captured
        self.state, self.skeleton = state, skeleton

    def __repr__(self) -> str:
        return f"<stateful {self.prefix!r}>"


def describe_key(key: str) -> str:
    return f"state entry '{key}'" if key else "the state"


_KIB = MAX_LEAF_BYTES // 1024
#: What a save takes, for the messages that refuse a value (the save walk and the skeleton codec).
SAVE_VALID = ("save() stores tensors (tensor by tensor), objects with state_dict()/load_state_dict() (nn.Module, "
              "optimizers, LR schedulers, DCP Stateful: saved through their state dicts), dicts, lists and "
              "tuples of those, and small plain values (None, bool, int, float, complex, torch.dtype, "
              f"torch.device, torch.Size; str and bytes up to {_KIB} KiB; with allow_pickle=True, other picklable "
              f"objects up to {_KIB} KiB pickled). Make it a tensor or a Stateful, or pass it as save(..., extra=...)")


def is_plain_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is a torch optimizer none of whose parameters is a DTensor or ShardedTensor."""
    if not isinstance(obj, _Optimizer):
        return False
    return all(owns_storage(p) for g in obj.param_groups for p in g["params"])

