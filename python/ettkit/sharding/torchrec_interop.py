"""Converting between TorchRec sharding plans and ettkit plans, without importing TorchRec.

:func:`from_torchrec` reads any of:

* TorchRec's ``ShardingPlan`` object (``.plan``: module path -> ``{param: ParameterSharding}``),
* such a ``{module: {param: ParameterSharding}}`` dict, or one module's ``{param: ParameterSharding}``,
* the JSON of ``ShardingPlan._serialize()`` (a ``str`` or the parsed ``dict``):
  ``{"plan": {module: {param: {"sharding_type", "compute_kernel", "ranks", "shards": [{"shard_offsets",
  "shard_sizes", "placement"}]}}}}``.

Objects are read by attribute (``sharding_type``, ``ranks``, ``sharding_spec.shards`` with
``shard_offsets`` / ``shard_sizes`` / ``placement``), so TorchRec is needed only to produce them. Every
table becomes a compact :class:`Table` when ettkit's rule reproduces TorchRec's shard list exactly, and a
table with an explicit shard list otherwise (a planner's uneven split, ``column_wise(size_per_rank=...)``,
ZCH buckets, ...), so the conversion never changes a layout.

A TorchRec plan carries no dtype and (for data_parallel) no shape: they come from the table configs
(``tables=``), never from a rank's tensors.

:func:`to_torchrec_dict` writes built metadata back in the ``_serialize()`` JSON shape, for golden diffs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _C
from ..errors import InvalidArgumentError
from .metadata import GlobalMetadata
from .plan import ShardingPlan, Table, _dtype_name

__all__ = ["from_torchrec", "to_torchrec_dict"]

_log = logging.getLogger("ettkit.sharding")


def _placement_rank(placement: Any) -> int | None:
    if placement is None:
        return None
    rank = getattr(placement, "rank", None)  # torch _remote_device
    if callable(rank):
        return rank()
    text = str(placement)
    if text.startswith("rank:"):
        return int(text[5:].split("/", 1)[0])
    return None


def _entry(name: str, ps: Any) -> tuple[str, list[int], list[tuple[list[int], list[int], int | None]] | None]:
    """(sharding_type, ranks, shards as (offsets, sizes, placement rank)) of a ParameterSharding or its JSON."""
    if isinstance(ps, Mapping):
        kind = ps.get("sharding_type")
        ranks = ps.get("ranks")
        raw = ps.get("shards")
        shards = (
            None
            if raw is None
            else [
                (list(s["shard_offsets"]), list(s["shard_sizes"]), _placement_rank(s.get("placement")))
                for s in raw
            ]
        )
    else:
        kind = getattr(ps, "sharding_type", None)
        ranks = getattr(ps, "ranks", None)
        spec = getattr(ps, "sharding_spec", None)
        raw = getattr(spec, "shards", None) if spec is not None else None
        shards = (
            None
            if raw is None
            else [(list(s.shard_offsets), list(s.shard_sizes), _placement_rank(s.placement)) for s in raw]
        )
    kind = getattr(kind, "value", kind)
    if not isinstance(kind, str):
        raise InvalidArgumentError(f"table '{name}': the TorchRec entry has no sharding_type")
    for offsets, sizes, _ in shards or ():
        if len(offsets) != 2 or len(sizes) != 2:
            raise InvalidArgumentError(
                f"table '{name}': shard offsets {offsets} / sizes {sizes} are not 2-D; ettkit plans hold 2-D tables"
            )
    return kind, list(ranks or []), shards


def _modules(plan: Any) -> Iterable[tuple[str, Mapping[str, Any]]]:
    if isinstance(plan, (str, bytes)):
        plan = json.loads(plan)
    if not isinstance(plan, Mapping):
        plan = getattr(plan, "plan", None)
        if not isinstance(plan, Mapping):
            raise InvalidArgumentError(
                "from_torchrec takes a TorchRec ShardingPlan, its dict or its _serialize() JSON"
            )
    if set(plan) == {"plan"} and isinstance(plan["plan"], Mapping):
        plan = plan["plan"]
    # One module's plan ({param: ParameterSharding}) or a model's ({module: {param: ...}}).
    values = list(plan.values())
    if values and all(_looks_like_parameter(v) for v in values):
        return [("", plan)]
    return list(plan.items())


def _looks_like_parameter(v: Any) -> bool:
    return (isinstance(v, Mapping) and "sharding_type" in v) or hasattr(v, "sharding_type")


def _config(tables: Any, qualified: str, param: str) -> tuple[int | None, int | None, Any]:
    """(rows, cols, dtype) from the user's table configs, looked up by qualified name, then by param name."""
    if tables is None:
        return None, None, None
    cfg = tables.get(qualified, tables.get(param))
    if cfg is None:
        return None, None, None
    if isinstance(cfg, Table):
        return cfg.rows, cfg.cols, cfg.dtype
    if isinstance(cfg, Mapping):
        return cfg.get("rows"), cfg.get("cols"), cfg.get("dtype")
    if isinstance(cfg, (tuple, list)):
        return (tuple(cfg) + (None, None, None))[:3]
    # TorchRec EmbeddingBagConfig / EmbeddingConfig
    return (
        getattr(cfg, "num_embeddings", None),
        getattr(cfg, "embedding_dim", None),
        getattr(cfg, "data_type", None),
    )


def _rule_shards(tables: list[Table], world_size: int, ranks_per_host: int, device: str) -> list[list[tuple] | None]:
    """The shards ettkit's rule gives each of ``tables``, or None for one whose compact form is not a valid plan.

    One C++ build for all of them (a build per table was a third of ``from_torchrec``); only when that build
    refuses one does each table get its own, to find which.
    """
    def build(batch: list[Table]) -> list[list[tuple]]:
        md = _C.sharding.build(_C.sharding.Plan([t._spec() for t in batch], world_size, ranks_per_host, device), False)
        return [[tuple(s) for s in md.shards(i)] for i in range(len(batch))]

    if not tables:
        return []
    try:
        return build(tables)
    except ValueError:  # InvalidArgumentError: some compact guess does not fit; find which, one by one
        out: list[list[tuple] | None] = []
        for t in tables:
            try:
                out.append(build([t])[0])
            except ValueError:
                out.append(None)
        return out


def _is_cuda(placement: Any) -> bool:
    device = getattr(placement, "device", None)  # torch _remote_device: no string formatting needed
    if callable(device):
        return device().type == "cuda"
    return "cuda" in str(placement)


def _compact_candidate(name, kind, rows, cols, dtype, ranks, shards, world_size) -> Table:
    block = None
    if kind in ("column_wise", "table_column_wise", "grid_shard") and shards:
        block = shards[0][3]
    if kind in ("row_wise", "data_parallel") and ranks == list(range(world_size)):
        ranks = []
    if kind == "table_wise":
        ranks = ranks[:1]
    return Table(name, rows, cols, dtype, kind, ranks, block)


def from_torchrec(
    plan: Any,
    *,
    world_size: int,
    ranks_per_host: int,
    tables: Any = None,
    dtype: Any = None,
    device: str | None = None,
    qualify: bool = True,
) -> ShardingPlan:
    """An ettkit :class:`ShardingPlan` equal in layout to TorchRec's ``plan``.

    ``tables``: the table configs, as a mapping name -> :class:`Table` / ``(rows, cols, dtype)`` /
    ``{"rows", "cols", "dtype"}`` / TorchRec ``EmbeddingBagConfig``, or an iterable of objects with
    ``.name``; looked up by ``"module.param"`` and then by ``param``. ``dtype`` is the fallback dtype for
    tables without a config. Shapes of sharded tables default to the extent of their shards; data_parallel
    tables need a config. ``device`` defaults to ``"cuda"`` when any placement is on CUDA, else ``"cpu"``; a
    plan whose tables are all data_parallel carries no placement at all, so pass ``device=`` for it (a
    warning says so when it is missing). Table names are
    ``"module.param"`` (``qualify=True``) or ``param``.
    """
    if tables is not None and not isinstance(tables, Mapping):
        tables = {t.name: t for t in tables}  # once: a lookup per table must not rebuild it
    entries, saw_cuda, saw_placement = _plan_entries(plan, qualify)
    if device is None and entries and not saw_placement:
        # data_parallel entries carry no shards, so nothing in the plan says which device it is for.
        _log.warning(
            "from_torchrec: no table of the plan has a shard with a placement (all data_parallel?), so the "
            "device cannot be read from it; using 'cpu' placements: pass device='cuda' for a CUDA job"
        )
    device = device or ("cuda" if saw_cuda else "cpu")
    out = [_table_of(tables, dtype, world_size, *entry) for entry in entries]
    # A table keeps its compact form only where ettkit's rule gives exactly TorchRec's shards.
    pending = [i for i, t in enumerate(out) if isinstance(t, tuple) and t[0] is not None]
    for i, shards in zip(pending, _rule_shards([out[i][0] for i in pending], world_size, ranks_per_host, device)):
        candidate, _, flat = out[i]
        out[i] = candidate if shards == flat else Table(candidate.name, candidate.rows, candidate.cols,
                                                         candidate.dtype, candidate.sharding_type, shards=flat)
    out = [t[1] if isinstance(t, tuple) else t for t in out]
    return ShardingPlan(out, world_size, ranks_per_host, device)


def _plan_entries(plan: Any, qualify: bool) -> tuple[list, bool, bool]:
    """``(entries, saw_cuda, saw_placement)``: one ``(name, param, kind, ranks, shards)`` per table of the
    plan, whether a shard is placed on CUDA, and whether any shard has a placement at all."""
    entries = []
    saw_cuda = False
    saw_placement = False
    for module, params in _modules(plan):
        for param, ps in params.items():
            name = f"{module}.{param}" if (qualify and module) else param
            kind, ranks, shards = _entry(name, ps)
            if not isinstance(ps, Mapping):
                spec = getattr(ps, "sharding_spec", None)
                # A table's shards share one device type (TorchRec's placement() per compute device).
                first = (getattr(spec, "shards", None) or (None,))[0]
                saw_cuda = saw_cuda or (first is not None and _is_cuda(first.placement))
            else:
                saw_cuda = saw_cuda or any("cuda" in str(s.get("placement")) for s in ps.get("shards") or ())
            saw_placement = saw_placement or any(p is not None for _, _, p in shards or ())
            entries.append((name, param, kind, ranks, shards))
    return entries, saw_cuda, saw_placement


def _flat_shards(name: str, ranks: list, shards: list) -> list:
    """``(row offset, col offset, rows, cols, rank)`` per shard: the ranks the plan lists when they match the
    shards (a placement that disagrees is warned about), else the placements' ranks."""
    placement_ranks = [p for _, _, p in shards]
    if ranks and len(ranks) == len(shards):
        if any(p is not None and p != r for p, r in zip(placement_ranks, ranks)):
            # TorchRec's inference placement_helper puts every CPU shard on "rank:0/cpu".
            _log.warning(
                "table '%s': placement ranks %s disagree with ranks %s; using ranks",
                name,
                placement_ranks,
                ranks,
            )
        shard_ranks = ranks
    else:
        if any(p is None for p in placement_ranks):
            raise InvalidArgumentError(
                f"table '{name}': shards have no placement and ranks do not match them"
            )
        shard_ranks = placement_ranks
    return [(o[0], o[1], s[0], s[1], r) for (o, s, _), r in zip(shards, shard_ranks)]


def _table_of(tables: Any, dtype: Any, world_size: int, name: str, param: str, kind: str, ranks: list,
              shards: list | None) -> Table | tuple:
    """A data_parallel entry's :class:`Table`, else ``(compact candidate or None, explicit table or None,
    flat shards)``: from_torchrec keeps the candidate only where ettkit's rule gives TorchRec's shards."""
    rows, cols, cfg_dtype = _config(tables, name, param)
    table_dtype = cfg_dtype if cfg_dtype is not None else dtype
    if table_dtype is None:
        raise InvalidArgumentError(
            f"table '{name}': a TorchRec plan carries no dtype; pass tables= (the table configs) or dtype=. "
            "ettkit never takes it from a rank's own tensor"
        )
    flat = None
    if shards is not None:
        flat = _flat_shards(name, ranks, shards)
        if rows is None:
            rows = max(o + s for o, _, s, _, _ in flat)
        if cols is None:
            cols = max(o + s for _, o, _, s, _ in flat)
    if rows is None or cols is None:
        raise InvalidArgumentError(
            f"table '{name}': {kind} entries carry no shards to take the shape from; pass tables= with its rows and cols"
        )
    dtype_name = _dtype_name(table_dtype)
    if flat is None:  # data_parallel: nothing to compare
        return Table(name, rows, cols, dtype_name, kind, [])
    candidate = None
    try:
        candidate = _compact_candidate(
            name, kind, rows, cols, dtype_name, list(ranks or [s[4] for s in flat]), flat, world_size
        )
    except ValueError:
        candidate = None
    explicit = Table(name, rows, cols, dtype_name, kind, shards=flat) if candidate is None else None
    return candidate, explicit, flat


def to_torchrec_dict(metadata: GlobalMetadata, compute_kernel: str = "dense") -> dict:
    """The metadata in the shape of TorchRec's ``ShardingPlan._serialize()``.

    A table named ``"module.param"`` goes under module ``"module"`` (the last dot splits), others under
    ``""``. data_parallel tables list every rank and no shards, as TorchRec's do.
    """
    plan: dict[str, dict] = {}
    for name, md in metadata.tables.items():
        module, _, param = name.rpartition(".")
        entry: dict[str, Any] = {
            "sharding_type": md.sharding_type,
            "compute_kernel": compute_kernel,
            "ranks": [s.rank for s in md.shards],
        }
        if md.sharding_type != "data_parallel":
            entry["shards"] = [
                {"shard_offsets": list(s.offsets), "shard_sizes": list(s.sizes), "placement": s.placement}
                for s in md.shards
            ]
        plan.setdefault(module, {})[param] = entry
    return {"plan": plan}
