"""The shared source of a :class:`ettkit.startup.CompileCache`: a precompiled-file cache that jobs share
(``shared_dir=``, e.g. a team's directory on a shared file system).

Another user may own the directory and its files, so each file is sealed with the cache's HMAC
(:mod:`.cache_seal`), verified before a byte of it is copied or unpickled; a world-writable directory is
refused. A file that verifies is copied into the job's own directory and loaded from there, so the job's
restarts need nothing shared.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import cache_format
from .cache_files import STALE_TEMPORARY_S, CacheFiles
from .cache_results import CacheLoadResult, CacheSaveResult, CompileCacheWarning
from .cache_seal import SHARE_FILE, SHARED_CONTEXT, check_sealed_file, seal, unseal
from .trusted_files import CacheDirectory, UntrustedFileError

__all__ = ["SharedCache"]

#: The largest shared-cache file read (until its HMAC is checked, it is someone else's bytes).
_MAX_SHARED_BYTES = 4 << 30


def _printable(value: Any, limit: int = 80) -> str:
    """A header field for a log line or a ledger note: text, no control characters, bounded."""
    text = value if isinstance(value, str) else "?"
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _describe_producer(header: Mapping) -> str:
    producer = header.get("producer")
    if not isinstance(producer, dict):
        return "shared"
    return f"shared, job {_printable(producer.get('job'))} on {_printable(producer.get('host'))}"


class SharedCache:
    """The source's interface: :meth:`load` (a ``(result, fn)`` pair) and :meth:`save` (a result).
    ``load_here`` loads the copy from the job's own directory (the precompiled source's load)."""

    def __init__(self, files: CacheFiles, shared_dir: Path, secret: bytes,
                 load_here: Callable[[], tuple[CacheLoadResult, Any]]):
        self.files = files
        self.dir = shared_dir
        self.secret = secret
        self.name = files.key.shared_name
        self.load_here = load_here

    def _directory(self) -> CacheDirectory:
        """The shared directory, opened: another user may own it (its files carry HMACs), but one that every
        user of the machine can write is refused (UntrustedFileError): anyone could fill or empty it."""
        directory = CacheDirectory(self.dir, trust_shared=True)
        mode = os.fstat(directory.fd).st_mode
        if mode & stat.S_IWOTH:
            directory.close()
            raise UntrustedFileError(
                f"the shared compile cache {self.dir} is world-writable (mode {stat.S_IMODE(mode):04o}): "
                "every user of this machine could replace its files. Give it to the group that shares it "
                f"(chmod o-w {self.dir}; the files' HMACs keep out whoever lacks the secret)"
            )
        return directory

    def load(self, here: CacheLoadResult) -> tuple[CacheLoadResult, Any]:
        """This key's file in the shared cache, verified (its HMAC, then its header: key and checksum), copied
        into this node's directory and loaded from there; or why not (``here``'s miss extended by the shared
        cache's, or the shared file's refusal, warned)."""
        from . import precompiled

        t0 = time.perf_counter()
        if precompiled.supported():
            return here, None
        payload = self._read_verified(here, t0)
        if isinstance(payload, CacheLoadResult):
            return payload, None
        files, where = self.files, self.dir / self.name
        file = files.checked(payload, t0, where, cache_format.PRECOMPILED)
        if isinstance(file, CacheLoadResult):
            return file, None
        local = files.path(files.key.precompiled_name)
        try:
            files.write_atomic(payload, local)
        except OSError as exc:
            why = f"the shared cache's file could not be copied to {local}: {exc}"
            warnings.warn(why, CompileCacheWarning, stacklevel=3)
            return CacheLoadResult("miss", str(where), why, seconds=time.perf_counter() - t0), None
        result, fn = self.load_here()
        if fn is None:
            return result, None
        source = _describe_producer(file.header)
        result = dataclasses.replace(
            result, path=str(where), reason=f"from the shared cache ({source})", source=source,
            seconds=time.perf_counter() - t0,
        )
        return result, fn

    def _read_verified(self, here: CacheLoadResult, t0: float) -> bytes | CacheLoadResult:
        """The body of this key's shared file, its HMAC verified; else the result that says why not."""
        files, where = self.files, self.dir / self.name
        try:
            directory = self._directory()
        except FileNotFoundError:  # a mount that is missing on this node, or a typo: say so, then compile
            return files.ignored("miss", f"the shared compile cache {self.dir} does not exist", t0, where, 4)
        except UntrustedFileError as exc:
            return files.ignored("untrusted", str(exc), t0, where, 4)
        except OSError as exc:
            return files.ignored("miss", f"the shared compile cache cannot be opened ({exc})", t0, where, 4)

        def check(fd: int, size: int) -> None:
            check_sealed_file(self.secret, files.key.key, fd, size)

        try:
            with directory:
                payload = directory.read(self.name, max_bytes=_MAX_SHARED_BYTES, verify=check)
        except ValueError as exc:  # its HMAC does not verify: not a byte of it was held, written or unpickled
            return files.ignored("untrusted", f"refused: it {exc}", t0, where, 4)
        except FileNotFoundError:
            reason = f"{here.reason}; none in the shared cache {self.dir} either"
            return dataclasses.replace(here, reason=reason, seconds=here.seconds + time.perf_counter() - t0)
        except UntrustedFileError as exc:
            return files.ignored("untrusted", str(exc), t0, where, 4)
        except OSError as exc:
            return files.ignored("corrupt", f"cannot read it ({exc})", t0, where, 4)
        try:
            kind, body = unseal(self.secret, files.key.key, payload, SHARED_CONTEXT)
            if kind != SHARE_FILE:
                raise ValueError("is not a precompiled file")
        except ValueError as exc:  # forged, foreign or for another key: nothing of it is written or unpickled
            return files.ignored("untrusted", f"refused: it {exc}", t0, where, 4)
        return bytes(body)

    def save(self, publishable: bytes | None, local: Path) -> CacheSaveResult:
        """Writes ``publishable`` (the precompiled file this process produced, see
        :attr:`.PrecompiledFile.publishable`; ``local`` is where it lives) into the shared cache, sealed,
        atomically, readable by the group (0640). Without it it warns and returns ``written=False``; so does a
        failed write, quietly when the directory is read-only for this job."""
        where = self.dir / self.name
        if publishable is None:
            why = (f"{local} was not written by this process"
                   + (" (and under trust_shared=True others may have put it there)" if self.files.trust_shared
                      else "")
                   + ": only a file this process produced is sealed for the shared cache")
            warnings.warn(f"not publishing to the shared compile cache {where}: {why}", CompileCacheWarning,
                          stacklevel=3)
            return CacheSaveResult(False, str(where), f"not published: {why}")
        try:
            sealed = seal(self.secret, self.files.key.key, SHARE_FILE, publishable, SHARED_CONTEXT)
            with self._directory() as directory:
                directory.write(self.name, sealed, mode=0o640)
                directory.remove_stale_temporaries(self.name, STALE_TEMPORARY_S)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return CacheSaveResult(False, str(where), f"read-only for this job: {exc}")
            warnings.warn(f"could not write the shared compile cache {where}: {exc}", CompileCacheWarning,
                          stacklevel=3)
            return CacheSaveResult(False, str(where), f"write failed: {exc}")
        return CacheSaveResult(True, str(where), "written", {"precompiled": 1}, len(sealed))
