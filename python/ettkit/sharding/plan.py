"""The sharding plan: :class:`Table` and :class:`ShardingPlan`, and the plan codec.

A plan holds only rank-independent inputs (global shapes, dtypes from the table configs, sharding types,
ranks, column blocks, world size, ranks per host, device type), so every rank that holds the same plan
builds the same metadata. The C++ core (``ettkit._C.sharding``) validates it; errors are
:class:`~ettkit.InvalidArgumentError` naming the table and the field.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _C
from ..errors import InvalidArgumentError

__all__ = [
    "SHARDING_TYPES",
    "ShardingPlan",
    "Table",
    "decode",
    "encode",
    "plan_hash",
]

#: TorchRec's ShardingType values, in the order of the codec's numbering.
SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "grid_shard",
)

# TorchRec's DataType names (torchrec.types.DataType) -> torch dtype names.
_TORCHREC_DTYPES = {
    "FP32": "float32",
    "FP16": "float16",
    "BF16": "bfloat16",
    "INT64": "int64",
    "INT32": "int32",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT4": "quint4x2",
    "INT2": "quint2x4",
}
_DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "double": "float64",
    "short": "int16",
    "int": "int32",
    "long": "int64",
}


def _dtype_name(value: Any) -> str:
    """The canonical torch name of a dtype given as torch.dtype, str or TorchRec DataType."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    name = getattr(value, "name", None)  # an Enum such as torchrec DataType.FP16
    if name is not None and not isinstance(value, str):
        value = name
    text = str(value)
    text = _TORCHREC_DTYPES.get(text, text)
    text = text.removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)


def _shard_tuple(shard: Any) -> tuple[int, int, int, int, int]:
    """(row_offset, col_offset, rows, cols, rank) from a 5-tuple, an ettkit Shard or a dict."""
    if isinstance(shard, dict):
        offsets, sizes, rank = shard["offsets"], shard["sizes"], shard["rank"]
    elif hasattr(shard, "offsets") and hasattr(shard, "sizes"):
        offsets, sizes, rank = shard.offsets, shard.sizes, shard.rank
    else:
        values = tuple(shard)
        if len(values) != 5:
            raise InvalidArgumentError(
                f"an explicit shard must be (row_offset, col_offset, rows, cols, rank), got {shard!r}"
            )
        return tuple(operator.index(v) for v in values)  # type: ignore[return-value]
    if len(offsets) != 2 or len(sizes) != 2:
        raise InvalidArgumentError(
            f"an explicit shard of a 2-D table needs 2 offsets and 2 sizes, got {shard!r}"
        )
    return (
        operator.index(offsets[0]),
        operator.index(offsets[1]),
        operator.index(sizes[0]),
        operator.index(sizes[1]),
        operator.index(rank),
    )


@dataclass(frozen=True)
class Table:
    """One table (or 2-D parameter) of a plan.

    ``ranks`` follows TorchRec's ``ParameterSharding.ranks`` (see docs/sharding.md): ``data_parallel`` and
    ``row_wise``: empty for all ranks; ``table_wise``: ``[r]``; ``column_wise`` / ``table_column_wise``:
    the rank of each column block; ``table_row_wise``: the host's ranks (or its first rank);
    ``grid_shard``: one host's ``ranks_per_host`` ranks per column block.

    ``column_block`` is the width of each column block and must divide ``cols``; ``None`` applies
    TorchRec's search (``column_wise(ranks)``: from ``cols / len(ranks)``; ``grid_shard``: from 128).
    ``num_buckets`` (row_wise only) is TorchRec's ZCH bucket count. ``shards`` replaces the split rule with
    an explicit layout: ``(row_offset, col_offset, rows, cols, rank)`` per shard.

    ``dtype`` comes from the table config (torch.dtype, a name such as ``"float16"``, or a TorchRec
    DataType) and never from a rank's own tensor.
    """

    name: str
    rows: int
    cols: int
    dtype: Any
    sharding_type: str
    ranks: Sequence[int] = ()
    column_block: int | None = None
    num_buckets: int | None = field(default=None, kw_only=True)
    shards: Sequence[Any] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidArgumentError(f"table name must be a str, got {type(self.name).__name__}")
        set_ = object.__setattr__  # frozen: normalise once here
        set_(self, "rows", operator.index(self.rows))
        set_(self, "cols", operator.index(self.cols))
        set_(self, "dtype", _dtype_name(self.dtype))
        set_(self, "sharding_type", str(getattr(self.sharding_type, "value", self.sharding_type)))
        set_(self, "ranks", tuple(operator.index(r) for r in (self.ranks or ())))
        if self.column_block is not None:
            set_(self, "column_block", operator.index(self.column_block))
        if self.num_buckets is not None:
            set_(self, "num_buckets", operator.index(self.num_buckets))
        if self.shards is not None:
            set_(self, "shards", tuple(_shard_tuple(s) for s in self.shards))
        self._spec()  # names, dtype and sharding type are checked now, naming this table

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def _spec(self) -> _C.sharding.TableSpec:
        return _C.sharding.TableSpec(
            self.name,
            self.rows,
            self.cols,
            self.dtype,
            self.sharding_type,
            list(self.ranks),
            self.column_block or 0,
            self.num_buckets or 0,
            list(self.shards or ()),
        )

    @classmethod
    def _from_spec(cls, spec: _C.sharding.TableSpec) -> Table:
        shards = spec.shards
        return cls(
            spec.name,
            spec.rows,
            spec.cols,
            spec.dtype,
            spec.sharding_type,
            tuple(spec.ranks),
            spec.column_block or None,
            num_buckets=spec.num_buckets or None,
            shards=tuple(shards) if shards else None,
        )


def _device_name(device: Any) -> str:
    if isinstance(device, torch.device):
        return device.type
    text = str(device)
    return text.split(":", 1)[0]


class ShardingPlan:
    """The tables of a model and how each is sharded over ``world_size`` ranks, ``ranks_per_host`` per host.

    Immutable and validated on construction (field by field; the geometry of explicit shards and the
    strict-mode rules are checked by :func:`build_global_metadata`). ``device`` (``"cpu"`` or ``"cuda"``)
    decides the placement strings. Equal plans encode to equal bytes; ``hash()`` is the codec's 8-byte
    fingerprint. Pickling keeps the Python form (a list of :class:`Table`).
    """

    __slots__ = ("_c", "_tables")

    def __init__(self, tables: Iterable[Table], world_size: int, ranks_per_host: int, device: Any = "cpu"):
        tables = tuple(tables)
        for t in tables:
            if not isinstance(t, Table):
                raise InvalidArgumentError(
                    f"ShardingPlan takes ettkit.sharding.Table objects, got {type(t).__name__}"
                )
        self._c = _C.sharding.Plan(
            [t._spec() for t in tables],
            operator.index(world_size),
            operator.index(ranks_per_host),
            _device_name(device),
        )
        self._tables: tuple[Table, ...] | None = tables

    @classmethod
    def _wrap(cls, c_plan: _C.sharding.Plan) -> ShardingPlan:
        plan = cls.__new__(cls)
        plan._c = c_plan
        plan._tables = None  # materialised on first access: a decoded plan is built from C++ directly
        return plan

    @property
    def tables(self) -> tuple[Table, ...]:
        if self._tables is None:
            self._tables = tuple(Table._from_spec(self._c.table(i)) for i in range(self._c.num_tables))
        return self._tables

    def _table_at(self, index: int) -> Table:
        # One table without materialising all of them (a decoded plan holds only the C++ tables).
        if self._tables is not None:
            return self._tables[index]
        return Table._from_spec(self._c.table(index))

    @property
    def names(self) -> list[str]:
        """The table names, in plan order."""
        return self._c.names

    def table(self, name: str) -> Table:
        index = self._c.find(name)
        if index is None:
            raise KeyError(name)
        return self._table_at(index)

    @property
    def world_size(self) -> int:
        return self._c.world_size

    @property
    def ranks_per_host(self) -> int:
        return self._c.ranks_per_host

    @property
    def device(self) -> str:
        return self._c.device

    def __len__(self) -> int:
        return self._c.num_tables

    def hash(self) -> int:
        """The plan's 8-byte fingerprint (XXH3-64 of its encoding)."""
        return _C.sharding.plan_hash(self._c)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingPlan):
            return NotImplemented
        return self._c == other._c

    def __hash__(self) -> int:
        return self.hash()

    def __getstate__(self):
        return (self.tables, self.world_size, self.ranks_per_host, self.device)

    def __setstate__(self, state) -> None:
        tables, world_size, ranks_per_host, device = state
        self.__init__(tables, world_size, ranks_per_host, device)

    def __repr__(self) -> str:
        return (
            f"ShardingPlan({len(self)} tables, world_size={self.world_size}, "
            f"ranks_per_host={self.ranks_per_host}, device={self.device!r})"
        )


def encode(plan: ShardingPlan) -> bytes:
    """The plan's compact binary encoding (versioned, checksummed; see docs/sharding.md)."""
    if not isinstance(plan, ShardingPlan):
        raise InvalidArgumentError(f"encode takes a ShardingPlan, got {type(plan).__name__}")
    return _C.sharding.encode(plan._c)


def decode(data: bytes | bytearray | memoryview) -> ShardingPlan:
    """The plan encoded in ``data``; raises :class:`~ettkit.CorruptDataError` for damaged bytes."""
    return ShardingPlan._wrap(_C.sharding.decode(data))


def plan_hash(plan: ShardingPlan) -> int:
    """The plan's 8-byte fingerprint, equal on ranks whose plans are equal."""
    return plan.hash()
