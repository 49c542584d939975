"""The core every :class:`ettkit.startup.CompileCache` source shares: the cache's own directory under its key.

A file is read only when this user can trust it (:mod:`.trusted_files`), decoded and checked against the key
(:mod:`.cache_format`: a file for another key is "stale"), and written atomically. An ignored file is never
fatal: it warns with a :class:`CompileCacheWarning` and becomes a load result, and the job compiles cold.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path

from . import cache_format
from .cache_key import CacheKey
from .cache_results import CacheLoadResult, CompileCacheWarning
from .compiled_kernels import read_kernel_files, restore_kernels
from .trusted_files import CacheDirectory, UntrustedFileError

__all__ = ["CacheFiles", "STALE_TEMPORARY_S"]

#: A temporary cache file older than this is a dead writer's (a write takes seconds) and is removed.
STALE_TEMPORARY_S = 3600.0


class CacheFiles:
    """The files of one cache directory under one key. ``loaded_kernel_files`` and ``inductor_cache_dir``
    are what Inductor reports (the compiled kernels this process loaded, its cache directory): passed in, so
    that the facade keeps them where tests replace them."""

    def __init__(self, directory: Path, key: CacheKey, *, trust_shared: bool, kernels: bool,
                 loaded_kernel_files: Callable[[], list], inductor_cache_dir: Callable[[], Path]):
        self.dir = directory
        self.key = key
        self.trust_shared = trust_shared
        self.kernels = kernels
        self.loaded_kernel_files = loaded_kernel_files
        self.inductor_cache_dir = inductor_cache_dir

    def path(self, name: str) -> Path:
        return self.dir / name

    def ignored(self, status: str, reason: str, t0: float, path: Path, stacklevel: int = 3) -> CacheLoadResult:
        """The result that ignores ``path`` for ``reason``, warned."""
        warnings.warn(
            f"ignoring compile cache {path}: {reason}; compiling without it",
            CompileCacheWarning,
            stacklevel=stacklevel,
        )
        return CacheLoadResult(status, str(path), reason, seconds=time.perf_counter() - t0)

    def read(self, path: Path, t0: float, miss_reason: str) -> bytes | CacheLoadResult:
        """The bytes of ``path`` (a file in ``self.dir``) when this user can trust them (see
        :mod:`.trusted_files`), else the "miss" / "untrusted" (warned) / "corrupt" (warned) result."""
        try:
            with CacheDirectory(self.dir, trust_shared=self.trust_shared) as directory:
                return directory.read(path.name)
        except FileNotFoundError:
            return CacheLoadResult("miss", str(path), miss_reason, seconds=time.perf_counter() - t0)
        except UntrustedFileError as exc:
            return self.ignored("untrusted", str(exc), t0, path)
        except OSError as exc:
            return self.ignored("corrupt", f"cannot read it ({exc})", t0, path)

    def checked(
        self, data: bytes, t0: float, path: Path, kind: cache_format.FileKind
    ) -> cache_format.CacheFile | CacheLoadResult:
        """The decoded file, or the "corrupt" / "stale" result (warned) that ignores it. Both files (MegaCache
        and precompiled) share this layout and these checks."""
        try:
            file = cache_format.decode(data, kind)
        except ValueError as exc:
            return self.ignored("corrupt", str(exc), t0, path)
        header = file.header
        if header.get("key") != self.key.key:
            fields = header.get("key_fields", {}) if isinstance(header.get("key_fields"), dict) else {}
            return self.ignored(
                "stale",
                f"it was written for another key (torch {fields.get('torch', '?')}, "
                f"fingerprint {str(fields.get('fingerprint', '?'))[:12]}...)",
                t0,
                path,
            )
        return file

    def restore_kernels(self, file: cache_format.CacheFile, path: Path) -> int:
        """Puts the compiled kernels ``file`` (read from ``path``) carries back under Inductor's cache dir
        (with ``kernels=True``); how many. A directory it cannot write warns: the kernels are rebuilt from
        their sources, slower, not wrong."""
        try:
            if self.kernels:
                return restore_kernels(
                    file.kernels, file.body, file.section_bytes, self.inductor_cache_dir(), self.trust_shared
                )
        except OSError as exc:  # a read-only or untrusted Inductor dir
            warnings.warn(f"could not restore compiled kernels from {path}: {exc}", CompileCacheWarning, stacklevel=4)
        return 0

    def kernel_blobs(self, kernel_files: list, path: Path) -> list:
        """(relative path, bytes) of the kernel files to bundle; an unreadable one warns and bundles none."""
        try:
            return read_kernel_files(kernel_files)
        except OSError as exc:
            warnings.warn(f"compiled kernels not bundled into {path}: {exc}", CompileCacheWarning, stacklevel=3)
            return []

    def encode(self, kind: cache_format.FileKind, section: bytes, blobs: list, extra: dict) -> tuple:
        """The bytes of a cache file of this key and its body (see :func:`.cache_format.encode`)."""
        return cache_format.encode(kind, self.key.key, self.key.fields, section, blobs, extra)

    def write_atomic(self, data: bytes, path: Path) -> None:
        """Replaces a file of this cache atomically (the protocol of C++ ``ettkit::replace_file_durably``:
        temporary file, fsync, rename, fsync of the directory), through the opened, checked directory (created
        0700 when missing; a directory this user cannot trust is refused), as a new 0600 file. Removes dead
        writers' temporaries older than an hour: every crash mid-write would leave one. Raises OSError
        (ettkit's IoError, or UntrustedFileError) naming the file."""
        with CacheDirectory(self.dir, trust_shared=self.trust_shared, create=True) as directory:
            directory.write(path.name, data)
            directory.remove_stale_temporaries(path.name, STALE_TEMPORARY_S)
