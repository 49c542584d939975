"""Live ETT metrics: a running job's ETT figures over HTTP in the Prometheus format, kept current by reading
only what the ledger gained since the last scrape.

    handle = ett.serve_metrics(9400, run_dir=run_dir)      # on rank 0; None on every other rank
    ...                                                     # Prometheus scrapes handle.url
    handle.close()

or, as a side-car process that does not share the trainer's GIL:
``python -m ettkit serve RUN_DIR --port 9400``.

The figures come from :class:`ettkit.ett.live_ledger.LiveLedger`, which reads only the ledger's appended
bytes on each scrape (its module docstring says how, and what it approximates).

The endpoint is bounded whatever its clients do (docs/security.md): one thread serves every connection,
each must send its request and take its answer within a few seconds, at most 64 are open at once, and the
figures are recomputed at most once a second unless the ledger grew. It has no authentication: binding an
address other than loopback logs a warning saying so.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Optional

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder
except ImportError as e:  # an optional dependency (the "report" extra), like the file exporter's
    raise ImportError("ettkit's live metrics need prometheus-client: pip install 'ettkit[report]' "
                      "(or pip install prometheus-client)") from e

from ..errors import InvalidArgumentError
from .live_collector import LiveCollector
from .live_ledger import LiveLedger

logger = logging.getLogger("ettkit")


# HTTP reasons of the statuses the endpoint answers.
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}
_MAX_REQUEST_HEAD = 8192   # a scrape's request line and headers take a few hundred bytes
_ACCEPTS_PER_WAKE = 64     # connections accepted before the loop serves the ones it has
_WAKE = object()           # selector data of the socket close() writes to


class _Connection:
    """One client connection: what it sent so far, and the answer still to send."""

    __slots__ = ("sock", "deadline", "head", "out")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.head = bytearray()
        self.out: Optional[memoryview] = None  # set once the request is answered


class _ScrapeServer:
    """The live endpoint's HTTP server, bounded whatever its clients do.

    Promises: one thread serves every connection (non-blocking sockets under a selector), so idle or slow
    clients never add threads; a connection must send its request head (at most 8 KiB) and take its answer
    within ``request_timeout_s`` of being accepted, or it is closed; at most ``max_connections`` are open at
    once, and one more closes the oldest, so a flood of idle connections cannot lock a scraper out (a scrape
    sends its request as it connects, and a request already there is read when its connection is accepted).
    ``GET`` or ``HEAD`` of ``/`` or ``/metrics`` is answered with ``render(accept_header)`` -> (status,
    content type, body), called on the serving thread; anything else gets a 4xx. Every answer closes its
    connection. :meth:`close` stops the thread and closes every socket."""

    def __init__(self, host: str, port: int, render: Callable[[str], tuple[int, str, bytes]],
                 request_timeout_s: float, max_connections: int) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0,
                                                             socket.AI_PASSIVE)[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.server_address = self._listener.getsockname()
        self._render = render
        self._timeout_s = request_timeout_s
        self._max_connections = max_connections
        self._connections: dict[int, _Connection] = {}  # in accept order, so also in deadline order
        self._accept_paused_until: Optional[float] = None
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, _WAKE)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="ettkit-live-metrics", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_writer.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=10)
        self._wake_writer.close()

    # ---- the serving thread ------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, events in self._selector.select(self._wait_s()):
                    if key.data is None:
                        self._accept()
                    elif key.data is _WAKE:
                        self._wake_reader.recv(64)
                    elif key.data.sock.fileno() in self._connections:  # not closed earlier in this batch
                        if events & selectors.EVENT_READ:
                            self._read(key.data)
                        if events & selectors.EVENT_WRITE and key.data.sock.fileno() in self._connections:
                            self._send(key.data)
                self._expire(time.monotonic())
        except Exception:  # noqa: BLE001 - a bug here must not take the trainer down; the endpoint stops
            logger.exception("ETT live metrics: the endpoint stopped")
        finally:
            for conn in list(self._connections.values()):
                self._drop(conn)
            self._selector.close()
            self._listener.close()
            self._wake_reader.close()

    def _wait_s(self) -> Optional[float]:
        now = time.monotonic()
        waits = []
        if self._connections:
            waits.append(next(iter(self._connections.values())).deadline - now)
        if self._accept_paused_until is not None:
            waits.append(self._accept_paused_until - now)
        return max(0.0, min(waits)) if waits else None

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, ConnectionAbortedError, InterruptedError):
                return
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: stop accepting for a second, not spin
                logger.warning("ETT live metrics: cannot accept a connection (%s); pausing for 1 s", e)
                self._selector.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + 1.0
                return
            if len(self._connections) >= self._max_connections:
                self._drop(next(iter(self._connections.values())))  # the oldest
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + self._timeout_s)
            self._connections[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._read(conn)  # a scrape's request is usually there already

    def _expire(self, now: float) -> None:
        while self._connections:
            oldest = next(iter(self._connections.values()))
            if oldest.deadline > now:
                break
            self._drop(oldest)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)

    def _drop(self, conn: _Connection) -> None:
        self._connections.pop(conn.sock.fileno(), None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Connection) -> None:
        if conn.out is not None:
            return  # answered: what else it sends is ignored
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        conn.head += data
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            end = conn.head.find(b"\n\n")
        if end < 0:
            if len(conn.head) > _MAX_REQUEST_HEAD:
                self._answer(conn, 431, "text/plain; charset=utf-8", b"request head longer than 8 KiB\n")
            return
        if end > _MAX_REQUEST_HEAD:
            self._answer(conn, 431, "text/plain; charset=utf-8", b"request head longer than 8 KiB\n")
            return
        self._respond(conn, bytes(conn.head[:end]))

    def _respond(self, conn: _Connection, head: bytes) -> None:
        lines = head.replace(b"\r\n", b"\n").split(b"\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self._answer(conn, 400, "text/plain; charset=utf-8", b"not an HTTP request\n")
            return
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            self._answer(conn, 405, "text/plain; charset=utf-8", b"only GET and HEAD\n",
                         extra="Allow: GET, HEAD\r\n")
            return
        if target.split(b"?", 1)[0] not in (b"/", b"/metrics"):
            self._answer(conn, 404, "text/plain; charset=utf-8", b"the metrics are at /metrics\n")
            return
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"accept":
                accept = value.strip().decode("latin-1")
        try:
            status, content_type, body = self._render(accept)
        except Exception as e:  # noqa: BLE001 - answered as a 500 rather than lost with the connection
            logger.exception("ETT live metrics: a scrape failed")
            status, content_type = 500, "text/plain; charset=utf-8"
            body = f"{type(e).__name__}: {e}\n".encode("utf-8", "replace")
        self._answer(conn, status, content_type, body, head_only=method == b"HEAD")

    def _answer(self, conn: _Connection, status: int, content_type: str, body: bytes, *, extra: str = "",
                head_only: bool = False) -> None:
        header = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                  f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode("latin-1")
        conn.out = memoryview(header if head_only else header + body)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._drop(conn)


def _encoder_for(accept: str) -> tuple[Callable, str]:
    """prometheus_client's encoder and content type for the client's ``Accept`` header; the text format
    when the header is malformed (prometheus_client raises for some) or would put other than printable
    ASCII into the answer's Content-Type."""
    try:
        encoder, content_type = choose_encoder(accept)
        if content_type.isascii() and content_type.isprintable():
            return encoder, content_type
    except Exception:  # noqa: BLE001 - a client's header, not our bug
        pass
    return choose_encoder("")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class MetricsServer:
    """A live-metrics endpoint serving one run directory, from :func:`serve_metrics`.

    Promises: it listens on ``host``:``port`` (``port`` is the bound one, also when 0 was asked for) on
    one daemon thread, whatever its clients do: a connection must send its request and take its answer
    within ``request_timeout_s`` (5 s) of being accepted, at most ``max_connections`` (64) are open at once
    and one more closes the oldest, so 300 idle connections neither add threads nor lock a scraper out. The
    exposition is prometheus_client's, from a private registry holding only ettkit's live collector, kept
    per content type until the figures change (recomputed when the ledger grew, else at most once per
    ``max_age_s``). A ledger folder that cannot be read (a symbolic link where ``ett/`` belongs, a
    permission error) is answered with status 500 and a one-line reason, scrape after scrape, and the
    endpoint stays up. The ledger is caught up on a background thread, and a scrape that arrives meanwhile
    waits for it. A ``host`` other than loopback logs a warning: there is no authentication. :meth:`close`
    (or leaving a ``with`` block) stops listening; it is idempotent.
    """

    def __init__(self, ledger: LiveLedger, host: str, port: int, job: Optional[str] = None, *,
                 request_timeout_s: float = 5.0, max_connections: int = 64, max_age_s: float = 1.0) -> None:
        if not request_timeout_s > 0 or type(max_connections) is not int or max_connections < 1:
            raise InvalidArgumentError(f"MetricsServer: request_timeout_s={request_timeout_s!r} and "
                                       f"max_connections={max_connections!r}; pass a positive number of "
                                       f"seconds and an int >= 1")
        self.ledger = ledger
        self.collector = LiveCollector(ledger, job, max_age_s=max_age_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.caught_up = threading.Event()
        self._bodies: dict[str, tuple[int, bytes]] = {}  # content type -> (figures' generation, body)
        # Holding the collector's lock from here makes a scrape that beats the catch-up wait for it.
        self.collector.lock.acquire()
        self._catch_up = threading.Thread(target=self._initial_refresh, name="ettkit-live-catch-up",
                                          daemon=True)
        try:
            self._server = _ScrapeServer(host, port, self._render, request_timeout_s, max_connections)
        except OSError as e:
            self.collector.lock.release()
            raise OSError(e.errno, f"serve_metrics: cannot listen on {host}:{port}: {e.strerror or e}") from e
        self._catch_up.start()
        self.host = host
        self.port = int(self._server.server_address[1])
        self._closed = False
        if not _is_loopback(host):
            logger.warning("ETT live metrics on %s:%d: the endpoint has no authentication or TLS; anyone who "
                           "can reach this address reads the job's figures. Bind 127.0.0.1 (the default) "
                           "unless the network is trusted (docs/security.md)", host, self.port)

    def _initial_refresh(self) -> None:
        try:
            self.ledger.refresh()
        except Exception:  # noqa: BLE001 - the scrape that follows reports it; the endpoint must come up
            logger.exception("ETT live metrics: the initial ledger read of %s failed", self.ledger.run_dir)
        finally:
            self.collector.lock.release()
            self.caught_up.set()

    def _render(self, accept: str) -> tuple[int, str, bytes]:
        """The answer to a scrape: the exposition in the format ``accept`` asks for (prometheus_client's
        choice), or a 500 naming why the ledger could not be read."""
        encoder, content_type = _encoder_for(accept)
        try:
            generation = self.collector.update()
            cached = self._bodies.get(content_type)
            if cached is not None and cached[0] == generation:
                return 200, content_type, cached[1]
            body = encoder(self.registry)
        except Exception as e:  # noqa: BLE001 - the endpoint answers and stays up; the log says why
            logger.warning("ETT live metrics: cannot read the ledger of %s: %s", self.ledger.run_dir, e)
            return 500, "text/plain; charset=utf-8", (
                f"ettkit live metrics: cannot read the ledger of {self.ledger.run_dir}: "
                f"{type(e).__name__}: {e}\n").encode("utf-8", "replace")
        if len(self._bodies) >= 4:  # the Accept header picks the key: keep few
            self._bodies.clear()
        self._bodies[content_type] = (generation, body)
        return 200, content_type, body

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops listening and joins the server thread."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self._catch_up.join(timeout=60)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"MetricsServer({self.ledger.run_dir!r}, url={self.url!r}, {state})"


def _env_rank() -> int:
    # The Recorder's rule (docs/ett.md §12): RANK unset or not an integer means 0.
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _check_port(port) -> int:
    if type(port) is not int or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"serve_metrics: port={port!r} is not a TCP port; pass an int from 1 to "
                                   f"65535, or 0 for any free port (the handle's .port tells which)")
    return port


def serve_metrics(port: int, run_dir: str | os.PathLike | None = None, *, host: str = "127.0.0.1",
                  rank: Optional[int] = None, job: Optional[str] = None,
                  window_records: int = 1024) -> Optional[MetricsServer]:
    """Serves the job's live ETT figures in the Prometheus format on ``http://host:port/metrics``.

    Only rank 0 serves: on any other rank (``rank``, else the ``RANK`` environment variable; unset means 0)
    this returns None and starts nothing, so every rank can call it. ``run_dir`` defaults to the current
    recorder's (:func:`ettkit.ett.current`). ``host`` defaults to the loopback interface: pass ``"0.0.0.0"``
    (or an interface address) for a Prometheus on another host to reach it. ``port=0`` binds any free port.
    ``job`` adds a ``job`` label to every metric (as ``report --job``). Returns a :class:`MetricsServer`
    (``.port``, ``.url``, ``.close()``, a context manager).

    Raises ``ettkit.InvalidArgumentError`` (a ValueError) for a port outside 0..65535, a negative rank, or
    no ``run_dir`` with no recorder open; ``OSError`` when the address cannot be bound (naming it).
    """
    _check_port(port)
    if rank is None:
        rank = _env_rank()
    elif type(rank) is not int or rank < 0:
        raise InvalidArgumentError(f"serve_metrics: rank={rank!r}; pass a rank >= 0, or None to read RANK")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"serve_metrics: host={host!r}; pass an address such as '127.0.0.1' or "
                                   f"'0.0.0.0'")
    if run_dir is None:
        from .recorder import current

        rec = current()
        if rec is None:
            raise InvalidArgumentError("serve_metrics: no run_dir given and no ETT recorder is open; pass "
                                       "run_dir= (the directory given to ett.Recorder)")
        run_dir = os.path.dirname(os.path.dirname(rec.ledger_path))
    if rank != 0:
        return None
    return MetricsServer(LiveLedger(run_dir, window_records=window_records), host, port, job)


def serve_command(args) -> int:
    """``python -m ettkit serve RUN_DIR --port P [--host H] [--job J]``: serves until SIGINT or SIGTERM.
    Exit status 0 when stopped, 2 for a bad argument or an address that cannot be bound."""
    import sys

    if not os.path.isdir(args.run_dir):
        print(f"ettkit serve: error: run directory '{args.run_dir}' does not exist or is not a directory; "
              f"pass the directory given to ettkit.ett.Recorder", file=sys.stderr)
        return 2
    try:
        # A side-car is no rank of the job: it serves whatever RANK its environment holds.
        server = serve_metrics(args.port, args.run_dir, host=args.host, rank=0, job=args.job)
    except (ValueError, OSError) as e:  # a bad port; an address in use or unknown (socket.gaierror too)
        print(f"ettkit serve: error: {e}", file=sys.stderr)
        return 2
    # SIGTERM raises in the main thread, as Ctrl-C does. A handler that set a threading.Event instead could
    # deadlock: a signal arriving while the main thread is inside Event.wait() holding the Event's lock runs
    # the handler there, and its set() waits for that same lock (seen under load: the process never exited).
    stopping: list = []

    def on_sigterm(*_):
        if not stopping:  # once: a second SIGTERM during the shutdown below must not cut it short
            stopping.append(True)
            raise _Stopped

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        print(f"ettkit serve: ETT metrics of {args.run_dir} on {server.url} (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        stopping.append(True)
        signal.signal(signal.SIGTERM, previous)
        server.close()
    return 0


class _Stopped(Exception):
    """SIGTERM, raised in the main thread of ``ettkit serve``."""


__all__ = ["LiveCollector", "LiveLedger", "MetricsServer", "serve_metrics"]
