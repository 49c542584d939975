"""The checkpointer's options as data: :class:`CheckpointerConfig` holds what ``AsyncCheckpointer(...)`` was
given (one field per keyword, the same defaults), checks what only Python can (the types C++ cannot see), and
translates itself into C++'s ``CheckpointerOptions``, whose setters and constructor check every value (one
place for C++ and Python callers, with the same messages)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from .. import _C
from ..errors import InvalidArgumentError
from ._interval_policy import every_of


def overlap_name(overlap: Any) -> Any:
    """``overlap=True``/``False`` as the C++ names ``"on"``/``"off"``; anything else as given, for the C++
    options to check (``CheckpointerOptions.overlap``)."""
    if overlap is True or overlap is False:
        return "on" if overlap else "off"
    return overlap


def memory_tier_root(memory_tier: Any) -> str:
    """``memory_tier=``: None/False (off), True (``/dev/shm``) or a directory on a memory file system."""
    if memory_tier is None or memory_tier is False:
        return ""
    if memory_tier is True:
        return "/dev/shm"
    if isinstance(memory_tier, (str, os.PathLike)) and os.fspath(memory_tier):
        return os.fspath(memory_tier)
    raise InvalidArgumentError(f"memory_tier={memory_tier!r} must be True (/dev/shm), a directory on a memory file "
                               f"system, or None/False (off)")


@dataclass(frozen=True)
class CheckpointerConfig:
    """The keywords of ``AsyncCheckpointer(...)`` that are options (not the process group, the store or the
    recorder, which are objects it uses); documented there."""

    directory: Any
    keep_last: int = 3
    memory_budget_bytes: Optional[int] = None
    on_busy: str = "wait"
    verify_on_load: bool = True
    every: Any = None
    double_buffer: bool = False
    copy_threads: int = 0
    commit_timeout_s: float = 600.0
    metadata: Optional[dict] = None
    preempt_signals: Optional[Iterable[int]] = None
    preempt_deadline_s: float = 60.0
    mtbf_prior_s: float = 24 * 3600.0
    pin_memory: Optional[bool] = None
    overlap: Any = "auto"
    unfenced_sync_max_bytes: int = 64 * 1024
    read_only: bool = False
    peer_timeout_s: float = 3.0
    memory_tier: Any = None
    job_id: Optional[str] = None
    memory_tier_budget_bytes: Optional[int] = None
    every_memory: Any = None
    verify_memory_tier: bool = True
    peer_replica: bool = False
    ranks_per_host: Optional[int] = None
    reshard_whole_from_rank0: bool = False
    allow_pickle: bool = False
    cuda_gather_max_bytes: int = 0
    rng_state: bool = True

    def intervals(self) -> tuple["_C.checkpoint.Every", "_C.checkpoint.Every"]:
        """Checks what C++ cannot see and returns the (disk, memory) intervals, in the order the checks were
        always made (the first bad value is the one named)."""
        if self.allow_pickle is not True and self.allow_pickle is not False:
            raise InvalidArgumentError(f"allow_pickle={self.allow_pickle!r} must be True or False")
        if self.rng_state is not True and self.rng_state is not False:
            raise InvalidArgumentError(f"rng_state={self.rng_state!r} must be True or False")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InvalidArgumentError(f"memory_budget_bytes={self.memory_budget_bytes} must be positive (or None)")
        if self.memory_tier_budget_bytes is not None and self.memory_tier_budget_bytes <= 0:
            raise InvalidArgumentError(
                f"memory_tier_budget_bytes={self.memory_tier_budget_bytes} must be positive (or None)")
        memory_root = memory_tier_root(self.memory_tier)
        every_disk = every_of(self.every)
        every_mem = every_of(self.every_memory, "every_memory")
        if every_mem.kind != "never" and not memory_root:
            raise InvalidArgumentError(f"every_memory={self.every_memory!r} needs a memory tier: pass "
                                       f"memory_tier=True (/dev/shm) or a directory on a memory file system")
        return every_disk, every_mem

    def cpp_options(self, rank: int, world: int, recorder: Any) -> "_C.checkpoint.CheckpointerOptions":
        """C++'s ``CheckpointerOptions``: every check of these values is C++'s (the constructor, or the
        options' setters for the names)."""
        options = _C.checkpoint.CheckpointerOptions()
        options.directory = os.fspath(self.directory)
        options.keep_last = int(self.keep_last)
        options.on_busy = self.on_busy
        options.overlap = overlap_name(self.overlap)
        options.unfenced_sync_max_bytes = int(self.unfenced_sync_max_bytes)
        options.verify_on_load = bool(self.verify_on_load)
        options.stager.memory_budget_bytes = int(self.memory_budget_bytes or 0)
        options.stager.num_arenas = 2 if self.double_buffer else 1
        options.stager.copy_threads = int(self.copy_threads)
        options.stager.pin_memory = -1 if self.pin_memory is None else int(bool(self.pin_memory))
        options.stager.cuda_gather_max_bytes = int(self.cuda_gather_max_bytes)
        options.rank = rank
        options.world_size = world
        options.commit_timeout_s = float(self.commit_timeout_s)
        options.peer_timeout_s = float(self.peer_timeout_s)
        options.recorder = recorder
        options.metadata = {str(k): str(v) for k, v in (self.metadata or {}).items()}
        options.read_only = bool(self.read_only)
        options.memory_tier.root = memory_tier_root(self.memory_tier)
        options.memory_tier.job_id = str(self.job_id or "")
        options.memory_tier.budget_bytes = int(self.memory_tier_budget_bytes or 0)
        options.memory_tier.verify = bool(self.verify_memory_tier)
        options.reshard_whole_from_rank0 = bool(self.reshard_whole_from_rank0)
        return options

    def checked_ranks_per_host(self, options: "_C.checkpoint.CheckpointerOptions") -> int:
        """``ranks_per_host=`` (default: torchrun's ``LOCAL_WORLD_SIZE``) as an int, with the peer replica's
        preconditions checked by C++ (``check_peer_replica``: a memory tier, world_size > 1, the range)."""
        _C.checkpoint.check_peer_replica(options)  # the memory tier and world first: they need no ranks_per_host
        ranks_per_host = self.ranks_per_host
        if ranks_per_host is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if not local:
                raise InvalidArgumentError("peer_replica=True needs ranks_per_host (the ranks each node runs): pass "
                                           "ranks_per_host=..., or run under torchrun (LOCAL_WORLD_SIZE)")
            try:
                ranks_per_host = int(local)
            except ValueError:
                raise InvalidArgumentError(f"LOCAL_WORLD_SIZE={local!r} is not an int: pass ranks_per_host=...") \
                    from None
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int):
            raise InvalidArgumentError(f"ranks_per_host={ranks_per_host!r} ({type(ranks_per_host).__name__}) must "
                                       f"be an int: the ranks each node runs")
        _C.checkpoint.check_peer_replica(options, ranks_per_host)
        return ranks_per_host


def rank_world_store(process_group: Any, store: Any) -> tuple[int, int, Any]:
    """(rank, world size, store) of a checkpointer: from ``process_group`` or the default group when one is
    initialized (its store when none was given and there is more than one rank), else (0, 1, store)."""
    import torch

    if process_group is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        import torch.distributed as dist

        rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
        if store is None and world > 1:
            store = dist.distributed_c10d._get_default_store()  # keys are namespaced in C++
        return rank, world, store
    return 0, 1, store
