"""The live ETT figures of a run directory, kept current by reading only what its ledger gained since the
last refresh (:class:`LiveLedger`); :mod:`ettkit.ett.live` serves them to Prometheus.

**How it stays cheap.** :class:`LiveLedger` keeps a byte offset per ``RUN_DIR/ett/rank-<r>.jsonl``. A
refresh lists the folder (a rank file that appears later is picked up), reads each file from its offset to
its current size, keeps an incomplete last line (a batch still being written) for the next read, parses the
complete lines and folds every record into running state. Nothing already read is parsed again, so a
scrape costs the records appended since the previous one (docs/benchmarks.md, "Live metrics").

**What it computes.** The after-the-fact report (``src/ett/report.cpp``, docs/ett.md §7) flattens each
rank's records into one owner per instant (a phase over a step, and among phases or among steps the one
that ends first), and takes the most severe rank at each instant of the job. The live view applies the
same flattening, with the same rule, to the **lowest rank** it sees, through a window: the latest
``window_records`` phases and steps of the current attempt stay open, and when the window is full the time
before its oldest part is settled for good. Time owned once settled is exact as long as no record that
arrives later covers it. Attempts, failures, their categories and failure points come from every rank.
docs/ett.md ("Live metrics") lists where the two can differ.
"""

from __future__ import annotations

import errno
import functools
import heapq
import itertools
import json
import logging
import os
import re
import stat
import time
from typing import Optional

from .. import _C
from ..errors import InvalidArgumentError, IoError

logger = logging.getLogger("ettkit")

# ---- the ledger format (src/ett/ledger_format.h, src/ett/ledger_reader.cpp) --------------------------------
_FORMAT_VERSION = 1
# UTC epoch microseconds a ledger time may take (1970 ... 9999-12-31T23:59:59): what the C++ reader accepts.
_MAX_EPOCH_US = 253_402_300_799_000_000
_MAX_RANK = 2_147_483_647
# A refresh reads at most this much of one file at a time, so that catching up on a large ledger never
# holds the whole file in memory.
_CHUNK_BYTES = 1 << 20
# What one line may cost (ledger::kMaxLineBytes and kMaxNestingDepth in src/ett/ledger_format.h): a longer or
# deeper line is no record of the Recorder's; it is counted as corrupt and skipped, never held whole.
_MAX_LINE_BYTES = 1 << 20
_MAX_NESTING_DEPTH = 64
_OVERSIZED = f"longer than {_MAX_LINE_BYTES} bytes; a ledger record is far shorter"
# Opens a ledger file only as itself: never through a symbolic link, and without blocking on a FIFO.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# What a piece of owned time is (report.cpp's Kind) and which record wins where records overlap (Layer).
_PHASE, _TRAINING, _WASTED, _UNATTRIBUTED, _LOST = range(5)
_FILLER, _STEP, _PHASE_LAYER = range(3)
_PROCESS_TEARDOWN = "shutdown/process_teardown"  # phase::kProcessTeardown
# report_timeline.cpp kPeerClockSkewUs: how far an exception may be recorded before a dead peer's last sign of
# life and still count as that death's consequence.
_PEER_CLOCK_SKEW_US = 5000

_EFFECTIVE, _IDLE, _FAILURE, _UNATTRIBUTED_BUCKET = "effective", "idle", "failure", "unattributed"
_BASE_BUCKET = {_PHASE: _IDLE, _TRAINING: _EFFECTIVE, _WASTED: _FAILURE, _UNATTRIBUTED: _UNATTRIBUTED_BUCKET,
                _LOST: _FAILURE}


@functools.lru_cache(maxsize=4096)
def top_level_phase(name: str) -> str:
    """The top-level phase ``name`` rolls up into, as the report groups phases (the C++ rule,
    ``ettkit::ett::top_level_phase``): ``"parent/child"`` -> ``"parent"``, a launcher_init sub-stage ->
    ``"launcher_init"``, any other name -> itself. Cached: a ledger has few distinct names."""
    return _C.ett.top_level_phase(name)


def _checkpoint_tier(name: str, phase: str) -> Optional[str]:
    """``"disk"`` or ``"memory"`` for a record of checkpoint phase ``phase`` (report.cpp checkpoint_tier):
    ``<phase>/memory`` is the memory tier's, the phase itself and its other sub-stages the disk tier's."""
    if name == phase:
        return "disk"
    if not name.startswith(phase + "/"):
        return None
    return "memory" if name[len(phase):] == "/memory" else "disk"


class _Corrupt(Exception):
    """A ledger line the reader skips and counts; the message says why."""


_decode = json.JSONDecoder().decode
# A step line exactly as the Recorder writes it (src/ett/recorder.cpp), nearly every line of a ledger: read
# without building a dict, as the C++ reader's FlatRecord does. JSON numbers have no leading zeros, so
# neither does the pattern; any other spelling of a step takes the JSON path.
_INT = "(?:0|[1-9][0-9]*)"
_STEP_LINE = re.compile(r'\{"v":1,"t":"step","n":(-?' + _INT + '),"b":(' + _INT + '),"e":(' + _INT + r')\}')


# A JSON string, or an unterminated one up to the end of the line: it always matches from a quote, without
# backtracking, so stripping strings is linear in the line whatever it holds.
_STRING = re.compile(rb'"[^"\\]*(?:\\.?[^"\\]*)*(?:"|\Z)')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _nesting_within(line: str | bytes, max_depth: int = _MAX_NESTING_DEPTH) -> bool:
    """Whether ``line`` nests arrays and objects at most ``max_depth`` deep, brackets inside strings not
    counted (the C++ reader's nesting_within). Python's json would otherwise build one list per level, or
    raise RecursionError (no ValueError) a thousand levels down. At C speed: few brackets prove it at once;
    otherwise strings are cut out, the brackets kept, and their running depth's maximum taken."""
    if type(line) is str:
        if line.count("[") + line.count("{") <= max_depth:
            return True
        line = line.encode("utf-8", "surrogatepass")
    elif line.count(b"[") + line.count(b"{") <= max_depth:
        return True
    brackets = _STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) <= max_depth


def _parse(line: str | bytes) -> Optional[dict | tuple]:
    """One ledger line as a JSON object, as (n, b, e) for a step line in the Recorder's own spelling, or
    None when it is not an object (the caller counts it as corrupt). Raises _Corrupt, with the reason, for a
    line nested deeper than the ledger's bound. Module-level so that a test can count the lines a refresh
    parses."""
    if type(line) is str:
        m = _STEP_LINE.fullmatch(line)
        if m is not None:
            return int(m[1]), int(m[2]), int(m[3])
    if not _nesting_within(line):
        raise _Corrupt(f"nested deeper than {_MAX_NESTING_DEPTH} levels")
    try:
        doc = _decode(line) if type(line) is str else json.loads(line)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        return None
    return doc if type(doc) is dict else None


def _integer(doc: dict, key: str) -> int:
    v = doc.get(key)
    if type(v) is not int:  # bool is an int subclass, and JSON true is no integer to the C++ reader
        raise _Corrupt(f"'{key}' is missing or not an integer")
    return v


def _time(doc: dict, key: str) -> int:
    v = _integer(doc, key)
    if not 0 <= v <= _MAX_EPOCH_US:
        raise _Corrupt(f"'{key}' = {v} is out of range for UTC epoch microseconds (1970 to 9999)")
    return v


def _rank_of(file_name: str) -> Optional[int]:
    """The rank of ``rank-<r>.jsonl`` written as the Recorder writes it (plain decimal, no leading zeros, at
    most 2147483647), else None: the same files the report reads."""
    digits = file_name[len("rank-"):-len(".jsonl")]
    if not digits.isdigit() or not digits.isascii() or (len(digits) > 1 and digits[0] == "0"):
        return None
    rank = int(digits)
    return rank if rank <= _MAX_RANK else None


def _own(items: list, lo: int, hi: int, failed: bool, failure_point: int, first_training: Optional[int],
         pre: dict, post: dict) -> Optional[int]:
    """Adds the time each record owns within [lo, hi) to ``pre`` / ``post`` (µs per (name, kind)), split at
    the attempt's first training; returns the first training (the begin of its first training time).

    The owner of an instant is report.cpp's flatten(): the covering record of the highest layer (phase >
    step > filler); within a layer the one that ends first, then the one that began last, then the one read
    first. Records are ranked by their whole interval, not by the part inside [lo, hi), so owning [lo, T)
    and then [T, hi) gives what owning [lo, hi) at once would: that is what lets the window settle time.
    Uncovered time is unattributed. In a failed attempt, whatever the rank does from the job's failure
    point on is lost_in_flight (``failure_point``; the job redoes it after the restore): its uncovered tail,
    the report's fillers there, and, when another rank failed first, its records after that.
    ``items`` are (b, e, layer, seq, name, kind)."""
    if hi <= lo:
        return first_training
    live = sorted(it for it in items if it[1] > lo and it[0] < hi)
    points = {lo, hi}
    for it in live:
        if it[0] > lo:
            points.add(it[0])
        if it[1] < hi:
            points.add(it[1])
    points = sorted(points)
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    nxt, n = 0, len(live)
    p = points[0]
    for q in points[1:]:
        while nxt < n and live[nxt][0] <= p:
            b, e, layer, seq, name, kind = live[nxt]
            push(heap, (-layer, e, -b, seq, name, kind))
            nxt += 1
        # Lazy deletion, as in report.cpp: an ended record leaves the heap once it reaches the top.
        while heap and heap[0][1] <= p:
            pop(heap)
        if heap:
            top = heap[0]
            if first_training is None and (top[5] == _TRAINING or top[5] == _WASTED):
                first_training = p  # report.cpp: before the failure-point split
            key = ("lost_in_flight", _LOST) if failed and p >= failure_point else (top[4], top[5])
        elif failed and p >= failure_point:
            key = ("lost_in_flight", _LOST)
        else:
            key = ("unattributed", _UNATTRIBUTED)
        target = post if first_training is not None and p >= first_training else pre
        target[key] = target.get(key, 0) + (q - p)
        p = q
    return first_training


class _Timeline:
    """The lowest rank's owned time in one attempt: settled totals plus the window of open records."""

    __slots__ = ("pending", "lo", "pre", "post", "first_training", "seq", "final", "closing", "blocked_steps",
                 "unnumbered", "cache_key", "cache")

    def __init__(self) -> None:
        self.pending: list = []        # open records: (b, e, layer, seq, name, kind)
        self.lo: Optional[int] = None  # time before this is settled (None: nothing settled yet)
        self.pre: dict = {}            # settled µs per (name, kind) before the first training ...
        self.post: dict = {}           # ... and from it on (a recovery attempt's window is failure time)
        self.first_training: Optional[int] = None
        self.seq = 0                   # file order: the last tie-break of the ownership rule
        self.closing = False           # a later attempt record was read: settled at the end of the refresh
        self.final = False             # settled: every record of the attempt is in pre/post
        self.blocked_steps = {"disk": set(), "memory": set()}  # a save that blocks twice is one checkpoint
        self.unnumbered = {"disk": 0, "memory": 0}
        self.cache_key: Optional[tuple] = None
        self.cache: Optional[tuple] = None


class _Attempt:
    """What any rank's attempt contributes: its extent, status and failure point (and, on the lowest rank,
    its timeline)."""

    __slots__ = ("number", "ts", "proc_start", "floor", "begin", "alloc_begin", "last_ts", "activity_end",
                 "has_end", "end_ts", "pid", "status", "detail", "max_step", "last_step", "has_bootstrap", "timeline", "first")

    def __init__(self, number: int, ts: int, proc_start: Optional[int], floor: Optional[int],
                 first: bool) -> None:
        self.number = number
        self.first = first  # the rank's first attempt: E2E begins at its allocation
        self.ts = ts
        self.proc_start = proc_start
        self.floor = floor  # process_start_floor() of report.cpp: the previous attempt's end, or None
        self.begin = ts if proc_start is None else min(ts, proc_start)
        self.alloc_begin = self.begin
        self.last_ts = ts
        self.activity_end = 0
        self.has_end = False
        self.end_ts = 0
        self.pid: Optional[int] = None  # the recording process (attempt record)
        self.status = "clean"
        self.detail = ""
        self.max_step: Optional[int] = None
        self.last_step: Optional[int] = None
        self.has_bootstrap = False
        self.timeline: Optional[_Timeline] = None

    def failure_point(self) -> int:
        return self.activity_end if self.activity_end > 0 else self.begin


class _RankFile:
    """One ledger file: where reading stopped, and the attempts read so far."""

    __slots__ = ("rank", "path", "inode", "offset", "partial", "skipping", "refused", "line_no", "attempts",
                 "high_water", "timeline", "corrupt_here")

    def __init__(self, rank: int, path: str, timeline: bool) -> None:
        self.rank = rank
        self.path = path
        self.inode: Optional[int] = None
        self.offset = 0
        # Bytes after the last newline read (a line still being written), appended to in place; dropped once
        # longer than a line may be, and the rest of that line then skipped up to its newline.
        self.partial = bytearray()
        self.skipping = False
        self.refused = False  # became a link or not a regular file: no longer read (its records stay)
        self.line_no = 0
        self.attempts: list[_Attempt] = []
        self.high_water: Optional[int] = None  # highest step of the attempts before the current one
        self.timeline = timeline
        self.corrupt_here = 0


def _byte_length(line: str | bytes) -> int:
    return len(line) if type(line) is bytes else len(line.encode("utf-8", "surrogatepass"))


def _open_ledger_folder(folder: str) -> Optional[int]:
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


class LiveLedger:
    """The ETT figures of ``run_dir``'s ledger, brought up to date by :meth:`refresh` from only the bytes
    appended since the previous call.

    Promises: a refresh never reads a byte twice (a file that shrank or was replaced is read again from its
    start, with a warning); a line is folded only once complete (ends with a newline), so a torn or
    half-written last line is neither counted nor lost; a corrupt line is skipped and counted; a rank file
    that appears later is picked up. For one rank whose records arrive in the order the Recorder writes them,
    the :meth:`figures` of a finished run (an end record) equal the report's (``build_report``).
    ``window_records`` (>= 16) bounds the open records of the current attempt, and so a refresh's cost.
    A hostile run directory costs bounded memory (docs/ett.md §10, "Directories someone else wrote"): a line
    longer than 1 MiB or nested deeper than 64 levels is one corrupt line, never held whole (a refresh holds
    at most one 1 MiB chunk and one line); only regular files of ``RUN_DIR/ett`` are read, never through a
    symbolic link. Not thread-safe: :class:`MetricsServer` serialises its calls.
    """

    def __init__(self, run_dir: str | os.PathLike, *, window_records: int = 1024) -> None:
        if type(window_records) is not int or window_records < 16:
            raise InvalidArgumentError(f"LiveLedger: window_records={window_records!r}; pass an int >= 16 "
                                       f"(the open records of the current attempt; default 1024)")
        self.run_dir = os.fspath(run_dir)
        self._window = window_records
        self._keep = window_records // 4  # records left open when the window is settled
        self._files: dict[str, _RankFile] = {}
        self._ignored: set[str] = set()
        self._timeline_rank: Optional[int] = None
        self._latest_attempt: Optional[int] = None  # the highest attempt number of any rank
        self.records = 0          # records folded (what the report counts as ledger.records)
        self.corrupt_lines = 0
        self.orphan_records = 0   # records before any attempt record of their file
        self.late_records = 0     # records that arrived after the time they cover was settled (clipped)
        self.warnings: list[str] = []
        self._categories: dict[str, str] = {}

    # ---- reading ---------------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Reads what the ledger files gained since the last call and folds it; returns the number of
        records folded. A missing ``ett/`` folder (no Recorder has written yet) reads as no files.
        Raises ``ettkit.IoError`` naming the path when ``ett/`` is a symbolic link (refused, as by the
        report) or the OS refuses to open, list or read the folder or a ledger file."""
        folder = os.path.join(self.run_dir, "ett")
        dir_fd = _open_ledger_folder(folder)
        if dir_fd is None:
            return 0
        try:
            return self._refresh_in(dir_fd, folder)
        finally:
            os.close(dir_fd)

    def _refresh_in(self, dir_fd: int, folder: str) -> int:
        try:
            names = os.listdir(dir_fd)
        except OSError as e:
            raise IoError(f"cannot list ledger folder '{folder}': {e.strerror}") from e
        for name in names:
            if name in self._files or name in self._ignored:
                continue
            if not (name.startswith("rank-") and name.endswith(".jsonl")) or len(name) <= 11:
                continue
            path = os.path.join(folder, name)
            rank = _rank_of(name)
            if rank is None:
                self._ignored.add(name)
                self._warn(f"{path}: skipped; a ledger file is named rank-<r>.jsonl with r a rank in "
                           f"plain decimal (0 to 2147483647, no leading zeros)")
                continue
            why = _not_a_ledger_file(dir_fd, name, path)
            if why:
                self._ignored.add(name)
                self._warn(f"{path}: skipped; it {why}")
                continue
            self._files[name] = _RankFile(rank, path, timeline=False)
        if not self._files:
            return 0
        lowest = min(rf.rank for rf in self._files.values())
        if lowest != self._timeline_rank:
            # A lower rank appeared. Files are only ever added, so its file is new (nothing read yet) and its
            # timeline starts with its first byte; the previous rank's is dropped.
            for rf in self._files.values():
                if rf.rank == self._timeline_rank:
                    rf.timeline = False
                    for a in rf.attempts:
                        a.timeline = None
                elif rf.rank == lowest:
                    rf.timeline = True
            self._timeline_rank = lowest
        before = self.records
        for name, rf in sorted(self._files.items(), key=lambda kv: kv[1].rank):
            self._read(rf, dir_fd, name)
        # An attempt the lowest rank has left is settled once every file was read, so that its lost time
        # starts at the job's failure point as far as all ranks tell it.
        for a in self._file_of(lowest).attempts:
            if a.timeline is not None and a.timeline.closing and not a.timeline.final:
                self._settle(a, a.timeline, final=True)
        return self.records - before

    @property
    def progress(self) -> tuple:
        """What changes whenever a refresh folds or counts anything (records, corrupt lines, files,
        warnings): equal before and after a refresh that found nothing new."""
        return (self.records, self.corrupt_lines, self.orphan_records, self.late_records, len(self._files),
                len(self._ignored), len(self.warnings))

    def _warn(self, message: str) -> None:
        if len(self.warnings) < 100:  # bounded: a long-running endpoint must not grow with a bad ledger
            self.warnings.append(message)
        logger.warning("ETT live metrics: %s", message)

    def _restart(self, rf: _RankFile, why: str) -> None:
        self._warn(f"{rf.path} {why}; read again from its start")
        fresh = _RankFile(rf.rank, rf.path, rf.timeline)
        for slot in _RankFile.__slots__:
            setattr(rf, slot, getattr(fresh, slot))

    def _read(self, rf: _RankFile, dir_fd: int, name: str) -> None:
        if rf.refused:
            return
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return  # removed since the listing; its records so far stay counted
        except OSError as e:
            raise IoError(f"cannot read ledger file '{rf.path}': {e.strerror}") from e
        if not stat.S_ISREG(st.st_mode):
            rf.refused = True
            self._warn(f"{rf.path} was replaced by a symbolic link or something that is not a regular file; "
                       f"no longer read (its records so far stay counted)")
            return
        if rf.inode is None:
            rf.inode = st.st_ino
        elif st.st_ino != rf.inode or st.st_size < rf.offset:
            self._restart(rf, "was replaced or truncated")
            rf.inode = st.st_ino
        if st.st_size <= rf.offset:
            return
        try:
            fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.ELOOP:
                return  # swapped for a link since the stat: the next refresh refuses it
            raise IoError(f"cannot read ledger file '{rf.path}': {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != rf.inode:
                return  # swapped since the stat: the next refresh sees what it is now
            while rf.offset < st.st_size:
                chunk = os.pread(fd, min(_CHUNK_BYTES, st.st_size - rf.offset), rf.offset)
                if not chunk:
                    break
                rf.offset += len(chunk)
                self._feed(rf, chunk)
        except OSError as e:
            raise IoError(f"cannot read ledger file '{rf.path}': {e.strerror}") from e
        finally:
            os.close(fd)

    def _feed(self, rf: _RankFile, chunk: bytes) -> None:
        """Folds the lines ``chunk`` completes. The bytes after its last newline wait in ``rf.partial``,
        appended in place, so an unterminated line costs its own length once (not once per chunk) and at
        most ``_MAX_LINE_BYTES``: past that it is dropped and skipped up to its newline, one corrupt line."""
        start = 0
        if rf.skipping:
            newline = chunk.find(b"\n")
            if newline < 0:
                return
            rf.skipping = False
            rf.line_no += 1
            self._corrupt(rf, _OVERSIZED)
            start = newline + 1
        cut = chunk.rfind(b"\n", start) + 1
        if cut == 0:
            rf.partial += memoryview(chunk)[start:]
            if len(rf.partial) > _MAX_LINE_BYTES:
                rf.partial = bytearray()
                rf.skipping = True
            return
        if rf.partial:  # at most _MAX_LINE_BYTES waiting, plus at most a chunk
            rf.partial += memoryview(chunk)[start:cut - 1]
            data = bytes(rf.partial)
        else:
            data = chunk[start:cut - 1]
        rf.partial = bytearray(memoryview(chunk)[cut:])
        self._fold_lines(rf, data)

    def _fold_lines(self, rf: _RankFile, data: bytes) -> None:
        """Folds the newline-separated lines of ``data`` (its last line complete, its newline cut off)."""
        try:
            # One decode for the whole batch (a newline always ends a character) is what keeps a refresh
            # cheap; a batch holding bytes that are not UTF-8 is split into lines first, so that only the
            # line holding them is corrupt.
            lines = data.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            lines = data.split(b"\n")
        parse = _parse
        for line in lines:
            rf.line_no += 1
            if not line:
                continue
            try:
                if len(line) > _MAX_LINE_BYTES // 4 and _byte_length(line) > _MAX_LINE_BYTES:
                    raise _Corrupt(_OVERSIZED)
                doc = parse(line)
                if doc is None:
                    raise _Corrupt("")
                if type(doc) is tuple:
                    self._fold_step(rf, *doc)
                else:
                    self._fold(rf, doc)
            except _Corrupt as e:
                self._corrupt(rf, str(e))

    def _corrupt(self, rf: _RankFile, why: str) -> None:
        self.corrupt_lines += 1
        rf.corrupt_here += 1
        if rf.corrupt_here <= 3:
            self._warn(f"{rf.path}:{rf.line_no}: corrupt record skipped" + (f" ({why})" if why else ""))

    # ---- folding ---------------------------------------------------------------------------------------
    def _fold(self, rf: _RankFile, doc: dict) -> None:
        v = doc.get("v")
        t = doc.get("t")
        if type(v) is not int or type(t) is not str:
            raise _Corrupt("")
        if v > _FORMAT_VERSION:
            # The report refuses such a ledger (UnsupportedError); a live endpoint keeps serving and says so.
            raise _Corrupt(f"format version {v}; this ettkit reads up to version {_FORMAT_VERSION}, upgrade "
                           f"ettkit to read it")
        if t == "attempt":
            self._fold_attempt(rf, doc)
            self.records += 1
            return
        if not rf.attempts:
            self.orphan_records += 1
            return
        a = rf.attempts[-1]
        if t == "step":
            _integer(doc, "n")
            _time(doc, "b")
            _time(doc, "e")
            self._fold_step(rf, doc["n"], doc["b"], doc["e"])
            return
        if t == "phase" or t == "bg":
            name = doc.get("name")
            if type(name) is not str:
                raise _Corrupt("'name' is missing or not a string")
            b = _time(doc, "b")
            e = _time(doc, "e")
            if e < b:
                raise _Corrupt("ends before it begins")
            if e > a.last_ts:
                a.last_ts = e
            if t == "phase":
                if e > a.activity_end:
                    a.activity_end = e
                if name == "process_bootstrap":
                    a.has_bootstrap = True
                    if a.floor is not None:
                        b = max(b, a.floor)  # as report.cpp's phase_begin
                if b < a.begin:
                    a.begin = b
                if b < a.alloc_begin and name != "scheduling":
                    a.alloc_begin = b
                tl = a.timeline
                if tl is not None:
                    kind = (_TRAINING if name == "training" else
                            _WASTED if name == "wasted_training" else _PHASE)
                    self._add(a, tl, b, e, _PHASE_LAYER, name, kind)
                    tier = _checkpoint_tier(name, "checkpoint_blocking")
                    if tier is not None:
                        step = doc.get("step")
                        if type(step) is int and step >= 0:
                            tl.blocked_steps[tier].add(step)
                        else:
                            tl.unnumbered[tier] += 1
        elif t == "hb":
            ts = _time(doc, "ts")
            if ts > a.last_ts:
                a.last_ts = ts
        elif t == "config":
            value = doc.get("value")
            if type(doc.get("key")) is not str or type(value) not in (int, float):
                raise _Corrupt("'key' or 'value' is missing or of the wrong type")
        elif t == "dropped":
            _integer(doc, "n")
        elif t == "end":
            ts = _time(doc, "ts")
            a.has_end = True
            a.end_ts = ts
            if ts > a.last_ts:
                a.last_ts = ts
            status = doc.get("status")
            detail = doc.get("detail")
            a.status = status if type(status) is str else "clean"
            a.detail = detail if type(detail) is str else ""
        elif t == "process_exit":
            ts = _time(doc, "ts")
            number = _integer(doc, "attempt")
            pid = doc.get("pid")
            if number != a.number or (type(pid) is int and a.pid is not None and pid != a.pid):
                return  # another attempt's or process's line: skipped, as by the report
            # report.cpp: a clean attempt lasts until its process exits; the teardown after the end record
            # is the shutdown sub-stage.
            if a.has_end and a.status == "clean" and ts > a.last_ts:
                if a.timeline is not None:
                    self._add(a, a.timeline, a.last_ts, ts, _PHASE_LAYER, _PROCESS_TEARDOWN, _PHASE)
                a.last_ts = ts
        else:
            return  # an unknown type of a known version (a newer minor release): skipped, as by the report
        self.records += 1

    def _fold_step(self, rf: _RankFile, n: int, b: int, e: int) -> None:
        if not rf.attempts:  # the report's order: a record before any attempt is an orphan, whatever it holds
            self.orphan_records += 1
            return
        if not 0 <= b <= e <= _MAX_EPOCH_US:
            if b > _MAX_EPOCH_US or e > _MAX_EPOCH_US:
                raise _Corrupt(f"'b' = {b} or 'e' = {e} is out of range for UTC epoch microseconds "
                               f"(1970 to 9999)")
            raise _Corrupt("ends before it begins")
        a = rf.attempts[-1]
        if e > a.activity_end:
            a.activity_end = e
        if e > a.last_ts:
            a.last_ts = e
        if b < a.begin:
            a.begin = b
        if a.max_step is None or n > a.max_step:
            a.max_step = n
        a.last_step = n
        tl = a.timeline
        if tl is not None:
            wasted = rf.high_water is not None and n <= rf.high_water
            if wasted:
                self._add(a, tl, b, e, _STEP, "wasted_training", _WASTED)
            else:
                self._add(a, tl, b, e, _STEP, "training", _TRAINING)
        self.records += 1

    def _fold_attempt(self, rf: _RankFile, doc: dict) -> None:
        number = _integer(doc, "attempt")
        ts = _time(doc, "ts")
        proc_start = doc.get("proc_start")
        if type(proc_start) is not int:
            proc_start = None
        elif not 0 <= proc_start <= _MAX_EPOCH_US:
            self._warn(f"{rf.path}:{rf.line_no}: proc_start {proc_start} is out of range; ignored")
            proc_start = None
        prev = rf.attempts[-1] if rf.attempts else None
        floor = None
        if prev is not None:
            if prev.max_step is not None and (rf.high_water is None or prev.max_step > rf.high_water):
                rf.high_water = prev.max_step
            if prev.timeline is not None:
                prev.timeline.closing = True
            # report.cpp process_start_floor(): a start read before the previous attempt's end is /proc's
            # imprecision, so it is raised to that end.
            if proc_start is not None and proc_start < prev.last_ts <= ts:
                floor = prev.last_ts
                proc_start = max(proc_start, floor)
        a = _Attempt(number, ts, proc_start, floor, first=prev is None)
        pid = doc.get("pid")
        a.pid = pid if type(pid) is int and pid >= 0 else None
        if self._latest_attempt is None or number > self._latest_attempt:
            self._latest_attempt = number
        if rf.timeline:
            a.timeline = _Timeline()
        rf.attempts.append(a)

    def _add(self, a: _Attempt, tl: _Timeline, b: int, e: int, layer: int, name: str, kind: int) -> None:
        if tl.lo is not None and b < tl.lo:
            self.late_records += 1  # its time before tl.lo is settled already: only the rest counts
            if e <= tl.lo:
                return
        tl.pending.append((b, e, layer, tl.seq, name, kind))
        tl.seq += 1
        if len(tl.pending) > self._window:
            self._settle(a, tl, final=False)

    @staticmethod
    def _base_lo(a: _Attempt) -> int:
        # E2E begins at the first attempt's allocation (its queue is outside E2E, docs/ett.md §7).
        return a.alloc_begin if a.first else a.begin

    def _file_of(self, rank: Optional[int]) -> _RankFile:
        for rf in self._files.values():
            if rf.rank == rank:
                return rf
        raise KeyError(rank)

    @staticmethod
    def _fillers(a: _Attempt) -> list:
        # The report's own start-up fillers (docs/ett.md §3): worker_spawn for [allocation, process start)
        # and, when the Recorder wrote none, process_bootstrap for [process start, Recorder start).
        out = []
        ps = a.proc_start
        if ps is not None:
            if ps > a.begin:
                out.append((a.begin, ps, _FILLER, -2, "worker_spawn", _PHASE))
            if ps < a.ts and not a.has_bootstrap:
                out.append((ps, a.ts, _FILLER, -1, "process_bootstrap", _PHASE))
        return out

    def _settle(self, a: _Attempt, tl: _Timeline, final: bool) -> None:
        """Settles the window's oldest time (all of it when the attempt is over) into the totals."""
        lo = tl.lo if tl.lo is not None else self._base_lo(a)
        failed, point = self._job_failure(a.number)
        if final:
            tl.first_training = _own(tl.pending + self._fillers(a), lo, a.last_ts, failed, point,
                                     tl.first_training, tl.pre, tl.post)
            tl.pending = []
            tl.lo = max(lo, a.last_ts)
            tl.final = True
            return
        ends = sorted(it[1] for it in tl.pending)
        horizon = ends[len(ends) - self._keep - 1]
        if horizon > lo:
            tl.first_training = _own(tl.pending + self._fillers(a), lo, horizon, failed, point,
                                     tl.first_training, tl.pre, tl.post)
            tl.lo = horizon
        tl.pending = [it for it in tl.pending if it[1] > horizon]

    # ---- figures ---------------------------------------------------------------------------------------
    def _owned(self, a: _Attempt, failed: bool, point: Optional[int]) -> tuple[dict, dict, Optional[int]]:
        """The attempt's owned time (settled and open) and first training; ``failed`` and ``point`` are the
        job's view of the attempt."""
        tl = a.timeline
        if tl.final:
            return tl.pre, tl.post, tl.first_training
        lo = tl.lo if tl.lo is not None else self._base_lo(a)
        key = (tl.seq, len(tl.pending), lo, a.last_ts, a.begin, a.alloc_begin, failed, point, a.has_bootstrap)
        if tl.cache_key != key:
            pre, post = dict(tl.pre), dict(tl.post)
            first = _own(tl.pending + self._fillers(a), lo, a.last_ts, failed, point or 0, tl.first_training,
                         pre, post)
            tl.cache_key, tl.cache = key, (pre, post, first)
        return tl.cache

    def _category(self, name: str) -> str:
        c = self._categories.get(name)
        if c is None:
            from .badput import badput_category

            c = self._categories[name] = badput_category(name)
        return c

    def figures(self, now_s: Optional[float] = None) -> dict:
        """The current figures as a dict (report-like keys; docs/ett.md "Live metrics"). Call
        :meth:`refresh` first to include what was appended since. ``now_s`` (epoch seconds, default now)
        dates ``seconds_since_last_record``."""
        now_us = int((time.time() if now_s is None else now_s) * 1e6)
        out: dict = {
            "run_dir": self.run_dir,
            "rank": self._timeline_rank,
            "ranks": sorted(rf.rank for rf in self._files.values()),
            "ledger": {"files": len(self._files), "records": self.records,
                       "corrupt_lines": self.corrupt_lines, "orphan_records": self.orphan_records,
                       "late_records": self.late_records, "warnings": list(self.warnings)},
            "seconds_since_last_record": {rf.rank: max(0.0, (now_us - rf.attempts[-1].last_ts) / 1e6)
                                          for rf in self._files.values() if rf.attempts},
        }
        jobs = self._jobs()
        out["attempts"] = len(jobs)
        failed = sorted((j["failure_point"], n) for n, j in jobs.items() if j["failed"])
        by_category: dict[str, int] = {}
        for _, n in failed:
            by_category[jobs[n]["category"]] = by_category.get(jobs[n]["category"], 0) + 1
        out["failures"] = len(failed)
        out["failures_by_category"] = by_category
        if self._timeline_rank is None:
            return out
        ref = self._file_of(self._timeline_rank)
        if not ref.attempts:
            return out

        buckets = {_EFFECTIVE: 0, _IDLE: 0, _FAILURE: 0, _UNATTRIBUTED_BUCKET: 0}
        phases: dict[str, int] = {}
        badput: dict[str, int] = {}
        tier_blocking = {"disk": 0, "memory": 0}
        numbers = sorted(jobs)
        index = {n: i for i, n in enumerate(numbers)}

        def account(name: str, kind: int, us: int, bucket: str) -> None:
            buckets[bucket] += us
            top = top_level_phase(name)
            phases[top] = phases.get(top, 0) + us
            if bucket != _EFFECTIVE:
                c = self._category(name)
                c = "OTHER" if c == "GOODPUT" else c  # "training" while the job still recovered
                badput[c] = badput.get(c, 0) + us
            tier = _checkpoint_tier(name, "checkpoint_blocking")
            if tier is not None:
                tier_blocking[tier] += us

        first_training: dict[int, int] = {}
        tts: dict[int, float] = {}
        ended = None  # the latest end of the lowest rank's attempts so far
        previous = None
        saves = {"disk": 0, "memory": 0}
        for a in ref.attempts:
            job = jobs[a.number]
            pre, post, first = self._owned(a, job["failed"], job["failure_point"])
            if ended is not None and a.begin > ended:
                # No record of the lowest rank covers the gap between two of its attempts.
                prev_failed = jobs[previous.number]["failed"]
                gap = a.begin - ended
                account("detect_and_teardown" if prev_failed else "restart_gap", _PHASE, gap,
                        _FAILURE if prev_failed else _IDLE)
            i = index[a.number]
            recovery = i > 0 and jobs[numbers[i - 1]]["failed"]
            for (name, kind), us in pre.items():
                account(name, kind, us, _FAILURE if recovery else _BASE_BUCKET[kind])
            for (name, kind), us in post.items():
                account(name, kind, us, _BASE_BUCKET[kind])
            if first is not None:
                first_training[a.number] = first
                tts[a.number] = (first - a.alloc_begin) / 1e6
            for tier in saves:
                saves[tier] += len(a.timeline.blocked_steps[tier]) + a.timeline.unnumbered[tier]
            ended = a.last_ts if ended is None else max(ended, a.last_ts)
            previous = a

        e2e_us = sum(buckets.values())
        out["e2e_s"] = e2e_us / 1e6
        for bucket, us in buckets.items():
            out[f"{bucket}_s"] = us / 1e6
        for bucket, key in ((_EFFECTIVE, "ett_pct"), (_IDLE, "idle_pct"), (_FAILURE, "failure_pct"),
                            (_UNATTRIBUTED_BUCKET, "unattributed_pct")):
            out[key] = 100.0 * buckets[bucket] / e2e_us if e2e_us > 0 else None
        out["phases"] = {name: us / 1e6 for name, us in sorted(phases.items())}
        from .badput import BADPUT_CATEGORIES

        out["badput"] = {c: badput.get(c, 0) / 1e6 for c in BADPUT_CATEGORIES}
        out["time_to_start_s"] = tts
        out["time_to_recover_s"] = self._time_to_recover(failed, numbers, first_training, ended)
        out["checkpoint_blocking_s"] = phases.get("checkpoint_blocking", 0) / 1e6
        out["checkpoints"] = {tier: {"count": saves[tier], "blocking_s": tier_blocking[tier] / 1e6}
                              for tier in ("disk", "memory")
                              if tier == "disk" or saves[tier] or tier_blocking[tier]}
        out["last_step"] = next((a.last_step for a in reversed(ref.attempts) if a.last_step is not None),
                                None)
        out["max_step"] = max((a.max_step for a in ref.attempts if a.max_step is not None), default=None)
        return out

    def _job_failure(self, number: int) -> tuple[bool, Optional[int]]:
        """Whether attempt ``number`` failed on any rank, and the job's failure point (see :meth:`_jobs`)."""
        failed, point = False, None
        for rf in self._files.values():
            for a in rf.attempts:
                if a.number == number and self._rank_failed(a):
                    p = a.failure_point()
                    failed, point = True, p if point is None else min(point, p)
        return failed, point

    def _rank_failed(self, a: _Attempt) -> bool:
        # Without an end record an attempt is killed once any rank has a later attempt; before that it runs.
        return a.status != "clean" if a.has_end else a.number < self._latest_attempt

    def _jobs(self) -> dict[int, dict]:
        """The job view of each attempt number over every rank: failed (any rank failed in it), its failure
        point (the earliest failed rank's last activity) and category, as report.cpp decides them (its
        cause_of_failure(): a death from outside, killed or by a signal, names the failure unless a peer's
        exception was recorded while it was demonstrably still alive)."""
        jobs: dict[int, dict] = {}
        groups: dict[int, tuple[list, list]] = {}  # attempt -> (deaths from outside, other failed ranks)
        for rf in sorted(self._files.values(), key=lambda r: r.rank):
            for a in rf.attempts:
                job = jobs.setdefault(a.number, {"failed": False, "failure_point": None, "category": None})
                if not self._rank_failed(a):
                    continue
                point = a.failure_point()
                if not job["failed"] or point < job["failure_point"]:
                    job["failure_point"] = point
                job["failed"] = True
                outside = not a.has_end or a.status == "signal"
                groups.setdefault(a.number, ([], []))[0 if outside else 1].append((point, rf.rank, a))
        for number, (outside, other) in groups.items():
            first_outside = min(outside, key=lambda x: x[:2], default=None)
            first_other = min(other, key=lambda x: x[:2], default=None)
            cause = first_outside or first_other
            if first_outside is not None and first_other is not None:
                dead, raised = first_outside[2], first_other[2]
                dead_alive = dead.end_ts if dead.has_end else dead.last_ts
                if raised.end_ts + _PEER_CLOCK_SKEW_US < dead_alive:
                    cause = first_other
            a = cause[2]
            if not a.has_end:
                category = "killed"
            elif a.status == "exception":
                sep = a.detail.find(": ")
                category = "exception:" + (a.detail if sep < 0 else a.detail[:sep])
            else:
                category = a.status
            jobs[number]["category"] = category
        return jobs

    @staticmethod
    def _time_to_recover(failed: list, numbers: list, first_training: dict, end: int) -> list:
        """Time to Recover per failure in failure-point order (docs/ett.md §7): to the first training of the
        first later attempt that trains after the failure point, cut at the next failure; still growing
        (to the latest record) while the job has not trained again."""
        out = []
        for k, (f, attempt) in enumerate(failed):
            stop = end
            for n in numbers:
                if n > attempt and first_training.get(n, -1) > f:
                    stop = first_training[n]
                    break
            if k + 1 < len(failed) and failed[k + 1][0] < stop:
                stop = failed[k + 1][0]
            out.append(max(stop - f, 0) / 1e6)
        return out


__all__ = ["LiveLedger", "top_level_phase"]
