"""Compile caches for warm restarts: PT2's MegaCache persisted next to the checkpoints.

``torch.compiler.save_cache_artifacts()`` serializes every cache artifact this process produced or used
(Inductor FX graphs, AOTAutograd entries, autotuning, PGO), and ``load_cache_artifacts(bytes)`` puts them
into the local on-disk caches (``TORCHINDUCTOR_CACHE_DIR``) of a fresh process, where the next compile
finds them. :class:`CompileCache` adds what a training job needs around those two calls:

- one file per key: the torch build, Triton, Python, the machine (CPU ISA or GPU) and a fingerprint of
  the model, its batch spec and compile configuration (config values are part of torch's own cache keys,
  so a different config would miss anyway — keying by it keeps caches of different jobs apart);
- atomic writes (temporary file, fsync, rename, fsync of the directory): a crash never leaves a torn
  cache, and concurrent writers (ranks) leave one complete file;
- a header with a checksum: a stale, foreign or corrupt file is ignored with a
  :class:`CompileCacheWarning` and reported as a miss — never fatal, the job compiles cold instead;
- hit/miss reporting, at the file level and from torch's cache counters;
- compiled CPU kernels. MegaCache carries Inductor's generated code but not the shared libraries g++ built
  from it (torch 2.14), so a "warm" CPU restart still runs g++ for every kernel — most of a small model's
  warm compile. With ``kernels=True`` (the default) the file also carries the kernel libraries this process
  loaded (found through Inductor's in-process C++ code caches), and :meth:`CompileCache.load` puts them
  back under ``TORCHINDUCTOR_CACHE_DIR`` at the paths Inductor derives from their source and compiler
  flags, so a kernel whose source and flags match is loaded instead of rebuilt.

Use: ``cache.load()`` before compiling, ``cache.save()`` once forward and backward have compiled (later saves
add what later recompiles produced). :func:`ettkit.startup.overlapped_start` does both itself: it saves right
after its warm compile, on the compile's thread.

The precompiled tier (``precompile=True``, torch >= 2.13): a second file under the same key,
``precompiled-<key>.bin``, holds the module's forward and backward compiled ahead of time
(``aot_compile``; see :mod:`ettkit.startup.precompiled`), the compiled CPU kernels it uses, and the
checksums of every Python source Dynamo inlined. :func:`ettkit.startup.overlapped_start` writes it on a cold
start and loads it on a warm one, which then skips Dynamo, AOTAutograd and Inductor altogether; the MegaCache
file stays the fallback for models that cannot be precompiled. :meth:`CompileCache.load_precompiled` never
loads an artifact whose key or sources differ ("stale") or whose bytes are damaged ("corrupt").

Trust (docs/startup.md, "What a compile cache trusts"): both files hold pickles that run code as they load,
so a file is loaded only from a directory and a file this user owns that nobody else can write, opened
without following symlinks (:mod:`ettkit.startup.trusted_files`); anything else is "untrusted" (warned, a
cold compile) unless ``trust_shared=True``. MegaCache artifact keys are checked before torch sees them (a key
becomes a path under Inductor's cache dir). Compile once per job through the Store carries an HMAC-SHA256
keyed by a secret the ranks share outside the Store, verified before a byte of it is used.

This module holds the key, both tiers and compile once per job; the bytes of a file and their strict checks
are :mod:`ettkit.startup.cache_format`'s, finding and restoring the compiled kernels is
:mod:`ettkit.startup.compiled_kernels`'.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import importlib.metadata
import inspect
import json
import os
import platform
import stat
import sys
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgumentError
from . import cache_format
from .cache_format import megacache_artifacts
from .compiled_kernels import read_kernel_files, restore_kernels
# Module names, looked up at each call, so that tests can replace what Inductor would report.
from .compiled_kernels import inductor_cache_dir as _inductor_cache_dir
from .compiled_kernels import loaded_kernel_files as _loaded_kernel_files
from .trusted_files import CacheDirectory, UntrustedFileError
from .warm import compile_counters, counter_delta

__all__ = ["CacheLoadResult", "CacheSaveResult", "CompileCache", "CompileCacheWarning", "compile_fingerprint"]


#: The largest shared-cache file read (until its HMAC is checked, it is someone else's bytes).
_MAX_SHARED_BYTES = 4 << 30
#: The pieces a shared-cache file's HMAC is streamed in before the file is read (_check_sealed_file).
_HMAC_PIECE = 1 << 20
#: A temporary cache file older than this is a dead writer's (a write takes seconds) and is removed.
_STALE_TEMPORARY_S = 3600.0


class CompileCacheWarning(UserWarning):
    """A compile cache file was ignored (stale, corrupt, or rejected by torch) or could not be written."""


@dataclasses.dataclass(frozen=True)
class CacheLoadResult:
    """``status``: "hit" (loaded), "miss" (no file for this key), "stale" (a file for another key, or for
    sources that changed since), "corrupt" (unreadable, bad checksum, a MegaCache artifact key that would
    leave Inductor's cache dir), "untrusted" (a file or directory another user owns or can write, a symlink;
    or a Store payload whose HMAC does not verify) or "rejected" (torch refused the artifacts). A
    precompiled-tier load that succeeds says "precompiled"."""

    status: str
    path: str
    reason: str = ""
    artifacts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    #: A precompiled forward compiled with soft dims: which guard specialized a declared dynamic dim when it
    #: was compiled (the same text the cold start reported), so that a warm start reports it too.
    dynamic_dims_specialized: str | None = None
    #: Where a precompiled artifact came from when it was not this node's own file: "from rank 0" (compile
    #: once per job) or "shared, job <job> on <host>" (the shared compile cache). None otherwise.
    source: str | None = None

    @property
    def hit(self) -> bool:
        return self.status in ("hit", "precompiled")


@dataclasses.dataclass(frozen=True)
class CacheSaveResult:
    written: bool
    path: str
    reason: str = ""
    artifacts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bytes: int = 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _machine_key(device: torch.device | None) -> dict:
    key = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "triton": _version("triton") or _version("pytorch-triton"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cache_key_tag": os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", ""),
    }
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        key["cuda"] = torch.version.cuda or ""
        key["gpu"] = f"{props.name} sm_{props.major}{props.minor}"
        # Inductor's GPU artifacts bake in the device index (pytorch #108971): one cache per local rank.
        key["device_index"] = index
    return key


def _class_source_hash(cls: type) -> str:
    try:
        return hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def compile_fingerprint(model: Any = None, spec: Any = None, config: Mapping | None = None) -> str:
    """A stable hash of what decides the compiled graphs: the module tree (classes, and the source of
    classes not from torch), parameter and buffer names, shapes, dtypes and flags, train/eval mode, the batch
    spec's description and a compile configuration (e.g. the ``torch.compile`` keyword arguments)."""
    h = hashlib.sha256()

    def feed(*parts):
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    if model is not None:
        module = getattr(model, "_orig_mod", model)
        if isinstance(module, torch.nn.Module):
            for name, m in module.named_modules():
                cls = type(m)
                feed("module", name, f"{cls.__module__}.{cls.__qualname__}", m.training)
                if not cls.__module__.startswith("torch."):
                    feed(_class_source_hash(cls))
            for name, p in module.named_parameters():
                feed("param", name, tuple(p.shape), p.dtype, p.device.type, p.requires_grad)
            for name, b in module.named_buffers():
                feed("buffer", name, tuple(b.shape), b.dtype, b.device.type)
        else:
            feed("callable", getattr(module, "__qualname__", type(module).__qualname__))
    if spec is not None:
        feed("spec", spec.describe() if hasattr(spec, "describe") else repr(spec))
    if config:
        feed("config", json.dumps(config, sort_keys=True, default=repr))
    return h.hexdigest()


# ---- compile once per job: the Store payload's HMAC ------------------------------------------------------

_SHARE_SECRET_ENV = "ETTKIT_COMPILE_SHARE_SECRET"
# The shared compile cache's secret: the fleet's (whoever may fill the cache holds it), not one job's.
_CACHE_SECRET_ENV = "ETTKIT_COMPILE_CACHE_SECRET"
_MIN_SECRET_BYTES = 32
# What a MAC is for, under the MAC: a payload one job published through its Store cannot pass for a shared
# cache file, nor the reverse.
_JOB_CONTEXT = b"ettkit precompiled share v1"
_SHARED_CONTEXT = b"ettkit shared compile cache v1"
_SHARE_MAGIC = b"ETTKSHR1"
_SHARE_FILE, _SHARE_FALLBACK = b"F", b"X"  # the payload's kind: rank 0's file, or why there is none
_MAC_BYTES = hashlib.sha256().digest_size
_NO_SECRET = (
    "CompileCache(store=...) does not share the precompiled file through the Store: the Store has no "
    "authentication, and compile once per job needs a secret the ranks share outside it to sign what goes "
    f"through it. Set ${_SHARE_SECRET_ENV} (32+ random bytes, the same on every rank: e.g. export "
    f"{_SHARE_SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') in the job "
    "script before the launcher) or pass share_secret=. Each rank compiles or loads its own file meanwhile."
)


def _secret(explicit: bytes | str | None, env: str = _SHARE_SECRET_ENV, argument: str = "share_secret=",
            who: str = "set once by the launcher for every rank") -> tuple[bytes | None, str]:
    """A secret (``explicit``, else ``$env``) and where it came from. Raises InvalidArgumentError for one
    shorter than 32 bytes: a short secret is a configuration mistake."""
    source = argument
    if explicit is None:
        explicit, source = os.environ.get(env) or None, f"${env}"
    if explicit is None:
        return None, ""
    secret = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
    if len(secret) < _MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"the compile cache secret from {source} is {len(secret)} bytes; it must be at least "
            f"{_MIN_SECRET_BYTES} random bytes, e.g. {env}=$(python -c 'import secrets; "
            f"print(secrets.token_hex(32))') {who}"
        )
    return secret, source


def _share_secret(explicit: bytes | str | None) -> tuple[bytes | None, str]:
    """The job's share secret (``share_secret=``, else $ETTKIT_COMPILE_SHARE_SECRET) and where it came from."""
    return _secret(explicit)


def _mac_of(secret: bytes, share_key: str, kind: bytes, context: bytes, nonce: bytes = b"") -> Any:
    """The HMAC of a sealed payload before its body is fed. The key is under the MAC: a payload published
    for one model cannot be replayed under another; so is `nonce` when there is one (the job's run id, for
    the Store: a payload of another job sharing the secret is refused), length-prefixed."""
    head = context + b"\0" + share_key.encode() + b"\0" + kind
    if nonce:
        head += b"\0nonce" + len(nonce).to_bytes(4, "little") + nonce
    return hmac.new(secret, head, hashlib.sha256)


def _share_mac(secret: bytes, share_key: str, kind: bytes, body: bytes, context: bytes = _JOB_CONTEXT,
               nonce: bytes = b"") -> bytes:
    mac = _mac_of(secret, share_key, kind, context, nonce)
    mac.update(body)
    return mac.digest()


def _seal(secret: bytes, share_key: str, kind: bytes, body: bytes, context: bytes = _JOB_CONTEXT,
          nonce: bytes = b"") -> bytes:
    return _SHARE_MAGIC + _share_mac(secret, share_key, kind, body, context, nonce) + kind + body


def _no_mac(context: bytes) -> ValueError:
    """The refusal of a payload that is not sealed at all (for a job's Store, or the shared cache)."""
    return ValueError(
        "carries no ettkit HMAC ("
        + ("not published by an ettkit rank with a share secret)" if context == _JOB_CONTEXT else "not written "
           f"by ettkit with ${_CACHE_SECRET_ENV} set)")
    )


def _bad_mac(context: bytes) -> ValueError:
    """The refusal of a payload whose HMAC does not verify."""
    if context == _JOB_CONTEXT:
        return ValueError(
            f"has an HMAC-SHA256 that does not verify with this rank's share secret (${_SHARE_SECRET_ENV} or "
            "share_secret=): it was not published by a rank of this job, or the ranks' secrets differ"
        )
    return ValueError(
        f"has an HMAC-SHA256 that does not verify with this job's cache secret (${_CACHE_SECRET_ENV} or "
        "shared_secret=) for this key: it was written by someone without the secret, for another key, or "
        "with another secret"
    )


def _unseal(secret: bytes, share_key: str, payload: bytes, context: bytes = _JOB_CONTEXT,
            nonce: bytes = b"") -> tuple[bytes, memoryview]:
    """``(kind, body)`` of a sealed payload (the body a view into ``payload``: a precompiled file is not
    copied to be verified); ValueError, before anything of it is used, when it is not one this secret sealed
    under this key for this ``context`` (a job's Store, or the shared cache)."""
    head = len(_SHARE_MAGIC) + _MAC_BYTES + 1
    if len(payload) < head or not payload.startswith(_SHARE_MAGIC):
        raise _no_mac(context)
    mac = payload[len(_SHARE_MAGIC) : len(_SHARE_MAGIC) + _MAC_BYTES]
    kind, body = payload[head - 1 : head], memoryview(payload)[head:]
    if kind not in (_SHARE_FILE, _SHARE_FALLBACK) or not hmac.compare_digest(
        mac, _share_mac(secret, share_key, kind, body, context, nonce)
    ):
        raise _bad_mac(context)
    return kind, body


def _check_sealed_file(secret: bytes, share_key: str, fd: int, size: int) -> None:
    """Verifies the HMAC of the sealed shared-cache file open as ``fd`` (``size`` bytes) by streaming it in
    pieces, before it is read into memory: a file someone without the secret planted (sparse, gigabytes)
    costs one pass at hashing speed and no memory, not its size in RSS. Raises ValueError as
    :func:`_unseal` does. The caller unseals the bytes it then reads too (the file could change between)."""
    head = len(_SHARE_MAGIC) + _MAC_BYTES + 1
    start = os.pread(fd, head, 0)
    if len(start) < head or not start.startswith(_SHARE_MAGIC):
        raise _no_mac(_SHARED_CONTEXT)
    kind = start[head - 1 : head]
    mac = _mac_of(secret, share_key, kind, _SHARED_CONTEXT)
    buf = bytearray(_HMAC_PIECE)
    view = memoryview(buf)
    offset = head
    while offset < size:
        n = os.preadv(fd, [view[: min(_HMAC_PIECE, size - offset)]], offset)
        if n <= 0:
            break
        mac.update(view[:n])
        offset += n
    if kind not in (_SHARE_FILE, _SHARE_FALLBACK) or not hmac.compare_digest(
        start[len(_SHARE_MAGIC) : len(_SHARE_MAGIC) + _MAC_BYTES], mac.digest()
    ):
        raise _bad_mac(_SHARED_CONTEXT)


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


def _printable(value: Any, limit: int = 80) -> str:
    """A header field for a log line or a ledger note: text, no control characters, bounded."""
    text = value if isinstance(value, str) else "?"
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _describe_producer(header: Mapping) -> str:
    producer = header.get("producer")
    if not isinstance(producer, dict):
        return "shared"
    return f"shared, job {_printable(producer.get('job'))} on {_printable(producer.get('host'))}"


def _artifact_counts(info: Any) -> dict:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items()}


def _artifact_keys(info: Any) -> set:
    artifacts = getattr(info, "artifacts", None) or {}
    return {(str(kind), str(k)) for kind, keys in artifacts.items() for k in keys}


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
        if device is None and isinstance(model, torch.nn.Module):
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else None
        device = torch.device(device) if device is not None else None
        self.key_fields = _machine_key(device)
        self.key_fields["fingerprint"] = (
            fingerprint if fingerprint is not None else compile_fingerprint(model, spec, config)
        )
        self.key = hashlib.sha256(json.dumps(self.key_fields, sort_keys=True).encode()).hexdigest()
        self.path = self.dir / f"megacache-{self.key[:24]}.bin"
        self.precompiled_path = self.dir / f"precompiled-{self.key[:24]}.bin"
        self.precompile = precompile
        if store is not None and not (hasattr(store, "set") and hasattr(store, "get") and hasattr(store, "wait")):
            raise TypeError(f"store= must be a torch.distributed Store (set/get/wait), not {type(store).__name__}")
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank= must be a rank number >= 0, not {rank!r}")
        self._share_secret = None
        if store is not None and precompile:
            self._share_secret, _ = _share_secret(share_secret)
            if self._share_secret is None:
                warnings.warn(_NO_SECRET, CompileCacheWarning, stacklevel=2)
                store = None
        self.store = store
        self.rank = rank
        self.share_timeout_s = float(share_timeout_s)
        # The Store key of the job's shared artifact: the cache key without the GPU index, so that every rank
        # of a job meets under one key; a rank whose full key differs finds the shared file stale and compiles.
        shared = {k: v for k, v in self.key_fields.items() if k != "device_index"}
        # The job under the Store payload's MAC: a launcher that reuses the secret across jobs (and so Stores
        # an attacker may have read) does not let one job's payload be replayed into another's. The attempt
        # is not: no value the ranks of one attempt share outside the Store names it (a node's
        # TORCHELASTIC_RESTART_COUNT differs from the others' after a restart another node's failure caused).
        self._share_nonce = os.environ.get("TORCHELASTIC_RUN_ID", "").encode()
        self._share_key = "ettkit/precompiled/" + hashlib.sha256(
            json.dumps(shared, sort_keys=True).encode()
        ).hexdigest()[:24]
        self.shared_dir = Path(shared_dir) if shared_dir is not None else None
        self._shared_secret = None
        if self.shared_dir is not None:
            self._shared_secret, _ = _secret(
                shared_secret, _CACHE_SECRET_ENV, "shared_secret=", "held by everyone who may fill the cache"
            )
            if self._shared_secret is None:
                raise InvalidArgumentError(
                    f"CompileCache(shared_dir={str(self.shared_dir)!r}) needs the shared cache's secret: every "
                    "file there runs code when it loads and may have been written by another user, so each "
                    f"carries an HMAC. Set ${_CACHE_SECRET_ENV} (32+ random bytes, the same for every job "
                    "that uses the cache) or pass shared_secret="
                )
        self.shared_name = f"precompiled-{self.key[:24]}.shared"
        self.job = job
        self.kernels = kernels
        self._loaded_keys: set | None = None
        self._loaded_kernels: set = set()
        self._counters_at_load: dict | None = None
        self.last_load: CacheLoadResult | None = None
        self.last_save: CacheSaveResult | None = None
        # The precompiled file's bytes as this process wrote them (or loaded them from a directory only this
        # user can write): what publish_shared seals. Never re-read from the directory, which others may
        # write under trust_shared=True, and which could change between the save and a re-read.
        self._publishable: bytes | None = None

    # ---- load ----------------------------------------------------------------------------------------

    def _ignored(self, status: str, reason: str, t0: float, path: Path | None = None) -> CacheLoadResult:
        path = path or self.path
        warnings.warn(
            f"ignoring compile cache {path}: {reason}; compiling without it",
            CompileCacheWarning,
            stacklevel=3,
        )
        return CacheLoadResult(status, str(path), reason, seconds=time.perf_counter() - t0)

    def load(self) -> CacheLoadResult:
        """Loads the cache for this key into torch's local caches, before compiling. Never raises for a
        missing, stale or corrupt file: it warns (except for a plain miss) and reports the status."""
        t0 = time.perf_counter()
        self._counters_at_load = compile_counters()
        result = self._load(t0)
        self.last_load = result
        return result

    def _read(self, path: Path, t0: float, miss_reason: str) -> bytes | CacheLoadResult:
        """The bytes of ``path`` (a file in ``self.dir``) when this user can trust them (see
        :mod:`.trusted_files`), else the "miss" / "untrusted" (warned) / "corrupt" (warned) result."""
        try:
            with CacheDirectory(self.dir, trust_shared=self.trust_shared) as directory:
                return directory.read(path.name)
        except FileNotFoundError:
            return CacheLoadResult("miss", str(path), miss_reason, seconds=time.perf_counter() - t0)
        except UntrustedFileError as exc:
            return self._ignored("untrusted", str(exc), t0, path)
        except OSError as exc:
            return self._ignored("corrupt", f"cannot read it ({exc})", t0, path)

    def _miss_reason(self) -> str:
        try:
            others = sorted(p.name for p in self.dir.glob("megacache-*.bin") if p != self.path)
        except OSError:
            others = []
        if not others:
            return "no cache for this key"
        return (
            f"no cache for this key ({len(others)} cache file(s) for other keys: torch, machine, model or "
            "config changed)"
        )

    def _load(self, t0: float) -> CacheLoadResult:
        data = self._read(self.path, t0, "no cache for this key")
        if isinstance(data, CacheLoadResult):
            return dataclasses.replace(data, reason=self._miss_reason()) if data.status == "miss" else data
        file = self._checked(data, t0, self.path, cache_format.MEGACACHE)
        if isinstance(file, CacheLoadResult):
            return file
        megacache = file.section
        try:
            megacache_artifacts(megacache)  # before torch sees a key, and before any kernel is written
        except ValueError as exc:
            return self._ignored("corrupt", str(exc), t0)
        kernels = file.kernels
        restored = 0
        try:
            if self.kernels:
                restored = restore_kernels(
                    kernels, file.body, file.section_bytes, _inductor_cache_dir(), self.trust_shared
                )
        except OSError as exc:  # a read-only or untrusted Inductor dir: the compile is merely slower
            warnings.warn(
                f"could not restore compiled kernels from {self.path}: {exc}",
                CompileCacheWarning,
                stacklevel=3,
            )
        import torch._dynamo

        try:
            info = torch.compiler.load_cache_artifacts(megacache)
        except Exception as exc:  # noqa: BLE001 - torch rejecting a cache must not stop the job
            return self._ignored(
                "rejected", f"torch rejected its artifacts ({type(exc).__name__}: {exc})", t0
            )
        self._loaded_keys = _artifact_keys(info)
        self._loaded_kernels = {k["path"] for k in kernels}
        artifacts = _artifact_counts(info)
        if kernels:
            artifacts["cpu_kernel_files"] = restored
        return CacheLoadResult(
            "hit",
            str(self.path),
            "loaded",
            artifacts=artifacts,
            bytes=len(file.body),
            seconds=time.perf_counter() - t0,
        )

    def _checked(
        self, data: bytes, t0: float, path: Path, kind: cache_format.FileKind
    ) -> cache_format.CacheFile | CacheLoadResult:
        """The decoded file, or the "corrupt" / "stale" result (warned) that ignores it. Both files (MegaCache
        and precompiled) share this layout and these checks."""
        try:
            file = cache_format.decode(data, kind)
        except ValueError as exc:
            return self._ignored("corrupt", str(exc), t0, path)
        header = file.header
        if header.get("key") != self.key:
            fields = header.get("key_fields", {}) if isinstance(header.get("key_fields"), dict) else {}
            return self._ignored(
                "stale",
                f"it was written for another key (torch {fields.get('torch', '?')}, "
                f"fingerprint {str(fields.get('fingerprint', '?'))[:12]}...)",
                t0,
                path,
            )
        return file

    # ---- save ----------------------------------------------------------------------------------------

    def save(self) -> CacheSaveResult:
        """Writes this process's compile artifacts atomically (after the first steps, when forward and
        backward have compiled). Skips the write when nothing new was compiled since :meth:`load`. An I/O
        error warns and returns ``written=False``: a cache is an optimization, never a reason to fail."""
        import torch._dynamo

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            result = CacheSaveResult(False, str(self.path), "nothing was compiled in this process")
            self.last_save = result
            return result
        megacache, info = saved
        counts = _artifact_counts(info)
        keys = _artifact_keys(info)
        kernel_files = _loaded_kernel_files() if self.kernels else []
        kernel_paths = {rel for rel, _ in kernel_files}
        if (
            self._loaded_keys is not None
            and keys <= self._loaded_keys
            and kernel_paths <= self._loaded_kernels
            and self.path.exists()
        ):
            result = CacheSaveResult(False, str(self.path), "unchanged since load", counts, len(megacache))
            self.last_save = result
            return result
        blobs = self._kernel_blobs(kernel_files, self.path)
        if blobs:
            counts["cpu_kernel_files"] = len(blobs)
        data, body = self._encode(cache_format.MEGACACHE, megacache, blobs, {"artifacts": counts})
        try:
            self._write_atomic(data)
        except OSError as exc:
            warnings.warn(
                f"could not write compile cache {self.path}: {exc}", CompileCacheWarning, stacklevel=2
            )
            result = CacheSaveResult(False, str(self.path), f"write failed: {exc}", counts, len(body))
            self.last_save = result
            return result
        self._loaded_keys = keys
        self._loaded_kernels = {rel for rel, _ in blobs}
        result = CacheSaveResult(True, str(self.path), "written", counts, len(body))
        self.last_save = result
        return result

    @staticmethod
    def _kernel_blobs(kernel_files: list, path: Path) -> list:
        """(relative path, bytes) of the kernel files to bundle; an unreadable one warns and bundles none."""
        try:
            return read_kernel_files(kernel_files)
        except OSError as exc:
            warnings.warn(f"compiled kernels not bundled into {path}: {exc}", CompileCacheWarning, stacklevel=3)
            return []

    def _encode(self, kind: cache_format.FileKind, section: bytes, blobs: list, extra: dict) -> tuple:
        """The bytes of a cache file of this key and its body (see :func:`.cache_format.encode`)."""
        return cache_format.encode(kind, self.key, self.key_fields, section, blobs, extra)

    def _write_atomic(self, data: bytes, path: Path | None = None) -> None:
        """Replaces a file of this cache atomically (the protocol of C++ ``ettkit::replace_file_durably``:
        temporary file, fsync, rename, fsync of the directory), through the opened, checked directory (created
        0700 when missing; a directory this user cannot trust is refused), as a new 0600 file. Removes dead
        writers' temporaries older than an hour: every crash mid-write would leave one. Raises OSError
        (ettkit's IoError, or UntrustedFileError) naming the file."""
        path = path or self.path
        with CacheDirectory(self.dir, trust_shared=self.trust_shared, create=True) as directory:
            directory.write(path.name, data)
            directory.remove_stale_temporaries(path.name, _STALE_TEMPORARY_S)

    # ---- precompiled tier ----------------------------------------------------------------------------

    def load_precompiled(self) -> tuple[CacheLoadResult, Any]:
        """Loads the precompiled forward for this key: ``(result, fn)`` with ``result.status ==
        "precompiled"`` and the loaded function, or ``(result, None)`` with "miss", "stale" (another key, or
        a Python source Dynamo inlined has changed since: named in the reason), "corrupt", "untrusted" or
        "rejected" (torch refused it: another torch build or device). With ``shared_dir``, a plain miss here
        tries the shared cache's file (``result.source`` then says whose compile it was). Never raises for a
        bad file; warns except on a plain miss."""
        result, fn = self._load_precompiled_here()
        if fn is None and result.status == "miss" and self.shared_dir is not None:
            return self._load_shared(result)
        return result, fn

    def _load_precompiled_here(self) -> tuple[CacheLoadResult, Any]:
        from . import precompiled

        t0 = time.perf_counter()
        path = self.precompiled_path
        why_not = precompiled.supported()
        if why_not:
            return CacheLoadResult("miss", str(path), why_not, seconds=time.perf_counter() - t0), None
        data = self._read(path, t0, "no precompiled artifact for this key")
        if isinstance(data, CacheLoadResult):
            return data, None
        file = self._checked(data, t0, path, cache_format.PRECOMPILED)
        if isinstance(file, CacheLoadResult):
            return file, None
        header, body = file.header, file.body
        changed = precompiled.changed_sources(header.get("sources", []))
        if changed:
            return self._ignored(
                "stale", f"the Python source it was traced from has changed ({', '.join(changed[:5])})", t0, path
            ), None
        size = file.section_bytes
        kernels = file.kernels
        restored = 0
        try:
            if self.kernels:
                restored = restore_kernels(kernels, body, size, _inductor_cache_dir(), self.trust_shared)
        except OSError as exc:  # the kernels are rebuilt from the artifact's sources: slower, not wrong
            warnings.warn(f"could not restore compiled kernels from {path}: {exc}", CompileCacheWarning, stacklevel=2)
        try:
            fn = precompiled.deserialize(body[:size])
        except Exception as exc:  # noqa: BLE001 - torch refusing an artifact must not stop the job
            return self._ignored("rejected", f"torch rejected it ({type(exc).__name__}: {exc})", t0, path), None
        if self.shared_dir is not None and not self.trust_shared:
            self._publishable = data  # this user's own file, in a directory only this user can write
        artifacts = {"precompiled": 1}
        if kernels:
            artifacts["cpu_kernel_files"] = restored
        specialized = header.get("dynamic_dims_specialized")
        result = CacheLoadResult(
            "precompiled", str(path), "loaded", artifacts=artifacts, bytes=len(body), seconds=time.perf_counter() - t0,
            dynamic_dims_specialized=specialized if isinstance(specialized, str) else None,
        )
        return result, fn

    def save_precompiled(self, fn: Any, dynamic_dims_specialized: str | None = None) -> CacheSaveResult:
        """Writes a precompiled forward (an ``aot_compile`` result) for this key, atomically, with the
        compiled CPU kernels this process loaded and the checksums of the sources it was traced from. An
        I/O error or an artifact torch cannot serialize warns and returns ``written=False``.
        ``dynamic_dims_specialized``: the guard that made the compile use soft dims (kept in the file's header
        and given back by :meth:`load_precompiled`)."""
        from . import precompiled

        path = self.precompiled_path
        try:
            artifact = precompiled.serialize(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. a module captured in a closure
            warnings.warn(f"cannot serialize the precompiled forward: {exc}", CompileCacheWarning, stacklevel=2)
            return CacheSaveResult(False, str(path), f"not serializable: {type(exc).__name__}: {exc}")
        blobs = self._kernel_blobs(_loaded_kernel_files() if self.kernels else [], path)
        counts = {"precompiled": 1}
        if blobs:
            counts["cpu_kernel_files"] = len(blobs)
        extra = {"artifacts": counts, "sources": precompiled.source_fingerprint(fn), "producer": _producer(self.job)}
        if dynamic_dims_specialized:
            extra["dynamic_dims_specialized"] = dynamic_dims_specialized
        data, body = self._encode(cache_format.PRECOMPILED, artifact, blobs, extra)
        try:
            self._write_atomic(data, path)
        except OSError as exc:
            warnings.warn(f"could not write compile cache {path}: {exc}", CompileCacheWarning, stacklevel=2)
            return CacheSaveResult(False, str(path), f"write failed: {exc}", counts, len(body))
        if self.shared_dir is not None:
            self._publishable = data
        return CacheSaveResult(True, str(path), "written", counts, len(body))

    # ---- the shared compile cache (shared_dir) ---------------------------------------------------------

    def _shared_directory(self) -> CacheDirectory:
        """The shared directory, opened: another user may own it (its files carry HMACs), but one that every
        user of the machine can write is refused (UntrustedFileError): anyone could fill or empty it."""
        directory = CacheDirectory(self.shared_dir, trust_shared=True)
        mode = os.fstat(directory.fd).st_mode
        if mode & stat.S_IWOTH:
            directory.close()
            raise UntrustedFileError(
                f"the shared compile cache {self.shared_dir} is world-writable (mode {stat.S_IMODE(mode):04o}): "
                "every user of this machine could replace its files. Give it to the group that shares it "
                f"(chmod o-w {self.shared_dir}; the files' HMACs keep out whoever lacks the secret)"
            )
        return directory

    def _load_shared(self, here: CacheLoadResult) -> tuple[CacheLoadResult, Any]:
        """This key's file in the shared cache, verified (its HMAC, then its header: key and checksum), copied
        into this node's directory and loaded from there; or why not (``here``'s miss extended by the shared
        cache's, or the shared file's refusal, warned)."""
        from . import precompiled

        t0 = time.perf_counter()
        where = self.shared_dir / self.shared_name
        if precompiled.supported():
            return here, None
        try:
            directory = self._shared_directory()
        except FileNotFoundError:  # a mount that is missing on this node, or a typo: say so, then compile
            return self._ignored("miss", f"the shared compile cache {self.shared_dir} does not exist", t0, where), None
        except UntrustedFileError as exc:
            return self._ignored("untrusted", str(exc), t0, where), None
        except OSError as exc:
            return self._ignored("miss", f"the shared compile cache cannot be opened ({exc})", t0, where), None
        def check(fd: int, size: int) -> None:
            _check_sealed_file(self._shared_secret, self.key, fd, size)

        try:
            with directory:
                payload = directory.read(self.shared_name, max_bytes=_MAX_SHARED_BYTES, verify=check)
        except ValueError as exc:  # its HMAC does not verify: not a byte of it was held, written or unpickled
            return self._ignored("untrusted", f"refused: it {exc}", t0, where), None
        except FileNotFoundError:
            reason = f"{here.reason}; none in the shared cache {self.shared_dir} either"
            return dataclasses.replace(here, reason=reason, seconds=here.seconds + time.perf_counter() - t0), None
        except UntrustedFileError as exc:
            return self._ignored("untrusted", str(exc), t0, where), None
        except OSError as exc:
            return self._ignored("corrupt", f"cannot read it ({exc})", t0, where), None
        try:
            kind, body = _unseal(self._shared_secret, self.key, payload, _SHARED_CONTEXT)
            if kind != _SHARE_FILE:
                raise ValueError("is not a precompiled file")
        except ValueError as exc:  # forged, foreign or for another key: nothing of it is written or unpickled
            return self._ignored("untrusted", f"refused: it {exc}", t0, where), None
        body = bytes(body)
        file = self._checked(body, t0, where, cache_format.PRECOMPILED)
        if isinstance(file, CacheLoadResult):
            return file, None
        try:
            self._write_atomic(body, self.precompiled_path)
        except OSError as exc:
            why = f"the shared cache's file could not be copied to {self.precompiled_path}: {exc}"
            warnings.warn(why, CompileCacheWarning, stacklevel=3)
            return CacheLoadResult("miss", str(where), why, seconds=time.perf_counter() - t0), None
        result, fn = self._load_precompiled_here()
        if fn is None:
            return result, None
        source = _describe_producer(file.header)
        result = dataclasses.replace(
            result, path=str(where), reason=f"from the shared cache ({source})", source=source,
            seconds=time.perf_counter() - t0,
        )
        return result, fn

    def publish_shared(self) -> CacheSaveResult:
        """Writes this key's precompiled file into the shared cache, sealed with the cache's HMAC, atomically,
        readable by the group (0640: the directory's group is who shares it). What is sealed is only what this
        process produced: the bytes :meth:`save_precompiled` wrote, or those :meth:`load_precompiled` loaded
        from this user's own directory (not under ``trust_shared=True``, where others may have put them); never
        the file re-read from the directory. Without such bytes it warns, naming the file, and returns
        ``written=False``. A directory this job may not write (a read-only cache: jobs read, a precompile
        service fills) returns ``written=False`` quietly; any other failure warns."""
        where = self.shared_dir / self.shared_name if self.shared_dir is not None else Path(self.shared_name)
        if self.shared_dir is None:
            return CacheSaveResult(False, str(where), "no shared_dir")
        body = self._publishable
        if body is None:
            why = (f"{self.precompiled_path} was not written by this process"
                   + (" (and under trust_shared=True others may have put it there)" if self.trust_shared else "")
                   + ": only a file this process produced is sealed for the shared cache")
            warnings.warn(f"not publishing to the shared compile cache {where}: {why}", CompileCacheWarning,
                          stacklevel=2)
            return CacheSaveResult(False, str(where), f"not published: {why}")
        try:
            sealed = _seal(self._shared_secret, self.key, _SHARE_FILE, body, _SHARED_CONTEXT)
            with self._shared_directory() as directory:
                directory.write(self.shared_name, sealed, mode=0o640)
                directory.remove_stale_temporaries(self.shared_name, _STALE_TEMPORARY_S)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return CacheSaveResult(False, str(where), f"read-only for this job: {exc}")
            warnings.warn(f"could not write the shared compile cache {where}: {exc}", CompileCacheWarning, stacklevel=2)
            return CacheSaveResult(False, str(where), f"write failed: {exc}")
        return CacheSaveResult(True, str(where), "written", {"precompiled": 1}, len(sealed))

    # ---- compile once per job: the precompiled file through the c10d Store -----------------------------

    @property
    def shares(self) -> bool:
        return self.precompile and self.store is not None

    def publish_precompiled(self, fallback_reason: str | None = None) -> None:
        """Rank 0: publishes this key's precompiled file (or, with ``fallback_reason``, that there is none and
        why) to the other ranks. A Store error warns: the others then compile themselves after their wait."""
        if not self.shares:
            return
        kind, body = _SHARE_FALLBACK, None
        if fallback_reason is None:
            try:  # the file this rank trusts (its own), never one it would refuse to load itself
                with CacheDirectory(self.dir, trust_shared=self.trust_shared) as directory:
                    kind, body = _SHARE_FILE, directory.read(self.precompiled_path.name)
            except OSError as exc:
                fallback_reason = f"rank 0 could not read its precompiled file ({exc})"
        if body is None:
            body = str(fallback_reason).encode()
        payload = _seal(self._share_secret, self._share_key, kind, body, _JOB_CONTEXT, self._share_nonce)
        try:
            self.store.set(self._share_key, payload)
        except Exception as exc:  # noqa: BLE001 - a Store failure must not stop rank 0's start
            warnings.warn(
                f"could not publish the precompiled file to the other ranks: {exc}", CompileCacheWarning, stacklevel=2
            )

    def receive_precompiled(self) -> tuple[CacheLoadResult, Any, str | None]:
        """A rank other than 0 without a file of its own: waits for rank 0's, verifies its HMAC, writes it
        here and loads it. Returns ``(result, fn, why_not)``: ``fn`` None with ``why_not`` when rank 0 could
        not precompile, the wait timed out, the payload's HMAC does not verify (warned; status "untrusted":
        nothing of it was written or unpickled) or the file does not load here (stale, corrupt: then this rank
        compiles)."""
        from . import precompiled

        t0 = time.perf_counter()
        path = self.precompiled_path
        precompiled.import_compile_stack()  # while rank 0 compiles: the load needs it anyway
        try:
            self.store.wait([self._share_key], timedelta(seconds=self.share_timeout_s))
            payload = self.store.get(self._share_key)
        except Exception as exc:  # noqa: BLE001 - a timeout or a Store that went away: compile here
            why = f"no precompiled file from rank 0 within share_timeout_s={self.share_timeout_s:g} s ({exc})"
            return CacheLoadResult("miss", str(path), why, seconds=time.perf_counter() - t0), None, why
        try:
            payload = payload if isinstance(payload, bytes) else bytes(payload)
            kind, payload = _unseal(self._share_secret, self._share_key, payload, _JOB_CONTEXT, self._share_nonce)
        except ValueError as exc:  # forged or foreign: nothing of it is written or unpickled
            why = f"rank 0's precompiled file was refused: the payload under Store key {self._share_key} "
            why += str(exc)
            warnings.warn(f"{why}; compiling on this rank", CompileCacheWarning, stacklevel=2)
            return CacheLoadResult("untrusted", str(path), why, seconds=time.perf_counter() - t0), None, why
        if kind == _SHARE_FALLBACK:
            why = bytes(payload).decode(errors="replace")
            return CacheLoadResult("miss", str(path), why, seconds=time.perf_counter() - t0), None, why
        waited = time.perf_counter() - t0
        try:
            self._write_atomic(payload, path)
        except OSError as exc:
            why = f"could not write rank 0's precompiled file to {path}: {exc}"
            return CacheLoadResult("miss", str(path), why, seconds=time.perf_counter() - t0), None, why
        result, fn = self.load_precompiled()
        if fn is None:
            return result, None, f"rank 0's precompiled file does not load here: {result.status}, {result.reason}"
        result = dataclasses.replace(
            result, reason=f"from rank 0 (waited {waited:.2f} s)", source="from rank 0",
            seconds=time.perf_counter() - t0,
        )
        return result, fn, None

    # ---- reporting -----------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Hits and misses: the file-level status of the last load, and torch's cache counters since it
        (Inductor FX graph cache, AOTAutograd cache). Call after the first steps."""
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

    def __repr__(self) -> str:
        return f"CompileCache({str(self.path)!r})"
