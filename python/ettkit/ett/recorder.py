"""The Python face of the C++ :class:`Recorder` (``ettkit._C.ett.Recorder``).

The hot calls — ``rec.step(n)`` and ``with rec.phase(name):`` — go straight to C++ (one pybind11 call
each). This module adds what only Python can know: how the attempt ended (an exception and its type), the
interpreter-exit hooks of :func:`init`, and the module-level :func:`phase` / :func:`step` helpers and
decorators, so library code can be instrumented without passing a recorder around.

**The current recorder** lives in C++ (``ettkit::ett::current_recorder()``): every open recorder, however
it was made (``with ett.Recorder(...)``, :func:`init`, C++), is pushed on one process-wide stack when it is
constructed and removed when it closes. :func:`current` reads it, and so do the components
(``AsyncCheckpointer``, ``StageGraph``, ``overlapped_start``) that are not given ``recorder=``.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import warnings
from typing import Any, Callable, Optional

from .. import _C
from ..errors import NoRecorderWarning


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500]


class Recorder(_C.ett.Recorder):
    """Records this process's phases and steps into ``run_dir/ett/rank-<rank>.jsonl``.

    Keyword options (all optional): ``rank``/``world_size`` (default: ``RANK``/``WORLD_SIZE``),
    ``heartbeat_s`` (1.0), ``flush_interval_s`` (0.1), ``fsync`` ("never" | "heartbeat" | "always"),
    ``queue_capacity``, ``shutdown_timeout_s`` (5.0), ``nvtx`` (NVTX ranges when built with CUDA),
    ``launcher_phases_from_env`` (read ``ETTKIT_LAUNCHER_PHASES``), ``metadata`` (dict of str),
    ``ledger_readable_by_others`` (False: the ledger is created 0600 in a 0700 ``ett`` directory; True: 0644
    and 0755, for reports run by other users).

    Use it as a context manager: leaving the block closes the attempt as "clean", or as "exception" with
    the exception's type when one propagates. A process killed by a signal writes no end record; the
    report then counts the attempt as killed.

    From construction until it closes, the recorder is the process's :func:`current` one (unless a newer
    open recorder is), so checkpointers and start-up graphs created inside the block record into it.
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


# ---- the current recorder ----------------------------------------------------------------------------------
# The stack itself is in C++ (see the module docstring). Python keeps only what init() owns: the recorder it
# created (closed by the next init() or at interpreter exit) and whether its hooks are installed. Guarded by
# _lock; only init() writes them.
_lock = threading.Lock()
_init_recorder: Optional[Recorder] = None
_hooks_installed = False


def current() -> Optional[Recorder]:
    """The process's current recorder: the innermost open one, however it was created (``with
    ett.Recorder(...)``, :func:`init`, or C++), or None."""
    return _C.ett.current_recorder()


def resolve(recorder: Any, component: str, stacklevel: int = 2) -> Optional[Recorder]:
    """The recorder a component records into. ``"current"`` (the components' default) means
    :func:`current`; when no recorder is open that is None, with a :class:`ettkit.NoRecorderWarning`
    (shown once per call site under Python's default warning filter) so that the component's phases are
    never lost silently. ``None`` means "record nothing" (no warning); anything else is used as given."""
    if isinstance(recorder, str):
        if recorder != "current":
            raise ValueError(f"recorder={recorder!r}: pass a Recorder, None, or 'current'")
        recorder = current()
        if recorder is None:
            warnings.warn(
                f"{component}: no ETT recorder is open, so its phases (checkpoint blocking, compile, ...) are "
                f"not recorded and ETT% counts that time as training. Create it inside `with "
                f"ett.Recorder(run_dir):` or after ett.init(run_dir), pass recorder=, or pass recorder=None to "
                f"record nothing.",
                NoRecorderWarning, stacklevel=stacklevel + 1)
    elif recorder is not None and recorder.closed:
        recorder = None  # records into a closed recorder would go nowhere
    return recorder


def init(run_dir: str | os.PathLike, **options) -> Recorder:
    """Creates a recorder that is the process's current one until the next :func:`init` (which closes it)
    or interpreter exit, and arranges for the attempt's end to be recorded: an uncaught exception closes it
    as "exception" with its type, interpreter exit as "clean". A ``with ett.Recorder(...)`` block opened
    later is current inside the block, and this one again after it."""
    global _init_recorder, _hooks_installed
    with _lock:
        if _init_recorder is not None and not _init_recorder.closed:
            _init_recorder.close("clean")
        _init_recorder = Recorder(run_dir, **options)
        if not _hooks_installed:
            previous = sys.excepthook

            def excepthook(exc_type, exc, tb):
                rec = _init_recorder
                if rec is not None and not rec.closed and rec._pid == os.getpid():
                    status = "signal" if issubclass(exc_type, KeyboardInterrupt) else "exception"
                    rec.close(status, _describe(exc))
                previous(exc_type, exc, tb)

            sys.excepthook = excepthook
            atexit.register(_close_at_exit)
            _hooks_installed = True
        return _init_recorder


def _close_at_exit() -> None:
    rec = _init_recorder
    # A forked child (e.g. a DataLoader worker) inherits the object but not the writer thread or the
    # attempt: only the process that created the recorder closes it.
    if rec is not None and not rec.closed and rec._pid == os.getpid():
        rec.close("clean")


class phase:
    """Times a phase on the current recorder; a context manager and a decorator::

        with ett.phase("compile"): ...

        @ett.phase("eval")
        def evaluate(): ...

    Does nothing when no recorder is open, so instrumented library code runs anywhere.
    """

    __slots__ = ("name", "step", "_scope")

    def __init__(self, name: str, step: int = -1):
        self.name = name
        self.step = step
        self._scope = None

    def __enter__(self):
        rec = current()
        if rec is not None:
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
    """Marks the completion of global step ``n`` on the current recorder (no-op without one)."""
    rec = current()
    if rec is not None:
        rec.step(n)
