"""Moving plans between ranks: :func:`broadcast_plan`, :func:`check_consistent`, and the all-gather baseline.

ettkit's way: rank ``src`` encodes the compact plan and sends it in one byte-tensor broadcast over a c10d
process group (gloo: a CPU tensor, NCCL: a CUDA tensor); every rank decodes it and builds the global
metadata locally. A plan larger than ``first_chunk_bytes`` (64 KiB by default: about 5,000 tables at ~13
bytes each) takes a second broadcast for the rest, because receivers learn the size from the header of the
first.

The baseline (:func:`allgather_baseline`) is what TorchRec did before Nov 2024 and what
``ShardedTensor._init_from_local_shards`` still does: broadcast the pickled, fully expanded plan, then for
every table all-gather each rank's local shard metadata and assemble it with torch's own
``build_global_metadata``. It exists for the tests and the benchmark.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _C
from ..errors import CorruptDataError, InvalidArgumentError
from ..ett import recorder as _ett
from .metadata import ETT_PHASE, GlobalMetadata
from .plan import ShardingPlan, decode, encode
from .reference import expand_table

__all__ = [
    "DEFAULT_FIRST_CHUNK_BYTES",
    "allgather_baseline",
    "allgather_metadata",
    "broadcast_plan",
    "check_consistent",
    "torchrec_style_plan",
]

#: Bytes sent by the first (usually only) broadcast of :func:`broadcast_plan`.
DEFAULT_FIRST_CHUNK_BYTES = 64 * 1024
# Sent instead of a plan when the source rank has none, so the other ranks fail instead of waiting forever.
_ABORT = b"ETAB"


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            "this needs an initialized default process group; call torch.distributed.init_process_group first"
        )
    return dist


def _device(dist, group) -> torch.device:
    """gloo moves CPU tensors, NCCL moves CUDA tensors; a mixed backend string prefers gloo for bytes."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _byte_tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def broadcast_plan(
    plan: ShardingPlan | None,
    group: Any = None,
    src: int = 0,
    *,
    verify: bool = False,
    first_chunk_bytes: int = DEFAULT_FIRST_CHUNK_BYTES,
) -> ShardingPlan:
    """Sends ``plan`` from global rank ``src`` to every rank of ``group``; returns the plan on every rank.

    Other ranks pass ``None``. One broadcast of a byte tensor carries the encoded plan (a second one the
    rest of a plan larger than ``first_chunk_bytes``). ``verify=True`` adds an 8-byte hash check across
    ranks (:func:`check_consistent`). If ``src`` has no plan, every rank raises
    :class:`~ettkit.InvalidArgumentError`; damaged bytes raise :class:`~ettkit.CorruptDataError`.
    Recorded as ETT phase ``launcher_init/sharding``.
    """
    dist = _dist()
    rank = dist.get_rank()
    device = _device(dist, group)
    cap = max(int(first_chunk_bytes), _C.sharding.HEADER_BYTES)
    with _ett.phase(ETT_PHASE):
        if rank == src:
            if not isinstance(plan, ShardingPlan):
                dist.broadcast(_byte_tensor(_ABORT, cap, device), src=src, group=group)
                raise InvalidArgumentError(
                    f"broadcast_plan: rank {src} is the source but was given {type(plan).__name__}, not a ShardingPlan"
                )
            data = encode(plan)
            dist.broadcast(_byte_tensor(data[:cap], cap, device), src=src, group=group)
            if len(data) > cap:
                dist.broadcast(_byte_tensor(data[cap:], len(data) - cap, device), src=src, group=group)
            result = plan
        else:
            first = torch.empty(cap, dtype=torch.uint8, device=device)
            dist.broadcast(first, src=src, group=group)
            head = _bytes_of(first)
            if head[:4] == _ABORT:
                raise InvalidArgumentError(
                    f"broadcast_plan: the source rank {src} had no ShardingPlan to send"
                )
            total = _C.sharding.encoded_size(head[: _C.sharding.HEADER_BYTES])
            if total > cap:
                rest = torch.empty(total - cap, dtype=torch.uint8, device=device)
                dist.broadcast(rest, src=src, group=group)
                data = head + _bytes_of(rest)
            else:
                data = head[:total]
            result = decode(data)
        if verify:
            check_consistent(result, group)
    return result


def check_consistent(obj: ShardingPlan | GlobalMetadata, group: Any = None) -> int:
    """Checks that every rank of ``group`` holds the same plan (or metadata) with one 16-byte all-reduce.

    Returns the 8-byte hash; raises :class:`~ettkit.CorruptDataError` on every rank when they differ (e.g.
    ranks that built their plans from different configs, TorchRec's dtype bug). Costs O(1) communication
    instead of gathering the metadata.
    """
    if not isinstance(obj, (ShardingPlan, GlobalMetadata)):
        raise InvalidArgumentError(
            f"check_consistent takes a ShardingPlan or GlobalMetadata, got {type(obj).__name__}"
        )
    dist = _dist()
    h = obj.hash()
    signed = h - (1 << 64) if h >= (1 << 63) else h
    # MAX over (h, ~h) gives the largest hash and, through ~, the smallest: equal iff all ranks agree.
    t = torch.tensor([signed, ~signed], dtype=torch.int64, device=_device(dist, group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(t[0]), ~int(t[1])
    if hi != lo:
        what = "plan" if isinstance(obj, ShardingPlan) else "shard metadata"
        raise CorruptDataError(
            f"the {what} differs across ranks: hashes range from {lo & (2**64 - 1):#018x} to {hi & (2**64 - 1):#018x} "
            f"(this rank: {h:#018x}); every rank must build from the same plan (broadcast_plan) and the same ettkit"
        )
    return h


# ---- the baseline: the old way -------------------------------------------------------------------------------


def torchrec_style_plan(plan: ShardingPlan) -> dict[str, dict]:
    """The fully expanded plan a TorchRec planner hands out (what ``collective_plan`` pickles and broadcasts).

    table name -> ``{"sharding_type", "ranks", "size", "dtype", "shards"}`` with ``shards`` a list of
    ``torch.distributed._shard.metadata.ShardMetadata`` (``None`` for data_parallel, which has no spec).
    Expanded with :mod:`ettkit.sharding.reference`, independently of the C++ builder.
    """
    from torch.distributed._shard.metadata import ShardMetadata

    out = {}
    L = plan.ranks_per_host
    for t in plan.tables:
        shards = expand_table(t, plan.world_size, L)
        specs = None
        if t.sharding_type != "data_parallel":
            specs = [
                ShardMetadata(
                    [ro, co],
                    [r, c],
                    f"rank:{rank}/cuda:{rank % L}" if plan.device == "cuda" else f"rank:{rank}/cpu",
                )
                for ro, co, r, c, rank in shards
            ]
        out[t.name] = {
            "sharding_type": t.sharding_type,
            "ranks": [s[4] for s in shards],
            "size": (t.rows, t.cols),
            "dtype": t.torch_dtype,
            "shards": specs,
        }
    return out


def allgather_metadata(expanded: dict[str, dict], group: Any = None) -> dict:
    """Assembles every sharded table's ``ShardedTensorMetadata`` the way ``_init_from_local_shards`` does.

    For each table (serially, as TorchRec did): this rank's local shard metadata is all-gathered with
    ``all_gather_object`` and merged in rank order by torch's ``build_global_metadata`` (which checks
    sizes, dtypes, overlap and volume). data_parallel tables have no sharded tensor and are skipped.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharded_tensor.utils import build_global_metadata

    dist = _dist()
    rank = dist.get_rank()
    world = dist.get_world_size(group)
    out = {}
    for name, p in expanded.items():
        if p["shards"] is None:
            continue
        local = [s for s in p["shards"] if s.placement.rank() == rank]
        local_md = None
        if local:
            # dtype from the table config, as TorchRec's reland does (not from a local tensor).
            local_md = ShardedTensorMetadata(local, torch.Size(p["size"]), TensorProperties(dtype=p["dtype"]))
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local_md, group=group)
        out[name] = build_global_metadata(gathered)
    return out


def allgather_baseline(expanded: dict[str, dict] | None, group: Any = None, src: int = 0) -> dict:
    """The old way end to end: ``broadcast_object_list`` of the expanded plan, then :func:`allgather_metadata`."""
    dist = _dist()
    holder = [expanded]
    dist.broadcast_object_list(holder, src=src, group=group)
    return allgather_metadata(holder[0], group)
