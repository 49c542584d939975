"""Async checkpointing: pinned host arena, stream-ordered staging, crash-consistent persistence.

::

    from ettkit.checkpoint import AsyncCheckpointer
    with AsyncCheckpointer("ckpt", keep_last=3, every=100) as ckpt:
        ckpt.attach(model=model, optimizer=optimizer) # save() overlaps training; writers wait for their copies
        restored = ckpt.load_latest(state)            # (step, extra) or None
        start = restored[0] + 1 if restored else 0
        for step in range(start, steps):
            train_step()
            if ckpt.should_save(step):
                ckpt.save(step, state, extra={"epoch": epoch})   # returns after staging is queued

``state`` is a (nested) dict of tensors, Statefuls and small plain values, e.g.
``{"model": model, "optim": optimizer, "sched": scheduler}``: every save takes a fresh ``state_dict()`` of
each object with ``state_dict()``/``load_state_dict()`` (so it holds the state an optimizer created after
the state was put together), and ``load_latest`` restores them through ``load_state_dict()``. Tensors are
saved as ``step-<N>/rank-<r>.safetensors``; the small plain values and ``extra`` go into ``rank-<r>.extra``,
a versioned data format read without pickle (_skeleton_codec.py); anything else is refused naming its key,
unless the checkpointer was created with ``allow_pickle=True``. Guarantees and the on-disk layout:
docs/checkpoint.md; what a checkpoint directory is trusted with: docs/security.md.
"""

from __future__ import annotations

import operator
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Iterable, Optional

import torch

from .. import _C
from ..errors import InvalidArgumentError
from ._attach import Attachment, Fences, _listify
from ._flatten import (
    by_value_optimizer_prefixes,
    check_by_value,
    check_sharded,
    check_unique,
    find_captured_optimizer,
    find_saved,
    flatten_state,
    global_shapes,
    bounded,
    live_sharded,
    prune_to_live,
    rebuild_named,
    reconcile_moved,
    restore_by_value,
    unplaced_tensors,
)
from ._skeleton_codec import ExtraRecord, decode_extra, encode_extra, encode_skeleton
from . import rng_state
from .data_position import DataPosition

__all__ = ["AUTO_UNMEASURED_INTERVAL_S", "AsyncCheckpointer", "Attachment", "DataPosition", "DcpStager",
           "EttkitStorageReader",
           "SaveHandle", "latest_step", "parse_every"]

SaveHandle = _C.checkpoint.SaveHandle


#: ``every="auto"`` before a save of this checkpointer has committed (so its cost is unknown): the interval
#: after the last save. The first save is made at once, to measure; this bounds the saves made while it is
#: still persisting, or after it failed, to one per 10 minutes instead of one per step.
AUTO_UNMEASURED_INTERVAL_S = _C.checkpoint.AUTO_UNMEASURED_INTERVAL_S


def _overlap_name(overlap: Any) -> Any:
    """``overlap=True``/``False`` as the C++ names ``"on"``/``"off"``; anything else as given, for the C++
    options to check (``CheckpointerOptions.overlap``)."""
    if overlap is True or overlap is False:
        return "on" if overlap else "off"
    return overlap


def _step_number(step: Any) -> int:
    """``step`` as an int, refusing what is not an integer: ``int(1.5)`` would silently save step 1 and
    ``int("7")`` would parse text. Python and numpy integers and one-element integer tensors pass
    (``operator.index``); the range is the C++ side's to check."""
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise InvalidArgumentError(
        f"step={step!r} ({type(step).__name__}) is not a step number: give an int (a numpy integer or a one-element "
        f"integer tensor works too)"
    )


def _every(every: Any, field: str = "every") -> "_C.checkpoint.Every":
    """The C++ interval of ``every=`` (``None``, an int of steps, or a string: a duration or ``"auto"``)."""
    Every = _C.checkpoint.Every
    if every is None:
        return Every.never()
    if isinstance(every, bool) or not isinstance(every, (int, str)):
        raise InvalidArgumentError(f"{field}={every!r} is not valid: give steps (e.g. 100), a duration (e.g. '90s', "
                                   f"'10min', '1h'), 'auto', or None ('never') to save only when asked")
    if isinstance(every, int):
        return Every.steps(every, field)
    return Every.parse(every, field)


def _record_intervals(recorder: Any, disk: "_C.checkpoint.Every", memory: "_C.checkpoint.Every") -> None:
    """Records the policy's fixed intervals as the report's configured interval (``checkpoint_interval_steps``
    or ``checkpoint_interval_s``; ``checkpoint_memory_*`` for the memory tier), so that a trainer does not
    have to repeat ``every=`` in ``set_config``. ``"auto"`` changes with the measured costs: the report
    infers it from the saves."""
    for every, prefix in ((disk, "checkpoint"), (memory, "checkpoint_memory")):
        if every.kind == "steps":
            recorder.set_config(f"{prefix}_interval_steps", float(every.value))
        elif every.kind == "seconds":
            recorder.set_config(f"{prefix}_interval_s", float(every.value))


def parse_every(every: Any) -> tuple[str, float]:
    """``None`` -> ("never", 0); int n -> ("steps", n); "90s"/"5min"/"2h" -> ("seconds", s); "auto". The
    parsing is the C++ ``Every::parse`` that C++ trainers use (include/ettkit/checkpoint/schedule.h)."""
    e = _every(every)
    return (e.kind, float(e.value))


def latest_step(directory: str | os.PathLike) -> Optional[int]:
    """The newest committed step of a checkpoint directory, or ``None`` when none is (or the directory does
    not exist). Committed and newest as for :meth:`AsyncCheckpointer.load_latest` (``step-<N>/manifest.json``
    decodes; ordered by commit, not by number). Read-only: no lock, nothing changed, only manifests read, so
    it works beside a running writer and before any checkpointer exists, e.g. to position a data loader
    before the restore (which may still fall back to an older step if this one's files fail verification)."""
    return _C.checkpoint.latest_step(os.fspath(directory))


def _memory_tier_root(memory_tier: Any) -> str:
    """``memory_tier=``: None/False (off), True (``/dev/shm``) or a directory on a memory file system."""
    if memory_tier is None or memory_tier is False:
        return ""
    if memory_tier is True:
        return "/dev/shm"
    if isinstance(memory_tier, (str, os.PathLike)) and os.fspath(memory_tier):
        return os.fspath(memory_tier)
    raise InvalidArgumentError(f"memory_tier={memory_tier!r} must be True (/dev/shm), a directory on a memory file "
                               f"system, or None/False (off)")


#: The most subdirectories of an empty checkpoint directory looked into for steps (a run directory has a few:
#: ckpt/, ett/, compile-cache/); a directory with more is not searched further.
MAX_SUBDIRECTORIES_SEARCHED = 64


def _subdirectory_with_steps(directory: str) -> Optional[tuple[str, int]]:
    """(path, newest committed step) of a direct subdirectory of ``directory`` that holds committed steps, when
    ``directory`` itself holds no ``step-<N>`` entry; else None. Links are not followed and at most
    :data:`MAX_SUBDIRECTORIES_SEARCHED` subdirectories are read (only their manifests, as
    :func:`latest_step`); an unreadable directory is no finding."""
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except OSError:
        return None
    if any(e.name.startswith("step-") for e in entries):
        return None
    searched = 0
    for e in sorted(entries, key=lambda e: e.name):
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        searched += 1
        if searched > MAX_SUBDIRECTORIES_SEARCHED:
            break
        try:
            step = latest_step(e.path)
        except Exception:  # a subdirectory we cannot read is not the one the user meant
            step = None
        if step is not None:
            return e.path, int(step)
    return None


def _saved_states(slots: list, live: Any, value: Optional[ExtraRecord]) -> dict:
    """``id(slot)`` -> the saved state dict skeleton of each Stateful of the state being loaded. Raises
    :class:`InvalidArgumentError` (a mismatch: the load stops, naming the key) when the step has none for
    one, or an optimizer's parameter groups differ from the saved ones."""
    if not slots:
        return {}
    if value is None:
        # A C++ checkpointer's step has no skeleton: restore from the live structure (tensors load in place).
        return {id(s): s.skeleton for s in slots}
    saved: dict = {}
    find_saved(live, value.skeleton, saved)
    for s in slots:
        where = f"'{s.prefix}'" if s.prefix else "the root"
        if id(s) not in saved:
            raise InvalidArgumentError(f"the checkpoint has no state dict at {where} for the "
                                       f"{type(s.obj).__qualname__} there (nothing saved there)")
        sub = saved[id(s)]
        if not isinstance(sub, (dict, list, tuple)):
            raise InvalidArgumentError(f"the checkpoint has no state dict at {where} for the "
                                       f"{type(s.obj).__qualname__} there (it holds a {type(sub).__name__})")
        if isinstance(s.obj, torch.optim.Optimizer) and isinstance(s.state, dict) and "param_groups" in s.state:
            # (TorchRec's KeyedOptimizer of fused tables has no param_groups in its state dict.)
            groups = sub.get("param_groups") if isinstance(sub, dict) else None
            want = [len(g["params"]) for g in s.obj.param_groups]
            have = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] \
                if isinstance(groups, list) else None
            if have != want:
                raise InvalidArgumentError(
                    f"the optimizer at {where} has parameter groups of sizes {want}; the checkpoint's has "
                    f"{have}: it was saved from another model or optimizer")
    return saved


def _restore_stateful(slot, saved: Any, loaded: dict) -> None:
    """Hands a Stateful its saved state dict (built from the saved skeleton: the tensors loaded in place
    into its current state dict's, and the new ones) through its own ``load_state_dict``."""
    state = rebuild_named(reconcile_moved(saved, slot.skeleton, slot.prefix, loaded), slot.prefix, loaded)
    metadata = getattr(slot.state, "_metadata", None)
    if metadata is not None:
        # nn.Module versions its state dict layout (BatchNorm, ...): the live module's versions apply.
        from collections import OrderedDict

        state = OrderedDict(state)
        state._metadata = metadata
    slot.obj.load_state_dict(state)
    if slot.captured is not None:
        from ._flatten import refresh_captured, state_dict_of

        refresh_captured(slot.captured, state_dict_of(slot.obj))


class AsyncCheckpointer:
    """Asynchronous, crash-consistent checkpointer (one per rank). See the module docstring.

    ``memory_budget_bytes`` bounds the host arenas; ``double_buffer=True`` uses a second arena (when the
    budget allows) so a save can stage while the previous one persists (with a memory tier there are two
    arenas either way: they are the tier's files, docs/checkpoint.md "The memory tier"); ``on_busy`` says what ``save``
    does while every arena is still persisting: ``"wait"``, ``"skip"`` (returns a skipped handle) or
    ``"error"``. ``every``: the interval policy of :meth:`should_save`. ``process_group`` gives rank and
    world size; the commit is coordinated through ``store`` (default: the default process group's store),
    never through collectives. ``preempt_signals`` (default SIGTERM when ``every`` is set): on such a
    signal the next :meth:`should_save` returns True, that save is made durable and the process exits with
    128+signal; a save already in flight is finished first; ``preempt_deadline_s`` bounds it all.

    ``overlap`` says when ``save()`` may return before its copies are done: ``"auto"`` (default) once
    :meth:`attach` has installed the fences that make the writers wait for their copies, ``True`` always
    (a write that no fence orders after its copy makes that save refused with
    :class:`ettkit.TornSnapshotError`), ``False`` never. Either way a committed step is never a torn
    snapshot of what version counters see (docs/checkpoint.md). ``unfenced_sync_max_bytes``: while no
    model is attached, overlapped saves copy tensors up to this size inside ``save()`` (BatchNorm
    statistics are written without a version bump); 0 for a loop that fences every writer itself.

    ``memory_tier`` (``True`` for ``/dev/shm``, or a directory on a memory file system) keeps this rank's
    latest snapshot where it survives the process but not the node; ``job_id`` names the job (default
    ``TORCHELASTIC_RUN_ID``, else ``SLURM_JOB_ID``); ``memory_tier_budget_bytes`` bounds it per rank;
    ``verify_memory_tier=False`` skips the checksums of memory steps on load (the disk tier's stay on).
    ``every_memory`` (steps, a duration or ``"auto"``) is the memory tier's own interval: a save the
    policy makes between two disk saves goes to the memory tier (docs/checkpoint.md, "The memory tier").
    ``peer_replica=True`` also sends each memory snapshot to a partner rank on another node, rank
    ``(rank + ranks_per_host) % world``, which keeps it in its memory tier, so that a rank whose node was
    lost restores from its partner (default ``ranks_per_host``: ``LOCAL_WORLD_SIZE``, set by torchrun). The
    bytes travel over a gloo process group this checkpointer creates on its own Store prefix.

    A step written by another number of ranks is resharded (docs/checkpoint.md, "Elastic restore"): a tensor
    saved whole is read from old rank 0's copy once the digests show every old rank saved the same bytes;
    copies that differ are refused naming them, unless ``reshard_whole_from_rank0=True`` (old rank 0's copy,
    with a warning: right for a DDP model's buffers, which DDP syncs from rank 0 at every forward).

    Rank 0 holds the directory's lock (``CKPT_DIR/.lock``) from here to :meth:`close`: a second checkpointer
    on the same directory, in another job or in this process, raises :class:`ettkit.CheckpointLockedError`
    naming the holder. ``read_only=True`` only loads: no lock, nothing removed, ``save()`` raises.

    ``allow_pickle`` (default False): the non-tensor state (``rank-<r>.extra``) is a data format that holds
    plain values (None, bool, int, float, complex, str, bytes, lists, tuples, dicts, torch.Size, dtypes,
    devices; in ``extra=`` also tensors) and is read without pickle, so a hostile checkpoint directory cannot
    run code at load. A value of another type is refused at save naming its key, unless ``allow_pickle=True``:
    then it is stored pickled, and a load with ``allow_pickle=True`` reads it (and steps written by ettkit's
    former, pickled format) through an allow-list like ``torch.load(weights_only=True)``'s; a class of your own
    loads once registered with ``torch.serialization.add_safe_globals``. Without it such a step is refused
    with :class:`ettkit.InvalidArgumentError` naming ``allow_pickle=True`` (docs/security.md).

    ``rng_state`` (default True): each save keeps this rank's random generators (Python's ``random``, NumPy's
    when NumPy is imported, torch's CPU generator and every initialized CUDA device's) and :meth:`load_latest`
    restores them (not after a reshard: they are per rank), so that dropout and other random ops after a restore draw what the saved run drew
    (docs/checkpoint.md, "Exact resume"). ``False`` leaves the generators alone.

    ``cuda_gather_max_bytes`` (opt-in, default 0 = off; at most 1 MiB): contiguous CUDA tensors up to this
    size reach the pinned arena by one kernel per save instead of a ``cudaMemcpyAsync`` each. On an H200 it
    staged 20,001 small tensors 1.8x faster but made ``save()`` block longer beside a training step
    (docs/benchmarks.md, "GPU"), so it stays off until that is understood.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3, memory_budget_bytes: Optional[int] = None,
                 on_busy: str = "wait", verify_on_load: bool = True, every: Any = None, process_group=None,
                 store=None, double_buffer: bool = False, copy_threads: int = 0, recorder: Any = "current",
                 commit_timeout_s: float = 600.0, metadata: Optional[dict] = None,
                 preempt_signals: Optional[Iterable[int]] = None, preempt_deadline_s: float = 60.0,
                 mtbf_prior_s: float = 24 * 3600.0, pin_memory: Optional[bool] = None, overlap: Any = "auto",
                 unfenced_sync_max_bytes: int = 64 * 1024, read_only: bool = False, peer_timeout_s: float = 3.0,
                 memory_tier: Any = None, job_id: Optional[str] = None,
                 memory_tier_budget_bytes: Optional[int] = None, every_memory: Any = None,
                 verify_memory_tier: bool = True, peer_replica: bool = False, ranks_per_host: Optional[int] = None,
                 reshard_whole_from_rank0: bool = False, allow_pickle: bool = False,
                 cuda_gather_max_bytes: int = 0, rng_state: bool = True):
        if allow_pickle is not True and allow_pickle is not False:
            raise InvalidArgumentError(f"allow_pickle={allow_pickle!r} must be True or False")
        if rng_state is not True and rng_state is not False:
            raise InvalidArgumentError(f"rng_state={rng_state!r} must be True or False")
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise InvalidArgumentError(f"memory_budget_bytes={memory_budget_bytes} must be positive (or None)")
        if memory_tier_budget_bytes is not None and memory_tier_budget_bytes <= 0:
            raise InvalidArgumentError(
                f"memory_tier_budget_bytes={memory_tier_budget_bytes} must be positive (or None)")
        memory_root = _memory_tier_root(memory_tier)
        every_disk = _every(every)
        every_mem = _every(every_memory, "every_memory")
        if every_mem.kind != "never" and not memory_root:
            raise InvalidArgumentError(f"every_memory={every_memory!r} needs a memory tier: pass memory_tier=True "
                                       f"(/dev/shm) or a directory on a memory file system")
        rank, world = 0, 1
        if process_group is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            import torch.distributed as dist

            rank = dist.get_rank(process_group)
            world = dist.get_world_size(process_group)
            if store is None and world > 1:
                store = dist.distributed_c10d._get_default_store()  # keys are namespaced in C++
        from ..ett.recorder import resolve

        recorder = resolve(recorder, "AsyncCheckpointer", stacklevel=2)  # "current": the innermost open one
        self._recorder = recorder
        # Every check of these values is C++'s (the constructor, or the options' setters for the names): one
        # place for C++ and Python callers, with the same messages.
        options = _C.checkpoint.CheckpointerOptions()
        options.directory = os.fspath(directory)
        options.keep_last = int(keep_last)
        options.on_busy = on_busy
        options.overlap = _overlap_name(overlap)
        options.unfenced_sync_max_bytes = int(unfenced_sync_max_bytes)
        options.verify_on_load = bool(verify_on_load)
        options.stager.memory_budget_bytes = int(memory_budget_bytes or 0)
        options.stager.num_arenas = 2 if double_buffer else 1
        options.stager.copy_threads = int(copy_threads)
        options.stager.pin_memory = -1 if pin_memory is None else int(bool(pin_memory))
        options.stager.cuda_gather_max_bytes = int(cuda_gather_max_bytes)
        options.rank = rank
        options.world_size = world
        options.commit_timeout_s = float(commit_timeout_s)
        options.peer_timeout_s = float(peer_timeout_s)
        options.recorder = recorder
        options.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        options.read_only = bool(read_only)
        options.memory_tier.root = memory_root
        options.memory_tier.job_id = str(job_id or "")
        options.memory_tier.budget_bytes = int(memory_tier_budget_bytes or 0)
        options.memory_tier.verify = bool(verify_memory_tier)
        options.reshard_whole_from_rank0 = bool(reshard_whole_from_rank0)
        if peer_replica:
            # Before the directory is locked and the side group created: nothing to undo when it is refused.
            ranks_per_host = self._ranks_per_host(options, ranks_per_host)
        self._c = _C.checkpoint.AsyncCheckpointer(options, store)
        if recorder is not None and not read_only:
            _record_intervals(recorder, every_disk, every_mem)
        self.restored_from: Optional[str] = None
        # With a peer replica: the rank that gave this rank's memory step back at the last load_latest.
        self.restored_from_rank: Optional[int] = None
        # The world size that wrote the step the last load_latest resharded on this rank (None: this rank read
        # its own file; the same world size when its shards were saved under another layout), and the bytes of
        # the old files this rank read and verified for it.
        self.resharded_from: Optional[int] = None
        self.reshard_bytes: Optional[dict] = None
        # Whether the last load_latest used prefetch()'s verification ({"reverified_bytes": n}) or not (None).
        self.restore_prefetched: Optional[dict] = None
        self._replica_group = None
        if peer_replica:
            try:
                self._replica_group = self._open_replica_group(store, rank, world, ranks_per_host,
                                                               float(commit_timeout_s))
            except BaseException:
                self._c.close(False)
                raise
        self._clock = time.monotonic  # the interval policy's clock (tests replace it)
        #: Tests set a function ``tier -> (committed, blocking_s, durable_s)`` to inject the costs ``"auto"``
        #: decides from; None: C++ reads this checkpointer's measured costs (``TierCosts::of``).
        self._injected_costs = None
        self._fences = Fences(self._c)
        self._handles: deque = deque(maxlen=4)
        self._tensor_list = _C.checkpoint.TensorList()
        self._names: Optional[list] = None
        self._prepare_thread: Optional[threading.Thread] = None
        self._prepare_outcome: Any = None  # the bytes the last prepare() backed, or the exception it raised
        self._allow_pickle = allow_pickle
        self._rng_state = rng_state
        self._adopted: dict = {}  # id -> optimizer state dict passed by value that load_latest filled
        self._skeleton: Any = None
        self._skeleton_code = None  # the previous save's skeleton, encoded (_skeleton_codec.EncodedSkeleton)
        self._skeleton_comparable = False
        # The interval policy (C++ CheckpointSchedule): "auto" is held against this job's failure history.
        mtbf_s, restart_s = self._failure_history(mtbf_prior_s)
        self._schedule = _C.checkpoint.CheckpointSchedule(every_disk, every_mem, mtbf_s, restart_s, self._clock())
        self._preempt_signal: Optional[int] = None
        self._preempt_time = 0.0
        self._preempt_deadline_s = float(preempt_deadline_s)
        self._old_handlers: dict = {}
        if preempt_signals is None and (every_disk.kind != "never" or every_mem.kind != "never"):
            preempt_signals = (signal.SIGTERM,)
        if preempt_signals and threading.current_thread() is threading.main_thread():
            for sig in preempt_signals:
                self._old_handlers[sig] = signal.signal(sig, self._on_preempt_signal)
        self._closed = False
        # A checkpointer nobody closed (a loop that raised outside a `with` block) still finishes its queued
        # saves when it is collected or the interpreter exits; its writer never needs the GIL to do so.
        # Not a clean end either: the memory tier stays for the restart.
        self._finalizer = weakref.finalize(self, self._c.close, False)

    @staticmethod
    def _ranks_per_host(options: "_C.checkpoint.CheckpointerOptions", ranks_per_host: Any) -> int:
        """``ranks_per_host=`` (default: torchrun's ``LOCAL_WORLD_SIZE``) as an int, with the peer replica's
        preconditions checked by C++ (``check_peer_replica``: a memory tier, world_size > 1, the range)."""
        _C.checkpoint.check_peer_replica(options)  # the memory tier and world first: they need no ranks_per_host
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

    def _open_replica_group(self, store, rank: int, world: int, ranks_per_host: int, timeout_s: float):
        """The side gloo group that carries replicas (its own PrefixStore: no key of the training's groups)."""
        import datetime

        import torch.distributed as dist

        prefix = f"ettkit_replica:{self._c.directory}/{self._c.run_id}/"
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world,
                                      datetime.timedelta(seconds=timeout_s))
        self._c.enable_peer_replica(group, int(ranks_per_host))
        return group

    @property
    def replica_stats(self) -> dict:
        """Peer replica counters: snapshots ``sent`` to the partner and committed there, ``received`` from
        the rank this one keeps replicas for, and ``failed`` (either direction; each was warned about)."""
        return dict(self._c.replica_stats)

    # ---- saving -------------------------------------------------------------------------------------
    def save(self, step: int, state_dict: Any, extra: Any = None, *, tier: Optional[str] = None) -> SaveHandle:
        """Stages ``state_dict`` and persists it in the background as step ``step``. Statefuls in it (modules,
        optimizers, schedulers, anything with ``state_dict()``/``load_state_dict()``) are saved through a
        fresh ``state_dict()``, and so is a dict captured from an attached optimizer's ``state_dict()``
        (which is refreshed in place); a leaf that is neither a tensor nor a small plain value raises
        :class:`ettkit.InvalidArgumentError` naming its key and ``allow_pickle=True`` (``extra`` takes plain
        values and tensors, and with ``allow_pickle=True`` any picklable object). Returns a handle with
        ``wait()``, ``staged``, ``durable``, ``error``. Without :meth:`attach` (and ``overlap="auto"``) it
        returns once the copies are done; with it, it returns once they are queued, and the attached hooks
        make each writer wait for the copies of what it writes. A save whose tensors changed while being
        copied is refused: its handle's ``wait()`` raises :class:`ettkit.TornSnapshotError`.

        ``tier="memory"`` (needs ``memory_tier``) commits this rank's snapshot into the memory tier instead of
        the directory: no disk write and no collective, it survives a killed process on this node (not the
        node), and a later disk save of a step at least as new retires it. ``tier=None`` (default): the tier
        :meth:`due` names for this step, and ``"disk"`` when it names none (a save outside the policy)."""
        # The blocking the ledger records is the whole call, from here (the walk and the encoding below block
        # the training thread as much as the copies do): the C++ save takes this start.
        call_begin_us = time.time_ns() // 1000
        step = _step_number(step)
        if tier is None:
            tier = self.due(step) or "disk"
        # Statefuls (modules, optimizers, ...) give a fresh state_dict() here, so the save holds the state an
        # optimizer created since the last one; so does a dict captured from an attached optimizer.
        names, tensors, skeleton, comparable, _ = flatten_state(state_dict, self._find_optimizer())
        # Names and the encoded skeleton are handed over again only when they changed: for a state dict of
        # 10^4 tensors converting the names and encoding the skeleton would dominate the blocking time. The
        # skeleton and extra= are encoded first, so that a value the format refuses changes nothing.
        if not (comparable and self._skeleton_comparable and skeleton == self._skeleton):
            code = encode_skeleton(skeleton, allow_pickle=self._allow_pickle)
            self._skeleton, self._skeleton_code, self._skeleton_comparable = skeleton, code, comparable
        blob = encode_extra(self._skeleton_code, extra, self._c.world_size, allow_pickle=self._allow_pickle,
                            rng=rng_state.capture() if self._rng_state else None)
        if self._fences.attachments:
            self._c.set_copy_priority(*self._fences.priority())
        if names == self._names:
            self._tensor_list.set(None, tensors)
        else:
            check_unique(names)
            self._tensor_list.set(names, tensors)
            self._names = names
        handle = self._c.save(step, self._tensor_list, blob, tier, call_begin_us=call_begin_us)
        if not handle.skipped:
            self._schedule.saved(step, handle.tier, self._clock())
            self._handles.append(handle)
        if self._preempt_signal is not None:
            self._finish_preemption(handle)
        return handle

    def prepare(self, state_dict: Any, *, wait: bool = False) -> None:
        """Sizes, allocates and backs (faults in) the host arenas for ``state_dict`` on a background thread,
        so that the first ``save()`` of this state blocks like the later ones: without it, the first save of
        every attempt pays for the arena's page faults, which cost about as much as the copy itself. Call it
        once the state exists (after the model and optimizer are built or restored), before the first save;
        a ``save()`` that comes while it runs waits for it. Only the structure is read (names, dtypes,
        shapes), never the values, so the state may change meanwhile. ``wait=True``: runs on the calling
        thread and raises what it raises. In the background, an error (the state beyond
        ``memory_budget_bytes``, a dtype safetensors cannot store) is raised by :meth:`wait_prepared`, and
        the first ``save()`` raises it too. A state whose structure changes later (an optimizer's lazy
        state) is planned again at its save, as without ``prepare``."""
        if self._closed:
            raise InvalidArgumentError("prepare() on a closed checkpointer")
        names, tensors, skeleton, comparable, _ = flatten_state(state_dict, self._find_optimizer())
        check_unique(names)
        # What the first save() would do on this thread for the Python side, done now: the skeleton encoded
        # and the names converted for C++ (for 10^4 tensors, milliseconds each), kept for the saves of the same
        # structure. The tensor references are dropped at once: prepare() keeps no tensor alive.
        if not (comparable and self._skeleton_comparable and skeleton == self._skeleton):
            code = encode_skeleton(skeleton, allow_pickle=self._allow_pickle)
            self._skeleton, self._skeleton_code, self._skeleton_comparable = skeleton, code, comparable
        if names != self._names:
            self._tensor_list.set(names, tensors)
            self._tensor_list.clear_tensors()
            self._names = names
        self.wait_prepared()  # one at a time
        if wait:
            self._prepare_outcome = self._c.prepare(self._prepare_list(names, tensors))
            return
        self._prepare_outcome = None
        self._prepare_thread = threading.Thread(target=self._run_prepare, args=(names, tensors),
                                                name="ettkit-checkpoint-prepare", daemon=True)
        self._prepare_thread.start()

    @staticmethod
    def _prepare_list(names: list, tensors: list) -> Any:
        tensor_list = _C.checkpoint.TensorList()  # its own: save() uses self._tensor_list meanwhile
        tensor_list.set(names, tensors)
        return tensor_list

    def _run_prepare(self, names: list, tensors: list) -> None:
        try:
            # The names' conversion needs the GIL, here and not on the caller's thread; the C++ prepare
            # releases it.
            self._prepare_outcome = self._c.prepare(self._prepare_list(names, tensors))
        except Exception as exc:  # noqa: BLE001 - handed to wait_prepared(); the first save() raises it too
            self._prepare_outcome = exc

    def wait_prepared(self, timeout: Optional[float] = None) -> Optional[int]:
        """Waits for :meth:`prepare`'s background work (for ever when ``timeout`` is None) and returns the
        bytes it backed (0: the arenas were ready already; None: still running at the timeout, or no
        prepare ran); raises the error it met."""
        thread = self._prepare_thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return None
            self._prepare_thread = None
        outcome = self._prepare_outcome
        if isinstance(outcome, BaseException):
            self._prepare_outcome = None
            raise outcome
        return outcome

    def attach(self, *objects: Any, model: Any = None, optimizer: Any = None,
               in_backward: Any = "auto") -> Attachment:
        """Fences the writers of the saved tensors, so that ``save()`` returns before its copies are done
        (overlapping the next forward/backward) and still commits consistent snapshots.

        ``objects``, ``model=`` and ``optimizer=`` take modules and optimizers (one or a list):

        - an optimizer: before its ``step()`` the latest save's copies are waited for (GPU: the compute
          stream waits on the copy event; CPU: the host waits). A ``step()`` that runs inside backward
          (optimizer-in-backward) waits only for its own parameters and state;
        - a module: before the forward of every submodule that owns buffers (BatchNorm statistics), the
          copies of those buffers; TorchRec-style fused modules (a ``fused_optimizer`` attribute; they
          update their tables inside backward) wait for all their tensors before their forward;
          ``in_backward="auto"``: every parameter that already has a post-accumulate-grad hook (updated
          inside backward) waits for its copy, and its optimizer state's, before that hook runs
          (``True``: every parameter; ``False``: none).

        The copies run buffers first, then what backward updates, then the rest, so the waits are short.
        Returns an :class:`Attachment` whose ``remove()`` takes the hooks out. Other writers: call
        :meth:`wait_for` before writing, or save with ``overlap=False``."""
        att = self._fences.attach(list(objects) + _listify(model) + _listify(optimizer), in_backward)
        return att

    def wait_for(self, tensors: Iterable[torch.Tensor]) -> None:
        """Waits (GPU: the current stream waits) until the latest save's copies of ``tensors`` (matched by
        storage) are done; afterwards they may be written. For writers :meth:`attach` does not cover."""
        self._c.wait_for(list(tensors))

    def wait_staged(self) -> None:
        """Makes the caller wait (GPU: its stream) until the latest save is staged."""
        self._c.wait_staged_on_current_stream()

    def wait(self) -> None:
        """Waits until every queued save is durable or failed."""
        self._c.wait_all()

    # ---- when to save -------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether the interval policy (``every``, and ``every_memory`` with a memory tier) saves at this
        step: ``due(step) is not None``. Always True once a preemption signal arrived."""
        return self.due(step) is not None

    def due(self, step: int) -> Optional[str]:
        """The tier the interval policy saves to at this step: ``"disk"`` when ``every`` is due (always once
        a preemption signal arrived), else ``"memory"`` when ``every_memory`` is, else ``None``. The two
        intervals run separately: a memory save does not reset the disk interval."""
        step = _step_number(step)
        if self._preempt_signal is not None:
            return "disk"
        if self._injected_costs is not None:
            return self._schedule.due(step, self._clock(), self._injected_costs("disk"),
                                      self._injected_costs("memory"))
        return self._schedule.due(step, self._clock(), self._c)

    def auto_interval_s(self, tier: str = "disk") -> float:
        """The interval the ETT advisor recommends for one tier from this job's measured blocking time and
        save duration in that tier and its failure history (Daly's first order, never below the time a save
        of that tier takes to commit). Before a save of the tier has committed (nothing measured):
        :data:`AUTO_UNMEASURED_INTERVAL_S`. Both tiers are held against every failure the history shows
        (the ledger does not say which failures lost a node; the disk interval is the conservative one)."""
        if self._injected_costs is not None:
            return self._schedule.auto_interval_s(self._injected_costs(tier))
        return self._schedule.auto_interval_s(self._c, tier)

    def _measured_costs(self, tier: str = "disk") -> tuple[int, float, float]:
        """(saves committed, mean blocking s, mean time to committed s) of one tier: what ``"auto"`` decides
        from (C++ ``TierCosts::of``)."""
        return tuple(self._c.tier_costs(tier))

    def _failure_history(self, prior: float) -> tuple[float, float]:
        """(MTBF s, mean Time to Recover s) from the recorder's ETT ledger (the run directory above
        ``ett/rank-<r>.jsonl``); (prior, 0) without one. C++ ``FailureHistory::from_run``: a ledger that
        cannot be read is warned about, not raised."""
        rec = self._recorder
        path = getattr(rec, "ledger_path", None) if rec is not None else None
        run_dir = os.path.dirname(os.path.dirname(path)) if path else ""
        return _C.checkpoint.failure_history(run_dir, float(prior))

    # ---- preemption -------------------------------------------------------------------------------------
    def _on_preempt_signal(self, signum, frame) -> None:
        if self._preempt_signal is not None:
            return
        self._preempt_signal = signum
        self._preempt_time = time.monotonic()
        # Watchdog: exit by the deadline even if the loop never reaches a safe point.
        t = threading.Thread(target=self._deadline_watchdog, daemon=True, name="ettkit-preempt-watchdog")
        t.start()

    def _deadline_watchdog(self) -> None:
        deadline = self._preempt_time + self._preempt_deadline_s
        # Finish the save in flight (if any) even if the loop never calls should_save again.
        try:
            for h in list(self._handles):
                h.wait(max(deadline - time.monotonic(), 0.0))
        except Exception:
            pass
        time.sleep(max(deadline - time.monotonic(), 0.0))
        os._exit(128 + int(self._preempt_signal or signal.SIGTERM))

    def _finish_preemption(self, handle) -> None:
        remaining = self._preempt_deadline_s - (time.monotonic() - self._preempt_time)
        try:
            for h in list(self._handles):
                h.wait(max(remaining, 0.0))
        finally:
            code = 128 + int(self._preempt_signal)
            self.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    # ---- loading ----------------------------------------------------------------------------------------
    def prefetch(self) -> list[int]:
        """Starts verifying, on a background thread, the step ``load_latest`` will most likely restore (this
        rank's newest memory-tier step unless a disk step has a larger number, else the newest committed disk
        step), and returns the steps queued (``[]``: nothing to restore). Call it first thing in a restart,
        before building the model and compiling: the checksum pass, and for a disk step the reads from the
        device, overlap that work, and ``load_latest`` (which waits for the prefetch) is left with the copy.
        The guarantees stay those of ``load_latest``: it uses the result only for the step the ranks agree
        on, only while that step's manifest is the one verified, and hashes again any chunk whose pages
        left the page cache since; any other step it checks itself. Not collective."""
        return list(self._c.prefetch())

    def wait_prefetch(self, timeout: Optional[float] = None) -> bool:
        """Waits for ``prefetch()`` (for ever when ``timeout`` is None); True when it ended or none runs."""
        return bool(self._c.wait_prefetch(-1.0 if timeout is None else float(timeout)))

    @property
    def prefetch_figures(self) -> dict:
        """The last prefetch's ``seconds`` and ``bytes`` verified (0 while it runs)."""
        seconds, nbytes = self._c.prefetch_figures
        return {"seconds": float(seconds), "bytes": int(nbytes)}

    def load_latest(self, state_dict: Any, *, partial: bool = False) -> Optional[tuple[int, Any]]:
        """Copies the newest committed, valid step into ``state_dict``'s tensors in place (non-tensor leaves
        of its dicts/lists are replaced) and restores its Statefuls through ``load_state_dict()`` (an
        optimizer gets back the state its first step would create). Returns ``(step, extra)``, or ``None``
        when nothing is committed. Falls back to older steps with a warning; raises
        ``ettkit.CorruptCheckpointError`` when no step is valid and ``ettkit.InvalidArgumentError`` (a
        ``ValueError``) naming every key that differs when ``state_dict`` does not match. A checkpoint
        written by the C++ ``AsyncCheckpointer`` loads too; its ``extra`` comes back as the raw bytes.

        ``partial=True``: ``state_dict`` may hold a part of the step, whole entries of its dicts left out (a
        model without its optimizer, for evaluation or export): what it has no place for is not read. What it
        holds must be in the step as in a full load; a Stateful, list or tuple it holds is loaded whole."""
        if partial is not True and partial is not False:
            raise InvalidArgumentError(f"partial={partial!r} must be True or False")
        names, tensors, live, _, slots = flatten_state(state_dict, self._find_optimizer(), for_load=True)
        check_unique(names)
        decoded: dict = {}
        # Names a partial load may leave unread: none inside what the state holds (a Stateful, list or tuple
        # is loaded whole), only whole dict entries it lacks.
        by_value_optim = by_value_optimizer_prefixes(live)
        read_prefixes = [s.prefix for s in slots if not isinstance(s.obj, torch.nn.Module)] + by_value_optim

        def decode(blob: bytes) -> Optional[ExtraRecord]:
            value = decode_extra(blob, "the step's .extra file", allow_pickle=self._allow_pickle)
            if partial and value is not None:
                value = value._replace(skeleton=prune_to_live(value.skeleton, live))
                left = unplaced_tensors(value.skeleton, live, names, read_prefixes)
                if left:
                    raise InvalidArgumentError(
                        f"partial=True leaves out whole entries of the state's dicts only, not tensors inside what "
                        f"the state holds: it lacks {bounded([repr(n) for n in left], ', ')}, which the step holds "
                        f"there")
            return value

        def validate(blob: bytes) -> None:
            # The C++ loader calls this for each candidate once its manifest, files, checksums and tensor names
            # were checked, and before any tensor is copied: an extra that does not decode makes the step fall
            # back like any corrupt step instead of failing after the tensors were overwritten; a Stateful the
            # step cannot restore, or a pickle without allow_pickle=True, is a mismatch (InvalidArgumentError:
            # no fallback to an older step, which would silently lose the newer one).
            value = decode(blob)
            if value is not None and value.rng is not None:
                rng_state.check(value.rng, "the step's .extra file")
            if value is not None:
                check_sharded(live, value.skeleton,
                              world_changed=value.world_size is not None and value.world_size != self._c.world_size)
                # Every saved value either has a place in the state or the load is refused, before any copy.
                check_by_value(live, value.skeleton)
            saved = _saved_states(slots, live, value)
            decoded.update(blob=blob, value=value, saved=saved)

        # Tensors under a Stateful that are not in its state_dict() yet (an optimizer before its first step)
        # come back as new CPU tensors for its load_state_dict(); a module's must all be there already. So do
        # those under the `state` of an optimizer's state dict passed by value, which the dict is given
        # (read_prefixes, above).
        self.restore_prefetched = None
        res = self._c.load_latest(names, tensors, validate, read_prefixes, partial, global_shapes(live))
        if res is None:
            self._nothing_to_restore()
            return None
        step, blob, tier = res.step, res.extra, res.tier
        self.restored_from = tier
        self.restore_prefetched = {"reverified_bytes": int(res.prefetch_reverified_bytes)} if res.prefetched else None
        self.restored_from_rank = res.memory_from_rank if res.memory_from_rank >= 0 else None
        self.resharded_from = res.saved_world_size if res.resharded else None
        self.reshard_bytes = ({"read": res.reshard_bytes_read, "verified": res.reshard_bytes_verified}
                              if self.resharded_from else None)
        if res.skipped_steps or res.memory_fallback:
            import warnings

            skipped = res.skipped_steps
            why = f"newer steps {skipped} in {self._c.directory} failed validation" if skipped else ""
            if res.memory_fallback:
                why += ("; " if why else "") + f"the memory tier was not usable ({res.memory_fallback})"
            warnings.warn(f"ettkit.checkpoint: {why}; loaded step {step} from the {tier} tier", RuntimeWarning,
                          stacklevel=2)
        if decoded.get("blob") == blob:
            value, saved = decoded["value"], decoded["saved"]
        else:
            value = decode(blob)
            saved = _saved_states(slots, live, value)
        self._schedule.restored(int(step))
        loaded = dict(zip(names, tensors))
        loaded.update(res.read)
        if slots:
            live_sharded(live, loaded)  # a ShardedTensor goes back whole (its shards were loaded in place)
            for slot in slots:
                _restore_stateful(slot, saved[id(slot)], loaded)
        if value is None:
            # Written by the C++ AsyncCheckpointer: `extra` is its opaque bytes and there is no skeleton.
            return int(step), bytes(blob)
        if self._rng_state:
            rng_state.restore(value.rng, world_changed=self.resharded_from is not None, step=int(step))
        captured = frozenset(id(s.captured) for s in slots if s.captured is not None)
        filled: list = []
        restore_by_value(state_dict, value.skeleton, loaded, captured, filled)
        for d in filled:
            # Once the caller has handed it to optimizer.load_state_dict and attached the optimizer, a save
            # recognises the dict as that optimizer's and keeps it current, although its tensors (new CPU ones
            # here) are not the optimizer's (load_state_dict copies them to the parameters' device). Held, so
            # that the id names this dict as long as it is remembered.
            self._adopted[id(d)] = d
        return int(step), value.extra

    def _nothing_to_restore(self) -> None:
        """A load that found no step: says so with the directory on the "ettkit" logger, so that a job that
        starts from scratch by mistake (a wrong directory, a wiped one) shows it. WARNING on a restart
        (``TORCHELASTIC_RESTART_COUNT`` > 0), where a checkpoint was expected; INFO on a first start, where
        finding none is the normal case and a warning at every new job would teach people to ignore it. A
        directory without steps whose direct subdirectory has some (``AsyncCheckpointer(run_dir)`` for steps
        in ``run_dir/ckpt``) is warned about, naming the subdirectory, whatever the attempt."""
        import logging
        import warnings

        directory = self._c.directory
        logger = logging.getLogger("ettkit")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() not in ("", "0")
        logger.log(logging.WARNING if restart else logging.INFO,
                   "checkpoint: no committed step in %s: starting from scratch", directory)
        holder = _subdirectory_with_steps(directory)
        if holder is not None:
            sub, step = holder
            warnings.warn(
                f"ettkit.checkpoint: {directory} holds no checkpoint, but its subdirectory {sub} holds step {step}: "
                f"the job starts from scratch. If that is this job's checkpoint directory, pass "
                f"AsyncCheckpointer({sub!r})", RuntimeWarning, stacklevel=3)

    def _find_optimizer(self):
        return find_captured_optimizer(self._fences.optimizers, self._adopted)

    # ---- lifetime ---------------------------------------------------------------------------------------
    def close(self, discard_memory_tier: bool = True) -> None:
        """Waits for queued saves and stops the writer. Idempotent. A call is a clean end of the job: it also
        removes this rank's memory tier, unless ``discard_memory_tier=False`` (a ``with`` block left by an
        exception, and a checkpointer nobody closed, keep it for the restart)."""
        if self._closed:
            return
        self._closed = True
        if self._prepare_thread is not None:
            self._prepare_thread.join()  # it uses the C++ checkpointer, which close() stops
            self._prepare_thread = None
        for att in self._fences.attachments:
            att.remove()
        self._finalizer.detach()
        self._c.close(bool(discard_memory_tier))
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                if signal.getsignal(sig) == self._on_preempt_signal:
                    signal.signal(sig, old)

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # Left by an exception (a lost peer, a crash of the step): the job will be restarted, and its memory
        # tier is what the restart restores from.
        self.close(discard_memory_tier=exc_type is None)
        return False

    # ---- introspection ----------------------------------------------------------------------------------
    directory = property(lambda self: self._c.directory)
    rank = property(lambda self: self._c.rank)
    world_size = property(lambda self: self._c.world_size)
    arena_bytes = property(lambda self: self._c.arena_bytes)
    num_arenas = property(lambda self: self._c.num_arenas)
    pinned = property(lambda self: self._c.pinned)
    plan_builds = property(lambda self: self._c.plan_builds)
    arena_allocations = property(lambda self: self._c.arena_allocations)
    mean_blocking_s = property(lambda self: self._c.mean_blocking_s)
    mean_time_to_durable_s = property(lambda self: self._c.mean_time_to_durable_s)
    overlapped = property(lambda self: self._c.overlapped)
    saves_committed = property(lambda self: self._c.saves_committed)
    memory_saves_committed = property(lambda self: self._c.memory_saves_committed)
    #: This rank's memory-tier directory ("" without one).
    memory_tier_directory = property(lambda self: self._c.memory_tier_directory)
    saves_refused = property(lambda self: self._c.saves_refused)
    #: Saves that failed (refused ones included): nothing of them was committed.
    saves_failed = property(lambda self: self._c.saves_failed)


def __getattr__(name: str):
    # DcpStager subclasses DCP's AsyncStager, and importing torch.distributed.checkpoint costs 1–2 s: pay it
    # only when DcpStager is used, not on every (re)start of a job that imports ettkit.checkpoint.
    if name == "DcpStager":
        from ._dcp import DcpStager

        return DcpStager
    if name == "EttkitStorageReader":
        from ._dcp_reader import EttkitStorageReader

        return EttkitStorageReader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
