"""Compiled CPU kernels: which libraries this process loaded, and putting them back for a warm start.

MegaCache carries Inductor's generated code but not the shared libraries g++ built from it (torch 2.14), so a
"warm" CPU restart still runs g++ for every kernel. A compile cache file therefore also carries the kernel
libraries this process loaded (:func:`loaded_kernel_files`, found through Inductor's in-process C++ code
caches), and :func:`restore_kernels` writes them back under ``TORCHINDUCTOR_CACHE_DIR`` at the paths Inductor
derives from their source and compiler flags, so that a kernel whose source and flags match is loaded instead
of rebuilt. The file's layout (where each kernel's bytes lie) is :mod:`.cache_format`'s; this module only
knows Inductor's cache directory.
"""

from __future__ import annotations

import re
from pathlib import Path

from .trusted_files import CacheDirectory, UntrustedFileError

__all__ = [
    "glob_escape",
    "inductor_cache_dir",
    "is_kernel_path",
    "loaded_kernel_files",
    "read_kernel_files",
    "restore_kernels",
]

#: Where a kernel may lie, relative to Inductor's cache dir: ``<2 characters>/<file name>``. A path of any
#: other form, read from a file, would leave that directory.
_KERNEL_PATH = re.compile(r"^[A-Za-z0-9_]{2}/[A-Za-z0-9_][A-Za-z0-9_.]*$")


def is_kernel_path(rel: object) -> bool:
    """Whether ``rel`` is a kernel path a cache file may carry: ``<2 characters>/<file name>``."""
    return isinstance(rel, str) and _KERNEL_PATH.match(rel) is not None


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def inductor_cache_dir() -> Path:
    """Inductor's cache dir (``TORCHINDUCTOR_CACHE_DIR``, else its default under the temporary dir)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _code_cache_keys() -> set:
    """The keys of every C++ kernel Inductor's in-process code caches hold (every subclass of
    ``CppCodeCache``: the CPU kernels and their wrappers)."""
    from torch._inductor import codecache

    keys: set = set()
    stack = [codecache.CppCodeCache]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        keys.update(k for k in getattr(cls, "cache", {}) if isinstance(k, str))
    return keys


def _isa_probe_files(root: Path, have: set) -> list:
    """Inductor's CPU vector-ISA probe: before it builds the first kernel of a process it compiles a test
    program per candidate ISA and dlopens it in a child process (5.6 s of a 9.3 s warm load measured, on a
    2-core machine); a "<library>.load_ok" marker beside the library skips both. The probe's answer depends on
    the CPU, which the cache key holds (machine, ATen's CPU capability). Returns the libraries and markers not
    in ``have`` (which it extends)."""
    try:
        markers = sorted(root.glob("*/*.so.load_ok"))
    except OSError:
        markers = []
    files = []
    for marker in markers:
        library = marker.with_name(marker.name[: -len(".load_ok")])
        for p in (library, marker):
            rel = f"{p.parent.name}/{p.name}"
            if rel not in have and p.is_file() and is_kernel_path(rel):
                files.append((rel, p))
                have.add(rel)
    return files


def loaded_kernel_files() -> list:
    """(path relative to the Inductor cache dir, absolute path) of every compiled C++ kernel this process
    loaded. Uses Inductor internals (its C++ code caches); if they change, kernels are simply not bundled."""
    try:
        keys = _code_cache_keys()
        if not keys:
            return []
        root = inductor_cache_dir()
    except Exception:  # noqa: BLE001 - an optimization; torch internals may move
        return []
    files = []
    for key in sorted(keys):
        if len(key) < 3:
            continue
        for p in sorted((root / key[1:3]).glob(glob_escape(key) + ".*")):
            rel = f"{key[1:3]}/{p.name}"
            if p.is_file() and not p.name.endswith((".lock", ".tmp")) and is_kernel_path(rel):
                files.append((rel, p))
    return files + _isa_probe_files(root, {rel for rel, _ in files})


def read_kernel_files(kernel_files: list) -> list:
    """(relative path, bytes) of ``kernel_files`` (as :func:`loaded_kernel_files` lists them). Raises OSError
    when one cannot be read: the caller then bundles none rather than half."""
    return [(rel, p.read_bytes()) for rel, p in kernel_files]


def restore_kernels(
    kernels: list, body: bytes, offset: int, root_dir: Path, trust_shared: bool = False
) -> int:
    """Writes bundled kernel files that are not already in ``root_dir`` (Inductor's cache dir: see
    :func:`inductor_cache_dir`); returns how many.
    ``kernels``: the file header's entries (``{"path", "bytes"}``), whose bytes follow one another in ``body``
    from ``offset``. Each goes through the opened cache dir and its opened two-letter subdirectory (created
    0700; a symlink, or a directory of another user or writable by the world, is refused:
    UntrustedFileError), as a new 0600 file renamed into place (dlopen needs no execute bit). A group-writable
    directory is accepted here: torch creates Inductor's directories with the umask's mode (0775 under umask
    002) and loads kernels from them whatever ettkit does, so refusing it would only make the warm start
    rebuild them."""
    restored = 0
    with CacheDirectory(root_dir, trust_shared=trust_shared, create=True, group_write_ok=True) as root:
        subdirs: dict = {}
        try:
            for entry in kernels:
                rel, size = entry["path"], entry["bytes"]
                data = body[offset : offset + size]
                offset += size
                if not is_kernel_path(rel) or ".." in rel:  # the decoder checked it; a path never leaves root
                    raise UntrustedFileError(f"kernel path {rel!r} is not <2 characters>/<file name>")
                sub_name, name = rel.split("/")
                if sub_name not in subdirs:
                    subdirs[sub_name] = root.subdirectory(sub_name)
                sub = subdirs[sub_name]
                if sub.exists(name):
                    continue
                # Atomic: a concurrent Inductor never sees half a library. Not fsynced: a kernel lost in a
                # crash is rebuilt from its source.
                sub.write(name, data, durable=False)
                restored += 1
        finally:
            for sub in subdirs.values():
                sub.close()
    return restored
