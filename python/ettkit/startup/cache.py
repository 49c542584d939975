"""Compile caches for warm restarts: PT2's compile artifacts persisted next to the checkpoints.

:class:`CompileCache` is a core with its sources around it. The core is the key (:mod:`.cache_key`: the torch
build, Triton, Python, the machine and a fingerprint of the model, its batch spec and compile configuration),
the HMAC sealing of what comes from others (:mod:`.cache_seal`) and the cache's own directory
(:mod:`.cache_files`: trusted reads, header checks against the key, atomic writes). Each source is a module
with a ``load`` and a ``save``:

- :mod:`.cache_megacache`: ``megacache-<key>.bin``, torch's MegaCache and the compiled CPU kernels
  (``cache.load()`` before compiling, ``cache.save()`` once forward and backward have compiled);
- :mod:`.cache_precompiled`: ``precompiled-<key>.bin``, the forward and backward compiled ahead of time
  (``precompile=True``, torch >= 2.13), which a warm start loads without Dynamo, AOTAutograd or Inductor;
- :mod:`.cache_shared`: the precompiled file from a cache that jobs share (``shared_dir=``);
- :mod:`.cache_store`: rank 0's precompiled file through the job's c10d Store (``store=``, compile once per
  job).

None is ever fatal: a missing, stale ("another key", "changed sources"), corrupt, untrusted or rejected file
warns with a :class:`CompileCacheWarning` (except a plain miss) and the job compiles cold.
:func:`ettkit.startup.overlapped_start` loads and saves the cache itself, on the compile's thread.

Trust (docs/startup.md, "What a compile cache trusts"): both files hold pickles that run code as they load,
so a file is loaded only from a directory and a file this user owns that nobody else can write, opened
without following symlinks (:mod:`ettkit.startup.trusted_files`); anything else is "untrusted" (warned, a
cold compile) unless ``trust_shared=True``. MegaCache artifact keys are checked before torch sees them (a key
becomes a path under Inductor's cache dir). What comes through the Store or from the shared cache carries an
HMAC-SHA256 keyed by a secret given outside it, verified before a byte of it is used.

The bytes of a file and their strict checks are :mod:`ettkit.startup.cache_format`'s, finding and restoring
the compiled kernels is :mod:`ettkit.startup.compiled_kernels`'.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .cache_files import CacheFiles
from .cache_key import CacheKey, compile_fingerprint
from .cache_megacache import MegacacheFile
from .cache_precompiled import PrecompiledFile
from .cache_results import CacheLoadResult, CacheSaveResult, CompileCacheWarning
from .cache_seal import CACHE_SECRET_ENV, NO_SECRET, read_secret, read_share_secret
from .cache_shared import SharedCache
from .cache_store import StoreShare
# Module names, looked up at each call, so that tests can replace what Inductor would report.
from .compiled_kernels import inductor_cache_dir as _inductor_cache_dir
from .compiled_kernels import loaded_kernel_files as _loaded_kernel_files

__all__ = ["CacheLoadResult", "CacheSaveResult", "CompileCache", "CompileCacheWarning", "compile_fingerprint"]


def _checked_store(store: Any, rank: Any) -> None:
    if store is not None and not (hasattr(store, "set") and hasattr(store, "get") and hasattr(store, "wait")):
        raise TypeError(f"store= must be a torch.distributed Store (set/get/wait), not {type(store).__name__}")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank= must be a rank number >= 0, not {rank!r}")


def _shared_cache_secret(shared_dir: Path, shared_secret: bytes | str | None) -> bytes:
    """The shared cache's secret (``shared_secret=``, else $ETTKIT_COMPILE_CACHE_SECRET); required."""
    who = "held by everyone who may fill the cache"
    secret, _ = read_secret(shared_secret, CACHE_SECRET_ENV, "shared_secret=", who)
    if secret is None:
        raise InvalidArgumentError(
            f"CompileCache(shared_dir={str(shared_dir)!r}) needs the shared cache's secret: every "
            "file there runs code when it loads and may have been written by another user, so each "
            f"carries an HMAC. Set ${CACHE_SECRET_ENV} (32+ random bytes, the same for every job "
            "that uses the cache) or pass shared_secret="
        )
    return secret


class CompileCache:
    """A MegaCache file in ``path`` (a directory, e.g. next to the checkpoints), keyed by the torch build,
    the machine and a fingerprint. Give ``fingerprint`` yourself, or ``model`` / ``spec`` / ``config`` to
    derive it with :func:`compile_fingerprint`. ``device``: the device the model compiles for (GPU caches
    are per device index); default: the device of the model's first parameter. ``kernels``: also carry the
    compiled CPU kernel libraries (see the module docstring). ``precompile``: use the precompiled tier in
    :func:`ettkit.startup.overlapped_start` (see the module docstring).

    ``store`` and ``rank`` (with ``precompile=True``): compile once per job, not once per rank. Rank 0
    precompiles (or loads its file) and publishes the file through the c10d Store (a ``TCPStore``,
    ``FileStore``, or the default process group's); another rank that has no file of its own waits for it
    (up to ``share_timeout_s``) instead of compiling the same graph, writes it to its own directory and loads
    it. If rank 0 cannot precompile it publishes why, and every rank takes the MegaCache path. The Store has
    no authentication, so what goes through it carries an HMAC-SHA256 keyed by ``share_secret`` (bytes or
    text, 32 bytes at least; default ``$ETTKIT_COMPILE_SHARE_SECRET``), a secret the launcher gives every rank
    outside the Store; a payload that does not verify is never written or unpickled (the rank warns and
    compiles itself). Without a secret the Store is not used: a warning says how to set one, and each rank
    compiles or loads its own file.

    ``trust_shared``: load files from a directory or file that another user owns or can write (a cache a team
    shares on purpose). Off by default: a file there is "untrusted" (warned, a cold compile), because loading
    it runs code that whoever wrote it chose.

    ``shared_dir``: a compile cache that jobs share (e.g. a team's directory on a shared file system), for the
    precompiled tier: a start whose own directory has no file for its key loads the one there, copies it into
    its own directory (so its restarts need nothing shared) and starts without compiling; a start that
    compiled writes its file there for the next job (:meth:`publish_shared`). The key (torch and Triton
    builds, Python, the machine and device, the model's classes and sources, its parameters, the batch spec,
    the compile configuration) names the file, so jobs of one model meet and others never do. Another user
    may own the directory and its files, so each file carries an HMAC-SHA256 keyed by ``shared_secret``
    (bytes or text, 32 bytes at least; default ``$ETTKIT_COMPILE_CACHE_SECRET``), a secret everyone who may
    fill the cache holds: a file that does not verify is never copied or unpickled ("untrusted", warned, a
    cold compile), and a world-writable directory is refused. ``job``: this job's name in the files it
    writes (default ``$SLURM_JOB_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID``); a start served from the
    shared cache records "precompiled (shared, job <job> on <host>)" in its ledger. ``python -m ettkit
    precompile`` fills the cache ahead of a job (docs/startup.md, "A warm first start").

    Not thread-safe; call :meth:`load` before compiling and :meth:`save` when no compile is running."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fingerprint: str | None = None,
        model: Any = None,
        spec: Any = None,
        config: Mapping | None = None,
        device: torch.device | str | None = None,
        kernels: bool = True,
        precompile: bool = False,
        store: Any = None,
        rank: int = 0,
        share_timeout_s: float = 1800.0,
        share_secret: bytes | str | None = None,
        trust_shared: bool = False,
        shared_dir: str | os.PathLike | None = None,
        shared_secret: bytes | str | None = None,
        job: str | None = None,
    ):
        self.dir = Path(path)
        self.trust_shared = bool(trust_shared)
        key = CacheKey.of(fingerprint=fingerprint, model=model, spec=spec, config=config, device=device)
        self.key_fields, self.key, self._share_key = key.fields, key.key, key.share_key
        self.precompile = precompile
        _checked_store(store, rank)
        self.rank = rank
        self.share_timeout_s = float(share_timeout_s)
        self.shared_dir = Path(shared_dir) if shared_dir is not None else None
        self.job = job
        self.kernels = kernels
        # Looked up in this module at each call (see the imports).
        files = CacheFiles(self.dir, key, trust_shared=self.trust_shared, kernels=kernels,
                           loaded_kernel_files=lambda: _loaded_kernel_files(),
                           inductor_cache_dir=lambda: _inductor_cache_dir())
        self._megacache = MegacacheFile(files)
        self._precompiled = PrecompiledFile(files, job=job, keep_publishable=self.shared_dir is not None)
        self.path, self.precompiled_path = self._megacache.path, self._precompiled.path
        self.shared_name = key.shared_name
        self.store, self._store_share = self._store_share_for(files, store, share_secret)
        self._shared = None
        if self.shared_dir is not None:
            secret = _shared_cache_secret(self.shared_dir, shared_secret)
            self._shared = SharedCache(files, self.shared_dir, secret, self._precompiled.load)

    def _store_share_for(self, files: CacheFiles, store: Any, share_secret: bytes | str | None) -> tuple:
        """``(store, its source)``: both None without a Store, without ``precompile`` or, warned, without
        a share secret (the Store has no authentication: each rank then compiles or loads its own file)."""
        if store is None or not self.precompile:
            return store, None
        secret, _ = read_share_secret(share_secret)
        if secret is None:
            warnings.warn(NO_SECRET, CompileCacheWarning, stacklevel=3)
            return None, None
        return store, StoreShare(files, store, secret, self.share_timeout_s, self.load_precompiled)

    @property
    def last_load(self) -> CacheLoadResult | None:
        return self._megacache.last_load

    @property
    def last_save(self) -> CacheSaveResult | None:
        return self._megacache.last_save

    # ---- the MegaCache file --------------------------------------------------------------------------

    def load(self) -> CacheLoadResult:
        """Loads the cache for this key into torch's local caches, before compiling. Never raises for a
        missing, stale or corrupt file: it warns (except for a plain miss) and reports the status."""
        return self._megacache.load()

    def save(self) -> CacheSaveResult:
        """Writes this process's compile artifacts atomically (after the first steps, when forward and
        backward have compiled). Skips the write when nothing new was compiled since :meth:`load`. An I/O
        error warns and returns ``written=False``: a cache is an optimization, never a reason to fail."""
        return self._megacache.save()

    # ---- precompiled tier ----------------------------------------------------------------------------

    def load_precompiled(self) -> tuple[CacheLoadResult, Any]:
        """Loads the precompiled forward for this key: ``(result, fn)`` with ``result.status ==
        "precompiled"`` and the loaded function, or ``(result, None)`` with "miss", "stale" (another key, or
        a Python source Dynamo inlined has changed since: named in the reason), "corrupt", "untrusted" or
        "rejected" (torch refused it: another torch build or device). With ``shared_dir``, a plain miss here
        tries the shared cache's file (``result.source`` then says whose compile it was). Never raises for a
        bad file; warns except on a plain miss."""
        result, fn = self._precompiled.load()
        if fn is None and result.status == "miss" and self._shared is not None:
            return self._shared.load(result)
        return result, fn

    def save_precompiled(self, fn: Any, dynamic_dims_specialized: str | None = None) -> CacheSaveResult:
        """Writes a precompiled forward (an ``aot_compile`` result) for this key, atomically, with the
        compiled CPU kernels this process loaded and the checksums of the sources it was traced from. An
        I/O error or an artifact torch cannot serialize warns and returns ``written=False``.
        ``dynamic_dims_specialized``: the guard that made the compile use soft dims (kept in the file's header
        and given back by :meth:`load_precompiled`)."""
        return self._precompiled.save(fn, dynamic_dims_specialized)

    # ---- the shared compile cache (shared_dir) ---------------------------------------------------------

    def publish_shared(self) -> CacheSaveResult:
        """Writes this key's precompiled file into the shared cache, sealed with the cache's HMAC, atomically,
        readable by the group (0640: the directory's group is who shares it). What is sealed is only what this
        process produced: the bytes :meth:`save_precompiled` wrote, or those :meth:`load_precompiled` loaded
        from this user's own directory (not under ``trust_shared=True``, where others may have put them); never
        the file re-read from the directory. Without such bytes it warns, naming the file, and returns
        ``written=False``. A directory this job may not write (a read-only cache: jobs read, a precompile
        service fills) returns ``written=False`` quietly; any other failure warns."""
        if self._shared is None:
            return CacheSaveResult(False, self.shared_name, "no shared_dir")
        return self._shared.save(self._precompiled.publishable, self.precompiled_path)

    # ---- compile once per job: the precompiled file through the c10d Store -----------------------------

    @property
    def shares(self) -> bool:
        return self.precompile and self.store is not None

    def publish_precompiled(self, fallback_reason: str | None = None) -> None:
        """Rank 0: publishes this key's precompiled file (or, with ``fallback_reason``, that there is none and
        why) to the other ranks. A Store error warns: the others then compile themselves after their wait."""
        if self._store_share is not None:
            self._store_share.save(fallback_reason)

    def receive_precompiled(self) -> tuple[CacheLoadResult, Any, str | None]:
        """A rank other than 0 without a file of its own: waits for rank 0's, verifies its HMAC, writes it
        here and loads it. Returns ``(result, fn, why_not)``: ``fn`` None with ``why_not`` when rank 0 could
        not precompile, the wait timed out, the payload's HMAC does not verify (warned; status "untrusted":
        nothing of it was written or unpickled) or the file does not load here (stale, corrupt: then this rank
        compiles)."""
        if self._store_share is None:  # no Store (or no share secret): as a wait that received nothing
            why = f"no precompiled file from rank 0 within share_timeout_s={self.share_timeout_s:g} s (no Store)"
            return CacheLoadResult("miss", str(self.precompiled_path), why), None, why
        return self._store_share.load()

    # ---- reporting -----------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Hits and misses: the file-level status of the last load, and torch's cache counters since it
        (Inductor FX graph cache, AOTAutograd cache). Call after the first steps."""
        return self._megacache.stats()

    def __repr__(self) -> str:
        return f"CompileCache({str(self.path)!r})"
