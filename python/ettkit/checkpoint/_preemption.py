"""Preemption: on a signal (SIGTERM by default when an interval is set) the next save is made durable and the
process exits with 128+signal, bounded by a deadline that a watchdog thread enforces even if the training
loop never reaches another save."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, Optional


class Preemption:
    """The signal handlers one checkpointer installed and what a signal set off. ``handles`` is the
    checkpointer's deque of recent save handles (read, never changed here). It holds nothing that leads back
    to the checkpointer (its ``close`` is handed to :meth:`finish`), so no reference cycle delays the collection
    of a checkpointer nobody closed."""

    def __init__(self, signals: Optional[Iterable[int]], deadline_s: float, handles: Any):
        self.signal: Optional[int] = None  # the signal that arrived (None: none yet)
        self._time = 0.0
        self._deadline_s = float(deadline_s)
        self._handles = handles
        self._old_handlers: dict = {}
        if signals and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._old_handlers[sig] = signal.signal(sig, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        if self.signal is not None:
            return
        self.signal = signum
        self._time = time.monotonic()
        # Watchdog: exit by the deadline even if the loop never reaches a safe point.
        t = threading.Thread(target=self._deadline_watchdog, daemon=True, name="ettkit-preempt-watchdog")
        t.start()

    def _deadline_watchdog(self) -> None:
        deadline = self._time + self._deadline_s
        # Finish the save in flight (if any) even if the loop never calls should_save again.
        try:
            for h in list(self._handles):
                h.wait(max(deadline - time.monotonic(), 0.0))
        except Exception:
            pass
        time.sleep(max(deadline - time.monotonic(), 0.0))
        os._exit(128 + int(self.signal or signal.SIGTERM))

    def finish(self, close: Callable[[], None]) -> None:
        """After the save that a signal asked for: waits for the saves in flight (within the deadline), calls
        ``close`` (the checkpointer's) and exits with 128+signal."""
        remaining = self._deadline_s - (time.monotonic() - self._time)
        try:
            for h in list(self._handles):
                h.wait(max(remaining, 0.0))
        finally:
            code = 128 + int(self.signal)
            close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def uninstall(self) -> None:
        """Puts back the handlers that were there before (those still ours: a later handler stays)."""
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                if signal.getsignal(sig) == self.on_signal:
                    signal.signal(sig, old)
