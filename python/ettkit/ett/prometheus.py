"""The ETT report as a Prometheus text-exposition file.

The file is meant for node_exporter's textfile collector (name it `*.prom` and put it in the collector's
directory) or for any scraper that reads the text format. Names follow the Prometheus conventions: the
`ettkit_` prefix, base units (seconds), ratios from 0 to 1 with `_ratio`, and a counter for failures so
that the exposition shows `ettkit_failures_total`.

The values are a snapshot computed from the ledger, not live instruments, so they are yielded by a
collector (the prometheus_client way to proxy another system's numbers) instead of being set on
Gauge/Counter objects: that way no `_created` timestamp of the export itself leaks into the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class JobCollector(Collector):
    """What the report's and the live endpoint's collectors share: metric families with an optional `job`
    label on every sample, and values that are None (not known yet) left out."""

    def __init__(self, job: str | None = None) -> None:
        self._job = job

    def _family(self, cls, name: str, doc: str, labels: tuple[str, ...] = ()) -> Metric:
        extra = ("job",) if self._job is not None else ()
        return cls(name, doc, labels=[*labels, *extra])

    def _add(self, family: Metric, value: float | None, *labels: str) -> None:
        if value is None:
            return
        extra = (self._job,) if self._job is not None else ()
        family.add_metric([*labels, *extra], float(value))

    def _gauge(self, name: str, doc: str, value: float | None) -> Metric:
        family = self._family(GaugeMetricFamily, name, doc)
        self._add(family, value)
        return family


class ReportCollector(JobCollector):
    """Yields the metrics of one report dict; values the report lacks (None) are left out."""

    def __init__(self, report: dict, job: str | None = None) -> None:
        super().__init__(job)
        self._report = report

    def _scalar(self, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        yield self._gauge(name, doc, value)

    def collect(self) -> Iterator[Metric]:
        # A family without samples would only add HELP/TYPE noise to the file.
        return (family for family in self._families() if family.samples)

    def _families(self) -> Iterator[Metric]:
        # Grouped: the job's time and ratios, its attempts and failures, its checkpoints.
        yield from self._time_families()
        yield from self._attempt_families()
        yield from self._checkpoint_families()

    def _time_families(self) -> Iterator[Metric]:
        r = self._report

        def ratio(pct: float | None) -> float | None:
            return None if pct is None else pct / 100.0

        yield from self._scalar("ettkit_e2e_seconds", "End-to-end wall time of the job.", r.get("e2e_s"))
        yield from self._scalar("ettkit_effective_training_ratio",
                                "Share of end-to-end time spent training on new data (ETT%/100).",
                                ratio(r.get("ett_pct")))
        yield from self._scalar("ettkit_idle_ratio", "Share of end-to-end time that was idle (Idleness%/100).",
                                ratio(r.get("idle_pct")))
        yield from self._scalar("ettkit_failure_ratio", "Share of end-to-end time lost to failures.",
                                ratio(r.get("failure_pct")))
        yield from self._scalar("ettkit_unattributed_ratio", "Share of end-to-end time no phase accounts for.",
                                ratio(r.get("unattributed_pct")))
        yield from self._scalar("ettkit_attempts", "Number of attempts (launches) of the job.",
                                len(r["attempts"]) if "attempts" in r else None)

        phases = self._family(GaugeMetricFamily, "ettkit_phase_seconds",
                              "Job-level wall time per top-level phase.", ("phase",))
        for name, seconds in (r.get("phases") or {}).items():
            self._add(phases, seconds, name)
        yield phases

    def _attempt_families(self) -> Iterator[Metric]:
        r = self._report
        failures = self._family(CounterMetricFamily, "ettkit_failures",
                                "Failures of the job since it was first launched.", ("category",))
        by_category = dict(r.get("failures_by_category") or {})
        if not by_category and r.get("failures"):
            by_category = {"unknown": r["failures"]}
        for category, count in by_category.items():
            self._add(failures, count, category)
        yield failures

        start = self._family(GaugeMetricFamily, "ettkit_time_to_start_seconds",
                             "Time from an attempt's launch to its first training step.", ("attempt",))
        for attempt in r.get("attempts") or []:
            self._add(start, attempt.get("time_to_start_s"), str(attempt.get("attempt")))
        yield start

        recover = self._family(GaugeMetricFamily, "ettkit_time_to_recover_seconds",
                               "Time from a failure until training resumed, by failure index.", ("failure",))
        for i, seconds in enumerate(r.get("time_to_recover_s") or []):
            self._add(recover, seconds, str(i))
        yield recover

    def _checkpoint_families(self) -> Iterator[Metric]:
        r = self._report
        for name, key, doc in (
            ("ettkit_checkpoint_blocking_seconds", "checkpoint_blocking_s",
             "Training time blocked by checkpoint saves, measured and as estimated from the interval."),
            ("ettkit_unsaved_training_seconds", "unsaved_training_s",
             "Training lost to failures since the last checkpoint, measured and estimated (failures x interval / 2)."),
        ):
            family = self._family(GaugeMetricFamily, name, doc, ("kind",))
            for kind, seconds in (r.get(key) or {}).items():
                self._add(family, seconds, kind)
            yield family

        badput = self._family(GaugeMetricFamily, "ettkit_badput_seconds",
                              "Job time that was not effective training, in the badput categories of Google's "
                              "ml-goodput-measurement (docs/ett.md, Badput categories).", ("category",))
        for category, seconds in (r.get("badput") or {}).items():
            self._add(badput, seconds, category)
        yield badput

        skew = self._family(GaugeMetricFamily, "ettkit_phase_skew_seconds",
                            "Spread (max - min) of a phase's duration across ranks.", ("phase",))
        for name, stats in ((r.get("rank_skew") or {}).get("phases") or {}).items():
            self._add(skew, stats.get("skew_s"), name)
        yield skew

        yield from self._scalar("ettkit_checkpoint_interval_seconds", "Checkpoint interval in use.",
                                (r.get("checkpoints") or {}).get("interval_s"))
        yield from self._scalar("ettkit_recommended_checkpoint_interval_seconds",
                                "Checkpoint interval that minimises expected waste.",
                                r.get("recommended_interval_s"))
        tiers = (r.get("checkpoints") or {}).get("tiers") or {}
        for name, key, doc in (
            ("ettkit_checkpoint_tier_saves", "count", "Checkpoint saves per tier (disk, memory)."),
            ("ettkit_checkpoint_tier_blocking_seconds", "blocking_s", "Training time blocked by saves, per tier."),
            ("ettkit_checkpoint_tier_interval_seconds", "interval_s", "Checkpoint interval in use, per tier."),
            ("ettkit_checkpoint_tier_recommended_interval_seconds", "recommended_interval_s",
             "Checkpoint interval that minimises expected waste, per tier."),
            ("ettkit_checkpoint_tier_restores", "restores", "Attempts that restored from each tier."),
            ("ettkit_checkpoint_tier_retraining_seconds", "retraining_s",
             "Training re-done after the failures restored from each tier."),
        ):
            family = self._family(GaugeMetricFamily, name, doc, ("tier",))
            for tier, figures in tiers.items():
                self._add(family, (figures or {}).get(key), tier)
            yield family
        yield from self._scalar("ettkit_mtbf_seconds", "Mean time between failures used by the advisor.",
                                r.get("mtbf_s"))


def write_prometheus(report: dict, path: str | os.PathLike, job: str | None = None) -> None:
    """Writes the report's metrics to `path` atomically; `job` adds a `job` label to every metric."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReportCollector(report, job))
    write_to_textfile(os.fspath(path), registry)
