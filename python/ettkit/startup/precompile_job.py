"""Filling the shared compile cache ahead of a job: ``python -m ettkit precompile`` and :func:`precompile`.

A job that starts from the shared cache (``CompileCache(shared_dir=...)``) compiles nothing, but the first
job of a model still compiles cold. :func:`precompile` runs that compile apart from any job, on a machine of
the job's kind (the key includes the torch build, the CPU ISA or GPU and its device index), from the
trainer's own model factory and batch spec, while the job waits in the scheduler's queue::

    ETTKIT_COMPILE_CACHE_SECRET=... python -m ettkit precompile \\
        --model mytrainer:build_model --spec mytrainer:batch_spec --shared-dir /shared/compile-cache \\
        --run-dir /shared/runs/precompile-resnet

It builds the model and the spec exactly as the trainer does (same classes, parameters, train/eval mode,
batch spec and compile configuration, so the same key), precompiles the forward as
:func:`ettkit.startup.overlapped_start` would, and writes the file into its own directory and, sealed with
the cache's HMAC, into the shared one. With ``--run-dir`` it writes its own ETT ledger (one attempt, its
compile phase, the note ``job_kind=precompile``), so a fleet report counts the time it took instead of
hiding it. Nothing is compiled when the shared cache already has a file for the key.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .cache import CacheSaveResult, CompileCache

__all__ = ["PrecompileResult", "precompile"]


@dataclasses.dataclass(frozen=True)
class PrecompileResult:
    """``status``: "compiled" (compiled now, written here and shared), "shared" (the shared cache already had
    a valid file: nothing compiled), or "published" (this directory's own file was valid: shared as it is).
    ``shared_save``: the write into the shared cache (None for "shared"); ``seconds``: the whole call."""

    status: str
    reason: str
    seconds: float
    shared_save: CacheSaveResult | None = None


def precompile(
    model: Any,
    spec: Any,
    cache: CompileCache,
    *,
    forward: Callable[[Any, Any], Any] | None = None,
    compile_kwargs: dict | None = None,
    seed: int = 0,
    recorder: Any = "current",
) -> PrecompileResult:
    """Precompiles ``model``'s forward for ``spec`` into ``cache`` (``precompile=True`` and ``shared_dir``
    required) as :func:`~ettkit.startup.overlapped_start` would, without a loader and without training.
    ``forward``, ``compile_kwargs`` and ``seed`` must be the trainer's (they decide the graph). Raises
    InvalidArgumentError for a cache without the shared tier, and RuntimeError naming why when the model
    cannot be precompiled (a graph break: the hint says what to change)."""
    from ..ett import recorder as _ett_recorder
    from .overlap import _OverlappedStart, _precompile_blocker
    from .stages import StageGraph

    if not cache.precompile or cache.shared_dir is None:
        raise InvalidArgumentError(
            "precompile() fills a shared compile cache: give it CompileCache(..., precompile=True, shared_dir=...)"
        )
    blocker = _precompile_blocker(model)
    if blocker:
        raise InvalidArgumentError(f"this model cannot be precompiled: {blocker}")
    t0 = time.perf_counter()
    rec = _ett_recorder.resolve(recorder, "precompile", stacklevel=2)
    loaded, fn = cache.load_precompiled()
    if fn is not None:
        if loaded.source is not None:  # the shared cache has it (and this directory has a copy now)
            return PrecompileResult("shared", loaded.reason, time.perf_counter() - t0)
        saved = cache.publish_shared()
        return PrecompileResult("published", f"this directory's file for the key: {saved.reason}",
                                time.perf_counter() - t0, saved)
    start = _OverlappedStart(model, spec, None, cache, forward, compile_kwargs, seed, StageGraph(recorder=rec))
    with rec.phase("compile") if rec is not None else contextlib.nullcontext():
        fn = start.precompile_forward()
    if fn is None:
        hint = start.fallback.get("hint")
        raise RuntimeError(f"the model could not be precompiled: {start.fallback.get('reason')}"
                           + (f" ({hint})" if hint else ""))
    saved = start.fallback.get("save")
    if saved is None or not saved.written:
        raise RuntimeError(f"the precompiled file could not be written: {saved.reason if saved else 'no save'}")
    shared = start.fallback.get("shared_save")
    if rec is not None:
        rec.set_note("compile_cache", "precompiled for the shared cache")
    return PrecompileResult("compiled", f"compiled in {start.fallback.get('seconds', 0.0):.1f} s",
                            time.perf_counter() - t0, shared)


def _load_object(text: str, flag: str) -> Any:
    """``module:attribute`` (dots allowed in both) imported the way ``python -m`` would find it."""
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidArgumentError(f"{flag} {text!r}: write MODULE:NAME, e.g. mytrainer:build_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(f"{flag} {text!r}: cannot import {module_name} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidArgumentError(f"{flag} {text!r}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


def _json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{flag}: a JSON object is needed, e.g. '{{\"mode\": \"max-autotune\"}}'")
    return value


def command(args: argparse.Namespace) -> int:
    """``ettkit precompile``: exit 0 when the shared cache holds the key's file afterwards, 2 otherwise."""
    try:
        factory = _load_object(args.model, "--model")
        spec = _load_object(args.spec, "--spec")
        forward = _load_object(args.forward, "--forward") if args.forward else None
        config = _json_object(args.config, "--config")
        compile_kwargs = _json_object(args.compile_kwargs, "--compile-kwargs")
        import torch

        model = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) else factory
        spec = spec() if callable(spec) and not hasattr(spec, "fast_batch") else spec
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"--model {args.model}: gave a {type(model).__name__}, not a torch.nn.Module")
        if not hasattr(spec, "fast_batch"):
            raise InvalidArgumentError(f"--spec {args.spec}: gave a {type(spec).__name__}, not a BatchSpec")
        if args.device:
            model = model.to(args.device)
        with contextlib.ExitStack() as stack:
            cache_dir = args.cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ettkit-precompile-"))
            cache = CompileCache(cache_dir, model=model, spec=spec, config=config, precompile=True,
                                 shared_dir=args.shared_dir, job=args.job)
            rec = None
            if args.run_dir:
                from ..ett import Recorder

                rec = stack.enter_context(Recorder(args.run_dir))
                rec.set_note("job_kind", "precompile")
                # Which hours the fleet report counts this run's time in (fleet.py: precompile.by_device_h).
                first = next(iter(model.parameters()), None)
                rec.set_note("device", first.device.type if first is not None else "cpu")
            result = precompile(model, spec, cache, forward=forward, compile_kwargs=compile_kwargs,
                                seed=args.seed, recorder=rec)
    except (InvalidArgumentError, RuntimeError, OSError) as exc:
        print(f"ettkit precompile: error: {exc}", file=sys.stderr)
        return 2
    shared = result.shared_save
    if shared is not None and not shared.written:
        print(f"ettkit precompile: error: {result.reason}, but the shared cache was not written: {shared.reason}",
              file=sys.stderr)
        return 2
    where = os.path.join(args.shared_dir, cache.shared_name)
    print(f"ettkit precompile: {result.status}: {where} ({result.reason}; {result.seconds:.1f} s)")
    return 0
