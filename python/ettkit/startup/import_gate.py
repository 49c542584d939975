"""One first-time import at a time while start-up stages run: imports that cannot deadlock.

Why: CPython takes one lock per module while it executes the module's body. Two threads that import modules
of one import cycle from opposite ends each hold one lock and wait for the other's; CPython (3.11, 3.12)
detects that and raises ``_DeadlockError`` in one of them. torch's compile stack is such a cycle: a thread
importing ``torch._dynamo`` while another imports ``torch._inductor.runtime.cache_dir_utils`` fails most of the
time on torch 2.14. A start-up that compiles on one stage thread while user init stages run on others hits it
whenever a stage touches the compile stack (an Inductor config tweak, a second compiled module, a library that
imports Dynamo).

Retrying the failed import is not safe: the thread that got the error had already run part of the modules in
its chain, and those are run again from the top. torch's do not allow that (seen: ``AssertionError: Artifact of
type=precompile already registered in mega-cache artifact factory``).

The rule instead: while a gate is open (:func:`serialized_imports`), a thread imports a module that is not yet
fully imported only while it holds one process-wide re-entrant lock, for the whole of that import (its nested
imports included). Every module lock is then taken under the gate, so no two threads can hold module locks of
one cycle: no deadlock, whatever the stages import. Modules already imported cost nothing (CPython never
reaches the gate for them). What it costs: first-time imports of different threads run one after another
instead of interleaving, which they mostly did under the GIL anyway.

The one wait the gate adds that CPython would not have: a thread that holds the gate (it is importing) and
waits for another thread which must import something first. Two cases are handled:

- the holder waits for a module lock the waiter took before the gate was opened (a module whose import was
  under way when the start began): the waiter sees that cycle and imports without the gate, as CPython would;
- anything else (the holder's module body joins a thread that imports): the waiter gives up after
  ``ETTKIT_IMPORT_GATE_TIMEOUT_S`` seconds (default 120), warns naming both modules, and imports without the
  gate. Slow, never hung.

The gate is installed by wrapping ``importlib._bootstrap._find_and_load``: CPython's ``import`` statement,
``importlib.import_module`` and ``from package import submodule`` all reach it for a module that is not in
``sys.modules`` (or still initializing) and never for one that is. It is removed when the last open gate
closes, unless someone wrapped it again on top (then it stays, inert).
"""

from __future__ import annotations

import contextlib
import importlib._bootstrap as _bootstrap
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["serialized_imports", "gate_open"]

_DEFAULT_TIMEOUT_S = 120.0
_POLL_S = 0.25  # how often a waiting thread looks for a cycle through a module lock it holds


class _Gate:
    """The process-wide import gate. ``lock`` serializes first-time imports; ``owner``/``owner_module`` say
    which thread holds it for which module (read by waiters for the cycle check and the warning). ``state``
    guards ``opened`` and ``original`` (the wrapped ``_find_and_load``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.owner: int | None = None
        self.owner_module: str | None = None
        self.state = threading.Lock()
        self.opened = 0
        self.original: Callable[..., Any] | None = None
        self.waiting = 0  # threads waiting for the lock now (read by tests: waiting_for_testing)
        # The one hook object installed: a bound method is a new object at each attribute read, so `is`
        # comparisons need this one.
        self.hook = self.find_and_load

    # ---- the wrapper CPython calls -----------------------------------------------------------------

    def find_and_load(self, name: str, import_: Any) -> Any:
        original = self.original or _ORIGINAL_FIND_AND_LOAD
        if self.opened == 0 or _is_loaded(name):
            return original(name, import_)
        me = threading.get_ident()
        if self.owner == me:  # a nested import of the thread that holds the gate
            return original(name, import_)
        if not self._acquire(name, me):
            return original(name, import_)  # the gate would deadlock here: CPython's own rules apply
        outer = self.owner_module
        self.owner, self.owner_module = me, name
        try:
            return original(name, import_)
        finally:
            self.owner_module = outer
            self.owner = None
            self.lock.release()

    def _acquire(self, name: str, me: int) -> bool:
        if self.lock.acquire(blocking=False):
            return True
        with self.state:
            self.waiting += 1
        try:
            return self._wait(name, me)
        finally:
            with self.state:
                self.waiting -= 1

    def _wait(self, name: str, me: int) -> bool:
        timeout = _timeout_s()
        deadline = time.monotonic() + timeout
        while True:
            if self.lock.acquire(timeout=_POLL_S):
                return True
            owner, module = self.owner, self.owner_module
            if owner is not None and _waits_for_me(owner, me):
                return False
            if time.monotonic() >= deadline:
                warnings.warn(
                    f"ettkit import gate: importing '{name}' waited {timeout:.0f} s for another thread's import "
                    f"of '{module}'; importing without the gate (a module body that waits for another thread's "
                    "import?). Raise ETTKIT_IMPORT_GATE_TIMEOUT_S if that import is just slow.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return False

    # ---- opening and closing -----------------------------------------------------------------------

    def open(self) -> None:
        with self.state:
            if self.opened == 0 and _bootstrap._find_and_load is not self.hook:
                self.original = _bootstrap._find_and_load
                _bootstrap._find_and_load = self.hook
            self.opened += 1

    def close(self) -> None:
        with self.state:
            self.opened = max(0, self.opened - 1)  # 0 already in a forked child (reset_in_child)
            if self.opened == 0 and _bootstrap._find_and_load is self.hook:
                _bootstrap._find_and_load = self.original
                self.original = None


    def reset_in_child(self) -> None:
        # A forked child (a DataLoader worker) has one thread: the gate's lock may have been held by a thread
        # that does not exist there, and the child's imports need no gate. Closed for good in the child.
        self.lock = threading.RLock()
        self.owner = self.owner_module = None
        self.state = threading.Lock()
        if _bootstrap._find_and_load is self.hook:
            _bootstrap._find_and_load = self.original
        self.opened = 0
        self.original = None


_ORIGINAL_FIND_AND_LOAD = _bootstrap._find_and_load
_GATE = _Gate()
os.register_at_fork(after_in_child=_GATE.reset_in_child)


def _timeout_s() -> float:
    raw = os.environ.get("ETTKIT_IMPORT_GATE_TIMEOUT_S")
    if not raw:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        warnings.warn(
            f"ETTKIT_IMPORT_GATE_TIMEOUT_S={raw!r} is not a positive number of seconds; using "
            f"{_DEFAULT_TIMEOUT_S:.0f}",
            RuntimeWarning,
            stacklevel=5,
        )
        return _DEFAULT_TIMEOUT_S
    return value


def _is_loaded(name: str) -> bool:
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _waits_for_me(owner: int, me: int) -> bool:
    """Whether thread ``owner`` waits, through CPython's module locks, for a lock that thread ``me`` holds."""
    blocking_on = getattr(_bootstrap, "_blocking_on", None)
    if blocking_on is None:
        return False
    seen = set()
    tid = owner
    while tid not in seen:
        seen.add(tid)
        entry = blocking_on.get(tid)
        if entry is None:
            return False
        # 3.11: the _ModuleLock itself; 3.12+: a list of the locks the thread waits on.
        locks = entry if isinstance(entry, list) else [entry]
        owners = [getattr(lock, "owner", None) for lock in locks]
        if me in owners:
            return True
        tid = next((o for o in owners if o is not None), None)
        if tid is None:
            return False
    return False


def waiting_for_testing() -> int:
    """Test hook: how many threads wait for the gate now (they import nothing until it is free)."""
    return _GATE.waiting


def gate_open() -> bool:
    """Whether a :func:`serialized_imports` block is open in this process."""
    return _GATE.opened > 0


@contextlib.contextmanager
def serialized_imports() -> Iterator[None]:
    """Within the block, first-time imports of every thread run one at a time (see the module's comment), so
    threads that import parts of one import cycle (torch's compile stack) cannot deadlock. Re-entrant and
    process-wide: :meth:`StageGraph.run` opens it around the stages; open it yourself around other threads
    that import while a compile runs (a prefetch thread started before the first compiled step)."""
    _GATE.open()
    try:
        yield
    finally:
        _GATE.close()
