"""The Store source of a :class:`ettkit.startup.CompileCache`: compile once per job, not once per rank.

Rank 0 precompiles (or loads its file) and publishes the file through the job's c10d Store; another rank
without a file of its own waits for it instead of compiling the same graph, writes it into its own directory
and loads it. If rank 0 cannot precompile it publishes why, and every rank takes the MegaCache path. The Store
has no authentication, so each payload is sealed with an HMAC under the job's share secret
(:mod:`.cache_seal`) and verified before a byte of it is written or unpickled.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from .cache_files import CacheFiles
from .cache_results import CacheLoadResult, CompileCacheWarning
from .cache_seal import JOB_CONTEXT, SHARE_FALLBACK, SHARE_FILE, seal, unseal
from .trusted_files import CacheDirectory

__all__ = ["StoreShare"]


class StoreShare:
    """The source's interface: :meth:`load` (rank 0's file, received) and :meth:`save` (rank 0 publishes).
    ``load_local`` loads the received file from this rank's directory (the cache's precompiled load)."""

    def __init__(self, files: CacheFiles, store: Any, secret: bytes, timeout_s: float,
                 load_local: Callable[[], tuple[CacheLoadResult, Any]]):
        self.files = files
        self.store = store
        self.secret = secret
        self.timeout_s = timeout_s
        self.key = files.key.share_key
        self.path: Path = files.path(files.key.precompiled_name)
        self.load_local = load_local
        # The job under the Store payload's MAC: a launcher that reuses the secret across jobs (and so Stores
        # an attacker may have read) does not let one job's payload be replayed into another's. The attempt
        # is not: no value the ranks of one attempt share outside the Store names it (a node's
        # TORCHELASTIC_RESTART_COUNT differs from the others' after a restart another node's failure caused).
        self.nonce = os.environ.get("TORCHELASTIC_RUN_ID", "").encode()

    def save(self, fallback_reason: str | None = None) -> None:
        """Rank 0: publishes this key's precompiled file (or, with ``fallback_reason``, that there is none and
        why). A Store error warns: the others then compile themselves after their wait."""
        kind, body = SHARE_FALLBACK, None
        if fallback_reason is None:
            try:  # the file this rank trusts (its own), never one it would refuse to load itself
                with CacheDirectory(self.files.dir, trust_shared=self.files.trust_shared) as directory:
                    kind, body = SHARE_FILE, directory.read(self.path.name)
            except OSError as exc:
                fallback_reason = f"rank 0 could not read its precompiled file ({exc})"
        if body is None:
            body = str(fallback_reason).encode()
        payload = seal(self.secret, self.key, kind, body, JOB_CONTEXT, self.nonce)
        try:
            self.store.set(self.key, payload)
        except Exception as exc:  # noqa: BLE001 - a Store failure must not stop rank 0's start
            warnings.warn(
                f"could not publish the precompiled file to the other ranks: {exc}", CompileCacheWarning, stacklevel=3
            )

    def load(self) -> tuple[CacheLoadResult, Any, str | None]:
        """A rank other than 0: ``(result, fn, why_not)`` (see :meth:`.CompileCache.receive_precompiled`)."""
        from . import precompiled

        t0 = time.perf_counter()
        path = self.path

        def missed(why: str, status: str = "miss") -> tuple[CacheLoadResult, Any, str | None]:
            return CacheLoadResult(status, str(path), why, seconds=time.perf_counter() - t0), None, why

        precompiled.import_compile_stack()  # while rank 0 compiles: the load needs it anyway
        try:
            self.store.wait([self.key], timedelta(seconds=self.timeout_s))
            payload = self.store.get(self.key)
        except Exception as exc:  # noqa: BLE001 - a timeout or a Store that went away: compile here
            return missed(f"no precompiled file from rank 0 within share_timeout_s={self.timeout_s:g} s ({exc})")
        try:
            payload = payload if isinstance(payload, bytes) else bytes(payload)
            kind, payload = unseal(self.secret, self.key, payload, JOB_CONTEXT, self.nonce)
        except ValueError as exc:  # forged or foreign: nothing of it is written or unpickled
            why = f"rank 0's precompiled file was refused: the payload under Store key {self.key} {exc}"
            warnings.warn(f"{why}; compiling on this rank", CompileCacheWarning, stacklevel=3)
            return missed(why, "untrusted")
        if kind == SHARE_FALLBACK:
            return missed(bytes(payload).decode(errors="replace"))
        waited = time.perf_counter() - t0
        try:
            self.files.write_atomic(payload, path)
        except OSError as exc:
            return missed(f"could not write rank 0's precompiled file to {path}: {exc}")
        result, fn = self.load_local()
        if fn is None:
            return result, None, f"rank 0's precompiled file does not load here: {result.status}, {result.reason}"
        result = dataclasses.replace(
            result, reason=f"from rank 0 (waited {waited:.2f} s)", source="from rank 0",
            seconds=time.perf_counter() - t0,
        )
        return result, fn, None
