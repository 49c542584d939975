"""The MegaCache source of a :class:`ettkit.startup.CompileCache`: ``megacache-<key>.bin`` in its directory.

``torch.compiler.save_cache_artifacts()`` serializes every cache artifact this process produced or used, and
``load_cache_artifacts(bytes)`` puts them into the local caches of a fresh process, where the next compile
finds them. The file also carries the compiled CPU kernel libraries (``kernels=True``), which MegaCache does
not (torch 2.14): a "warm" CPU restart would otherwise still run g++ for every kernel.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

from . import cache_format
from .cache_files import CacheFiles
from .cache_format import megacache_artifacts
from .cache_results import CacheLoadResult, CacheSaveResult, CompileCacheWarning
from .warm import compile_counters, counter_delta

__all__ = ["MegacacheFile"]


def _artifact_counts(info: Any) -> dict:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items()}


def _artifact_keys(info: Any) -> set:
    artifacts = getattr(info, "artifacts", None) or {}
    return {(str(kind), str(k)) for kind, keys in artifacts.items() for k in keys}


class MegacacheFile:
    """The source's interface: :meth:`load` (before compiling) and :meth:`save` (after), each a result."""

    def __init__(self, files: CacheFiles):
        self.files = files
        self.path = files.path(files.key.megacache_name)
        # What the last load put into torch's caches: a save that would add nothing is skipped.
        self._loaded_keys: set | None = None
        self._loaded_kernels: set = set()
        self._counters_at_load: dict | None = None
        self.last_load: CacheLoadResult | None = None
        self.last_save: CacheSaveResult | None = None

    # ---- load ----------------------------------------------------------------------------------------

    def load(self) -> CacheLoadResult:
        t0 = time.perf_counter()
        self._counters_at_load = compile_counters()
        result = self._load(t0)
        self.last_load = result
        return result

    def _miss_reason(self) -> str:
        try:
            others = sorted(p.name for p in self.files.dir.glob("megacache-*.bin") if p != self.path)
        except OSError:
            others = []
        if not others:
            return "no cache for this key"
        return (
            f"no cache for this key ({len(others)} cache file(s) for other keys: torch, machine, model or "
            "config changed)"
        )

    def _load(self, t0: float) -> CacheLoadResult:
        files = self.files
        data = files.read(self.path, t0, "no cache for this key")
        if isinstance(data, CacheLoadResult):
            return dataclasses.replace(data, reason=self._miss_reason()) if data.status == "miss" else data
        file = files.checked(data, t0, self.path, cache_format.MEGACACHE)
        if isinstance(file, CacheLoadResult):
            return file
        megacache = file.section
        try:
            megacache_artifacts(megacache)  # before torch sees a key, and before any kernel is written
        except ValueError as exc:
            return files.ignored("corrupt", str(exc), t0, self.path)
        restored = self.files.restore_kernels(file, self.path)
        import torch._dynamo

        try:
            info = torch.compiler.load_cache_artifacts(megacache)
        except Exception as exc:  # noqa: BLE001 - torch rejecting a cache must not stop the job
            return files.ignored("rejected", f"torch rejected its artifacts ({type(exc).__name__}: {exc})", t0,
                                 self.path)
        self._loaded_keys = _artifact_keys(info)
        self._loaded_kernels = {k["path"] for k in file.kernels}
        artifacts = _artifact_counts(info)
        if file.kernels:
            artifacts["cpu_kernel_files"] = restored
        return CacheLoadResult(
            "hit", str(self.path), "loaded", artifacts=artifacts, bytes=len(file.body),
            seconds=time.perf_counter() - t0,
        )

    def save(self) -> CacheSaveResult:
        result = self._save()
        self.last_save = result
        return result

    def _save(self) -> CacheSaveResult:
        import torch._dynamo

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return CacheSaveResult(False, str(self.path), "nothing was compiled in this process")
        files = self.files
        megacache, info = saved
        counts = _artifact_counts(info)
        keys = _artifact_keys(info)
        kernel_files = files.loaded_kernel_files() if files.kernels else []
        kernel_paths = {rel for rel, _ in kernel_files}
        if (
            self._loaded_keys is not None
            and keys <= self._loaded_keys
            and kernel_paths <= self._loaded_kernels
            and self.path.exists()
        ):
            return CacheSaveResult(False, str(self.path), "unchanged since load", counts, len(megacache))
        blobs = files.kernel_blobs(kernel_files, self.path)
        if blobs:
            counts["cpu_kernel_files"] = len(blobs)
        data, body = files.encode(cache_format.MEGACACHE, megacache, blobs, {"artifacts": counts})
        try:
            files.write_atomic(data, self.path)
        except OSError as exc:
            warnings.warn(f"could not write compile cache {self.path}: {exc}", CompileCacheWarning, stacklevel=4)
            return CacheSaveResult(False, str(self.path), f"write failed: {exc}", counts, len(body))
        self._loaded_keys = keys
        self._loaded_kernels = {rel for rel, _ in blobs}
        return CacheSaveResult(True, str(self.path), "written", counts, len(body))

    # ---- reporting -----------------------------------------------------------------------------------

    def stats(self) -> dict:
        since = self._counters_at_load or {}
        delta = counter_delta(since, compile_counters()) if since else {}
        return {
            "file": self.last_load.status if self.last_load else "not_loaded",
            "artifacts_loaded": sum(self.last_load.artifacts.values()) if self.last_load else 0,
            "fxgraph_hits": delta.get("fxgraph_cache_hit", 0),
            "fxgraph_misses": delta.get("fxgraph_cache_miss", 0),
            "autograd_hits": delta.get("autograd_cache_hit", 0),
            "autograd_misses": delta.get("autograd_cache_miss", 0),
        }
