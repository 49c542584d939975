"""The C++ core's log messages, delivered to Python's :mod:`logging` (logger ``"ettkit"``).

Installed by ``import ettkit`` (set ``ETTKIT_LOG_BRIDGE=0`` to keep the core writing to stderr itself).
From then on every message of the C++ core (checkpoint writers, the ETT ledger writer, the report, start-up
stages) becomes a :class:`logging.LogRecord` of the ``ettkit`` logger, so levels, handlers and filters work
as for any library::

    logging.getLogger("ettkit").setLevel(logging.ERROR)    # silence ettkit's warnings
    logging.getLogger("ettkit").addHandler(my_handler)      # or collect them

A record keeps the C++ time it was logged (``created``), the C++ source file and line (``pathname``,
``lineno``: for debugging; never in the message) and the logging thread's id (``cpp_thread_id``). The core
passes on messages at ``ETTKIT_LOG_LEVEL`` and above (default: debug, so that the Python level decides).

How (python/csrc/bind_logging.cpp): the core's threads never take the GIL to log. They queue the record
and wake a daemon thread, which hands the queue to ``logging`` with the GIL held. Delivery is therefore
asynchronous (milliseconds); :func:`flush` delivers everything queued so far on the calling thread, and
runs at interpreter exit, after which the core writes to stderr again.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from . import _C

logger = logging.getLogger("ettkit")

# C++ levels (ettkit::LogLevel) -> logging levels.
_LEVELS = {0: logging.DEBUG - 5, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

# Serialises draining and emitting, so that flush() returns only after whatever the daemon thread took has
# been handed to logging too. Re-entrant: a handler may log (or flush) again.
_emit_lock = threading.RLock()
_installed_pid = 0  # the process that installed the bridge (a forked child has no pump thread)


def flush() -> None:
    """Delivers every message the core has queued so far to ``logging``, on the calling thread."""
    with _emit_lock:
        records, dropped = _C._logging.drain()
        for level, message, path, line, epoch_us, thread_id in records:
            pylevel = _LEVELS.get(level, logging.ERROR)
            if not logger.isEnabledFor(pylevel):
                continue
            record = logger.makeRecord(logger.name, pylevel, path or "ettkit", line, message, (), None,
                                       extra={"cpp_thread_id": thread_id})
            record.created = epoch_us / 1e6
            record.msecs = (epoch_us % 1_000_000) // 1000
            record.relativeCreated = (record.created - logging._startTime) * 1000
            logger.handle(record)
        if dropped:
            logger.warning("%d ettkit log messages were dropped: they came faster than Python took them",
                           dropped)


def _pump(fd: int) -> None:
    # os.read releases the GIL while it blocks; a byte means "records are waiting".
    while True:
        try:
            if not os.read(fd, 512):
                return
        except OSError:
            return
        try:
            flush()
        except Exception:  # noqa: BLE001 - a broken handler must not end the delivery of later messages
            pass


def _at_exit() -> None:
    if os.getpid() != _installed_pid:
        return  # a forked child: the queue it inherited holds the parent's records, which the parent delivers
    flush()
    _C._logging.close()  # messages logged after this (threads still running at exit) go to stderr


def install() -> None:
    """Routes the core's messages into ``logging`` (idempotent; ``import ettkit`` calls it)."""
    global _installed_pid
    if _installed_pid or os.environ.get("ETTKIT_LOG_BRIDGE", "1") == "0":
        return
    env_level = _C._logging.env_level()
    fd = _C._logging.install(1 if env_level is None else env_level)
    threading.Thread(target=_pump, args=(fd,), name="ettkit-log-bridge", daemon=True).start()
    # Registered at import, so it runs after the atexit hooks registered later (ett.init's, checkpointers'):
    # their messages are delivered too.
    atexit.register(_at_exit)
    _installed_pid = os.getpid()
