"""overlapped_start: compile on a fast batch while the data pipeline fetches the first real batch.

The plain way costs first_batch + compile: ``batch = next(iter(loader))``, then the first step compiles.
:func:`overlapped_start` runs a :class:`StageGraph`:

    loader_iter (forks, on the calling thread, before any thread exists)   -> get_first_batch_data
    cache_load (runs_dynamo) -> compile: warm_compile on spec.fast_batch() (runs_dynamo)

``iter(loader)`` starts the worker processes, which begin prefetching at once; meanwhile a stage thread
compiles forward, loss and backward on the synthetic batch (holding the GIL for most of it, while the
workers load in their own processes and the thread that waits for the first batch sleeps in a queue read
without the GIL). Time to Start becomes max(compile, first batch) plus small overheads.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import BatchMismatchError
from ..ett import recorder as _ett_recorder
from .batch_spec import BatchSpec
from .cache import CacheLoadResult, CompileCache
from .stages import StageGraph, StageReport
from .warm import WarmCompileReport, compiled_graphs, warm_compile

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
            "cache": None if self.cache is None else self.cache.status,
            "recompiles": self.recompiles,
            "spec_mismatch": list(self.spec_mismatch),
            "dynamic_dims_specialized": self.dynamic_dims_specialized,
        }


class StartResult(NamedTuple):
    model: Any  # the compiled model (warm)
    first_batch: Any  # the first real batch
    report: StartReport
    batches: Iterator  # the loader's iterator, positioned after the first batch


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
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def _specialization(error: Exception) -> str:
    """The guard in Dynamo's ConstraintViolationError ("Not all values of ... satisfy the generated guard ...")."""
    lines = [line.strip(" -") for line in str(error).splitlines()]
    detail = [line for line in lines if "generated guard" in line or "specialized" in line]
    return "; ".join(detail) if detail else (lines[0] if lines else type(error).__name__)


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
    - ``cache``: a :class:`CompileCache` to load before compiling (save it yourself after the first steps).
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

    results = g.results  # not `g` itself: the graph owns these callables, they must not own it back
    g.add("loader_iter", lambda: iter(loader), forks=_iter_forks(loader), phase="preproc_creation")
    g.add("get_first_batch_data", lambda: next(results["loader_iter"]), after=["loader_iter"])
    compile_deps = list(compile_after)
    if cache is not None:
        g.add("cache_load", cache.load, runs_dynamo=True, phase="compile")
        compile_deps.append("cache_load")

    def compile_stage() -> tuple:
        # torch.compile() itself imports Dynamo (seconds in a fresh process): do it here, overlapped.
        compiled = model if _is_compiled(model) else torch.compile(model, **(compile_kwargs or {}))
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

        try:
            return compiled, warm_compile(compiled, spec.fast_batch(seed), loss_fn, forward=forward), None
        except ConstraintViolationError as e:
            # The model or Inductor made a size-dependent choice on a declared dynamic dim (e.g. Inductor's CPU
            # mm decomposition guards on the batch size of a matmul with an inner size of 1). A graph that
            # serves the whole declared range does not exist: compile with soft dims, and say which guard.
            specialized = _specialization(e)
            return compiled, warm_compile(compiled, spec.fast_batch(seed, soft=True), loss_fn, forward=forward), \
                specialized

    g.add("compile", compile_stage, after=compile_deps, runs_dynamo=True, phase="compile")

    try:
        stages = g.run()
    except BaseException:
        iterator = g.results.get("loader_iter")
        if iterator is not None:
            _shutdown(iterator)  # do not leave worker processes behind a failed start
        raise
    first_batch = g.results["get_first_batch_data"]
    mismatch = spec.diff(first_batch)
    if mismatch:
        message = (
            "the first real batch does not match the batch spec the model was compiled for: "
            + "; ".join(mismatch)
        )
        if strict:
            _shutdown(g.results["loader_iter"])
            raise BatchMismatchError(message)
        warnings.warn(message + " (the first step will recompile)", RuntimeWarning, stacklevel=2)
    specialized = g.results["compile"][2]
    if specialized:
        warnings.warn(
            f"the compile specialized a dynamic dim of the batch spec ({specialized}); compiled again with the dims "
            "marked soft (torch._dynamo.maybe_mark_dynamic): batch sizes outside the graph's guard recompile once "
            "(report.recompiles). Set Dim(hint=...) to the size of the real batches so that the warm graph "
            "covers them, or narrow Dim(min, max) to a range the guard allows.",
            RuntimeWarning,
            stacklevel=2,
        )
    time_to_start = time.perf_counter() - t0

    def dur(name: str) -> float:
        s = stages.stages.get(name)
        return s.duration_s if s is not None else 0.0

    report = StartReport(
        time_to_start_s=time_to_start,
        compile_s=dur("cache_load") + dur("compile"),
        first_batch_s=dur("loader_iter") + dur("get_first_batch_data"),
        cache=g.results.get("cache_load"),
        warm=g.results["compile"][1],
        stages=stages,
        spec_mismatch=mismatch,
        dynamic_dims_specialized=specialized,
        graphs_at_start=compiled_graphs(),
    )
    return StartResult(g.results["compile"][0], first_batch, report, g.results["loader_iter"])
