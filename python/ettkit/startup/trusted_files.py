"""The compile cache's files, opened so that only what this user wrote is ever loaded.

A compile cache file carries pickles that run code as they load: torch's precompiled forward
(``torch.compiler.load_compiled_function``), and inside MegaCache the FX graphs, AOTAutograd entries and
PGO states that Inductor unpickles when it finds them. Its checksum is the writer's own and proves nothing
about who the writer was. So a file is loaded only when this user wrote it and nobody else could have put
it there or replaced it since:

- the directory is opened once (``O_DIRECTORY``) and every later operation (open, create, rename, unlink)
  is relative to that handle (``dir_fd``): renaming a path component between the check and the use
  changes nothing;
- the directory is owned by this user and neither group- nor world-writable (whoever can write a
  directory can swap the files in it);
- the file is opened with ``O_NOFOLLOW`` (a symlink is refused, not followed) and ``O_NONBLOCK`` (a FIFO
  planted in its place cannot block the open), then checked on that descriptor (``fstat``): a regular
  file, owned by this user, neither group- nor world-writable.

``trust_shared=True`` drops the owner and mode rules, for a cache a team shares on purpose: whoever can
write there then runs code in the trainer. Symlinks and non-regular files stay refused. ``group_write_ok``
(for Inductor's own directories, which torch creates with the umask's mode and reads from regardless)
accepts a group-writable directory of this user's; a world-writable one stays refused.

What ettkit writes here is created 0600, in directories it creates 0700 (the umask narrows both further;
nothing is ever widened), through a temporary file created ``O_CREAT|O_EXCL|O_NOFOLLOW`` and renamed over
the target: a reader sees the old file or the new one, whole.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Callable

from ..errors import IoError

__all__ = ["CacheDirectory", "UntrustedFileError", "trust_problem"]

#: Write bits of the group and of others: a file or directory with either set is writable by someone else.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UntrustedFileError(IoError):
    """A compile-cache file or directory that this user cannot trust (another owner, writable by others, a
    symlink, not a regular file). The message names the path, what was found and what is required. An
    ``IoError`` (an ``OSError``), so that a save into such a directory warns like any failed write."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def trust_problem(
    st: os.stat_result, what: str, path: str, *, trust_shared: bool, group_write_ok: bool = False
) -> str | None:
    """Why ``st`` (of ``what``: "file" or "directory" at ``path``) is not to be trusted, or None. With
    ``trust_shared`` only the type is checked; with ``group_write_ok`` only the world's write bit counts."""
    want_dir = what == "directory"
    if not (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)):
        kind = "directory" if want_dir else "regular file"
        return f"{path} is not a {kind} (mode {stat.filemode(st.st_mode)})"
    if trust_shared:
        return None
    me = os.geteuid()
    others = stat.S_IWOTH if group_write_ok else _OTHERS_WRITE
    if st.st_uid != me or st.st_mode & others:
        writable = "not world-writable" if group_write_ok else "neither group- nor world-writable"
        return (
            f"{path} is owned by {_owner(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}; a compile "
            f"cache {what} is trusted only when it is owned by this user ({_owner(me)}) and {writable} "
            f"(it may run code when loaded). Fix it (chown, or chmod go-w {path}), remove it, or pass "
            "CompileCache(trust_shared=True) to trust everyone who can write there"
        )
    return None


def _make_directories(path: Path) -> None:
    """Creates ``path`` and its missing parents, each 0700 (narrowed by the umask). A parent that exists is
    left as it is: it is the caller's."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # another rank made it meanwhile; it is checked like any other when opened


def _io_error(what: str, exc: OSError) -> IoError:
    """ettkit's IoError naming ``what`` failed, keeping the errno of ``exc`` (a caller tells EACCES apart)."""
    error = IoError(f"{what}: {exc.strerror} (errno {exc.errno})")
    error.errno = exc.errno
    return error


class CacheDirectory:
    """An opened compile-cache directory whose owner and mode were checked once, on the handle; every file
    operation after that goes through the handle (``dir_fd``). Promises: :meth:`read` returns the bytes of a
    file only when the file passes the same rules (``O_NOFOLLOW``, regular, this user's, not writable by
    others; with ``trust_shared`` only the first two), else raises :class:`UntrustedFileError`; :meth:`write`
    replaces a file atomically with a new 0600 one. Construction raises :class:`UntrustedFileError` for a
    directory that fails the rules, ``OSError`` when it cannot be opened or created. Use as a context
    manager (it closes the handle)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trust_shared: bool = False,
        create: bool = False,
        group_write_ok: bool = False,
    ):
        self.path = Path(path)
        self.trust_shared = trust_shared
        self.group_write_ok = group_write_ok
        if create:
            _make_directories(self.path)
        self.fd = os.open(self.path, _DIR_FLAGS)
        try:
            problem = self._problem(os.fstat(self.fd), "directory", str(self.path))
            if problem:
                raise UntrustedFileError(problem)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CacheDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _problem(self, st: os.stat_result, what: str, path: str) -> str | None:
        return trust_problem(
            st, what, path, trust_shared=self.trust_shared, group_write_ok=self.group_write_ok
        )

    def _where(self, name: str) -> str:
        return str(self.path / name)

    def read(self, name: str, max_bytes: int | None = None, verify: Callable[[int, int], None] | None = None) -> bytes:
        """The bytes of file ``name`` in this directory. Raises FileNotFoundError when there is none,
        :class:`UntrustedFileError` when it fails the rules or is larger than ``max_bytes`` (checked on the
        descriptor before a byte is read: a file someone else planted cannot exhaust memory), OSError when it
        cannot be read. ``verify(fd, size)``: runs on the checked descriptor before the file is read into
        memory (a streamed HMAC), and raises to refuse it."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise UntrustedFileError(
                    f"{self._where(name)} is a symbolic link; a compile cache file is opened without "
                    "following links (a link could point anywhere)"
                ) from None
            raise
        with open(fd, "rb", closefd=True) as f:
            st = os.fstat(fd)
            problem = self._problem(st, "file", self._where(name))
            if problem:
                raise UntrustedFileError(problem)
            if max_bytes is not None and st.st_size > max_bytes:
                raise UntrustedFileError(
                    f"{self._where(name)} is {st.st_size} bytes, more than the {max_bytes} a compile cache file "
                    "may have here"
                )
            if verify is not None:
                verify(fd, st.st_size)
            return f.read() if max_bytes is None else f.read(max_bytes + 1)[: max_bytes]

    def write(self, name: str, data: bytes, *, durable: bool = True, mode: int = 0o600) -> None:
        """Replaces file ``name`` with ``data``: a new temporary file (``mode``, default 0600; never wider,
        ``O_EXCL|O_NOFOLLOW``), written, fsynced (``durable``), renamed over ``name``, and the directory fsynced
        (``durable``). A reader sees the old file or the new one, whole. On failure the temporary is removed
        and ``IoError`` names it (its ``errno`` is the failed call's)."""
        # The temporary's name is what remove_stale_temporaries recognises as a dead writer's.
        tmp = f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=self.fd)
        except OSError as exc:
            raise _io_error(f"creating '{self._where(tmp)}' failed", exc) from None
        step = "writing"
        try:
            try:
                if mode != 0o600:  # exactly what was asked (the umask could not widen the 0600 it was made with)
                    os.fchmod(fd, mode & 0o644)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if durable:
                    step = "fsync of"
                    os.fsync(fd)
            finally:
                os.close(fd)
            step = "renaming over"
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            where = self._where(name) if step == "renaming over" else self._where(tmp)
            raise _io_error(f"{step} '{where}' failed", exc) from None
        if durable:
            os.fsync(self.fd)  # the rename itself survives a crash

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists here (a symlink counts: it is not followed)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def subdirectory(self, name: str) -> CacheDirectory:
        """The subdirectory ``name`` (one path component), created 0700 when missing, opened without
        following a symlink and checked by the same rules."""
        if not name or "/" in name or name in (".", ".."):
            raise UntrustedFileError(f"{self._where(name)}: {name!r} is not one directory name")
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        sub = CacheDirectory.__new__(CacheDirectory)
        sub.path = self.path / name
        sub.trust_shared = self.trust_shared
        sub.group_write_ok = self.group_write_ok
        try:
            sub.fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UntrustedFileError(
                    f"{sub.path} is a symbolic link or not a directory; compiled kernels are written only "
                    "into a real directory"
                ) from None
            raise
        try:
            problem = sub._problem(os.fstat(sub.fd), "directory", str(sub.path))
            if problem:
                raise UntrustedFileError(problem)
        except BaseException:
            sub.close()
            raise
        return sub

    def remove_stale_temporaries(self, name: str, older_than_s: float) -> None:
        """Removes this user's temporaries of ``name`` older than ``older_than_s``: a writer killed between
        its temporary file and the rename (kill -9, OOM, a node lost) leaves one behind. A younger one may be
        a live writer on another node sharing this directory (its pid means nothing here)."""
        prefix, now, me = f".{name}.", time.time(), os.geteuid()
        try:
            entries = os.listdir(self.fd)
        except OSError:
            return
        for entry in entries:
            if not (entry.startswith(prefix) and entry.endswith(".tmp")):
                continue
            try:
                st = os.stat(entry, dir_fd=self.fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == me and now - st.st_mtime > older_than_s:
                    os.unlink(entry, dir_fd=self.fd)
            except OSError:
                pass  # another process removed it, or it is not ours to remove
