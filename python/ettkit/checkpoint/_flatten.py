"""Flattening nested state dicts into (names, tensors) plus a skeleton, and back.

The skeleton is the state dict with every tensor replaced by the :data:`TENSOR` placeholder; tensors
appear in the skeleton in the same order as in ``names``/``tensors`` (dict insertion order, then list
order), so :func:`rebuild` needs no names. This walk runs inside ``save()`` - on the training loop's
critical path - once per tensor: it does the least per tensor it can (no ``detach()``, no per-tensor
objects in the skeleton; the C++ stager reads the tensors' storage without autograd).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..errors import InvalidArgumentError
from .data_position import handed_out_by


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


def _type_name(obj: Any) -> str:
    t = type(obj)
    name = f"{t.__module__}.{t.__qualname__}"
    # nn.Parameter(wrapper) returns the wrapper itself, marked: say so, since the user wrote a Parameter.
    return f"{name} (an nn.Parameter)" if t is not _Parameter and getattr(obj, "_is_param", False) else name


def _reject(obj: Any, name: str, what: str = "is") -> None:
    raise InvalidArgumentError(
        f"state dict entry '{name}' {what} a {_type_name(obj)}; ettkit saves plain tensors (and subclasses "
        "whose storage holds their values), ShardedTensors (TorchRec's sharded tables: each rank its local "
        "shards), DTensors whose placements are Shard(d) or Replicate() (FSDP2's and HSDP's parameters, "
        "TorchRec's local shards) and Parameters around those. Save the plain tensors it wraps instead, or save it with DCP's "
        "own stager (dcp.async_save without ettkit's DcpStager), which asks a subclass that implements DCP's "
        "protocol how to save it")


def _sharded_tensor_type() -> Any:
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


def _dtensor_type() -> Any:
    mod = sys.modules.get("torch.distributed.tensor._api")
    return getattr(mod, "DTensor", None)


def _is_local_shards_wrapper(local: Any) -> bool:
    """Whether a DTensor's local tensor is a ``LocalShardsWrapper`` (torch's, or TorchRec's copy of it, which
    TorchRec's DTensor tables and their optimizer state use): several local shards of one rank, each with
    its offsets in the whole tensor. Looked up where they were put, never imported."""
    for module in ("torch.distributed.tensor._shards_wrapper", "torchrec.distributed.shards_wrapper"):
        cls = getattr(sys.modules.get(module), "LocalShardsWrapper", None)
        if cls is not None and isinstance(local, cls):
            return True
    return False


def _dtensor_slot(obj: Any, key: str, add_name: Any, add_tensor: Any) -> "ShardedSlot":
    """A DTensor in the native checkpointer, on a mesh of any number of dimensions whose placements are each
    ``Shard(d)`` or ``Replicate()``: this rank's local tensor is saved as a shard of the whole tensor at its
    global offsets (named like a ShardedTensor's, so a load at another world size reshards it; ranks that
    differ only along ``Replicate()`` dimensions save the same piece, and a resharding read takes one copy),
    and a DTensor replicated along every dimension as the whole tensor. Its :class:`ShardedSlot` holds the
    DTensor, loaded in place through its local tensor. A ``Shard(d)`` DTensor on a 1-D mesh whose local
    tensor is a ``LocalShardsWrapper`` (TorchRec) saves each of its local shards at its own offsets. Other
    placements (``Partial``, the ``_StridedShard`` that FSDP2 + tensor parallel produce on one dimension)
    are refused, naming the key."""
    mesh, placements = obj.device_mesh, tuple(obj.placements)
    local = obj._local_tensor
    if not placements or any(type(p).__name__ not in ("Shard", "Replicate") for p in placements):
        raise InvalidArgumentError(
            f"state dict entry '{key}' is a DTensor with placements {list(placements)} on a {mesh.ndim}-D mesh; "
            "ettkit's checkpointer saves DTensors whose placements are each Shard(d) or Replicate() (a "
            "_StridedShard, as FSDP2 with tensor parallelism on the same dimension makes, and Partial are not "
            "done). For others use DCP: dcp.async_save(..., async_stager=ettkit.checkpoint.DcpStager())")
    size = tuple(int(s) for s in obj.shape)
    # What the slot records as the shard's placement: torch's str of each mesh dimension's, joined ("S(0)" on
    # a 1-D mesh with torch 2.14, as before 2-D meshes were saved: a step saved then loads at the same layout;
    # "R, S(0)" for HSDP).
    text = ", ".join(str(p) for p in placements)
    if _is_local_shards_wrapper(local):
        if mesh.ndim != 1 or not placements[0].is_shard():
            raise InvalidArgumentError(
                f"state dict entry '{key}' is a DTensor of local shards (LocalShardsWrapper) with placements "
                f"{list(placements)} on a {mesh.ndim}-D mesh; ettkit saves those with Shard(d) on a 1-D mesh")
        shards = []
        for t, off in zip(local.local_shards(), local.local_offsets()):
            if not owns_storage(t):
                _reject(t, key, "is a DTensor whose local shard is")
            offsets = tuple(int(o) for o in off)
            add_name(shard_name(key, offsets))
            add_tensor(t)
            shards.append((offsets, tuple(int(s) for s in t.shape), text))
        return ShardedSlot(size, obj.dtype, tuple(shards), key, obj)
    if not owns_storage(local):
        _reject(local, key, "is a DTensor whose local tensor is")
    if all(p.is_replicate() for p in placements):
        add_name(key)
        add_tensor(local)
        return ShardedSlot(size, obj.dtype, (((0,) * len(size), size, text),), key, obj)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(obj.shape, mesh, placements)
    offsets = tuple(int(o) for o in offsets)
    add_name(shard_name(key, offsets))
    add_tensor(local)
    return ShardedSlot(size, obj.dtype, ((offsets, tuple(int(s) for s in shape), text),), key, obj)


def _special(obj: Any, key: str, strict: bool, add_name: Any, add_tensor: Any) -> Any:
    """The skeleton node of a tensor whose type is not exactly ``torch.Tensor`` or ``nn.Parameter``,
    classified by what it is (``isinstance``, dispatch keys), since a Parameter around a wrapper has the
    wrapper's type (``nn.Parameter(dtensor)`` returns a DTensor marked ``_is_param``): a ShardedTensor's local
    shards, named and added, and its :class:`ShardedSlot`; a DTensor (in a DCP stage, not ``strict``: its
    local tensor and a :class:`DTensorSlot`); a subclass whose own storage holds its values, as a plain
    tensor. Anything else is refused naming the key and the type, before any pointer reaches C++."""
    st = _sharded_tensor_type()
    if st is None or not isinstance(obj, st):
        dt = _dtensor_type()
        if dt is None or not isinstance(obj, dt):
            if not owns_storage(obj):
                _reject(obj, key)
            add_name(key)
            add_tensor(obj)
            return TENSOR
        if strict:
            return _dtensor_slot(obj, key, add_name, add_tensor)
        local = obj._local_tensor
        if not owns_storage(local):
            _reject(local, key, "is a DTensor whose local tensor is")
        add_name(key)
        add_tensor(local)
        return DTensorSlot(obj)
    md = obj.metadata()
    shards = []
    for shard in obj.local_shards():
        t, m = shard.tensor, shard.metadata
        if not owns_storage(t):
            _reject(t, key, "is a ShardedTensor whose local shard is")
        offsets = tuple(int(o) for o in m.shard_offsets)
        add_name(shard_name(key, offsets))
        add_tensor(t)
        shards.append((offsets, tuple(int(s) for s in m.shard_sizes),
                       None if m.placement is None else str(m.placement)))
    return ShardedSlot(tuple(int(s) for s in md.size), md.tensor_properties.dtype, tuple(shards), key, obj)


# Leaf types whose value cannot change behind an unchanged identity: a skeleton made only of these can be
# compared with ``==`` against the previous save's and its encoding reused.
_VALUE_TYPES = frozenset((int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device,
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


def _describe(key: str) -> str:
    return f"state entry '{key}'" if key else "the state"


_KIB = MAX_LEAF_BYTES // 1024
_VALID = ("save() stores tensors (tensor by tensor), objects with state_dict()/load_state_dict() (nn.Module, "
          "optimizers, LR schedulers, DCP Stateful: saved through their state dicts), dicts, lists and "
          "tuples of those, and small plain values (None, bool, int, float, complex, torch.dtype, "
          f"torch.device, torch.Size; str and bytes up to {_KIB} KiB; with allow_pickle=True, other picklable "
          f"objects up to {_KIB} KiB pickled). Make it a tensor or a Stateful, or pass it as save(..., extra=...)")


def flatten(state_dict: Any) -> tuple[list[str], list[torch.Tensor], Any, bool]:
    """Walks dicts, lists and tuples; tensors become dotted names (``model.layer.weight``,
    ``optim.state.0.exp_avg``); everything else stays in the skeleton as it is (DCP's stager: DCP has
    already turned its Statefuls into state dicts). Returns ``(names, tensors, skeleton, comparable)``;
    ``comparable`` is False when a leaf is an object that could change in place (then ``==`` on skeletons
    proves nothing). Call :func:`check_unique` on names not seen before."""
    names, tensors, skeleton, comparable, _ = _walk(state_dict, False, None, False)
    return names, tensors, skeleton, comparable


def flatten_state(state_dict: Any, find_optimizer: Any = None, *, for_load: bool = False):
    """:func:`flatten` for the checkpointer: a Stateful leaf is replaced by a fresh ``state_dict()`` (its
    tensors are named under its key); a dict that ``find_optimizer(d)`` recognises as captured from an
    attached optimizer is handled as that optimizer; a str or bytes leaf over ``MAX_LEAF_BYTES`` raises
    :class:`InvalidArgumentError` naming its key (a leaf that is none of tensor, container, Stateful, plain
    value is the skeleton encoder's to refuse or pickle: ``comparable`` is False). Returns ``(names, tensors,
    skeleton, comparable, slots)``. ``for_load``: the skeleton holds each Stateful's :class:`StatefulSlot`
    where its state dict would be, so that the load finds the saved state dict in the same place."""
    return _walk(state_dict, strict=True, find_optimizer=find_optimizer, slots=for_load)


def _walk(state_dict: Any, strict: bool, find_optimizer: Any, slots: bool):
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    add_name, add_tensor = names.append, tensors.append
    opaque: list = []
    found: list[StatefulSlot] = []

    fresh: set = set()  # ids of the state dicts taken here: an optimizer's own is not a captured one
    inside = [0]  # > 0 while walking a state dict taken here (a Stateful's own copies are current)

    def stateful(obj: Any, captured: Any, prefix: str) -> Any:
        if isinstance(obj, _Optimizer):
            # An optimizer of DTensor/ShardedTensor parameters gets the state its first step() would create,
            # so that a save holds it whole and a load has tensors of each parameter's layout to load into.
            from ._optim_state import create_first_step_state

            create_first_step_state(obj)
        state = state_dict_of(obj)
        fresh.add(id(state))
        inside[0] += 1
        try:
            skeleton = walk(state, prefix)
        finally:
            inside[0] -= 1
        if captured is not None:
            refresh_captured(captured, state)
        slot = StatefulSlot(prefix, obj, captured, state, skeleton)
        found.append(slot)
        return slot if slots else skeleton

    def walk(obj: Any, prefix: str) -> Any:
        # Containers: one loop over (key, value) for dicts, lists and tuples; tensor children are handled
        # inline rather than by recursion, since this runs once per tensor on the save path. A torch.Size
        # is a value (a tuple of ints the skeleton keeps as it is).
        is_dict = isinstance(obj, dict)
        if is_dict or (isinstance(obj, (list, tuple)) and type(obj) is not _Size):
            if is_dict and strict and not inside[0] and (
                    _COPY_MARKS.intersection(obj)
                    or (len(obj) == 2 and "batches" in obj and handed_out_by(obj) is not None)):
                refuse_copied_state_dict(obj, prefix)
            if is_dict and find_optimizer is not None and "param_groups" in obj and id(obj) not in fresh:
                opt = find_optimizer(obj, prefix)
                if opt is not None:
                    return stateful(opt, obj, prefix)
            out = {}
            for k, v in (obj.items() if is_dict else enumerate(obj)):
                key = f"{prefix}.{k}" if prefix else str(k)
                if isinstance(v, _Tensor):
                    # Exact types only: isinstance(v, Parameter) also holds for FSDP2's DTensor parameters.
                    tv = type(v)
                    if tv is not _Tensor and tv is not _Parameter:
                        out[k] = _special(v, key, strict, add_name, add_tensor)
                        continue
                    add_name(key)
                    add_tensor(v)
                    out[k] = TENSOR
                else:
                    out[k] = walk(v, key)
            if is_dict:
                return out
            return list(out.values()) if isinstance(obj, list) else tuple(out.values())
        if isinstance(obj, _Tensor):
            if type(obj) is not _Tensor and type(obj) is not _Parameter:
                return _special(obj, prefix, strict, add_name, add_tensor)
            add_name(prefix)
            add_tensor(obj)
            return TENSOR
        t = type(obj)
        if t in _VALUE_TYPES:
            if strict and (t is str or t is bytes) and len(obj) > MAX_LEAF_BYTES:
                raise InvalidArgumentError(f"{_describe(prefix)} is a {t.__name__} of {len(obj)} "
                                           f"characters/bytes, more than {MAX_LEAF_BYTES}; {_VALID}")
            return obj
        if strict and is_stateful(obj):
            return stateful(obj, None, prefix)
        opaque.append((prefix, obj))
        return obj

    # Leaves that are none of these (`opaque`) are the skeleton encoder's to refuse, or to pickle under
    # allow_pickle=True (_skeleton_codec.py); they make the skeleton one that `==` cannot compare.
    try:
        skeleton = walk(state_dict, "")
    finally:
        # walk and stateful call each other, so their closures form a reference cycle, and the cycle holds
        # add_tensor, the list of every tensor of the state: a Stateful's fresh state_dict() tensors then
        # lived until the cyclic collector ran. Emptying the cells frees them when the caller lets go.
        walk = stateful = None  # the closures hold the cells; emptying them breaks the cycle
    return names, tensors, skeleton, not opaque, found


# Keys that only the state dicts of Statefuls ettkit cannot find from a copy of their state dict have: an LR
# scheduler's (``_last_lr``: LRScheduler and ReduceLROnPlateau) and a GradScaler's (``_growth_tracker``).
# Private names, so a user's own dict does not have them. A DataPosition's copy is known by identity
# (data_position.handed_out_by): its keys are common words.
_COPY_MARKS = frozenset(("_last_lr", "_growth_tracker"))


def refuse_copied_state_dict(d: dict, prefix: str) -> None:
    """Refuses a dict that is the ``state_dict()`` of an LR scheduler, a GradScaler or a DataPosition put in
    the state by value. Such a dict is a copy taken when ``state_dict()`` was called: unlike an attached
    optimizer's (whose per-parameter state it shares, so that ettkit finds the optimizer and refreshes the
    dict), nothing in it leads back to the object. A save would store the object as it was at the capture
    (a scheduler at ``last_epoch`` 0 when the state was put together before training), and a load would
    restore the dict, never the object: a resume that goes on silently wrong. Raised at save and at load."""
    if "_last_lr" in d:
        what, noun = "an LR scheduler", "scheduler"
    elif "_growth_tracker" in d:
        what, noun = "a GradScaler", "scaler"
    else:
        what, noun = "a DataPosition", "data_position"
    key = prefix.rsplit(".", 1)[-1] if prefix else noun
    raise InvalidArgumentError(
        f"{_describe(prefix)} is {what}'s state_dict(), a copy taken when it was called: a save would store the "
        f"{noun} as it was then (not as it is at the save), and load_latest could restore only the copy, not the "
        f"{noun}. Pass the {noun} object itself, not its state_dict(): {{'{key}': {noun}}} (saved and restored "
        f"through its state_dict()/load_state_dict(); the files are the same)")


def refresh_captured(captured: dict, state: dict) -> None:
    """Makes a dict captured from ``opt.state_dict()`` hold what ``opt.state_dict()`` holds now, in place:
    its ``state`` maps to the optimizer's live per-parameter state (which the first ``step()`` creates
    after the capture), its ``param_groups`` carry the current hyperparameters (an LR scheduler changes
    them)."""
    live = captured["state"]
    if live is not state["state"]:
        live.clear()
        live.update(state["state"])
    groups = captured["param_groups"]
    for mine, now in zip(groups, state["param_groups"]):
        mine.update(now)


def find_captured_optimizer(optimizers: list, adopted: Any = ()):
    """The ``find_optimizer`` of :func:`flatten_state` for the attached ``optimizers``: a dict with
    ``state`` and ``param_groups`` is taken for ``opt.state_dict()`` of the attached optimizer whose
    parameter groups it matches (group count, hyperparameter names, parameter ids as ``state_dict()``
    numbers them) and, when the dict has state, shares it (its per-parameter dicts or their tensors are the
    optimizer's). A dict captured before the first step has none: one that matches several attached
    optimizers raises (pass the optimizer itself instead). ``adopted``: ids of dicts that ``load_latest`` filled
    with an optimizer's saved state (read into new tensors, which ``optimizer.load_state_dict(d)`` copies to
    the parameters' device, so they need not be shared): matched by their parameter groups alone."""
    if not optimizers:
        return None

    def matches(d: dict, opt) -> bool:
        groups = d.get("param_groups")
        if not isinstance(groups, list) or not isinstance(d.get("state"), dict):
            return False
        if len(groups) != len(opt.param_groups):
            return False
        start = 0
        for g, live in zip(groups, opt.param_groups):
            n = len(live["params"])
            ids = g.get("params") if isinstance(g, dict) else None
            # state_dict() numbers parameters 0, 1, ... across groups: the ends of each range suffice.
            # Keys: an LR scheduler created after the capture adds some (initial_lr) to the live groups.
            if not isinstance(ids, list) or len(ids) != n or not g.keys() <= live.keys():
                return False
            if n and (ids[0] != start or ids[-1] != start + n - 1):
                return False
            start += n
        return True

    def shares_state(d: dict, opt) -> bool:
        # One entry decides: state_dict() hands out the optimizer's own per-parameter dicts; after
        # opt.load_state_dict(d) the optimizer holds new dicts with the same tensors.
        state = d["state"]
        k = next(iter(state))
        params = [p for g in opt.param_groups for p in g["params"]]
        if not (isinstance(k, int) and 0 <= k < len(params)):
            return False
        mine, live = state[k], opt.state.get(params[k])
        if mine is live:
            return True
        return isinstance(mine, dict) and isinstance(live, dict) and any(
            isinstance(v, torch.Tensor) and live.get(f) is v for f, v in mine.items())

    def find(d: dict, prefix: str):
        candidates = [opt for opt in optimizers if matches(d, opt)]
        if candidates and d["state"] and id(d) not in adopted:
            # A dict with state is live only if it shares it: a deep copy, or another optimizer's dict of
            # the same shape, is saved as it is.
            candidates = [opt for opt in candidates if shares_state(d, opt)]
        if len(candidates) > 1:
            raise InvalidArgumentError(
                f"{_describe(prefix)} looks like the state_dict() of more than one attached optimizer; "
                "put the optimizer itself in the state ({'optim': optimizer}) so that ettkit knows which")
        return candidates[0] if candidates else None

    return find


def check_unique(names: list[str]) -> None:
    """Two paths can flatten to one name ({"a.b": t} and {"a": {"b": t}}): refuse rather than overwrite.
    (The name safetensors reserves, ``__metadata__``, is refused by the C++ save, for every caller.)"""
    unique = set(names)
    if len(unique) != len(names):
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise InvalidArgumentError(f"state dict key '{n}' appears twice after flattening")
            seen.add(n)


def _child(name: str, k: Any) -> str:
    return f"{name}.{k}" if name else str(k)


def _is_optimizer_dict(x: Any) -> bool:
    """Whether a live skeleton node is an optimizer's ``state_dict()`` passed by value."""
    return isinstance(x, dict) and isinstance(x.get("state"), dict) and isinstance(x.get("param_groups"), list)


def by_value_optimizer_prefixes(live: Any) -> list[str]:
    """The names of the ``state`` of every optimizer state dict passed by value (not a Stateful, not one
    recognised as an attached optimizer's) in the live skeleton from ``flatten_state(for_load=True)``: the
    saved per-parameter state a fresh optimizer's dict lacks (Adam creates it in its first ``step()``) is read
    there into new tensors and put into the dict, for the caller's ``optimizer.load_state_dict(d)``."""
    out: list[str] = []

    def walk(x: Any, name: str) -> None:
        if _is_optimizer_dict(x):
            out.append(_child(name, "state"))
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, _child(name, k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, _child(name, i))

    walk(live, "")
    return out


def _holds_values(x: Any) -> bool:
    """Whether a skeleton node holds anything but tensors (the C++ name check reports those): a plain value
    or an empty container is an entry that a load must restore or refuse."""
    if x is TENSOR or isinstance(x, (ShardedSlot, StatefulSlot)):
        return False
    if isinstance(x, dict):
        return not x or any(_holds_values(v) for v in x.values())
    if isinstance(x, (list, tuple)) and type(x) is not _Size:
        return not x or any(_holds_values(v) for v in x)
    return True


def check_by_value(live: Any, saved: Any) -> None:
    """Before any tensor is copied: every entry of the state being loaded that holds a value other than a
    tensor (the C++ loader checks those) must be in the saved state, since the load would otherwise leave it as
    it was beside restored ones, and a root tuple must hold only tensors (nowhere to put its values). Raises
    :class:`InvalidArgumentError` naming each such entry. The other direction needs no check: a saved entry
    the state lacks is put into its dict or list by :func:`restore_by_value` (the per-parameter state of an
    optimizer's state dict passed by value: a fresh optimizer has none), and a saved tensor with no place is
    the C++ loader's to refuse. Statefuls are their own ``load_state_dict``'s to check."""
    wrong: list[str] = []

    def walk(x: Any, s: Any, name: str) -> None:
        if isinstance(x, (StatefulSlot, ShardedSlot)) or x is TENSOR:
            return
        if isinstance(x, dict) and isinstance(s, dict):
            for k, v in x.items():
                if k in s:
                    walk(v, s[k], _child(name, k))
                elif _holds_values(v):
                    wrong.append(f"'{_child(name, k)}' is in the state, not in the checkpoint")
        elif isinstance(x, (list, tuple)) and type(x) is not _Size and isinstance(s, (list, tuple)) \
                and type(s) is not _Size:
            # A list takes the saved length (restore_by_value); its items beyond it hold no tensor or
            # Stateful, or the C++ loader or _saved_states refused them.
            for i, (v, sv) in enumerate(zip(x, s)):
                walk(v, sv, _child(name, i))

    walk(live, saved, "")
    if isinstance(live, tuple) and _holds_values(live):
        wrong.append("the state is a tuple, whose values load_latest cannot replace: pass a dict or a list")
    if wrong:
        raise InvalidArgumentError(
            "load_latest restores every value of the state or none, and these have nothing saved to restore "
            "them from: " + bounded(wrong) + ". Load with the keys that were saved (a key added since: put "
            "it in the state after load_latest)")


def restore_by_value(target: Any, saved: Any, tensors: dict, skip: Any = frozenset(),
                     optimizer_dicts: Any = None) -> Any:
    """Puts the saved state into ``target``'s containers in place, after :func:`check_by_value` passed and
    the tensors were loaded in place: plain values are replaced, a tuple is rebuilt around its (loaded)
    tensors, a list gets the saved list's length, and an entry only the checkpoint has (an optimizer's
    per-parameter state that a fresh optimizer's ``state_dict()`` lacks, a key a dict gained in training) is
    added, its tensors the new ones in ``tensors`` (by name).
    Statefuls and the dicts whose ids are in ``skip`` (captured optimizer state dicts) are restored by their
    own ``load_state_dict`` and left alone. The optimizer state dicts restored by value are appended to the
    list ``optimizer_dicts``. Returns what belongs where ``target`` was."""

    def merge(cur: Any, s: Any, name: str) -> Any:
        if isinstance(cur, _Tensor) or id(cur) in skip or is_stateful(cur):
            return cur
        if s is TENSOR or isinstance(s, ShardedSlot):
            return rebuild_named(s, name, tensors)
        if isinstance(s, dict) and isinstance(cur, dict):
            if optimizer_dicts is not None and _is_optimizer_dict(cur):
                optimizer_dicts.append(cur)
            for k, v in s.items():
                key = _child(name, k)
                if k in cur:
                    cur[k] = merge(cur[k], v, key)
                elif not held_elsewhere(v, key, tensors):
                    cur[k] = rebuild_named(v, key, tensors)
            return cur
        if isinstance(s, (list, tuple)) and type(s) is not _Size and isinstance(cur, (list, tuple)) \
                and type(cur) is not _Size:
            items = [merge(c, v, _child(name, i)) for i, (c, v) in enumerate(zip(cur, s))]
            items += [rebuild_named(v, _child(name, i), tensors) for i, v in enumerate(s) if i >= len(cur)]
            if isinstance(cur, list) and isinstance(s, list):
                cur[:] = items
                return cur
            return items if isinstance(s, list) else tuple(items)
        return rebuild_named(s, name, tensors)

    return merge(target, saved, "")


def held_elsewhere(saved: Any, name: str, loaded: dict) -> bool:
    """Whether a saved skeleton node holds only sharded tensors that this rank did not load: per-rank sharded
    state (TorchRec's fused optimizer state of a table) that its old self kept and, after a re-plan, another
    rank holds (:func:`check_sharded` allowed it)."""
    if isinstance(saved, ShardedSlot):
        return name not in loaded
    if isinstance(saved, dict):
        return bool(saved) and all(held_elsewhere(v, _child(name, k), loaded) for k, v in saved.items())
    return False


def _only_sharded(live: Any) -> bool:
    if isinstance(live, ShardedSlot):
        return True
    return isinstance(live, dict) and bool(live) and all(_only_sharded(v) for v in live.values())


def reconcile_moved(saved: Any, live: Any, name: str, loaded: dict) -> Any:
    """A Stateful's saved skeleton with its per-rank sharded state where this rank holds it now: entries whose
    sharded tensors this rank did not load (:func:`held_elsewhere`) are left out, and entries of the live
    skeleton made only of sharded tensors that the saved one lacks (state this rank holds since a re-plan,
    loaded from another old rank's file) are put in. Unchanged when nothing moved."""
    if not (isinstance(saved, dict) and isinstance(live, dict)):
        return saved
    out = {}
    for k, v in saved.items():
        key = _child(name, k)
        if k in live:
            out[k] = reconcile_moved(v, live[k], key, loaded)
        elif not held_elsewhere(v, key, loaded):
            out[k] = v
    for k, v in live.items():
        if k not in saved and _only_sharded(v):
            out[k] = v
    return out


def find_saved(live: Any, saved: Any, out: dict) -> None:
    """Walks the live skeleton (with :class:`StatefulSlot` markers, from ``flatten_state(for_load=True)``)
    beside the saved one and maps ``id(slot)`` to the saved skeleton at the same place (absent: not saved)."""
    if isinstance(live, StatefulSlot):
        out[id(live)] = saved
    elif isinstance(live, dict):
        if isinstance(saved, dict):
            for k, v in live.items():
                if k in saved:
                    find_saved(v, saved[k], out)
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        for v, s in zip(live, saved):
            find_saved(v, s, out)


def live_sharded(skeleton: Any, out: dict) -> dict:
    """``key`` -> live ShardedTensor for every :class:`ShardedSlot` of a skeleton from ``flatten_state``."""
    if isinstance(skeleton, StatefulSlot):
        live_sharded(skeleton.skeleton, out)
    elif isinstance(skeleton, ShardedSlot):
        out[skeleton.key] = skeleton.live
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            live_sharded(v, out)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            live_sharded(v, out)
    return out


#: The most mismatches one error message describes; the rest are counted, so that a wrong model of 10^4
#: tensors gives a message a person reads rather than pages of keys.
MAX_NAMED = 10


def bounded(items: list, sep: str = "; ") -> str:
    """``items`` joined by ``sep``, the first :data:`MAX_NAMED` of them and then how many more there are."""
    shown = sep.join(items[:MAX_NAMED])
    return shown if len(items) <= MAX_NAMED else f"{shown}{sep}... and {len(items) - MAX_NAMED} more"


def _sharded_slots(skeleton: Any, name: str, out: dict) -> dict:
    """``name`` -> :class:`ShardedSlot` for every sharded tensor of a skeleton, named as :func:`flatten` names."""
    if isinstance(skeleton, StatefulSlot):
        _sharded_slots(skeleton.skeleton, name, out)
    elif isinstance(skeleton, ShardedSlot):
        out[name] = skeleton
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            _sharded_slots(v, f"{name}.{k}" if name else str(k), out)
    elif isinstance(skeleton, (list, tuple)) and type(skeleton) is not _Size:
        for i, v in enumerate(skeleton):
            _sharded_slots(v, f"{name}.{i}" if name else str(i), out)
    return out


def check_sharded(live: Any, saved: Any, world_changed: bool = False) -> None:
    """Compares every ShardedTensor and DTensor of the live skeleton (from ``flatten_state(for_load=True)``)
    with what the checkpoint holds at the same place on this rank, and every one of the checkpoint with the
    live state, before any tensor is copied. Raises :class:`InvalidArgumentError` naming each one whose global
    size or dtype differs, or that one side has where the other holds something else.

    Another layout (sharding plan, world size, mesh shape, placements) is not a mismatch: the C++ loader reads
    it by resharding whenever this rank's shards are not in its own file. Nor is a sharded tensor saved where
    the state holds a plain tensor (one rank's plain model, a data-parallel table: its pieces are read whole),
    or a plain tensor saved where the state holds a sharded one (a replica read as shards): the loader checks
    the global shape and dtype of those from the files (:func:`global_shapes`). So is, when the layout changed, a
    sharded tensor only one side has on this rank, where the sharded state itself is per rank: TorchRec's fused
    optimizer keeps a table's state only on the ranks that hold a shard of the table, so after a re-plan a rank
    may have state the checkpoint kept on another rank (read from that rank's file; the loader refuses a key no
    old rank saved) or lack state its old self kept (tolerated only when this rank holds no shard of the
    parameter it belongs to: another rank reads it). A saved sharded tensor without a place in the state is
    refused otherwise, as at the saved layout (a model without that table; optimizer state the first step
    would create, with a hint)."""
    wrong: list[str] = []
    lazy: list[str] = []  # keys of optimizer state the state lacks (created by an optimizer's first step)
    plain_lazy: list[str] = []  # the same, of an optimizer of plain parameters (ettkit creates none for it)
    in_plain_optimizer = [False]
    live_slots = _sharded_slots(live, "", {})
    saved_slots = _sharded_slots(saved, "", {})
    # Whether this rank's shards moved: then each side may hold per-rank sharded state the other lacks.
    moved = world_changed or live_slots.keys() != saved_slots.keys() or any(
        saved_slots[k].shards != x.shards for k, x in live_slots.items())
    shardless = [k for k, x in live_slots.items() if not x.shards]  # no shard of these on this rank now
    plain_names = [n for n in tensor_names(live) if n not in live_slots]

    def no_shard_here(param: Optional[str]) -> bool:
        return param is not None and any(k == param or k.endswith("." + param) for k in shardless)

    def what(s: Any) -> str:
        if isinstance(s, ShardedSlot):
            return s.describe()
        return "nothing" if s is None else ("a plain tensor" if s is TENSOR else f"a {type(s).__name__}")

    def saved_only(s: Any, name: str, live: Any = None, param: Optional[str] = None) -> None:
        # `live`: what the state holds where the checkpoint has `s` (None: nothing). `param`: the parameter
        # (an optimizer state's key) that `s` is the state of.
        if isinstance(s, ShardedSlot):
            if live is TENSOR:
                return  # saved sharded, wanted whole: read from every piece
            if live is None and moved and no_shard_here(param):
                return
            holds = "" if live is None else f": it holds {what(live)}"
            # (A torch optimizer keys its state by parameter index, which names no tensor: only a named key.)
            plain = live is None and param is not None and not param.isdigit() and next(
                (n for n in plain_names if n == param or n.endswith("." + param)), None)
            if plain:
                # A re-plan made its table data-parallel: a plain tensor whose optimizer is another one.
                holds = (f" (its parameter '{plain}' is a plain tensor in the state, e.g. a table now "
                         f"data-parallel, whose optimizer is not this one: load the model alone with partial=True, "
                         f"or this state by value into that optimizer's)")
            wrong.append(f"'{name}': the checkpoint holds {s.describe()}; the state has no {s.kind} there{holds}")
            if live is None and ".state." in name and not plain:
                (plain_lazy if in_plain_optimizer[0] else lazy).append(name)
        elif isinstance(s, dict):
            for k, v in s.items():
                saved_only(v, f"{name}.{k}" if name else str(k), param=param)
        elif isinstance(s, (list, tuple)):
            for i, v in enumerate(s):
                saved_only(v, f"{name}.{i}" if name else str(i), param=param)

    def walk(x: Any, s: Any, name: str, param: Optional[str] = None) -> None:
        if isinstance(x, StatefulSlot):
            outer = in_plain_optimizer[0]
            in_plain_optimizer[0] = _is_plain_optimizer(x.obj)
            try:
                walk(x.skeleton, s, name)
            finally:
                in_plain_optimizer[0] = outer
        elif isinstance(x, ShardedSlot):
            if s is None and moved:
                return  # per-rank state this rank now holds: read from the old rank that saved it
            if s is TENSOR:
                return  # saved whole, wanted sharded: a replica's box, its global shape checked by the loader
            if not isinstance(s, ShardedSlot) or (s.size, s.dtype) != (x.size, x.dtype):
                wrong.append(f"'{name}': the checkpoint holds {what(s)}; the state holds {x.describe()}")
        elif isinstance(x, dict):
            sd = s if isinstance(s, dict) else {}
            # An optimizer's "state" is keyed by parameter: what lies below is that parameter's state.
            keyed_by_param = name == "state" or name.endswith(".state")
            for k, v in x.items():
                walk(v, sd.get(k), f"{name}.{k}" if name else str(k), str(k) if keyed_by_param else param)
            for k, v in sd.items():
                if k not in x:
                    saved_only(v, f"{name}.{k}" if name else str(k), param=str(k) if keyed_by_param else param)
        elif isinstance(x, (list, tuple)):
            ss = list(s) if isinstance(s, (list, tuple)) else []
            for i, v in enumerate(x):
                walk(v, ss[i] if i < len(ss) else None, f"{name}.{i}" if name else str(i), param)
        else:
            saved_only(s, name, x, param)

    walk(live, saved, "")
    if wrong:
        hint = ""
        if lazy:
            hint = (" (optimizer state that the state lacks is created by the optimizer's first step(); ettkit "
                    "creates it before a load for Adam, AdamW, RMSprop and SGD with dampening=0, "
                    "docs/checkpoint.md, 'FSDP2')")
        if plain_lazy:
            hint += (f" ({bounded([repr(n) for n in plain_lazy], ', ')}: the step holds this state sharded and the "
                     "optimizer, of plain parameters, has none yet to read it into; ettkit creates first-step "
                     "state only for optimizers of DTensor or ShardedTensor parameters. Take one optimizer step "
                     "before the load (the load replaces its state and the parameters), or load the model alone "
                     "with partial=True)")
        raise InvalidArgumentError(
            "sharded tensors do not match the checkpoint (another global size or dtype, or a sharded tensor "
            "only one side has; a layout alone, such as another sharding plan, mesh or world size, is "
            "resharded): " + bounded(wrong) + hint)


def _is_plain_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is a torch optimizer none of whose parameters is a DTensor or ShardedTensor."""
    if not isinstance(obj, _Optimizer):
        return False
    return all(owns_storage(p) for g in obj.param_groups for p in g["params"])


def global_shapes(live: Any) -> dict:
    """``key`` -> the global size of every sharded tensor of a live skeleton (from ``flatten_state``): what the
    loader checks a tensor saved whole against before reading this rank's shards of it from that copy."""
    return {slot.key: list(slot.size) for slot in _sharded_slots(live, "", {}).values()}


def rebuild_named(skeleton: Any, prefix: str, tensors: dict) -> Any:
    """The skeleton with each TENSOR placeholder replaced by ``tensors[name]``, names made as
    :func:`flatten` makes them under ``prefix``."""

    def build(x: Any, name: str) -> Any:
        if x is TENSOR:
            return tensors[name]
        if isinstance(x, ShardedSlot):
            # The live ShardedTensor, its shards already loaded in place (the load put it under its key).
            if name not in tensors:
                raise InvalidArgumentError(
                    f"the checkpoint has a {x.kind} at '{name}' ({x.describe()}); the state being "
                    f"loaded has no {x.kind} there to load it into")
            return tensors[name]
        if isinstance(x, dict):
            return {k: build(v, f"{name}.{k}" if name else str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and type(x) is not _Size:  # a torch.Size is a value: kept as it is
            items = [build(v, f"{name}.{i}" if name else str(i)) for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x

    return build(skeleton, prefix)


def rebuild(skeleton: Any, tensors: list) -> Any:
    """The skeleton with its TENSOR placeholders replaced by ``tensors``, in flatten order."""
    it = iter(tensors)

    def build(x: Any) -> Any:
        if x is TENSOR:
            return next(it)
        if isinstance(x, ShardedSlot):
            return _sharded_like(x.live, [next(it) for _ in x.shards])
        if isinstance(x, DTensorSlot):
            return _dtensor_like(x.live, next(it))
        if isinstance(x, dict):
            return {k: build(v) for k, v in x.items()}
        if isinstance(x, list):
            return [build(v) for v in x]
        if isinstance(x, tuple):
            return tuple(build(v) for v in x)
        return x

    return build(skeleton)


def _sharded_like(live: Any, tensors: list) -> Any:
    """A ShardedTensor with ``live``'s global metadata whose local shards are ``tensors`` (staged host
    copies): the placements' devices become the copies' (DCP reads offsets and sizes; a placement naming a
    GPU would not validate against a host tensor). Built locally: no collective."""
    import copy

    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.remote_device import _remote_device

    md = copy.deepcopy(live.metadata())
    md.tensor_properties.requires_grad = False  # a snapshot, also of a Parameter (nn.Parameter(sharded))
    device = tensors[0].device if tensors else torch.device("cpu")
    for m in md.shards_metadata:
        if m.placement is not None:
            m.placement = _remote_device(f"rank:{m.placement.rank()}/{device}")
    local = []
    for t, shard in zip(tensors, live.local_shards()):
        m = copy.deepcopy(shard.metadata)
        if m.placement is not None:
            m.placement = _remote_device(f"rank:{m.placement.rank()}/{t.device}")
        local.append(Shard(t, m))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=live._process_group)


def _dtensor_like(live: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``live``'s spec (mesh, placements, global shape) around the staged ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, live._spec, requires_grad=False)


def prune_to_live(saved: Any, live: Any, name: str = "") -> Any:
    """The saved skeleton without the dict entries the live state has no place for (a partial load:
    ``load_latest(state, partial=True)``, e.g. a model without its optimizer). Only whole dict entries are
    left out; below a Stateful, a list or a tuple the saved skeleton is kept as it is (and checked as in a
    full load)."""
    if isinstance(saved, dict) and isinstance(live, dict):
        return {k: prune_to_live(v, live[k], _child(name, k)) for k, v in saved.items() if k in live}
    return saved


def unplaced_tensors(saved: Any, live: Any, names: list, read_prefixes: list) -> list:
    """The tensors of a (pruned) saved skeleton that a load would leave unread: neither a live tensor's name
    (``names``), nor a live sharded tensor's key, nor under a read prefix. A partial load refuses them."""
    have = set(names) | set(_sharded_slots(live, "", {}))

    def covered(n: str) -> bool:
        return n in have or any(not p or n == p or n.startswith(p + ".") for p in read_prefixes)

    return [n for n in tensor_names(saved) if not covered(n)]


def tensor_names(skeleton: Any, name: str = "", out: Optional[list] = None) -> list:
    """The names of the tensors a skeleton holds (a sharded tensor by its key)."""
    out = [] if out is None else out
    if skeleton is TENSOR or isinstance(skeleton, ShardedSlot):
        out.append(name)
    elif isinstance(skeleton, StatefulSlot):
        tensor_names(skeleton.skeleton, name, out)
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            tensor_names(v, _child(name, k), out)
    elif isinstance(skeleton, (list, tuple)) and type(skeleton) is not torch.Size:
        for i, v in enumerate(skeleton):
            tensor_names(v, _child(name, i), out)
    return out

