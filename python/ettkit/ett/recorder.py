"""The Python face of the C++ :class:`Recorder` (``ettkit._C.ett.Recorder``).

The hot calls — ``rec.step(n)`` and ``with rec.phase(name):`` — go straight to C++ (one pybind11 call
each). This module adds what only Python can know: how the attempt ended (an exception and its type) and
a process-wide default recorder for the module-level :func:`phase` / :func:`step` helpers and decorators,
so library code can be instrumented without passing a recorder around.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from typing import Callable, Optional

from .. import _C


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500]


class Recorder(_C.ett.Recorder):
    """Records this process's phases and steps into ``run_dir/ett/rank-<rank>.jsonl``.

    Keyword options (all optional): ``rank``/``world_size`` (default: ``RANK``/``WORLD_SIZE``),
    ``heartbeat_s`` (1.0), ``flush_interval_s`` (0.1), ``fsync`` ("never" | "heartbeat" | "always"),
    ``queue_capacity``, ``shutdown_timeout_s`` (5.0), ``nvtx`` (NVTX ranges when built with CUDA),
    ``launcher_phases_from_env`` (read ``ETTKIT_LAUNCHER_PHASES``), ``metadata`` (dict of str).

    Use it as a context manager: leaving the block closes the attempt as "clean", or as "exception" with
    the exception's type when one propagates. A process killed by a signal writes no end record; the
    report then counts the attempt as killed.
    """

    def __init__(self, run_dir: str | os.PathLike, **options):
        super().__init__(os.fspath(run_dir), **options)
        self._pid = os.getpid()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
            self.close("clean")
        elif isinstance(exc, KeyboardInterrupt):
            self.close("signal", "KeyboardInterrupt")
        else:
            self.close("exception", _describe(exc))
        return False

    def timed(self, name: str, step: int = -1) -> Callable:
        """Decorator: every call of the function is recorded as phase ``name``."""
        phase_id = self.phase_id(name)

        def wrap(fn):
            @functools.wraps(fn)
            def inner(*args, **kwargs):
                with self.phase(phase_id, step):
                    return fn(*args, **kwargs)

            return inner

        return wrap


# ---- the process-wide default recorder -------------------------------------------------------------------
# Global on purpose: decorators and library code reach the job's one recorder without plumbing. Guarded by
# _lock; only init()/close paths write it.
_lock = threading.Lock()
_current: Optional[Recorder] = None
_hooks_installed = False


def current() -> Optional[Recorder]:
    """The default recorder set by :func:`init`, or None."""
    return _current


def init(run_dir: str | os.PathLike, **options) -> Recorder:
    """Creates the process-wide default recorder (closing any previous one) and arranges for the attempt's
    end to be recorded: an uncaught exception closes it as "exception" with its type, interpreter exit as
    "clean"."""
    global _current, _hooks_installed
    with _lock:
        if _current is not None and not _current.closed:
            _current.close("clean")
        _current = Recorder(run_dir, **options)
        if not _hooks_installed:
            previous = sys.excepthook

            def excepthook(exc_type, exc, tb):
                rec = _current
                if rec is not None and not rec.closed and rec._pid == os.getpid():
                    rec.close("signal" if issubclass(exc_type, KeyboardInterrupt) else "exception", _describe(exc))
                previous(exc_type, exc, tb)

            sys.excepthook = excepthook
            atexit.register(_close_at_exit)
            _hooks_installed = True
        return _current


def _close_at_exit() -> None:
    rec = _current
    # A forked child (e.g. a DataLoader worker) inherits the object but not the writer thread or the
    # attempt: only the process that created the recorder closes it.
    if rec is not None and not rec.closed and rec._pid == os.getpid():
        rec.close("clean")


class phase:
    """Times a phase on the default recorder; a context manager and a decorator::

        with ett.phase("compile"): ...

        @ett.phase("eval")
        def evaluate(): ...

    Does nothing when no default recorder exists, so instrumented library code runs anywhere.
    """

    __slots__ = ("name", "step", "_scope")

    def __init__(self, name: str, step: int = -1):
        self.name = name
        self.step = step
        self._scope = None

    def __enter__(self):
        rec = _current
        if rec is not None and not rec.closed:
            self._scope = rec.phase(self.name, self.step)
        return self

    def __exit__(self, *exc) -> bool:
        if self._scope is not None:
            self._scope.end()
            self._scope = None
        return False

    def __call__(self, fn: Callable) -> Callable:
        name, step_ = self.name, self.step

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name, step_):
                return fn(*args, **kwargs)

        return inner


def step(n: int) -> None:
    """Marks the completion of global step ``n`` on the default recorder (no-op without one)."""
    rec = _current
    if rec is not None:
        rec.step(n)
