"""DCP integration: ``DcpStager``, an ``AsyncStager`` backed by ettkit's arena and copy engine. Imported
lazily by ``ettkit.checkpoint`` (``torch.distributed.checkpoint`` is slow to import)."""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

import torch

from .. import _C
from ._flatten import check_unique, flatten
from ._skeleton_walk import rebuild as _walk_rebuild
from ._tensor_kinds import TENSOR, DTensorSlot, ShardedSlot


def _async_stager_base():
    try:
        from torch.distributed.checkpoint.staging import AsyncStager

        return AsyncStager
    except Exception:  # torch without distributed
        return object


class DcpStager(_async_stager_base()):
    """DCP ``AsyncStager`` backed by ettkit's arena and copy engine::

        fut = dcp.async_save(sd, checkpoint_id=path, async_stager=DcpStager())

    ``stage`` copies every plain tensor into a reused (pinned when CUDA is available) host arena - CPU
    tensors by parallel threads, CUDA tensors stream-ordered - and returns the state dict of arena views
    that DCP then writes in the background. The arena is reused by the next ``stage``: as with every DCP
    async save, wait for the previous save's future before the next ``async_save`` (or pass
    ``double_buffer=True`` to alternate two arenas, allowing one save in flight while the next stages).
    ShardedTensor and DTensor values are staged too (FSDP2's parameters and their optimizer state
    included): their local shards (local tensor) are copied and handed to DCP wrapped in the same global
    metadata (mesh and placements), built locally without a collective. Any other ``__torch_dispatch__``
    wrapper is refused naming its key and type. Non-tensor values pass through unchanged.

    The stager may be created inline, as above, and dropped once ``async_save`` returns: every staged
    tensor keeps its arena (and the copy engine that owns it) alive until DCP's background write has let
    go of it. Held in a variable and reused, it recycles its arena as said above.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, *, memory_budget_bytes: Optional[int] = None, double_buffer: bool = False,
                 copy_threads: int = 0):
        self._stager = _C.checkpoint.Stager(memory_budget_bytes=int(memory_budget_bytes or 0),
                                            num_arenas=2 if double_buffer else 1, copy_threads=int(copy_threads))
        self._held: deque = deque()
        self._keep = 2 if double_buffer else 1

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict, **kwargs):
        names, tensors, skeleton, _ = flatten(state_dict)
        check_unique(names)
        # The arena `_keep` saves ago is free again (its async_save must have completed).
        while len(self._held) >= self._keep:
            self._held.popleft().release()
        snap = self._stager.stage(names, tensors, "wait")
        snap.wait_staged()
        self._held.append(snap)
        # The views hold `snap`, and `snap` this stager's C++ Stager (bind_checkpoint.cpp, snapshot_views):
        # DCP's background write may outlive this object.
        return rebuild(skeleton, [t for _, t in snap.tensors()])

    def synchronize_staging(self) -> None:
        """Staging is complete when ``stage`` returns."""

    def close(self) -> None:
        while self._held:
            self._held.popleft().release()

    arena_bytes = property(lambda self: self._stager.arena_bytes)
    arena_allocations = property(lambda self: self._stager.arena_allocations)
    pinned = property(lambda self: self._stager.pinned)


# ---- rebuilding the staged state for DCP ----------------------------------------------------------------
def rebuild(skeleton: Any, tensors: list) -> Any:
    """The skeleton with its TENSOR placeholders replaced by ``tensors``, in flatten order (the one
    traversal, _skeleton_walk.rebuild, visits leaves in that order)."""
    it = iter(tensors)

    def leaf(x: Any, _name: str) -> Any:
        if x is TENSOR:
            return next(it)
        if isinstance(x, ShardedSlot):
            return _sharded_like(x.live, [next(it) for _ in x.shards])
        if isinstance(x, DTensorSlot):
            return _dtensor_like(x.live, next(it))
        return x  # a torch.Size, a Stateful's slot or a value, kept as it is

    return _walk_rebuild(skeleton, leaf)


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
