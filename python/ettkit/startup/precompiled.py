"""The precompiled tier: a module's forward (and its backward) compiled ahead of time, saved, and loaded by a
restart without running Dynamo, AOTAutograd or Inductor again.

torch >= 2.13 has ``torch.compile(module, fullgraph=True).forward.aot_compile(((args...), {kwargs}))``: it
traces the forward on the example inputs and compiles forward and backward (when parameters require grad)
without running the model, so no buffer, gradient or RNG state changes. The result is a callable
``fn(module, *args)`` with Dynamo's guards attached, which serializes to bytes and loads in a fresh process
(``torch.compiler.load_compiled_function``). A MegaCache restart replays caches but still traces and lowers;
this tier skips all of it.

What this module adds around those calls:

- :func:`capture_call_args`: the arguments the training step passes to the module, found by running the
  caller's ``forward(model, batch)`` on a stand-in that records its call and stops there (the demo's
  forward builds a pooled-embedding tensor before calling the dense part; the plain case is ``model(batch)``);
- :class:`PrecompiledModel`: what the training loop calls. It checks the guards on every call itself; a call
  the guards reject (another shape, dtype or mode than the spec declared) warns once and runs through an
  ordinary ``torch.compile`` of the same module (a recompile, counted like one), never the precompiled graph
  on inputs it was not compiled for;
- :func:`source_fingerprint` / :func:`changed_sources`: every function Dynamo inlined (the model's forward and
  the helpers it calls), by module, line range and checksum, so that an artifact whose Python source changed
  is stale even when the module tree and the spec are not (a MegaCache replay re-traces, a precompiled
  artifact would not).

torch APIs used (all public or documented as experimental in torch 2.13/2.14): ``OptimizedModule.forward
.aot_compile``, ``AOTCompiledFunction.serialize`` / ``guard_check`` / ``disable_guard_check`` /
``source_info``, ``torch.compiler.load_compiled_function``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PrecompiledModel", "capture_call_args", "changed_sources", "source_fingerprint", "supported"]


def supported() -> str | None:
    """None when this torch can precompile, else why not."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function (needs torch >= 2.13)"
    return None


class _Called(Exception):
    """Raised by the stand-in module once it has recorded its call: the rest of forward() must not run."""


class _CallRecorder:
    """Stands in for the module in the caller's ``forward(model, batch)``: attribute reads go to the module,
    the call is recorded."""

    def __init__(self, module: torch.nn.Module):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "call", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_module"), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        object.__setattr__(self, "call", (args, kwargs))
        raise _Called


def capture_call_args(
    module: torch.nn.Module, batch: Any, forward: Callable[[Any, Any], Any] | None
) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` the training step passes to ``module`` for ``batch``: ``((batch,), {})`` for the
    default forward, else what ``forward(model, batch)`` calls the model with (its first call). Raises
    ValueError when ``forward`` returns without calling the model."""
    if forward is None:
        return (batch,), {}
    stand_in = _CallRecorder(module)
    try:
        with torch.enable_grad():
            forward(stand_in, batch)
    except _Called:
        pass
    if stand_in.call is None:
        raise ValueError("forward(model, batch) returned without calling the model")
    return stand_in.call


def source_fingerprint(fn: Any) -> list:
    """``[[module, first line, last line, sha256], ...]`` of every source Dynamo inlined into ``fn`` outside
    torch itself (torch's own sources are covered by the torch version in the cache key)."""
    out = []
    try:
        sources = fn.source_info().inlined_sources
    except Exception:  # noqa: BLE001 - an older AOTCompiledFunction without source_info
        return out
    for s in sorted(sources, key=lambda s: (s.module, s.firstlineno)):
        if s.module == "torch" or s.module.startswith("torch."):
            continue
        out.append([s.module, int(s.firstlineno), int(s.lastlineno), str(s.checksum)])
    return out


def _current_checksum(module_name: str, first: int, last: int) -> str | None:
    try:
        m = importlib.import_module(module_name)
        lines = inspect.getsourcelines(m)[0][first - 1 : last - 1]
    except Exception:  # noqa: BLE001 - gone, renamed, or no source: not the same code
        return None
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def changed_sources(recorded: Any) -> list:
    """The entries of a :func:`source_fingerprint` whose source is not what it was ("module:first-last")."""
    changed = []
    for entry in recorded if isinstance(recorded, list) else []:
        try:
            module_name, first, last, checksum = entry
        except (TypeError, ValueError):
            return ["malformed source list"]
        if _current_checksum(str(module_name), int(first), int(last)) != checksum:
            changed.append(f"{module_name}:{first}-{last}")
    return changed


def import_compile_stack() -> None:
    """Imports what loading a precompiled forward imports (Dynamo's AOT loader, Inductor's code caches, and
    the modules its generated code imports): 1.8 s of a 2.4 s load measured on the CI machine. A rank that
    waits for rank 0's file does it while it waits. Best effort: a module missing in another torch only
    moves the cost back into the load."""
    for name in (
        "torch._dynamo.aot_compile",
        "torch._inductor.codecache",
        "torch._inductor.lowering",
        "torch._inductor.select_algorithm",
        "torch._inductor.codegen.wrapper",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def serialize(fn: Any) -> bytes:
    return type(fn).serialize(fn).serialized_data


def deserialize(data: bytes) -> Any:
    """The compiled function in ``data``. torch's loader is a plain unpickler (``AOTCompileUnpickler``): the
    bytes run whatever code they name. Only for bytes from a file this user trusts (CompileCache reads them
    through :class:`ettkit.startup.trusted_files.CacheDirectory`) or from a payload whose HMAC verified."""
    return torch.compiler.load_compiled_function(io.BytesIO(data))


_FENCE_MARK = "_ettkit_checkpoint_fence"  # set by ettkit.checkpoint's attach() on its forward pre-hooks


def _checkpoint_fences(module: torch.nn.Module) -> list:
    """``[(submodule, [fence hooks]), ...]``: the checkpoint fences among the forward pre-hooks of
    ``module``'s tree (a walk of the tree: about a microsecond per module)."""
    out = []
    for m in module.modules():
        hooks = m._forward_pre_hooks
        if hooks:
            fences = [h for h in hooks.values() if getattr(h, _FENCE_MARK, False)]
            if fences:
                out.append((m, fences))
    return out


@contextlib.contextmanager
def _fences_detached(fences: list):
    """Each fenced module's pre-hook dict replaced, for the block, by a copy without its fences (the
    caller's own hooks stay), and put back after (the same object: the hooks' removal handles keep working)."""
    saved = [(m, m._forward_pre_hooks) for m, _ in fences]
    try:
        for m, hooks in saved:
            kept = type(hooks)()
            for key, hook in hooks.items():
                if not getattr(hook, _FENCE_MARK, False):
                    kept[key] = hook
            m._forward_pre_hooks = kept
        yield
    finally:
        for m, hooks in saved:
            m._forward_pre_hooks = hooks


def checkpoint_fences_detached(module: torch.nn.Module):
    """A block in which ``module``'s tree has none of the checkpoint fences (its other hooks stay): what
    ``aot_compile`` traces and pickles must not reach the checkpointer a fence closes over (a C++ object that
    cannot be pickled), and what the graph's guards record must be what :class:`PrecompiledModel` checks
    them against (the tree without its fences)."""
    return _fences_detached(_checkpoint_fences(module))


def _hook_names(module: torch.nn.Module, limit: int = 4) -> list:
    """``["bn: forward_pre_hook check_stats", ...]``: the hooks of ``module``'s tree other than the checkpoint
    fences (those are kept out of the artifact), the usual holders of something that cannot be pickled."""
    out = []
    for name, m in module.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            for hook in getattr(m, kind, {}).values():
                if getattr(hook, _FENCE_MARK, False):
                    continue
                label = getattr(hook, "__qualname__", type(hook).__name__)
                out.append(f"{name or '<root>'}: {kind.strip('_')[:-1]} {label}")
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


def failure_hint(exc: BaseException, module: Any) -> str:
    """How to fix an ``aot_compile`` failure, for the warning that says the precompiled tier is not used."""
    text = f"{type(exc).__name__}: {exc}".lower()
    off = "or pass CompileCache(precompile=False) to take the MegaCache path without this warning"
    if "pickle" in text or "serializ" in text:
        hooks = _hook_names(module) if isinstance(module, torch.nn.Module) else []
        where = f" (hooks on the model: {'; '.join(hooks)})" if hooks else ""
        return (
            "the precompiled file must hold everything the forward reaches, and the object named above cannot be "
            f"pickled{where}. A hook or module attribute that holds a lock, an open file or a C++ object cannot "
            "be saved (ettkit's own checkpoint fences are kept out, whether attach() ran before or after the "
            "start): make the hook and what it holds picklable (e.g. a __getstate__ that leaves the lock "
            "out), keep the object off the model, " + off
        )
    if "graph break" in text or "unsupported" in text or "fullgraph" in text:
        return (
            "the precompiled tier needs the forward as one graph (aot_compile runs with fullgraph=True): remove the "
            "graph break named above (torch._dynamo.explain(model)(batch) lists every one), " + off
        )
    return "see docs/startup.md, \"The precompiled tier\", " + off


class PrecompiledModel:
    """What :func:`ettkit.startup.overlapped_start` returns on the precompiled tier, in place of
    ``torch.compile(module)``: ``model(*args)`` runs the precompiled forward (its backward runs in
    ``loss.backward()``); other attributes are the module's (``model.parameters()``, ``model.train()``), and
    ``model._orig_mod`` is the module, as on a compiled module.

    Promise: the precompiled graph only ever runs on calls its guards accept. A rejected call (a batch of
    another shape than the spec declared, another dtype, eval mode) warns once per reason and runs through
    ``torch.compile(module, **compile_kwargs)``, compiled then (counted in ``report.recompiles``) and reused.
    ``fallback_calls`` counts such calls. The forward pre-hooks that ``AsyncCheckpointer.attach(model=...)``
    installs after the start (its fences, which only wait for a copy) all run before the graph, on every
    call, and the graph runs without them: they neither make a call fall back nor get skipped. Not for concurrent calls from two threads (torch: "load once per
    thread"), like the module itself in a training loop. The module is the caller's; this object holds a
    reference and never changes it."""

    def __init__(self, module: torch.nn.Module, fn: Any, *, origin: str, compile_kwargs: dict | None = None):
        self._orig_mod = module
        self._fn = fn
        self._fn.disable_guard_check()  # checked here, once per call, so a reject can fall back
        self.origin = origin  # "loaded" (from the cache file) or "compiled" (in this process)
        self._compile_kwargs = dict(compile_kwargs or {})
        self._jit: Any = None
        self._warned: set = set()
        self.fallback_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._orig_mod
        # AsyncCheckpointer.attach(model=...) after the compile adds forward pre-hooks (its fences) that the
        # graph was traced without. Dynamo guards on the called module's hooks but not on its submodules'
        # (skip_nnmodule_hook_guards), so the graph would either be rejected or silently skip a BatchNorm's
        # fence, and a save could then commit statistics written during its copy. A fence only waits for the
        # copy of the buffers its module writes: run before the whole graph it waits earlier, never later. So
        # every fence of the tree runs here, and the graph runs with them taken out.
        fences = _checkpoint_fences(module)
        if not fences:
            if self._fn.guard_check(module, *args, **kwargs):
                return self._fn(module, *args, **kwargs)
            return self._fallback(args, kwargs)
        with _fences_detached(fences):
            accepted = self._fn.guard_check(module, *args, **kwargs)
        if not accepted:
            return self._fallback(args, kwargs)  # torch.compile traces the fences into its graph
        for m, hooks in fences:
            for hook in hooks:
                hook(m, args)
        with _fences_detached(fences):
            return self._fn(module, *args, **kwargs)

    def _fallback(self, args: tuple, kwargs: dict) -> Any:
        self.fallback_calls += 1
        reason = self.rejection(*args, **kwargs)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"the precompiled forward's guards reject this call ({reason}); running it through torch.compile "
                "instead (a recompile). For batches of other sizes, declare their dynamic dims in the BatchSpec; "
                "for a mode, hook or module attribute set after the start, set it before overlapped_start so that "
                "the graph is compiled with it.",
                RuntimeWarning,
                stacklevel=3,
            )
        if self._jit is None:
            self._jit = torch.compile(self._orig_mod, **self._compile_kwargs)
        return self._jit(*args, **kwargs)

    def rejection(self, *args: Any, **kwargs: Any) -> str:
        """Why the guards reject a call (the failing guard, in Dynamo's words), "" if they accept it."""
        module = self._orig_mod
        with _fences_detached(_checkpoint_fences(module)):  # as __call__ checks: the fences are not the reason
            return self._rejection(module, args, kwargs)

    def _rejection(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> str:
        if self._fn.guard_check(module, *args, **kwargs):
            return ""
        try:
            f_locals = self._fn.prepare_f_locals(module, *args, **kwargs)
            verbose = self._fn._artifacts.guard_manager.check_verbose(f_locals)
            parts = getattr(verbose, "verbose_code_parts", None)
            return "; ".join(parts) if parts else str(verbose)
        except Exception as exc:  # noqa: BLE001 - torch internals; the reject itself is what matters
            return f"guard check failed ({type(exc).__name__})"

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks: everything else is the module's.
        if name.startswith("__") or name in ("_orig_mod", "_fn"):
            raise AttributeError(name)
        return getattr(self._orig_mod, name)

    def __repr__(self) -> str:
        return f"PrecompiledModel({type(self._orig_mod).__name__}, origin={self.origin!r})"
