"""The save walk: a nested state becomes (names, tensors) plus a skeleton, on the training loop's critical path.

The skeleton is the state dict with every tensor replaced by the :data:`TENSOR` placeholder; tensors
appear in the skeleton in the same order as in ``names``/``tensors`` (dict insertion order, then list
order), so a rebuild needs no names. This walk runs inside ``save()`` - on the training loop's critical
path - once per tensor: it does the least per tensor it can (no ``detach()``, no per-tensor objects in the
skeleton; the C++ stager reads the tensors' storage without autograd). It is the one walk not written on
:mod:`._skeleton_walk`, hand-inlined for speed; issue #65 binds it into C++. What the values are is
:mod:`._tensor_kinds`'s; the load's walks are in _restore.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError
from ._captured_optimizer import refresh_captured
from ._tensor_kinds import (
    MAX_LEAF_BYTES,
    SAVE_VALID,
    TENSOR,
    VALUE_TYPES,
    DTensorSlot,
    ShardedSlot,
    StatefulSlot,
    describe_key,
    dtensor_type,
    is_local_shards_wrapper,
    is_stateful,
    owns_storage,
    reject,
    shard_name,
    sharded_tensor_type,
    state_dict_of,
)
from .data_position import handed_out_by

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_Size = torch.Size
_Optimizer = torch.optim.Optimizer


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
    if is_local_shards_wrapper(local):
        if mesh.ndim != 1 or not placements[0].is_shard():
            raise InvalidArgumentError(
                f"state dict entry '{key}' is a DTensor of local shards (LocalShardsWrapper) with placements "
                f"{list(placements)} on a {mesh.ndim}-D mesh; ettkit saves those with Shard(d) on a 1-D mesh")
        shards = []
        for t, off in zip(local.local_shards(), local.local_offsets()):
            if not owns_storage(t):
                reject(t, key, "is a DTensor whose local shard is")
            offsets = tuple(int(o) for o in off)
            add_name(shard_name(key, offsets))
            add_tensor(t)
            shards.append((offsets, tuple(int(s) for s in t.shape), text))
        return ShardedSlot(size, obj.dtype, tuple(shards), key, obj)
    if not owns_storage(local):
        reject(local, key, "is a DTensor whose local tensor is")
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
    st = sharded_tensor_type()
    if st is None or not isinstance(obj, st):
        dt = dtensor_type()
        if dt is None or not isinstance(obj, dt):
            if not owns_storage(obj):
                reject(obj, key)
            add_name(key)
            add_tensor(obj)
            return TENSOR
        if strict:
            return _dtensor_slot(obj, key, add_name, add_tensor)
        local = obj._local_tensor
        if not owns_storage(local):
            reject(local, key, "is a DTensor whose local tensor is")
        add_name(key)
        add_tensor(local)
        return DTensorSlot(obj)
    md = obj.metadata()
    shards = []
    for shard in obj.local_shards():
        t, m = shard.tensor, shard.metadata
        if not owns_storage(t):
            reject(t, key, "is a ShardedTensor whose local shard is")
        offsets = tuple(int(o) for o in m.shard_offsets)
        add_name(shard_name(key, offsets))
        add_tensor(t)
        shards.append((offsets, tuple(int(s) for s in m.shard_sizes),
                       None if m.placement is None else str(m.placement)))
    return ShardedSlot(tuple(int(s) for s in md.size), md.tensor_properties.dtype, tuple(shards), key, obj)



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


class _SaveWalk:
    """One walk of a state for :func:`flatten`/:func:`flatten_state`: the names and tensors found, in order,
    the leaves the skeleton encoder must judge (``opaque``) and the Statefuls met (``found``)."""

    __slots__ = ("names", "tensors", "add_name", "add_tensor", "opaque", "found", "fresh", "inside", "strict",
                 "find_optimizer", "slots")

    def __init__(self, strict: bool, find_optimizer: Any, slots: bool):
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.add_name, self.add_tensor = self.names.append, self.tensors.append
        self.opaque: list = []
        self.found: list[StatefulSlot] = []
        self.fresh: set = set()  # ids of the state dicts taken here: an optimizer's own is not a captured one
        self.inside = 0  # > 0 while walking a state dict taken here (a Stateful's own copies are current)
        self.strict, self.find_optimizer, self.slots = strict, find_optimizer, slots

    def stateful(self, obj: Any, captured: Any, prefix: str) -> Any:
        if isinstance(obj, _Optimizer):
            # An optimizer of DTensor/ShardedTensor parameters gets the state its first step() would create,
            # so that a save holds it whole and a load has tensors of each parameter's layout to load into.
            from ._optim_state import create_first_step_state

            create_first_step_state(obj)
        state = state_dict_of(obj)
        self.fresh.add(id(state))
        self.inside += 1
        try:
            skeleton = self.node(state, prefix)
        finally:
            self.inside -= 1
        if captured is not None:
            refresh_captured(captured, state)
        slot = StatefulSlot(prefix, obj, captured, state, skeleton)
        self.found.append(slot)
        return slot if self.slots else skeleton

    def node(self, obj: Any, prefix: str) -> Any:
        # Containers: one loop over (key, value) for dicts, lists and tuples; tensor children are handled
        # inline rather than by recursion, since this runs once per tensor on the save path. A torch.Size
        # is a value (a tuple of ints the skeleton keeps as it is).
        is_dict = isinstance(obj, dict)
        if is_dict or (isinstance(obj, (list, tuple)) and type(obj) is not _Size):
            if is_dict:
                found = self.dict_of_object(obj, prefix)
                if found is not None:
                    return found
            add_name, add_tensor, strict = self.add_name, self.add_tensor, self.strict
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
                    out[k] = self.node(v, key)
            if is_dict:
                return out
            return list(out.values()) if isinstance(obj, list) else tuple(out.values())
        if isinstance(obj, _Tensor):
            if type(obj) is not _Tensor and type(obj) is not _Parameter:
                return _special(obj, prefix, self.strict, self.add_name, self.add_tensor)
            self.add_name(prefix)
            self.add_tensor(obj)
            return TENSOR
        return self.leaf(obj, prefix)

    def dict_of_object(self, obj: dict, prefix: str) -> Any:
        """The skeleton of a dict that stands for an object: a copied state dict is refused, one captured from
        an attached optimizer is walked as that optimizer. None for a plain dict."""
        if self.strict and not self.inside and (
                _COPY_MARKS.intersection(obj)
                or (len(obj) == 2 and "batches" in obj and handed_out_by(obj) is not None)):
            refuse_copied_state_dict(obj, prefix)
        if self.find_optimizer is not None and "param_groups" in obj and id(obj) not in self.fresh:
            opt = self.find_optimizer(obj, prefix)
            if opt is not None:
                return self.stateful(opt, obj, prefix)
        return None

    def leaf(self, obj: Any, prefix: str) -> Any:
        t = type(obj)
        if t in VALUE_TYPES:
            if self.strict and (t is str or t is bytes) and len(obj) > MAX_LEAF_BYTES:
                raise InvalidArgumentError(f"{describe_key(prefix)} is a {t.__name__} of {len(obj)} "
                                           f"characters/bytes, more than {MAX_LEAF_BYTES}; {SAVE_VALID}")
            return obj
        if self.strict and is_stateful(obj):
            return self.stateful(obj, None, prefix)
        # Leaves that are none of these are the skeleton encoder's to refuse, or to pickle under
        # allow_pickle=True (_skeleton_codec.py); they make the skeleton one that `==` cannot compare.
        self.opaque.append((prefix, obj))
        return obj


def _walk(state_dict: Any, strict: bool, find_optimizer: Any, slots: bool):
    w = _SaveWalk(strict, find_optimizer, slots)
    skeleton = w.node(state_dict, "")
    return w.names, w.tensors, skeleton, not w.opaque, w.found


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
        f"{describe_key(prefix)} is {what}'s state_dict(), a copy taken when it was called: a save would store the "
        f"{noun} as it was then (not as it is at the save), and load_latest could restore only the copy, not the "
        f"{noun}. Pass the {noun} object itself, not its state_dict(): {{'{key}': {noun}}} (saved and restored "
        f"through its state_dict()/load_state_dict(); the files are the same)")


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
