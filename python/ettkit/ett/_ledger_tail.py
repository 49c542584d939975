"""Tailing ``RUN_DIR/ett/rank-<r>.jsonl``: which files are ledger files, and the complete lines each gained
since the last read, for :class:`ettkit.ett.live_ledger.LiveLedger`.

A :class:`FileTail` keeps a byte offset per file; a read takes the file from there to its current size in
bounded chunks, keeps an incomplete last line (a batch still being written) for the next read, and hands on
only complete lines. The rules for what is read are the report's (src/ett/ledger_reader.cpp): the folder
and its files are opened without following symbolic links, only regular files are read, and a line longer
than the ledger's bound is dropped, never held whole (docs/ett.md §10, "Directories someone else wrote").
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Container
from typing import Optional

from ..errors import IoError
from ._ledger_records import MAX_LINE_BYTES

MAX_RANK = 2_147_483_647
# A read takes at most this much of one file at a time, so that catching up on a large ledger never holds
# the whole file in memory.
CHUNK_BYTES = 1 << 20
# Opens a ledger file only as itself: never through a symbolic link, and without blocking on a FIFO.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class FileTail:
    """Where reading one ledger file stopped: its inode, offset and the unterminated line after it."""

    __slots__ = ("path", "inode", "offset", "partial", "skipping", "refused", "line_no")

    def __init__(self, path: str) -> None:
        self.path = path
        self.inode: Optional[int] = None
        self.offset = 0
        # Bytes after the last newline read (a line still being written), appended to in place; dropped once
        # longer than a line may be, and the rest of that line then skipped up to its newline.
        self.partial = bytearray()
        self.skipping = False
        self.refused = False  # became a link or not a regular file: no longer read (its records stay)
        self.line_no = 0


def rank_of(file_name: str) -> Optional[int]:
    """The rank of ``rank-<r>.jsonl`` written as the Recorder writes it (plain decimal, no leading zeros, at
    most 2147483647), else None: the same files the report reads."""
    digits = file_name[len("rank-"):-len(".jsonl")]
    if not digits.isdigit() or not digits.isascii() or (len(digits) > 1 and digits[0] == "0"):
        return None
    rank = int(digits)
    return rank if rank <= MAX_RANK else None


def open_ledger_folder(folder: str) -> Optional[int]:
    """``RUN_DIR/ett`` opened as a directory of the run directory, never through a symbolic link (as the
    report opens it), or None while it does not exist (or is no directory). Raises ``ettkit.IoError``."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        if not os.path.islink(folder):
            return None  # a file where the folder belongs: nothing any Recorder wrote
        raise IoError(f"ledger folder '{folder}' is a symbolic link; ettkit reads RUN_DIR/ett/ only as a "
                      f"directory of the run directory, never through a link: serve the run directory the "
                      f"link points into instead") from None
    except OSError as e:
        raise IoError(f"cannot open ledger folder '{folder}': {e.strerror}") from e


def _not_a_ledger_file(dir_fd: int, name: str, path: str) -> Optional[str]:
    """Why the entry ``name`` of the ledger folder is not read (a symbolic link, not a regular file), or
    None for a regular file: the report's rule (src/ett/ledger_reader.cpp open_ledger_file)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # removed since the listing: nothing to read now, and one of that name may come back
    except OSError as e:
        raise IoError(f"cannot read ledger file '{path}': {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link; only regular files in the ledger folder are read, never through a link"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a directory, FIFO, socket or device)"
    return None


def new_ledger_files(dir_fd: int, folder: str, known: Container[str], ignored: set[str],
                     warn: Callable[[str], None]) -> list[tuple[str, int, str]]:
    """The ledger files of the opened folder ``dir_fd`` not in ``known`` or ``ignored``, as (name, rank,
    path). An entry named like a ledger file that is not one (a bad rank, a link, not a regular file) is
    added to ``ignored`` and ``warn``\\ ed about once. Raises ``ettkit.IoError`` when the listing fails."""
    try:
        names = os.listdir(dir_fd)
    except OSError as e:
        raise IoError(f"cannot list ledger folder '{folder}': {e.strerror}") from e
    found = []
    for name in names:
        if name in known or name in ignored:
            continue
        if not (name.startswith("rank-") and name.endswith(".jsonl")) or len(name) <= 11:
            continue
        path = os.path.join(folder, name)
        rank = rank_of(name)
        if rank is None:
            ignored.add(name)
            warn(f"{path}: skipped; a ledger file is named rank-<r>.jsonl with r a rank in "
                 f"plain decimal (0 to 2147483647, no leading zeros)")
            continue
        why = _not_a_ledger_file(dir_fd, name, path)
        if why:
            ignored.add(name)
            warn(f"{path}: skipped; it {why}")
            continue
        found.append((name, rank, path))
    return found


def read_appended(tail: FileTail, dir_fd: int, name: str, *, feed: Callable[[FileTail, bytes], None],
                  restart: Callable[[FileTail, str], None], warn: Callable[[str], None]) -> None:
    """Hands ``feed`` each chunk of what file ``name`` (in the opened folder ``dir_fd``) gained since
    ``tail.offset``, at most :data:`CHUNK_BYTES` at a time. A file that shrank or was replaced is handed to
    ``restart`` (which must reset ``tail``) and read from its start; one that became a link or not a regular
    file is refused for good, with a warning. Raises ``ettkit.IoError`` naming the path on an OS error."""
    if tail.refused:
        return
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return  # removed since the listing; its records so far stay counted
    except OSError as e:
        raise IoError(f"cannot read ledger file '{tail.path}': {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        tail.refused = True
        warn(f"{tail.path} was replaced by a symbolic link or something that is not a regular file; "
             f"no longer read (its records so far stay counted)")
        return
    if tail.inode is None:
        tail.inode = st.st_ino
    elif st.st_ino != tail.inode or st.st_size < tail.offset:
        restart(tail, "was replaced or truncated")
        tail.inode = st.st_ino
    if st.st_size <= tail.offset:
        return
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            return  # swapped for a link since the stat: the next refresh refuses it
        raise IoError(f"cannot read ledger file '{tail.path}': {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != tail.inode:
            return  # swapped since the stat: the next refresh sees what it is now
        while tail.offset < st.st_size:
            chunk = os.pread(fd, min(CHUNK_BYTES, st.st_size - tail.offset), tail.offset)
            if not chunk:
                break
            tail.offset += len(chunk)
            feed(tail, chunk)
    except OSError as e:
        raise IoError(f"cannot read ledger file '{tail.path}': {e.strerror}") from e
    finally:
        os.close(fd)


def take_complete_lines(tail: FileTail, chunk: bytes) -> tuple[bool, Optional[bytes]]:
    """The lines ``chunk`` completes, as (whether an oversized line ended here, the bytes of the complete
    lines with the last newline cut off, or None). The bytes after the last newline wait in
    ``tail.partial``, appended in place, so an unterminated line costs its own length once (not once per
    chunk) and at most :data:`MAX_LINE_BYTES`: past that it is dropped and skipped up to its newline, where
    it ends as one oversized line (``tail.line_no`` counts it)."""
    start = 0
    oversized = False
    if tail.skipping:
        newline = chunk.find(b"\n")
        if newline < 0:
            return False, None
        tail.skipping = False
        tail.line_no += 1
        oversized = True
        start = newline + 1
    cut = chunk.rfind(b"\n", start) + 1
    if cut == 0:
        tail.partial += memoryview(chunk)[start:]
        if len(tail.partial) > MAX_LINE_BYTES:
            tail.partial = bytearray()
            tail.skipping = True
        return oversized, None
    if tail.partial:  # at most MAX_LINE_BYTES waiting, plus at most a chunk
        tail.partial += memoryview(chunk)[start:cut - 1]
        data = bytes(tail.partial)
    else:
        data = chunk[start:cut - 1]
    tail.partial = bytearray(memoryview(chunk)[cut:])
    return oversized, data


def split_lines(data: bytes) -> list[str] | list[bytes]:
    """The newline-separated lines of ``data``: str lines, or bytes lines when ``data`` is not UTF-8."""
    try:
        # One decode for the whole batch (a newline always ends a character) is what keeps a refresh cheap;
        # a batch holding bytes that are not UTF-8 is split into lines first, so that only the line holding
        # them is corrupt.
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return data.split(b"\n")
