"""What a :class:`ettkit.startup.CompileCache` source reports: the result of a load, of a save, and the
warning for a file it ignored. A leaf module: every source of the cache and the core import it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["CacheLoadResult", "CacheSaveResult", "CompileCacheWarning"]


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
