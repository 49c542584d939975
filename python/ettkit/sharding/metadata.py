"""Global shard metadata built locally from a plan, and its views in PyTorch's types.

:func:`build_global_metadata` is one C++ call (GIL released); shards become Python objects only for the
tables you look at. Views: ``torch.distributed._shard`` :class:`ShardedTensorMetadata` (for
``ShardedTensor._init_from_local_shards_and_global_metadata``), DCP :class:`ChunkStorageMetadata` /
:class:`TensorStorageMetadata`, and TorchRec's plan JSON (:mod:`ettkit.sharding.torchrec_interop`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from .. import _C
from ..errors import InvalidArgumentError
from ..ett import recorder as _ett
from .plan import ShardingPlan, Table

__all__ = [
    "DEFAULT_MAX_SHARDS",
    "GlobalMetadata",
    "LocalShard",
    "Shard",
    "TableMetadata",
    "build_global_metadata",
]

#: Default ``max_shards`` of :func:`build_global_metadata`: 4,194,304 shards (about 200 MB of metadata).
DEFAULT_MAX_SHARDS: int = _C.sharding.DEFAULT_MAX_SHARDS

#: The ETT phase the sharding work is recorded under (a launcher_init sub-stage).
ETT_PHASE = "launcher_init/sharding"


class _TorchTypes(NamedTuple):
    shard: type  # torch.distributed._shard.metadata.ShardMetadata
    sharded: type  # ShardedTensorMetadata
    properties: type  # sharded_tensor's TensorProperties
    setters: tuple  # its three slot descriptors: shard_offsets, shard_sizes, placement
    fast: bool  # the class has exactly those slots, so objects can be made without its __init__


@functools.cache
def _torch_types() -> _TorchTypes:
    # Once per process (torch's classes do not change while it runs); imported lazily because
    # torch.distributed is not needed to build metadata.
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata, TensorProperties

    names = ("shard_offsets", "shard_sizes", "placement")
    slots = tuple(getattr(ShardMetadata, "__slots__", ()))
    fast = slots == names and all(
        type(ShardMetadata.__dict__.get(n)).__name__ == "member_descriptor" for n in names)
    setters = tuple(ShardMetadata.__dict__[n] for n in names) if fast else ()
    return _TorchTypes(ShardMetadata, ShardedTensorMetadata, TensorProperties, setters, fast)


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while a block makes many objects that cannot form cycles.

    Every 700 new container objects start a collection, and the full ones walk every object of the process
    (torch, TorchRec): making the ShardMetadata of 148,786 shards took 1.08 s with collections and 0.06 s
    without (docs/benchmarks.md). The objects made here hold ints, torch.Size and shared placements only.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Shard(NamedTuple):
    """One shard: rows ``[offsets[0], offsets[0] + sizes[0])`` x cols ``[offsets[1], ...)`` on ``rank``."""

    offsets: tuple[int, int]
    sizes: tuple[int, int]
    rank: int
    placement: str

    @property
    def numel(self) -> int:
        return self.sizes[0] * self.sizes[1]


class LocalShard(NamedTuple):
    """A shard held by one rank: its table, its index in ``tables[table].shards`` and the shard."""

    table: str
    index: int
    shard: Shard


def _placement(rank: int, device: str, ranks_per_host: int) -> str:
    # TorchRec's placement(): the local device index is rank % local_world_size (same rule as the C++
    # GlobalMetadata::placement, which the C++ tests pin).
    return f"rank:{rank}/cuda:{rank % ranks_per_host}" if device == "cuda" else f"rank:{rank}/cpu"


class TableMetadata:
    """The global metadata of one table: shape, dtype, sharding type and every shard in TorchRec's plan order."""

    __slots__ = ("shards", "table")

    def __init__(self, table: Table, shards: list[Shard]):
        self.table = table
        self.shards = shards

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def size(self) -> torch.Size:
        return torch.Size([self.table.rows, self.table.cols])

    @property
    def dtype(self) -> torch.dtype:
        return self.table.torch_dtype

    @property
    def sharding_type(self) -> str:
        return self.table.sharding_type

    def __repr__(self) -> str:
        return (
            f"TableMetadata({self.name!r}, {self.table.rows}x{self.table.cols}, {self.table.dtype}, "
            f"{self.sharding_type}, {len(self.shards)} shards)"
        )


class _Tables(Mapping):
    """name -> TableMetadata, built per table on first access and cached."""

    def __init__(self, md: GlobalMetadata):
        self._md = md
        self._cache: dict[int, TableMetadata] = {}

    def _at(self, index: int) -> TableMetadata:
        cached = self._cache.get(index)
        if cached is None:
            plan = self._md.plan
            device, per_host = plan.device, plan.ranks_per_host
            shards = [
                Shard((ro, co), (r, c), rank, _placement(rank, device, per_host))
                for ro, co, r, c, rank in self._md._c.shards(index)
            ]
            cached = self._cache[index] = TableMetadata(plan._table_at(index), shards)
        return cached

    def __getitem__(self, name: str) -> TableMetadata:
        index = self._md.plan._c.find(name)
        if index is None:
            raise KeyError(name)
        return self._at(index)

    def __iter__(self) -> Iterator[str]:
        return iter(self._md.names)

    def __len__(self) -> int:
        return len(self._md.plan)


class GlobalMetadata:
    """Every table's shards and a per-rank index, built locally (no communication) from a plan.

    Equal plans give equal metadata on every rank (``hash()`` is the same 8-byte fingerprint). Immutable;
    owns its C++ arrays and shares the plan.
    """

    __slots__ = ("_c", "_devices", "_names", "_table_info", "plan", "tables")

    def __init__(self, plan: ShardingPlan, c_metadata: _C.sharding.Metadata):
        self.plan = plan
        self._c = c_metadata
        self._names: list[str] | None = None
        self._devices: dict[int, object] = {}  # rank -> torch _remote_device (parsed once, on first use)
        self._table_info: list | None = None
        self.tables: Mapping[str, TableMetadata] = _Tables(self)

    @property
    def names(self) -> list[str]:
        """Table names in plan order (cached)."""
        if self._names is None:
            self._names = self.plan.names
        return self._names

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def total_shards(self) -> int:
        return self._c.total_shards

    @property
    def warnings(self) -> list[str]:
        """Compat-mode notes about TorchRec sharp edges that were reproduced (empty in strict mode)."""
        return list(self._c.warnings)

    def hash(self) -> int:
        """XXH3-64 of the canonical metadata; equal on ranks that built the same metadata."""
        return self._c.hash()

    def local_shards(self, rank: int) -> list[LocalShard]:
        """The shards held by ``rank``, ordered by table (plan order), then by position in the table."""
        plan = self.plan
        names = self.names
        placement = _placement(rank, plan.device, plan.ranks_per_host)
        return [
            LocalShard(names[t], i, Shard((ro, co), (r, c), rank, placement))
            for t, i, ro, co, r, c in self._c.local_shards(rank)
        ]

    # ---- views in PyTorch's metadata types -----------------------------------------------------------------

    def _sharded(self, name: str) -> TableMetadata:
        md = self.tables[name]
        if md.sharding_type == "data_parallel":
            raise InvalidArgumentError(
                f"table '{name}' is data_parallel: it is replicated, not sharded, so it has no sharded-tensor "
                "metadata (TorchRec keeps such tables as plain tensors under DDP)"
            )
        return md

    def _placement_of(self, rank: int):
        """torch ``_remote_device`` of ``rank``. Parsed once per rank and metadata, and only for ranks that hold
        a shard (a plan's world may have 2^20 ranks): a ``_remote_device`` is never modified, so every shard
        of a rank shares one (``_devices``, filled here and by the C++ path)."""
        device = self._devices.get(rank)
        if device is None:
            from torch.distributed import _remote_device

            plan = self.plan
            device = self._devices[rank] = _remote_device(_placement(rank, plan.device, plan.ranks_per_host))
        return device

    def _torch_shards(self, index: int) -> list:
        types = _torch_types()
        if types.fast:
            return self._c.torch_shard_metadata(index, types.shard, self._devices, self._placement_of, *types.setters)
        # A torch whose ShardMetadata has other fields than the three the fast path sets: its constructor.
        return [types.shard([ro, co], [r, c], self._placement_of(rank)) for ro, co, r, c, rank in self._c.shards(index)]

    def _sharded_index(self, name: str) -> int:
        index = self.plan._c.find(name)
        if index is None:
            raise KeyError(name)
        if self._info()[index][4] == "data_parallel":
            raise InvalidArgumentError(
                f"table '{name}' is data_parallel: it is replicated, not sharded, so it has no sharded-tensor "
                "metadata (TorchRec keeps such tables as plain tensors under DDP)"
            )
        return index

    def _info(self) -> list:
        # (name, rows, cols, dtype name, sharding type) per table, fetched from C++ in one call.
        if self._table_info is None:
            self._table_info = self._c.table_info()
        return self._table_info

    def to_shard_metadata(self, name: str) -> list:
        """``torch.distributed._shard.metadata.ShardMetadata`` of every shard of ``name``, in plan order.

        Each call returns new objects (their offset and size lists are the caller's); shards of one rank
        share that rank's ``placement`` object.
        """
        index = self._sharded_index(name)
        with _gc_paused():
            return self._torch_shards(index)

    def _sharded_tensor_metadata(self, index: int, requires_grad: bool):
        types = _torch_types()
        _, rows, cols, dtype, _ = self._info()[index]
        return types.sharded(
            shards_metadata=self._torch_shards(index),
            size=torch.Size([rows, cols]),
            tensor_properties=types.properties(
                dtype=getattr(torch, dtype),
                layout=torch.strided,
                requires_grad=requires_grad,
                memory_format=torch.contiguous_format,
                pin_memory=False,
            ),
        )

    def to_sharded_tensor_metadata(self, name: str, requires_grad: bool = False):
        """``ShardedTensorMetadata`` of table ``name`` for ``ShardedTensor._init_from_local_shards_and_global_metadata``.

        dtype comes from the plan (the table config), never from a local shard. Empty shards are kept, as
        TorchRec keeps them.
        """
        index = self._sharded_index(name)
        with _gc_paused():
            return self._sharded_tensor_metadata(index, requires_grad)

    def all_sharded_tensor_metadata(self, requires_grad: bool = False) -> dict:
        """``{name: ShardedTensorMetadata}`` of every sharded table (all but data_parallel), in plan order.

        What a rank needs to create every sharded table without a collective; the same objects as
        :meth:`to_sharded_tensor_metadata` table by table, made in one pass.
        """
        with _gc_paused():
            return {
                name: self._sharded_tensor_metadata(i, requires_grad)
                for i, (name, _, _, _, kind) in enumerate(self._info())
                if kind != "data_parallel"
            }

    def to_sharded_tensor(self, name: str, rank: int, local: Sequence[torch.Tensor]):
        """A ``ShardedTensor`` of table ``name`` over ``rank``'s own shards, built from this metadata alone (no
        collective: ``ShardedTensor._init_from_local_shards_and_global_metadata``).

        ``local`` holds one tensor per shard of ``name`` in :meth:`local_shards` (``rank``), in that order, each
        of the shard's size and the table's dtype, on the shard's device. The tensors are used as they are, not
        copied. This is how a trainer that keeps its tables as plain tensors placed by an ettkit plan tells
        ``AsyncCheckpointer`` where each piece sits in its table, so that a checkpoint reshards at another
        world size (docs/checkpoint.md, *Elastic restore*).
        """
        from torch.distributed._shard.sharded_tensor import Shard as TorchShard
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        md = self._sharded(name)
        mine = [s for s in self.local_shards(rank) if s.table == name]
        if len(local) != len(mine):
            raise InvalidArgumentError(
                f"table '{name}': rank {rank} holds {len(mine)} shard(s) in the plan, but {len(local)} local "
                f"tensor(s) were given")
        shard_md = self.to_shard_metadata(name)
        shards = []
        for s, t in zip(mine, local):
            if tuple(t.shape) != tuple(s.shard.sizes) or t.dtype != md.dtype:
                raise InvalidArgumentError(
                    f"table '{name}': the local tensor for shard {s.index} (offsets {tuple(s.shard.offsets)}) is "
                    f"{tuple(t.shape)} {t.dtype}; the plan says {tuple(s.shard.sizes)} {md.dtype}")
            shards.append(TorchShard(t, shard_md[s.index]))
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, self.to_sharded_tensor_metadata(name, requires_grad=any(t.requires_grad for t in local)))

    def to_dcp_chunks(self, name: str, include_empty: bool = False) -> list:
        """DCP ``ChunkStorageMetadata`` of table ``name``, in plan order.

        Replicas (data_parallel) collapse into one chunk, as DCP's save-plan dedup does. Empty shards cover
        no data and are left out unless ``include_empty``.
        """
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        md = self.tables[name]
        shards = md.shards[:1] if md.sharding_type == "data_parallel" else md.shards
        return [
            ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
            for s in shards
            if include_empty or s.numel > 0
        ]

    def to_tensor_storage_metadata(self, name: str):
        """DCP ``TensorStorageMetadata`` (properties, size, chunks) of table ``name``."""
        from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

        md = self.tables[name]
        return TensorStorageMetadata(
            properties=TensorProperties(dtype=md.dtype), size=md.size, chunks=self.to_dcp_chunks(name)
        )

    def __repr__(self) -> str:
        return f"GlobalMetadata({len(self.tables)} tables, {self.total_shards} shards, world_size={self.world_size})"


def build_global_metadata(
    plan: ShardingPlan, strict: bool = False, *, max_shards: int | None = None
) -> GlobalMetadata:
    """Builds every table's shards and the per-rank index from ``plan``, locally, with no collective.

    Shards follow TorchRec's split rules bit for bit and are validated (bounds, overflow-safe volume, no
    overlap, full coverage, rank range). ``strict=True`` rejects TorchRec's sharp edges (0 rows or cols, a
    column split that silently yields fewer shards than ranks, ...) with :class:`~ettkit.InvalidArgumentError`;
    otherwise they are reproduced and listed in ``warnings``. Recorded as ETT phase
    ``launcher_init/sharding`` when a default recorder exists.

    ``max_shards`` (default :data:`DEFAULT_MAX_SHARDS`, at most ``2**27``) bounds the shards of all tables
    together: a plan that would expand to more raises :class:`~ettkit.InvalidArgumentError` naming the table
    that crosses it, before anything is allocated (a plan of a few hundred bytes can describe gigabytes).
    """
    if not isinstance(plan, ShardingPlan):
        raise InvalidArgumentError(f"build_global_metadata takes a ShardingPlan, got {type(plan).__name__}")
    with _ett.phase(ETT_PHASE):
        c_metadata = _C.sharding.build(
            plan._c, bool(strict), DEFAULT_MAX_SHARDS if max_shards is None else int(max_shards)
        )
    return GlobalMetadata(plan, c_metadata)
