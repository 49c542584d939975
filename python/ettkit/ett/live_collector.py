"""The collector behind :mod:`ettkit.ett.live`: a :class:`LiveLedger`'s figures as Prometheus metric
families, refreshed on every scrape and recomputed only when they changed or aged."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .live_ledger import LiveLedger
from .prometheus import JobCollector

__all__ = ["LiveCollector"]


class LiveCollector(JobCollector):
    """A prometheus_client collector that refreshes a :class:`LiveLedger` on every scrape and yields its
    figures (docs/ett.md, "Live metrics", lists the families). Refreshes are serialised by a lock, so
    concurrent scrapes are safe; values a ledger does not have yet are left out, as in
    :mod:`ettkit.ett.prometheus`. Metric names are the file exporter's where both have a figure.

    The figures are recomputed only when a refresh folded something new or they are ``max_age_s`` old
    (they hold "seconds since the last record"): a scrape storm costs a refresh that finds nothing (a
    listing and a stat per rank file) per scrape, not the figures. :attr:`generation` counts recomputations,
    so a server can keep the encoded exposition for as long as it stays the same."""

    def __init__(self, ledger: LiveLedger, job: Optional[str] = None, *, max_age_s: float = 1.0) -> None:
        super().__init__(job)
        self.ledger = ledger
        self.lock = threading.Lock()
        self.last_refresh_s: Optional[float] = None
        self.max_age_s = max_age_s
        self.generation = 0
        self._figures: Optional[dict] = None
        self._figures_progress: Optional[tuple] = None
        self._figures_at = 0.0

    def update(self) -> int:
        """Refreshes the ledger, recomputes the figures when they changed or aged, and returns their
        generation. Raises what :meth:`LiveLedger.refresh` raises (``ettkit.IoError`` for a folder or file
        the OS refuses, or a symbolic link where the ledger folder belongs)."""
        with self.lock:
            t0 = time.perf_counter()
            self.ledger.refresh()
            progress = self.ledger.progress
            now = time.monotonic()
            if (self._figures is None or progress != self._figures_progress
                    or now - self._figures_at >= self.max_age_s):
                self._figures = self.ledger.figures()
                self._figures_progress, self._figures_at = progress, now
                self.generation += 1
            self.last_refresh_s = time.perf_counter() - t0
            return self.generation

    def collect(self) -> Iterator[Metric]:
        self.update()
        f = self._figures
        return (family for family in self._families(f) if family.samples)

    def _families(self, f: dict) -> Iterator[Metric]:
        # Grouped as docs/ett.md lists them: the job's time, its attempts and failures, its checkpoints and
        # progress, and the ledger the figures come from.
        yield from self._time_families(f)
        yield from self._attempt_families(f)
        yield from self._progress_families(f)
        yield from self._ledger_families(f)

    def _time_families(self, f: dict) -> Iterator[Metric]:
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

    def _attempt_families(self, f: dict) -> Iterator[Metric]:
        g = self._gauge
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

    def _progress_families(self, f: dict) -> Iterator[Metric]:
        g = self._gauge
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

    def _ledger_families(self, f: dict) -> Iterator[Metric]:
        g = self._gauge
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
