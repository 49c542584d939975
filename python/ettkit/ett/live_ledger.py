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

**Where each part lives.** This module folds records into attempts and the lowest rank's window, and keeps
the public names (:class:`LiveLedger`, :func:`top_level_phase`). Reading the files is
:mod:`._ledger_tail`'s, decoding a line :mod:`._ledger_records`', the ownership and failure-cause rules it
shares with the report :mod:`._ownership`'s (pinned against the C++ by one corpus), and the figures
:mod:`._live_figures`'.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from ..errors import InvalidArgumentError
from . import _ledger_tail
from ._ledger_records import FORMAT_VERSION, OVERSIZED, Corrupt, byte_length, check_step_times, integer_field
from ._ledger_records import MAX_EPOCH_US, MAX_LINE_BYTES, time_field
# Module-level under its old name: a test counts the lines a refresh parses by replacing it here.
from ._ledger_records import parse_line as _parse
from ._ledger_tail import FileTail
from ._live_figures import add_failures, add_timeline_figures, checkpoint_tier, job_cause, job_failure, job_view
from ._live_figures import top_level_phase
from ._ownership import FILLER, PHASE, PHASE_LAYER, STEP, TRAINING, WASTED, Item, own

logger = logging.getLogger("ettkit")

_PROCESS_TEARDOWN = "shutdown/process_teardown"  # phase::kProcessTeardown


class _Timeline:
    """The lowest rank's owned time in one attempt: settled totals plus the window of open records."""

    __slots__ = ("pending", "lo", "pre", "post", "first_training", "seq", "final", "closing", "blocked_steps",
                 "unnumbered", "cache_key", "cache")

    def __init__(self) -> None:
        self.pending: list[Item] = []  # open records: (b, e, layer, seq, name, kind)
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
                 "has_end", "end_ts", "pid", "status", "detail", "max_step", "last_step", "has_bootstrap", "timeline",
                 "first")

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


class _RankFile(FileTail):
    """One ledger file: where reading stopped (:class:`FileTail`), and the attempts read so far."""

    __slots__ = ("rank", "attempts", "high_water", "timeline", "corrupt_here")

    def __init__(self, rank: int, path: str, timeline: bool) -> None:
        super().__init__(path)
        self.rank = rank
        self.attempts: list[_Attempt] = []
        self.high_water: Optional[int] = None  # highest step of the attempts before the current one
        self.timeline = timeline
        self.corrupt_here = 0


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

    # ---- reading ---------------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Reads what the ledger files gained since the last call and folds it; returns the number of
        records folded. A missing ``ett/`` folder (no Recorder has written yet) reads as no files.
        Raises ``ettkit.IoError`` naming the path when ``ett/`` is a symbolic link (refused, as by the
        report) or the OS refuses to open, list or read the folder or a ledger file."""
        folder = os.path.join(self.run_dir, "ett")
        dir_fd = _ledger_tail.open_ledger_folder(folder)
        if dir_fd is None:
            return 0
        try:
            return self._refresh_in(dir_fd, folder)
        finally:
            os.close(dir_fd)

    def _refresh_in(self, dir_fd: int, folder: str) -> int:
        for name, rank, path in _ledger_tail.new_ledger_files(dir_fd, folder, self._files, self._ignored,
                                                              self._warn):
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
        rf.__init__(rf.rank, rf.path, rf.timeline)  # what was read of it is forgotten, its role kept

    def _read(self, rf: _RankFile, dir_fd: int, name: str) -> None:
        # self._feed looked up on each read: a test counts the bytes read by replacing it on the class.
        _ledger_tail.read_appended(rf, dir_fd, name, feed=self._feed, restart=self._restart, warn=self._warn)

    def _feed(self, rf: _RankFile, chunk: bytes) -> None:
        """Folds the lines ``chunk`` completes (:func:`._ledger_tail.take_complete_lines`); an oversized line
        that ends in it is one corrupt line."""
        oversized, data = _ledger_tail.take_complete_lines(rf, chunk)
        if oversized:
            self._corrupt(rf, OVERSIZED)
        if data is not None:
            self._fold_lines(rf, data)

    def _fold_lines(self, rf: _RankFile, data: bytes) -> None:
        """Folds the newline-separated lines of ``data`` (its last line complete, its newline cut off)."""
        parse = _parse
        for line in _ledger_tail.split_lines(data):
            rf.line_no += 1
            if not line:
                continue
            try:
                if len(line) > MAX_LINE_BYTES // 4 and byte_length(line) > MAX_LINE_BYTES:
                    raise Corrupt(OVERSIZED)
                doc = parse(line)
                if doc is None:
                    raise Corrupt("")
                if type(doc) is tuple:
                    self._fold_step(rf, *doc)
                else:
                    self._fold(rf, doc)
            except Corrupt as e:
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
            raise Corrupt("")
        if v > FORMAT_VERSION:
            # The report refuses such a ledger (UnsupportedError); a live endpoint keeps serving and says so.
            raise Corrupt(f"format version {v}; this ettkit reads up to version {FORMAT_VERSION}, upgrade "
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
            integer_field(doc, "n")
            time_field(doc, "b")
            time_field(doc, "e")
            self._fold_step(rf, doc["n"], doc["b"], doc["e"])
            return
        if t == "phase" or t == "bg":
            self._fold_phase(a, doc, t)
        elif t == "hb":
            ts = time_field(doc, "ts")
            if ts > a.last_ts:
                a.last_ts = ts
        elif t == "config":
            value = doc.get("value")
            if type(doc.get("key")) is not str or type(value) not in (int, float):
                raise Corrupt("'key' or 'value' is missing or of the wrong type")
        elif t == "dropped":
            integer_field(doc, "n")
        elif t == "end":
            ts = time_field(doc, "ts")
            a.has_end = True
            a.end_ts = ts
            if ts > a.last_ts:
                a.last_ts = ts
            status = doc.get("status")
            detail = doc.get("detail")
            a.status = status if type(status) is str else "clean"
            a.detail = detail if type(detail) is str else ""
        elif t == "process_exit":
            if not self._fold_process_exit(a, doc):
                return  # another attempt's or process's line: skipped, as by the report
        else:
            return  # an unknown type of a known version (a newer minor release): skipped, as by the report
        self.records += 1

    def _fold_phase(self, a: _Attempt, doc: dict, t: str) -> None:
        """A "phase" or "bg" record of attempt ``a``: its times, and a phase's place on the timeline."""
        name = doc.get("name")
        if type(name) is not str:
            raise Corrupt("'name' is missing or not a string")
        b = time_field(doc, "b")
        e = time_field(doc, "e")
        if e < b:
            raise Corrupt("ends before it begins")
        if e > a.last_ts:
            a.last_ts = e
        if t != "phase":
            return
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
            kind = (TRAINING if name == "training" else
                    WASTED if name == "wasted_training" else PHASE)
            self._add(a, tl, b, e, PHASE_LAYER, name, kind)
            tier = checkpoint_tier(name, "checkpoint_blocking")
            if tier is not None:
                step = doc.get("step")
                if type(step) is int and step >= 0:
                    tl.blocked_steps[tier].add(step)
                else:
                    tl.unnumbered[tier] += 1

    def _fold_process_exit(self, a: _Attempt, doc: dict) -> bool:
        """A "process_exit" record of attempt ``a``; False when it is another attempt's or process's line."""
        ts = time_field(doc, "ts")
        number = integer_field(doc, "attempt")
        pid = doc.get("pid")
        if number != a.number or (type(pid) is int and a.pid is not None and pid != a.pid):
            return False
        # report.cpp: a clean attempt lasts until its process exits; the teardown after the end record
        # is the shutdown sub-stage.
        if a.has_end and a.status == "clean" and ts > a.last_ts:
            if a.timeline is not None:
                self._add(a, a.timeline, a.last_ts, ts, PHASE_LAYER, _PROCESS_TEARDOWN, PHASE)
            a.last_ts = ts
        return True

    def _fold_step(self, rf: _RankFile, n: int, b: int, e: int) -> None:
        if not rf.attempts:  # the report's order: a record before any attempt is an orphan, whatever it holds
            self.orphan_records += 1
            return
        check_step_times(b, e)
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
                self._add(a, tl, b, e, STEP, "wasted_training", WASTED)
            else:
                self._add(a, tl, b, e, STEP, "training", TRAINING)
        self.records += 1

    def _fold_attempt(self, rf: _RankFile, doc: dict) -> None:
        number = integer_field(doc, "attempt")
        ts = time_field(doc, "ts")
        proc_start = doc.get("proc_start")
        if type(proc_start) is not int:
            proc_start = None
        elif not 0 <= proc_start <= MAX_EPOCH_US:
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
    def _fillers(a: _Attempt) -> list[Item]:
        # The report's own start-up fillers (docs/ett.md §3): worker_spawn for [allocation, process start)
        # and, when the Recorder wrote none, process_bootstrap for [process start, Recorder start).
        out = []
        ps = a.proc_start
        if ps is not None:
            if ps > a.begin:
                out.append((a.begin, ps, FILLER, -2, "worker_spawn", PHASE))
            if ps < a.ts and not a.has_bootstrap:
                out.append((ps, a.ts, FILLER, -1, "process_bootstrap", PHASE))
        return out

    def _settle(self, a: _Attempt, tl: _Timeline, final: bool) -> None:
        """Settles the window's oldest time (all of it when the attempt is over) into the totals."""
        lo = tl.lo if tl.lo is not None else self._base_lo(a)
        failed, point = self._job_failure(a.number)
        survivor = self._survivor(a, failed, point)
        if final:
            tl.first_training = own(tl.pending + self._fillers(a), lo, a.last_ts, failed, point,
                                    tl.first_training, tl.pre, tl.post, survivor)
            tl.pending = []
            tl.lo = max(lo, a.last_ts)
            tl.final = True
            return
        ends = sorted(it[1] for it in tl.pending)
        horizon = ends[len(ends) - self._keep - 1]
        if horizon > lo:
            tl.first_training = own(tl.pending + self._fillers(a), lo, horizon, failed, point,
                                    tl.first_training, tl.pre, tl.post, survivor)
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
            first = own(tl.pending + self._fillers(a), lo, a.last_ts, failed, point or 0, tl.first_training,
                        pre, post, self._survivor(a, failed, point))
            tl.cache_key, tl.cache = key, (pre, post, first)
        return tl.cache

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
        jobs = job_view(self._files.values(), self._latest_attempt)
        failed = add_failures(jobs, out)
        if self._timeline_rank is None:
            return out
        ref = self._file_of(self._timeline_rank)
        if ref.attempts:
            add_timeline_figures(ref.attempts, jobs, failed, self._owned, out)
        return out

    def _survivor(self, a: _Attempt, failed: bool, point: Optional[int]) -> bool:
        """Whether this rank is not the one that names its failed attempt's failure (report_timeline.cpp's
        survivor)."""
        return failed and point is not None and job_cause(self._files.values(), a.number,
                                                          self._latest_attempt) is not a

    def _job_failure(self, number: int) -> tuple[bool, Optional[int]]:
        """Whether attempt ``number`` failed on any rank, and the job's failure point."""
        return job_failure(self._files.values(), number, self._latest_attempt)


__all__ = ["LiveLedger", "top_level_phase"]
