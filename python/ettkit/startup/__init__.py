"""Start-up without the serial wait: a stage DAG, PT2 compile on a fast batch overlapped with the data
warm-up, and compile caches that make restarts warm. See docs/startup.md.

::

    from ettkit import startup

    spec = startup.BatchSpec({...})                       # or BatchSpec.from_batch(sample, dynamic_dims={"*": 0})
    cache = startup.CompileCache(ckpt_dir / "compile-cache", model=model, spec=spec, precompile=True)
    model, batch, report, batches = startup.overlapped_start(model, loader, spec, loss_fn, cache)
    for step, batch in enumerate(itertools.chain([batch], batches)):   # the start saved the cache itself
        train_step(model, batch)
"""

from ..errors import BatchMismatchError, StageError
from .batch_spec import BatchSpec, Dim, TensorSpec
from .import_gate import serialized_imports
from .cache import CacheLoadResult, CacheSaveResult, CompileCache, CompileCacheWarning, compile_fingerprint
from .overlap import StartReport, StartResult, overlapped_start
from .precompile_job import PrecompileResult, precompile
from .precompiled import PrecompiledModel
from .stages import StageGraph, StageRecord, StageReport
from .warm import WarmCompileReport, compile_counters, compiled_graphs, warm_compile

__all__ = [
    "BatchMismatchError",
    "BatchSpec",
    "CacheLoadResult",
    "CacheSaveResult",
    "CompileCache",
    "CompileCacheWarning",
    "Dim",
    "PrecompileResult",
    "PrecompiledModel",
    "StageError",
    "StageGraph",
    "StageRecord",
    "StageReport",
    "StartReport",
    "StartResult",
    "TensorSpec",
    "WarmCompileReport",
    "compile_counters",
    "compile_fingerprint",
    "compiled_graphs",
    "overlapped_start",
    "precompile",
    "serialized_imports",
    "warm_compile",
]
