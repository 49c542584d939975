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

import os
import signal
import threading
import time
import weakref
from collections import deque
from typing import Any, Iterable, Optional

import torch

from .. import _C
from ..errors import InvalidArgumentError
from . import rng_state
from ._attach import Attachment, Fences, as_list
from ._captured_optimizer import find_captured_optimizer
from ._directory import latest_step, report_nothing_to_restore
from ._flatten import check_unique, flatten_state
from ._interval_policy import parse_every, step_number
from ._load_plan import LoadPlan
from ._options import CheckpointerConfig, rank_world_store
from ._preemption import Preemption
from ._skeleton_codec import encode_extra, encode_skeleton
from ._state_binding import BoundSaves
from .data_position import DataPosition

__all__ = ["AUTO_UNMEASURED_INTERVAL_S", "AsyncCheckpointer", "Attachment", "DataPosition", "DcpStager",
           "EttkitStorageReader",
           "SaveHandle", "latest_step", "parse_every"]

SaveHandle = _C.checkpoint.SaveHandle


#: ``every="auto"`` before a save of this checkpointer has committed (so its cost is unknown): the interval
#: after the last save. The first save is made at once, to measure; this bounds the saves made while it is
#: still persisting, or after it failed, to one per 10 minutes instead of one per step.
AUTO_UNMEASURED_INTERVAL_S = _C.checkpoint.AUTO_UNMEASURED_INTERVAL_S


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
        config = CheckpointerConfig(
            directory=directory, keep_last=keep_last, memory_budget_bytes=memory_budget_bytes, on_busy=on_busy,
            verify_on_load=verify_on_load, every=every, double_buffer=double_buffer, copy_threads=copy_threads,
            commit_timeout_s=commit_timeout_s, metadata=metadata, preempt_signals=preempt_signals,
            preempt_deadline_s=preempt_deadline_s, mtbf_prior_s=mtbf_prior_s, pin_memory=pin_memory,
            overlap=overlap, unfenced_sync_max_bytes=unfenced_sync_max_bytes, read_only=read_only,
            peer_timeout_s=peer_timeout_s, memory_tier=memory_tier, job_id=job_id,
            memory_tier_budget_bytes=memory_tier_budget_bytes, every_memory=every_memory,
            verify_memory_tier=verify_memory_tier, peer_replica=peer_replica, ranks_per_host=ranks_per_host,
            reshard_whole_from_rank0=reshard_whole_from_rank0, allow_pickle=allow_pickle,
            cuda_gather_max_bytes=cuda_gather_max_bytes, rng_state=rng_state)
        every_disk, every_mem = config.intervals()
        rank, world, store = rank_world_store(process_group, store)
        from ..ett.recorder import resolve

        recorder = resolve(recorder, "AsyncCheckpointer", stacklevel=2)  # "current": the innermost open one
        self._recorder = recorder
        options = config.cpp_options(rank, world, recorder)
        # Before the directory is locked and the side group created: nothing to undo when it is refused.
        ranks_per_host = config.checked_ranks_per_host(options) if peer_replica else None
        self._c = _C.checkpoint.AsyncCheckpointer(options, store)
        self._init_restore_figures()
        self._replica_group = None
        if peer_replica:
            try:
                self._replica_group = self._open_replica_group(store, rank, world, ranks_per_host,
                                                               float(commit_timeout_s))
            except BaseException:
                self._c.close(False)
                raise
        self._init_saving(config)
        # The interval policy (C++ CheckpointSchedule): "auto" is held against this job's failure history.
        mtbf_s, restart_s = self._failure_history(mtbf_prior_s)
        self._schedule = _C.checkpoint.CheckpointSchedule(every_disk, every_mem, mtbf_s, restart_s, self._clock())
        if recorder is not None and not read_only:
            _C.checkpoint.record_intervals(self._schedule, recorder)  # the C++ ledger adaptor's config records
        self._policy = every_disk.kind != "never" or every_mem.kind != "never"  # else due() is always None
        if preempt_signals is None and self._policy:
            preempt_signals = (signal.SIGTERM,)
        self._preemption = Preemption(preempt_signals, preempt_deadline_s, self._handles)
        self._closed = False
        # A checkpointer nobody closed (a loop that raised outside a `with` block) still finishes its queued
        # saves when it is collected or the interpreter exits; its writer never needs the GIL to do so.
        # Not a clean end either: the memory tier stays for the restart.
        self._finalizer = weakref.finalize(self, self._c.close, False)

    def _init_restore_figures(self) -> None:
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

    def _init_saving(self, config: CheckpointerConfig) -> None:
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
        self._allow_pickle = config.allow_pickle
        self._world_size = self._c.world_size
        self._rng_state = config.rng_state
        self._adopted: dict = {}  # id -> optimizer state dict passed by value that load_latest filled
        self._skeleton: Any = None
        self._skeleton_code = None  # the previous save's skeleton, encoded (_skeleton_codec.EncodedSkeleton)
        self._skeleton_comparable = False
        self._bound = BoundSaves(allow_pickle=config.allow_pickle)

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
        step = step_number(step)
        if tier is None:  # no policy: due() names none ("disk" after a signal), no C++ call for it (#65)
            tier = (self.due(step) or "disk") if self._policy else "disk"
        # A bound state (_state_binding.py) is checked, not walked. Otherwise Statefuls (modules, optimizers,
        # ...) give a fresh state_dict() here, so the save holds the state an optimizer created since the last
        # one; so does a dict captured from an attached optimizer.
        find_optimizer = self._find_optimizer()
        _, code = self._bound.take(state_dict, find_optimizer)
        walked = code is None
        if walked:
            names, tensors, skeleton, comparable, _ = flatten_state(state_dict, find_optimizer)
            # The encoded skeleton (and names, below) are made again only when they changed. The skeleton and
            # extra= are encoded first, so that a value the format refuses changes nothing.
            self._encode_skeleton(skeleton, comparable, names)
            code = self._skeleton_code
        blob = encode_extra(code, extra, self._world_size, allow_pickle=self._allow_pickle,
                            rng=rng_state.capture_record() if self._rng_state else None)
        if self._fences.attachments:
            self._c.set_copy_priority(*self._fences.priority())
        if walked:  # else the tensor list holds the binding's tensors, kept since the bind
            self._hand_over(state_dict, names, tensors, skeleton, code, find_optimizer)
        handle = self._c.save(step, self._tensor_list, blob, tier, call_begin_us)  # positional: kwargs cost
        if not handle.skipped:
            if self._policy:  # the schedule only answers due()
                self._schedule.saved(step, handle.tier, self._clock())
            self._handles.append(handle)
        if self._preemption.signal is not None:
            self._preemption.finish(self.close)
        return handle

    def prepare(self, state_dict: Any, *, wait: bool = False) -> None:
        """Sizes, allocates and backs (faults in) the host arenas for ``state_dict`` on a background thread,
        so that the first ``save()`` of this state blocks like the later ones: without it, the first save of
        every attempt pays for the arena's page faults, which cost about as much as the copy itself. Call it
        once the state exists (after the model and optimizer are built or restored), before the first save;
        a ``save()`` that comes while it runs waits for it. Only the structure is read (names, dtypes,
        shapes), never the values, so the state may change meanwhile. ``wait=True``: waits for it (the same
        thread does the work) and raises what it raises. In the background, an error (the state beyond
        ``memory_budget_bytes``, a dtype safetensors cannot store) is raised by :meth:`wait_prepared`, and
        the first ``save()`` raises it too. A state whose structure changes later (an optimizer's lazy
        state) is planned again at its save, as without ``prepare``. It also binds the state
        (docs/checkpoint.md, "The bound save"): the first save checks it instead of walking it, and the
        binding keeps references to the state's containers and tensors until a save binds another."""
        if self._closed:
            raise InvalidArgumentError("prepare() on a closed checkpointer")
        names, tensors, skeleton, comparable, _ = flatten_state(state_dict, self._find_optimizer())
        check_unique(names)
        # What the first save() would do on this thread for the Python side, done now: the skeleton encoded
        # and the names converted for C++ (for 10^4 tensors, milliseconds each), kept for the saves of the same
        # structure. The tensors are kept only by a binding (below): unbound, prepare() keeps none alive.
        self._encode_skeleton(skeleton, comparable, names)
        if names == self._names:
            self._tensor_list.set(None, tensors)
        else:
            self._tensor_list.set(names, tensors)
            self._names = names
        # The state is bound now, so that the first save is checked, not walked. Unbound, no tensor is kept.
        self._bound.bind(state_dict, names, tensors, skeleton, self._skeleton_code, self._find_optimizer())
        self._tensor_list.keep = self._bound.binding is not None
        if not self._tensor_list.keep:
            self._tensor_list.clear_tensors()
        self.wait_prepared()  # one at a time
        self._prepare_outcome = None
        self._prepare_thread = threading.Thread(target=self._run_prepare, args=(names, tensors),
                                                name="ettkit-checkpoint-prepare", daemon=True)
        self._prepare_thread.start()
        if wait:  # joined, not run here: the backing's page faults on this thread got it preempted inside the
            self.wait_prepared()  # first save on a busy machine (#65: 4 of 4 first saves, 1-45 ms at 12 tensors)

    def _hand_over(self, state: Any, names: list, tensors: list, skeleton: Any, code: Any, find_optimizer: Any) -> None:
        """Gives a walked save's names (when they changed) and tensors to the C++ list, and binds the state
        when its names are those of the save before (_state_binding.BoundSaves). A binding exists only while
        the list holds its tensors: it is made after they are handed over, and the list keeps them."""
        tensor_list = self._tensor_list
        if names == self._names:
            tensor_list.set(None, tensors)
            self._bound.walked(state, names, tensors, skeleton, code, find_optimizer)
        else:
            check_unique(names)
            tensor_list.set(names, tensors)
            self._names = names
            self._bound.drop()
        tensor_list.keep = self._bound.binding is not None

    def _encode_skeleton(self, skeleton: Any, comparable: bool, names: list) -> None:
        """Encodes the skeleton unless it equals the previous one (then its encoding is reused): a skeleton
        whose leaves are all values (``comparable``) is compared with ``==``; any other is encoded again.
        ``==`` on dicts ignores their order, which the encoding keeps: the names (the tensors' keys in the
        walk's order) must be the previous save's too, so that keys reordered around tensors are encoded in
        their new order, as a walk of a new checkpointer encodes them."""
        if not (comparable and self._skeleton_comparable and names == self._names and skeleton == self._skeleton):
            code = encode_skeleton(skeleton, allow_pickle=self._allow_pickle)
            self._skeleton, self._skeleton_code, self._skeleton_comparable = skeleton, code, comparable

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
        att = self._fences.attach(list(objects) + as_list(model) + as_list(optimizer), in_backward)
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
        step = step_number(step)
        if self._preemption.signal is not None:
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
        plan = LoadPlan.make(state_dict, self._find_optimizer(), partial=partial, world_size=self._c.world_size,
                             allow_pickle=self._allow_pickle)
        # Tensors under a Stateful that are not in its state_dict() yet (an optimizer before its first step)
        # come back as new CPU tensors for its load_state_dict(); a module's must all be there already. So do
        # those under the `state` of an optimizer's state dict passed by value, which the dict is given
        # (plan.read_prefixes).
        self.restore_prefetched = None
        res = self._c.load_latest(plan.names, plan.tensors, plan.check, plan.read_prefixes, partial,
                                  plan.global_shapes)
        if res is None:
            report_nothing_to_restore(self._c.directory)
            return None
        self._note_restore(res)
        self._schedule.restored(int(res.step))
        restored, filled = plan.apply(res, restore_rng=self._rng_state)
        for d in filled:
            # Once the caller has handed it to optimizer.load_state_dict and attached the optimizer, a save
            # recognises the dict as that optimizer's and keeps it current, although its tensors (new CPU ones
            # here) are not the optimizer's (load_state_dict copies them to the parameters' device). Held, so
            # that the id names this dict as long as it is remembered.
            self._adopted[id(d)] = d
        return restored

    def _note_restore(self, res: Any) -> None:
        """Records where the load found its step (the attributes after ``load_latest``) and warns, at the caller
        of ``load_latest``, about newer steps that failed validation or a memory tier that was not usable."""
        step, tier = res.step, res.tier
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
                          stacklevel=3)

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
        self._bound.drop()
        self._tensor_list.keep = False
        self._tensor_list.clear_tensors()
        self._c.close(bool(discard_memory_tier))
        self._preemption.uninstall()

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

