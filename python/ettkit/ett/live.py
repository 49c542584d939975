"""Live ETT metrics: a running job's ETT figures over HTTP in the Prometheus format, kept current by reading
only what the ledger gained since the last scrape.

    handle = ett.serve_metrics(9400, run_dir=run_dir)      # on rank 0; None on every other rank
    ...                                                     # Prometheus scrapes handle.url
    handle.close()

or, as a side-car process that does not share the trainer's GIL:
``python -m ettkit serve RUN_DIR --port 9400``.

The figures come from :class:`ettkit.ett.live_ledger.LiveLedger`, which reads only the ledger's appended
bytes on each scrape (its module docstring says how, and what it approximates).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Optional

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as e:  # an optional dependency (the "report" extra), like the file exporter's
    raise ImportError("ettkit's live metrics need prometheus-client: pip install 'ettkit[report]' "
                      "(or pip install prometheus-client)") from e

from ..errors import InvalidArgumentError
from .live_ledger import LiveLedger
from .prometheus import JobCollector

logger = logging.getLogger("ettkit")


class LiveCollector(JobCollector):
    """A prometheus_client collector that refreshes a :class:`LiveLedger` on every scrape and yields its
    figures (docs/ett.md, "Live metrics", lists the families). Refreshes are serialised by a lock, so
    concurrent scrapes are safe; values a ledger does not have yet are left out, as in
    :mod:`ettkit.ett.prometheus`. Metric names are the file exporter's where both have a figure."""

    def __init__(self, ledger: LiveLedger, job: Optional[str] = None) -> None:
        super().__init__(job)
        self.ledger = ledger
        self.lock = threading.Lock()
        self.last_refresh_s: Optional[float] = None

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            t0 = time.perf_counter()
            self.ledger.refresh()
            f = self.ledger.figures()
            self.last_refresh_s = time.perf_counter() - t0
        return (family for family in self._families(f) if family.samples)

    def _families(self, f: dict) -> Iterator[Metric]:
        g = self._gauge
        yield g("ettkit_e2e_seconds", "End-to-end wall time of the job so far (lowest rank).", f.get("e2e_s"))
        for bucket, doc in (("effective", "training on new data"), ("idle", "idle (no failure caused it)"),
                            ("failure", "lost to failures"), ("unattributed", "that no record covers")):
            yield g(f"ettkit_{bucket}_seconds", f"Seconds of end-to-end time {doc}.", f.get(f"{bucket}_s"))
        for name, key, doc in (
                ("ettkit_effective_training_ratio", "ett_pct",
                 "Share of end-to-end time spent training on new data (ETT%/100)."),
                ("ettkit_idle_ratio", "idle_pct", "Share of end-to-end time that was idle."),
                ("ettkit_failure_ratio", "failure_pct", "Share of end-to-end time lost to failures."),
                ("ettkit_unattributed_ratio", "unattributed_pct",
                 "Share of end-to-end time no record covers.")):
            pct = f.get(key)
            yield g(name, doc, None if pct is None else pct / 100.0)
        phases = self._family(GaugeMetricFamily, "ettkit_phase_seconds",
                              "Wall time per top-level phase (lowest rank).", ("phase",))
        for name, seconds in (f.get("phases") or {}).items():
            self._add(phases, seconds, name)
        yield phases
        badput = self._family(GaugeMetricFamily, "ettkit_badput_seconds",
                              "Non-effective time per Google ml-goodput-measurement badput category.",
                              ("category",))
        for category, seconds in (f.get("badput") or {}).items():
            self._add(badput, seconds, category)
        yield badput
        yield g("ettkit_attempts", "Number of attempts (launches) of the job.", f.get("attempts"))
        failures = self._family(CounterMetricFamily, "ettkit_failures",
                                "Failures of the job since it was first launched.", ("category",))
        for category, count in (f.get("failures_by_category") or {}).items():
            self._add(failures, count, category)
        yield failures
        start = self._family(GaugeMetricFamily, "ettkit_time_to_start_seconds",
                             "Time from an attempt's launch to its first training step.", ("attempt",))
        for attempt, seconds in (f.get("time_to_start_s") or {}).items():
            self._add(start, seconds, str(attempt))
        yield start
        tts = f.get("time_to_start_s") or {}
        yield g("ettkit_latest_time_to_start_seconds", "Time to Start of the latest attempt that trained.",
                tts[max(tts)] if tts else None)
        recover = self._family(GaugeMetricFamily, "ettkit_time_to_recover_seconds",
                               "Time from a failure until training resumed, by failure index.", ("failure",))
        ttr = f.get("time_to_recover_s") or []
        for i, seconds in enumerate(ttr):
            self._add(recover, seconds, str(i))
        yield recover
        yield g("ettkit_latest_time_to_recover_seconds",
                "Time to Recover of the latest failure (grows until training resumes).",
                ttr[-1] if ttr else None)
        blocking = self._family(GaugeMetricFamily, "ettkit_checkpoint_blocking_seconds",
                                "Training time blocked by checkpoint saves (measured).", ("kind",))
        self._add(blocking, f.get("checkpoint_blocking_s"), "measured")
        yield blocking
        tiers = f.get("checkpoints") or {}
        for name, key, doc in (("ettkit_checkpoint_tier_saves", "count",
                                "Checkpoint saves per tier (disk, memory)."),
                               ("ettkit_checkpoint_tier_blocking_seconds", "blocking_s",
                                "Training time blocked by saves, per tier.")):
            family = self._family(GaugeMetricFamily, name, doc, ("tier",))
            for tier, figures in tiers.items():
                self._add(family, figures[key], tier)
            yield family
        yield g("ettkit_last_step", "The global step the lowest rank recorded last (any attempt).",
                f.get("last_step"))
        stale = self._family(GaugeMetricFamily, "ettkit_seconds_since_last_record",
                             "Seconds since the latest time a rank's ledger mentions (heartbeats included).",
                             ("rank",))
        for rank, seconds in (f.get("seconds_since_last_record") or {}).items():
            self._add(stale, seconds, str(rank))
        yield stale
        yield g("ettkit_live_rank", "The rank whose timeline the live figures follow (the lowest).",
                f.get("rank"))
        ledger = f["ledger"]
        yield g("ettkit_ledger_files", "Ledger files (ranks) read.", ledger["files"])
        for name, key, doc in (("ettkit_ledger_records", "records",
                                "Ledger records folded into the live figures."),
                               ("ettkit_ledger_corrupt_lines", "corrupt_lines",
                                "Corrupt ledger lines skipped."),
                               ("ettkit_ledger_late_records", "late_records",
                                "Records that arrived after the time they cover was settled "
                                "(only their later part counts).")):
            family = self._family(CounterMetricFamily, name, doc)
            self._add(family, ledger[key])
            yield family
        yield g("ettkit_live_refresh_seconds", "How long the previous scrape's ledger refresh took.",
                self.last_refresh_s)


class MetricsServer:
    """A live-metrics endpoint serving one run directory, from :func:`serve_metrics`.

    Promises: it listens on ``host``:``port`` (``port`` is the bound one, also when 0 was asked for) through
    prometheus_client's own WSGI server on a daemon thread, with a private registry holding only ettkit's
    live collector; the ledger is caught up on a background thread, and a scrape that arrives meanwhile
    waits for it. :meth:`close` (or leaving a ``with`` block) stops listening; it is idempotent.
    """

    def __init__(self, ledger: LiveLedger, host: str, port: int, job: Optional[str] = None) -> None:
        self.ledger = ledger
        self.collector = LiveCollector(ledger, job)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.caught_up = threading.Event()
        # Holding the collector's lock from here makes a scrape that beats the catch-up wait for it.
        self.collector.lock.acquire()
        self._catch_up = threading.Thread(target=self._initial_refresh, name="ettkit-live-catch-up",
                                          daemon=True)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            self.collector.lock.release()
            raise OSError(e.errno, f"serve_metrics: cannot listen on {host}:{port}: {e.strerror or e}") from e
        self._catch_up.start()
        self.host = host
        self.port = int(self._server.server_port)
        self._closed = False

    def _initial_refresh(self) -> None:
        try:
            self.ledger.refresh()
        except Exception:  # noqa: BLE001 - the scrape that follows reports it; the endpoint must come up
            logger.exception("ETT live metrics: the initial ledger read of %s failed", self.ledger.run_dir)
        finally:
            self.collector.lock.release()
            self.caught_up.set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops listening and joins the server thread."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
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
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"ettkit serve: ETT metrics of {args.run_dir} on {server.url} (Ctrl-C stops)", flush=True)
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
    return 0


__all__ = ["LiveCollector", "LiveLedger", "MetricsServer", "serve_metrics"]
