"""The precompiled source of a :class:`ettkit.startup.CompileCache`: ``precompiled-<key>.bin`` in its directory.

The module's forward and backward compiled ahead of time (``aot_compile``; :mod:`ettkit.startup.precompiled`),
the compiled CPU kernels it uses and the checksums of every Python source Dynamo inlined. A load never returns
an artifact whose key or sources differ ("stale") or whose bytes are damaged ("corrupt").
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from typing import Any

from . import cache_format
from .cache_files import CacheFiles
from .cache_results import CacheLoadResult, CacheSaveResult, CompileCacheWarning

__all__ = ["PrecompiledFile"]


def _producer(job: str | None) -> dict:
    """Who wrote a precompiled file: kept in its header, shown in the ledger note of a start that loads it
    from the shared cache (the fleet report then tells which job's compile served which start)."""
    if not job:
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
        job = "" if job == "none" else job  # torchrun's default --rdzv-id
    try:
        import pwd

        user = pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        user = str(os.geteuid())
    return {"job": job or f"pid {os.getpid()}", "host": platform.node(), "user": user, "written": time.time()}


class PrecompiledFile:
    """The source's interface: :meth:`load` (a ``(result, fn)`` pair) and :meth:`save` (a result).
    ``keep_publishable``: keep the bytes this process wrote (or loaded from a directory only this user can
    write) for the shared cache (see :attr:`publishable`)."""

    def __init__(self, files: CacheFiles, *, job: str | None, keep_publishable: bool):
        self.files = files
        self.path = files.path(files.key.precompiled_name)
        self.job = job
        self.keep_publishable = keep_publishable
        # The precompiled file's bytes as this process wrote them (or loaded them from a directory only this
        # user can write): what the shared cache's publish seals. Never re-read from the directory, which
        # others may write under trust_shared=True, and which could change between the save and a re-read.
        self.publishable: bytes | None = None

    def load(self) -> tuple[CacheLoadResult, Any]:
        """This directory's file, loaded: ``(result, fn)``, ``fn`` None when it is not usable."""
        from . import precompiled

        files = self.files
        t0 = time.perf_counter()
        path = self.path
        why_not = precompiled.supported()
        if why_not:
            return CacheLoadResult("miss", str(path), why_not, seconds=time.perf_counter() - t0), None
        data = files.read(path, t0, "no precompiled artifact for this key")
        if isinstance(data, CacheLoadResult):
            return data, None
        file = files.checked(data, t0, path, cache_format.PRECOMPILED)
        if isinstance(file, CacheLoadResult):
            return file, None
        changed = precompiled.changed_sources(file.header.get("sources", []))
        if changed:
            return files.ignored(
                "stale", f"the Python source it was traced from has changed ({', '.join(changed[:5])})", t0, path
            ), None
        restored = self.files.restore_kernels(file, self.path)
        try:
            fn = precompiled.deserialize(file.body[: file.section_bytes])
        except Exception as exc:  # noqa: BLE001 - torch refusing an artifact must not stop the job
            return files.ignored("rejected", f"torch rejected it ({type(exc).__name__}: {exc})", t0, path), None
        if self.keep_publishable and not files.trust_shared:
            self.publishable = data  # this user's own file, in a directory only this user can write
        artifacts = {"precompiled": 1}
        if file.kernels:
            artifacts["cpu_kernel_files"] = restored
        specialized = file.header.get("dynamic_dims_specialized")
        result = CacheLoadResult(
            "precompiled", str(path), "loaded", artifacts=artifacts, bytes=len(file.body),
            seconds=time.perf_counter() - t0,
            dynamic_dims_specialized=specialized if isinstance(specialized, str) else None,
        )
        return result, fn

    def save(self, fn: Any, dynamic_dims_specialized: str | None = None) -> CacheSaveResult:
        """Writes ``fn`` (an ``aot_compile`` result) with the kernels this process loaded and its sources'
        checksums; warns and returns ``written=False`` on an I/O error or an unserializable artifact."""
        from . import precompiled

        files, path = self.files, self.path
        try:
            artifact = precompiled.serialize(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. a module captured in a closure
            warnings.warn(f"cannot serialize the precompiled forward: {exc}", CompileCacheWarning, stacklevel=3)
            return CacheSaveResult(False, str(path), f"not serializable: {type(exc).__name__}: {exc}")
        blobs = files.kernel_blobs(files.loaded_kernel_files() if files.kernels else [], path)
        counts = {"precompiled": 1}
        if blobs:
            counts["cpu_kernel_files"] = len(blobs)
        extra = {"artifacts": counts, "sources": precompiled.source_fingerprint(fn), "producer": _producer(self.job)}
        if dynamic_dims_specialized:
            extra["dynamic_dims_specialized"] = dynamic_dims_specialized
        data, body = files.encode(cache_format.PRECOMPILED, artifact, blobs, extra)
        try:
            files.write_atomic(data, path)
        except OSError as exc:
            warnings.warn(f"could not write compile cache {path}: {exc}", CompileCacheWarning, stacklevel=3)
            return CacheSaveResult(False, str(path), f"write failed: {exc}", counts, len(body))
        if self.keep_publishable:
            self.publishable = data
        return CacheSaveResult(True, str(path), "written", counts, len(body))
