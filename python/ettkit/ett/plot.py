"""The ETT report as a picture: a timeline per rank above the ETT breakdown bar.

Drawn with matplotlib's object API (`Figure` + the Agg canvas), never pyplot, so that writing a plot
from a notebook or an interactive session neither switches the user's backend nor leaves a figure open.
The output format follows the file name's extension (PNG when there is none).
"""

from __future__ import annotations

import os
import threading

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

NO_TIMELINE = "report has no timeline; build it with include_timeline=True"

BUCKETS = ("effective", "idle", "failure", "unattributed")
COLORS = {"effective": "#2ca02c", "idle": "#ff7f0e", "failure": "#d62728", "unattributed": "#9e9e9e"}
BACKGROUND_COLOR = "#1f77b4"


def _time_unit(e2e_s: float) -> tuple[float, str]:
    """Picks the unit that keeps the axis numbers readable for a run of this length."""
    if e2e_s >= 2 * 3600:
        return 3600.0, "hours"
    if e2e_s >= 2 * 60:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _draw_timeline(ax, report: dict) -> None:
    origin = report["e2e_begin_us"]
    scale, unit = _time_unit(report.get("e2e_s") or 0.0)

    def span(segment: dict) -> tuple[float, float]:
        return ((segment["begin_us"] - origin) / 1e6 / scale,
                (segment["end_us"] - segment["begin_us"]) / 1e6 / scale)

    ranks = list(report.get("ranks") or sorted({s["rank"] for s in report["timeline"]}))
    rows = [(f"rank {r}", [s for s in report["timeline"] if s["rank"] == r]) for r in ranks]
    rows.append(("job", report["job_timeline"]))
    for y, (_, segments) in enumerate(rows):
        for bucket in BUCKETS:
            spans = [span(s) for s in segments if s.get("bucket") == bucket]
            if spans:
                ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=COLORS[bucket])
    background = report.get("background") or []
    for y, rank in enumerate(ranks):
        # A thin strip just under the rank's bar: persistence overlaps training, so it cannot share the bar.
        spans = [span(s) for s in background if s["rank"] == rank]
        if spans:
            ax.broken_barh(spans, (y + 0.37, 0.1), facecolors=BACKGROUND_COLOR)

    for attempt in report.get("attempts") or []:
        if attempt.get("begin_us") is not None:
            x = (attempt["begin_us"] - origin) / 1e6 / scale
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
            ax.annotate(f"attempt {attempt.get('attempt')}", (x, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, 2), textcoords="offset points", fontsize=8)

    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top, "job" at the bottom
    ax.set_xlabel(f"{unit} since start")
    handles = [Patch(color=COLORS[b], label=b) for b in BUCKETS]
    if background:
        handles.append(Patch(color=BACKGROUND_COLOR, label="checkpoint persist"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def _draw_breakdown(ax, report: dict) -> None:
    left = 0.0
    handles = []
    for bucket in BUCKETS:
        pct = report.get(f"{'ett' if bucket == 'effective' else bucket}_pct") or 0.0
        ax.barh(0, pct, left=left, color=COLORS[bucket])
        # Labels inside narrow slices would overlap their neighbours; the legend still carries the value.
        if pct >= 5.0:
            ax.text(left + pct / 2, 0, f"{pct:.2f}%", ha="center", va="center", fontsize=9)
        handles.append(Patch(color=COLORS[bucket], label=f"{bucket} {pct:.2f}%"))
        left += pct
    ett = report.get("ett_pct")
    ax.set_title("ETT -" if ett is None else f"ETT {ett:.2f}%")
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("% of end-to-end time")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def write_plot(report: dict, path: str | os.PathLike) -> None:
    """Draws the timeline and breakdown and writes the image to `path` atomically."""
    if "timeline" not in report or "job_timeline" not in report:
        raise ValueError(NO_TIMELINE)
    n_rows = len(report.get("ranks") or []) + 1
    fig = Figure(figsize=(12, 2.0 + 0.4 * n_rows + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    timeline_ax, breakdown_ax = fig.subplots(2, 1, height_ratios=[max(2.0, 0.4 * n_rows + 1.0), 1.0])
    _draw_timeline(timeline_ax, report)
    _draw_breakdown(breakdown_ax, report)
    fig.suptitle(report.get("run_dir") or "", fontsize=9)

    path = os.path.abspath(os.fspath(path))
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fig.savefig(tmp, format=fmt, dpi=120)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
