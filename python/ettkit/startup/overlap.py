"""overlapped_start: compile on a fast batch while the data pipeline fetches the first real batch.

The plain way costs first_batch + compile: ``batch = next(iter(loader))``, then the first step compiles.
:func:`overlapped_start` runs a :class:`StageGraph`:

    loader_iter (forks, on the calling thread, before any thread exists)   -> get_first_batch_data
    cache_load (runs_dynamo) -> compile: warm_compile on spec.fast_batch() (runs_dynamo)

With a ``CompileCache(..., precompile=True)`` the cache stage first tries the precompiled tier: a hit
returns the loaded forward (no Dynamo, AOTAutograd or Inductor); otherwise the compile stage precompiles the
module's forward and backward on the fast batch (``aot_compile``, which runs nothing) and saves it for the
next restart, and a model that cannot be precompiled (a graph break, an unserializable artifact) falls back
to the MegaCache path with the reason in ``report.precompile_fallback``.

``iter(loader)`` starts the worker processes, which begin prefetching at once; meanwhile a stage thread
compiles forward, loss and backward on the synthetic batch (holding the GIL for most of it, while the
workers load in their own processes and the thread that waits for the first batch sleeps in a queue read
without the GIL). Time to Start becomes max(compile, first batch) plus small overheads.

Each stage is a method of :class:`_OverlappedStart` (``cache_load``, ``compile_stage`` and the steps it takes:
``precompile_and_publish``, ``jit_compile``, ``save_megacache``); :func:`overlapped_start` builds the graph,
runs it, checks the first batch and writes the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import BatchMismatchError
from ..ett import recorder as _ett_recorder
from . import precompiled as _precompiled
from .batch_spec import BatchSpec
from .cache import CacheLoadResult, CacheSaveResult, CompileCache, CompileCacheWarning
from .stages import StageGraph, StageReport
from .warm import WarmCompileReport, compile_counters, compiled_graphs, counter_delta, warm_compile

__all__ = ["StartReport", "StartResult", "overlapped_start"]


@dataclasses.dataclass
class StartReport:
    """The start-up as it happened. ``recompiles`` is read live: graphs Dynamo compiled since start-up
    finished (0 after the first real steps means they reused the warm graphs; it also counts first
    compiles of other functions, such as a compiled optimizer step)."""

    time_to_start_s: float  # overlapped_start() call -> compiled model and first batch in hand
    compile_s: float  # cache load + warm compile
    first_batch_s: float  # iter(loader) + next(): how long the first real batch took
    cache: CacheLoadResult | None
    warm: WarmCompileReport | None
    stages: StageReport
    spec_mismatch: list
    graphs_at_start: int
    # Set when the compile could not keep the spec's dynamic dims over their whole range: the guard Dynamo
    # generated (the warm graph was then compiled with soft dims; see overlapped_start).
    dynamic_dims_specialized: str | None = None
    # The precompiled tier (CompileCache(precompile=True)): its file's load result, the save of a freshly
    # precompiled forward, and why the start did not use it (None when it did, or was not asked for).
    precompiled: CacheLoadResult | None = None
    precompiled_save: CacheSaveResult | None = None
    precompile_fallback: str | None = None
    # With CompileCache(store=...) on a rank other than 0: why rank 0's file was not used (None when it was).
    precompile_peer: str | None = None
    # The MegaCache file saved by the start itself after a torch.compile (None when nothing compiled that way:
    # no cache, or the precompiled tier served the start and wrote its own file).
    cache_save: CacheSaveResult | None = None
    # With CompileCache(shared_dir=...): the write of this start's freshly precompiled file into the shared
    # cache (None when this start compiled nothing, or has no shared cache).
    shared_save: CacheSaveResult | None = None

    @property
    def cache_tier(self) -> str | None:
        """How the compile started: "precompiled" (loaded, nothing compiled), "megacache" (caches replayed
        into a compile), or the MegaCache file's "miss" / "stale" / "corrupt" / "untrusted" / "rejected" (a
        cold compile; with the precompiled tier on, it was precompiled and saved for the next start). None
        without a cache."""
        if self.precompiled is not None and self.precompiled.status == "precompiled":
            return "precompiled"
        if self.cache is None:
            return None
        return "megacache" if self.cache.status == "hit" else self.cache.status

    @property
    def recompiles(self) -> int:
        return compiled_graphs() - self.graphs_at_start

    @property
    def overlap_saved_s(self) -> float:
        """Time the overlap saved against running the same stages one after another."""
        return self.stages.saved_s

    def summary(self) -> dict:
        return {
            "time_to_start_s": self.time_to_start_s,
            "compile_s": self.compile_s,
            "first_batch_s": self.first_batch_s,
            "overlap_saved_s": self.overlap_saved_s,
            "cache": self.cache_tier,
            "precompiled": None if self.precompiled is None else self.precompiled.status,
            "precompiled_source": None if self.precompiled is None else self.precompiled.source,
            "precompile_fallback": self.precompile_fallback,
            "precompile_peer": self.precompile_peer,
            "cache_saved": None if self.cache_save is None else self.cache_save.written,
            "recompiles": self.recompiles,
            "spec_mismatch": list(self.spec_mismatch),
            "dynamic_dims_specialized": self.dynamic_dims_specialized,
        }


class StartResult(NamedTuple):
    model: Any  # the compiled model (warm)
    first_batch: Any  # the first real batch
    report: StartReport
    batches: Iterator  # the loader's iterator, positioned after the first batch


class CacheLoaded(NamedTuple):
    """Stage "cache_load"'s result: what the cache held before the compile."""

    precompiled: CacheLoadResult | None  # the precompiled file's load (None when that tier is not tried)
    precompiled_fn: Any  # its loaded (or rank 0's received) forward, or None: the compile stage must compile
    megacache: CacheLoadResult | None  # the MegaCache file's load (None when the precompiled file served)


class Compiled(NamedTuple):
    """Stage "compile"'s result: the model to train and how it came to be."""

    model: Any  # the compiled (or precompiled-and-loaded) model
    warm: WarmCompileReport | None  # the warm compile on the fast batch; None when nothing compiled
    specialized: str | None  # the guard that specialized a dynamic dim of the spec, or None


def _is_compiled(model: Any) -> bool:
    # Decided without importing torch._dynamo (~2 s in a fresh process): that import belongs in the compile
    # stage, where it overlaps with the first batch. (torch registers lazy modules in sys.modules, so their
    # presence there proves nothing.)
    if hasattr(model, "_torchdynamo_orig_callable"):  # a torch.compile'd function
        return True
    return any(
        c.__name__ == "OptimizedModule" and c.__module__ == "torch._dynamo.eval_frame"
        for c in type(model).__mro__
    )


def _iter_forks(loader: Any) -> bool:
    """Whether iter(loader) forks: a DataLoader with workers and the fork start method."""
    if getattr(loader, "num_workers", 0) <= 0:
        return False
    ctx = getattr(loader, "multiprocessing_context", None)
    if ctx is None:
        method = multiprocessing.get_context().get_start_method()
    elif isinstance(ctx, str):
        method = ctx
    else:
        method = ctx.get_start_method()
    return method == "fork"


def _shutdown(iterator: Any) -> None:
    # A DataLoader's iterator, or a wrapper that closes one (ettkit.checkpoint.DataPosition.stream's).
    shutdown = getattr(iterator, "_shutdown_workers", None) or getattr(iterator, "close", None)
    if callable(shutdown):
        shutdown()


def _specialization(error: Exception) -> str:
    """The guard in Dynamo's ConstraintViolationError ("Not all values of ... satisfy the generated guard ...")."""
    lines = [line.strip(" -") for line in str(error).splitlines()]
    detail = [line for line in lines if "generated guard" in line or "specialized" in line]
    return "; ".join(detail) if detail else (lines[0] if lines else type(error).__name__)


class _OverlappedStart:
    """The stages of one :func:`overlapped_start` call, each phase a method, and what they learnt.

    It holds the graph's results and recorder, never the graph: the graph owns the stage callables (bound
    methods of this object), which must not own it back. ``fallback`` is what the cache and compile stages
    learnt about the precompiled tier: "reason" (why it is not used), "hint", "peer", "specialized",
    "seconds", "save" (the precompiled file's save) and "cache_save" (the MegaCache file's)."""

    def __init__(
        self,
        model: Any,
        spec: BatchSpec,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        cache: CompileCache | None,
        forward: Callable[[Any, Any], Any] | None,
        compile_kwargs: dict | None,
        seed: int,
        graph: StageGraph,
    ):
        self.model, self.spec, self.loss_fn, self.cache = model, spec, loss_fn, cache
        self.forward, self.compile_kwargs, self.seed = forward, compile_kwargs, seed
        self.results = graph.results  # not the graph itself (see the class comment)
        self.sub_recorder = getattr(graph, "recorder", None)  # the recorder, not the graph: no cycle
        self.precompile = cache is not None and cache.precompile
        # Why this start cannot use the precompiled tier at all (it then behaves as without precompile=True).
        self.no_precompile = _precompile_blocker(model) if self.precompile else None
        self.fallback: dict = {}

    # ---- the graph ------------------------------------------------------------------------------------

    def add_stages(self, graph: StageGraph, loader: Any, compile_after: Sequence[str]) -> None:
        results = self.results
        graph.add("loader_iter", lambda: iter(loader), forks=_iter_forks(loader), phase="preproc_creation")
        graph.add("get_first_batch_data", lambda: next(results["loader_iter"]), after=["loader_iter"])
        compile_deps = list(compile_after)
        if self.cache is not None:
            graph.add("cache_load", self.cache_load, runs_dynamo=True, phase="compile")
            compile_deps.append("cache_load")
        graph.add("compile", self.compile_stage, after=compile_deps, runs_dynamo=True, phase="compile")

    def sub_phase(self, name: str):
        # A sub-phase of "compile" in the ETT ledger: which tier the start took is visible in the report.
        return self.sub_recorder.phase(name) if self.sub_recorder is not None else contextlib.nullcontext()

    # ---- stage "cache_load" ---------------------------------------------------------------------------

    def cache_load(self) -> CacheLoaded:
        """What the precompiled file and the MegaCache file held (the second only when the first did not
        serve)."""
        cache = self.cache
        if not (self.precompile and self.no_precompile is None):
            return CacheLoaded(None, None, cache.load())
        with self.sub_phase("compile/precompiled_load"):
            result, fn = cache.load_precompiled()
        if fn is None and cache.shares and cache.rank != 0:
            received, fn = self.receive_from_rank_0()
            if fn is not None:
                return CacheLoaded(received, fn, None)
        if fn is not None:
            return CacheLoaded(result, fn, None)  # the MegaCache file is not needed
        return CacheLoaded(result, None, cache.load())

    def receive_from_rank_0(self) -> tuple:
        """Compile once per job: rank 0 compiles (or loads) and publishes; this rank waits for its file."""
        with self.sub_phase("compile/precompiled_wait"):
            received, fn, why = self.cache.receive_precompiled()
        if fn is None:
            self.fallback["peer"] = why
            if why and not why.startswith(("no precompiled file from rank 0", "rank 0's precompiled")):
                # The same model fails here too.
                self.fallback["reason"] = f"rank 0 could not precompile: {why}"
        return received, fn

    # ---- stage "compile" ------------------------------------------------------------------------------

    def compile_stage(self) -> Compiled:
        """The model to train, its warm compile's report and the guard that specialized a dynamic dim."""
        loaded: CacheLoaded | None = self.results.get("cache_load")
        if loaded is not None and loaded.precompiled_fn is not None:
            self.publish(None)
            # A graph compiled with soft dims is still one: the warm start reports the cold start's guard.
            model = self.precompiled_model(loaded.precompiled_fn, "loaded")
            return Compiled(model, None, loaded.precompiled.dynamic_dims_specialized)
        if self.precompile and self.no_precompile is None and "reason" not in self.fallback:
            precompiled = self.precompile_and_publish()
            if precompiled is not None:
                return precompiled
        elif self.precompile and self.no_precompile is not None:
            self.publish(self.no_precompile)
        # With the precompiled tier asked for, what follows is its fallback: a sub-phase of its own in the
        # ledger, so that the report shows which starts fell back and what that cost.
        with self.sub_phase("compile/precompile_fallback") if self.precompile else contextlib.nullcontext():
            compiled = self.jit_compile()
        self.save_megacache()
        return compiled

    def precompiled_model(self, fn: Any, origin: str) -> _precompiled.PrecompiledModel:
        kwargs = self.compile_kwargs
        return _precompiled.PrecompiledModel(self.model, fn, origin=origin, compile_kwargs=kwargs)

    def precompile_and_publish(self) -> Compiled | None:
        """Precompiles on the fast batch, saves and publishes the file: the compile stage's result, or None
        (the reason in ``fallback``; "publish" then tells the other ranks why)."""
        before = compile_counters()
        fn = self.precompile_forward()
        saved = self.fallback.get("save")
        written = saved is not None and saved.written
        self.publish(None if written else self.fallback.get("reason", "its file was not written"))
        if fn is None:
            return None
        after = compile_counters()
        warm = WarmCompileReport(
            seconds=self.fallback["seconds"],
            graphs=after["graphs"] - before["graphs"],
            backward=any(p.requires_grad for p in self.model.parameters()),
            counters=counter_delta(before, after),
        )
        return Compiled(self.precompiled_model(fn, "compiled"), warm, self.fallback.get("specialized"))

    def aot_compile(self, batch: Any) -> Any:
        args, kwargs = _precompiled.capture_call_args(self.model, batch, self.forward)
        kw = dict(self.compile_kwargs or {})
        kw["fullgraph"] = True  # aot_compile's requirement: one graph, no Python between graphs
        # Fences that AsyncCheckpointer.attach() installed before the start close over the C++ checkpointer,
        # which cannot be pickled: traced in, they would make every such start compile cold. They are kept out
        # of the graph and its guards, as PrecompiledModel runs them: before the graph, on every call.
        with self.sub_phase("compile/precompile"), _precompiled.checkpoint_fences_detached(self.model):
            return torch.compile(self.model, **kw).forward.aot_compile((args, kwargs))

    def precompile_forward(self) -> Any:
        """The precompiled forward for the fast batch, compiled and saved now, or None (reason in
        ``fallback``)."""
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

        fallback = self.fallback
        t0 = time.perf_counter()
        try:
            try:
                fn = self.aot_compile(self.spec.fast_batch(self.seed))
            except ConstraintViolationError as e:
                # As in jit_compile: the declared range cannot be served by one graph; the soft dims give the
                # widest graph there is, and its guards send other sizes to the fallback compile.
                fallback["specialized"] = _specialization(e)
                fn = self.aot_compile(self.spec.fast_batch(self.seed, soft=True))
        except Exception as exc:  # noqa: BLE001 - graph breaks, unsupported ops: the MegaCache path still works
            text = str(exc).strip()
            first = text.splitlines()[0] if text else ""
            fallback["reason"] = f"aot_compile failed ({type(exc).__name__}: {first[:300]})"
            fallback["hint"] = _precompiled.failure_hint(exc, self.model)
            fallback.pop("specialized", None)
            return None
        fallback["seconds"] = time.perf_counter() - t0
        with self.sub_phase("compile/precompiled_save"):
            fallback["save"] = self.cache.save_precompiled(fn, fallback.get("specialized"))
        if fallback["save"].written and self.cache.shared_dir is not None:
            # The next job of this model (on any node that shares the cache) starts from this compile.
            with self.sub_phase("compile/precompiled_share"):
                fallback["shared_save"] = self.cache.publish_shared()
        return fn

    def publish(self, reason: str | None) -> None:
        cache = self.cache
        if self.precompile and cache.shares and cache.rank == 0:
            with self.sub_phase("compile/precompiled_publish"):
                cache.publish_precompiled(reason)

    def jit_compile(self) -> Compiled:
        model, spec, seed = self.model, self.spec, self.seed
        # torch.compile() itself imports Dynamo (seconds in a fresh process): do it here, overlapped.
        compiled = model if _is_compiled(model) else torch.compile(model, **(self.compile_kwargs or {}))
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

        try:
            fast = spec.fast_batch(seed)
            return Compiled(compiled, warm_compile(compiled, fast, self.loss_fn, forward=self.forward), None)
        except ConstraintViolationError as e:
            # The model or Inductor made a size-dependent choice on a declared dynamic dim (e.g. Inductor's
            # CPU mm decomposition guards on the batch size of a matmul with an inner size of 1). A graph that
            # serves the whole declared range does not exist: compile with soft dims, and say which guard.
            specialized = _specialization(e)
            soft = spec.fast_batch(seed, soft=True)
            warm = warm_compile(compiled, soft, self.loss_fn, forward=self.forward)
            return Compiled(compiled, warm, specialized)

    def save_megacache(self) -> None:
        """Saves the MegaCache file now, on the compile's thread (overlapped with the first batch like the
        compile): forward and backward have compiled on the fast batch, which is all the first real steps
        compile when they match the spec. A job killed before any later save still restarts warm; a later
        ``cache.save()`` writes only what compiled since (a compiled optimizer step), else nothing."""
        cache = self.cache
        if cache is None:
            return
        with self.sub_phase("compile/cache_save"):
            try:
                self.fallback["cache_save"] = cache.save()
            except Exception as exc:  # noqa: BLE001 - a cache is an optimization, never a reason to fail
                warnings.warn(f"could not save compile cache {cache.path}: {type(exc).__name__}: {exc}",
                              CompileCacheWarning, stacklevel=2)

    # ---- after the graph ------------------------------------------------------------------------------

    def fallback_reason(self, stacklevel: int) -> str | None:
        """Why the precompiled tier asked for was not used (warned, naming the line ``stacklevel`` up), or
        None."""
        if not self.precompile:
            return None
        reason = self.no_precompile or self.fallback.get("reason")
        if reason:
            hint = f". To fix it: {self.fallback['hint']}" if self.fallback.get("hint") else ""
            warnings.warn(
                f"the precompiled tier is not used: {reason}; compiled through torch.compile and the MegaCache "
                f"file instead (report.precompile_fallback){hint}",
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )
        return reason

    def report(
        self, stages: StageReport, time_to_start: float, mismatch: list, reason: str | None
    ) -> StartReport:
        results, fallback = self.results, self.fallback

        def dur(name: str) -> float:
            s = stages.stages.get(name)
            return s.duration_s if s is not None else 0.0

        loaded: CacheLoaded = results.get("cache_load") or CacheLoaded(None, None, None)
        compiled: Compiled = results["compile"]
        return StartReport(
            time_to_start_s=time_to_start,
            compile_s=dur("cache_load") + dur("compile"),
            first_batch_s=dur("loader_iter") + dur("get_first_batch_data"),
            cache=loaded.megacache,
            warm=compiled.warm,
            stages=stages,
            spec_mismatch=mismatch,
            dynamic_dims_specialized=compiled.specialized,
            graphs_at_start=compiled_graphs(),
            precompiled=loaded.precompiled,
            precompiled_save=fallback.get("save"),
            precompile_fallback=reason,
            precompile_peer=fallback.get("peer"),
            cache_save=fallback.get("cache_save"),
            shared_save=fallback.get("shared_save"),
        )

    def record_notes(self, report: StartReport) -> None:
        """In the ETT ledger too (the report's attempts[].notes): which compile path this start took and,
        with the precompiled tier asked for, why it was not used, so that a job's restarts show it after the
        fact."""
        recorder = self.sub_recorder
        if recorder is None:
            return
        tier = report.cache_tier
        if tier is not None:
            source = report.precompiled.source if tier == "precompiled" else None
            # e.g. "precompiled (shared, job 4711 on node-17)": whose compile served this start.
            recorder.set_note("compile_cache", f"{tier} ({source})" if source else tier)
        reason = report.precompile_fallback
        if reason:
            limit = recorder.MAX_NOTE_BYTES  # bytes of UTF-8, not characters
            recorder.set_note("precompile_fallback", reason.encode()[:limit].decode(errors="ignore"))


def _precompile_blocker(model: Any) -> str | None:
    """Why this model cannot take the precompiled tier at all, or None."""
    why_not = _precompiled.supported()
    if why_not is None and _is_compiled(model):
        return "the model was compiled by the caller: pass the module itself to precompile it"
    if why_not is None and not isinstance(model, torch.nn.Module):
        return f"the model is a {type(model).__name__}, not a torch.nn.Module"
    return why_not


def _run_graph(graph: StageGraph) -> StageReport:
    try:
        return graph.run()
    except BaseException:
        iterator = graph.results.get("loader_iter")
        if iterator is not None:
            _shutdown(iterator)  # do not leave worker processes behind a failed start
        raise


def _check_first_batch(spec: BatchSpec, results: dict, strict: bool, stacklevel: int) -> list:
    """The first real batch's differences from the spec: raises BatchMismatchError with ``strict`` (after
    stopping the loader's workers), else warns (naming the line ``stacklevel`` up) and returns them."""
    mismatch = spec.diff(results["get_first_batch_data"])
    if mismatch:
        message = (
            "the first real batch does not match the batch spec the model was compiled for: "
            + "; ".join(mismatch)
        )
        if strict:
            _shutdown(results["loader_iter"])
            raise BatchMismatchError(message)
        warnings.warn(message + " (the first step will recompile)", RuntimeWarning, stacklevel=stacklevel + 1)
    return mismatch


def _warn_specialized(specialized: str | None, stacklevel: int) -> None:
    if specialized:
        warnings.warn(
            f"the compile specialized a dynamic dim of the batch spec ({specialized}); compiled again with the dims "
            "marked soft (torch._dynamo.maybe_mark_dynamic): batch sizes outside the graph's guard recompile once "
            "(report.recompiles). Set Dim(hint=...) to the size of the real batches so that the warm graph "
            "covers them, or narrow Dim(min, max) to a range the guard allows.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def overlapped_start(
    model: Any,
    loader: Any,
    spec: BatchSpec,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    cache: CompileCache | None = None,
    *,
    forward: Callable[[Any, Any], Any] | None = None,
    compile_kwargs: dict | None = None,
    seed: int = 0,
    strict: bool = True,
    graph: StageGraph | None = None,
    compile_after: Sequence[str] = (),
    timeout_s: float | None = None,
    recorder: Any = "current",
) -> StartResult:
    """Starts training with the compile overlapped with the first batch. Returns
    ``(model, first_batch, report, batches)``: the compiled model, the first real batch, a
    :class:`StartReport`, and the loader's iterator to continue from.

    - ``model``: a module (compiled here with ``torch.compile(model, **compile_kwargs)``) or an already
      compiled one. Build, move and wrap it before calling: nothing may change it between the warm compile
      and the first step.
    - ``loader``: a DataLoader (use ``num_workers >= 1``: with none, loading runs on a stage thread and
      competes with the compile for the GIL).
    - ``spec``: the batch spec; the fast batch is ``spec.fast_batch(seed)`` and the first real batch is
      checked against it: with ``strict`` a mismatch raises :class:`ettkit.errors.BatchMismatchError` naming the
      field, otherwise it warns and the report lists it (the first step would then recompile).
    - ``loss_fn(output, batch)`` and ``forward(model, batch)`` (default ``model(batch)``): as in training.
    - ``cache``: a :class:`CompileCache` to load before compiling. The start saves it itself: the precompiled
      file right after ``aot_compile``, the MegaCache file right after the warm compile (both on the compile's
      thread, overlapped with the first batch; ``report.precompiled_save`` / ``report.cache_save``). Call
      ``cache.save()`` again only for what compiles later (a compiled optimizer step).
    - ``graph``: a StageGraph with more start-up stages to run in the same DAG (e.g. ``process_group_init``);
      ``compile_after`` names stages the compile must wait for. ``timeout_s``: deadline of the whole graph.
    - ``recorder``: where the stages are recorded as ETT phases (``compile``, ``preproc_creation``,
      ``get_first_batch_data``): default the current recorder (:func:`ettkit.ett.current`, with a
      :class:`ettkit.NoRecorderWarning` when none is open), ``None`` for none. Ignored with ``graph=``
      (the graph's own recorder is used).
    """
    t0 = time.perf_counter()
    if graph is None:
        # Resolved here, not in StageGraph, so that a missing recorder's warning names the caller's line.
        recorder = _ett_recorder.resolve(recorder, "overlapped_start", stacklevel=2)
    g = graph if graph is not None else StageGraph(timeout_s=timeout_s, recorder=recorder)
    start = _OverlappedStart(model, spec, loss_fn, cache, forward, compile_kwargs, seed, g)
    start.add_stages(g, loader, compile_after)
    stages = _run_graph(g)
    # Warnings from here on name the caller's line (stacklevel=2: one frame above this function).
    mismatch = _check_first_batch(spec, g.results, strict, stacklevel=2)
    compiled: Compiled = g.results["compile"]
    _warn_specialized(compiled.specialized, stacklevel=2)
    time_to_start = time.perf_counter() - t0
    report = start.report(stages, time_to_start, mismatch, start.fallback_reason(stacklevel=2))
    start.record_notes(report)
    results = g.results
    return StartResult(compiled.model, results["get_first_batch_data"], report, results["loader_iter"])
