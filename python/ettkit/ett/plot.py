"""The ETT report as a picture: per run, a timeline per rank and for the job, above a breakdown bar of where
the job's time went, everything on one time axis.

- Time that is not training is coloured by **phase** (compile, checkpoint_blocking, scheduling, ...), with
  the same colour for a phase in every plot; failure-bucket time is hatched, effective time is green and
  unattributed time grey. Persistence (``checkpoint_persist``) overlaps training, so it is a thin strip
  under its rank's bar.
- The breakdown bar lays the job's E2E out in seconds: effective time first, then each idle phase, each
  failure phase and the unattributed rest, so it ends where the timeline ends.
- Several runs (``write_plot([a, b], path)``, or ``--plot-with`` on the CLI) are drawn one under the other
  on one shared time axis, so a shorter run is visibly shorter and a phase's length compares by eye.

Drawn with matplotlib's object API (`Figure` + the Agg canvas), never pyplot, so that writing a plot
from a notebook or an interactive session neither switches the user's backend nor leaves a figure open.
The output format follows the file name's extension (PNG when there is none).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import zlib
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

NO_TIMELINE = "report has no timeline; build it with include_timeline=True"

BUCKETS = ("effective", "idle", "failure", "unattributed")
COLORS = {"effective": "#2ca02c", "idle": "#ff7f0e", "failure": "#d62728", "unattributed": "#9e9e9e"}
BACKGROUND_COLOR = "#1f77b4"
FAILURE_HATCH = "xx"

# One fixed colour per phase of the taxonomy, the same in every plot. The palette is chosen so that any two of
# these colours, and effective green, unattributed grey and the background blue, differ by at least 20 in
# CIELAB (CIE76 ΔE; about 2 is just noticeable): no two phases share a hue pair as tab20's light and dark
# pinks did for process_bootstrap and compile. Greens and greys stay reserved for effective and unattributed
# time. Related phases get related hues where the palette allows (start-up blues and violets, checkpoint
# yellows, failure reds). Other phase names get one of OTHER_COLORS by a stable hash. docs/ett.md lists both.
PHASE_COLORS = {
    "scheduling": "#87cefa",
    "hardware_setup": "#ffd700",
    "launcher_init": "#ff7f0e",
    "process_bootstrap": "#dda0dd",
    "worker_spawn": "#7b68ee",
    "process_group_init": "#8a2be2",
    "train_module_creation": "#8c6d31",
    "preproc_creation": "#ffe4b5",
    "get_first_batch_data": "#008080",
    "compile": "#c71585",
    "checkpoint_restore": "#0000cd",
    "checkpoint_blocking": "#bcbd22",
    "data_stall": "#40e0d0",
    "shutdown": "#f08080",
    "shutdown/process_teardown": "#fdae6b",
    "wasted_training": "#d62728",
    "lost_in_flight": "#ff00ff",
    "peer_teardown": "#550022",
    "detect_and_teardown": "#882d17",
    "restart_gap": "#7b4173",
}
# For user-named phases: as far (ΔE >= 25) from every colour above, and from each other, as the palette allows.
OTHER_COLORS = ("#1e90ff", "#800080", "#ee82ee", "#ff0000", "#b8860b", "#8c564b", "#5254a3", "#ffb6c1")


def phase_color(name: str) -> str:
    if name in PHASE_COLORS:
        return PHASE_COLORS[name]
    return OTHER_COLORS[zlib.crc32(name.encode()) % len(OTHER_COLORS)]


@dataclasses.dataclass(frozen=True)
class Style:
    """How one timeline segment is drawn: its colour, its hatch and its legend label."""

    color: str
    hatch: str | None
    label: str


def segment_style(segment: dict) -> Style:
    bucket, name = segment.get("bucket"), segment.get("name") or "?"
    if bucket == "effective":
        return Style(COLORS["effective"], None, "effective (training)")
    if bucket == "unattributed" or name == "unattributed":
        return Style(COLORS["unattributed"], None, "unattributed")
    if bucket == "failure":
        return Style(phase_color(name), FAILURE_HATCH, f"{name} (failure)")
    return Style(phase_color(name), None, name)


def time_unit(e2e_s: float) -> tuple[float, str]:
    """Picks the unit that keeps the axis numbers readable for a run of this length."""
    if e2e_s >= 2 * 3600:
        return 3600.0, "hours"
    if e2e_s >= 2 * 60:
        return 60.0, "minutes"
    return 1.0, "seconds"


def breakdown(report: dict) -> list[tuple[Style, float]]:
    """Where the job's E2E went, in seconds, in drawing order: effective, idle phases (longest first),
    failure phases (longest first), unattributed. Built from the job timeline, so it sums to its span."""
    totals: dict[Style, float] = {}
    for s in report["job_timeline"]:
        style = segment_style(s)
        totals[style] = totals.get(style, 0.0) + (s["end_us"] - s["begin_us"]) / 1e6

    def order(item):
        style, seconds = item
        rank = (0 if style.label.startswith("effective") else 3 if style.label == "unattributed"
                else 2 if style.hatch else 1)
        return rank, -seconds, style.label

    return sorted(totals.items(), key=order)


def _draw_timeline(ax, report: dict, scale: float) -> None:
    origin = report["e2e_begin_us"]

    def span(segment: dict) -> tuple[float, float]:
        return ((segment["begin_us"] - origin) / 1e6 / scale, (segment["end_us"] - segment["begin_us"]) / 1e6 / scale)

    ranks = list(report.get("ranks") or sorted({s["rank"] for s in report["timeline"]}))
    rows = [(f"rank {r}", [s for s in report["timeline"] if s["rank"] == r]) for r in ranks]
    rows.append(("job", report["job_timeline"]))
    for y, (_, segments) in enumerate(rows):
        by_style: dict[Style, list] = {}
        for s in segments:
            if s["end_us"] > s["begin_us"]:  # a zero-width segment draws nothing, so it names nothing
                by_style.setdefault(segment_style(s), []).append(span(s))
        for style, spans in by_style.items():
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=style.color, hatch=style.hatch,
                           edgecolor="black" if style.hatch else style.color, linewidth=0)
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
    ett = report.get("ett_pct")
    title = f"{report.get('run_dir') or ''}   ETT {'-' if ett is None else f'{ett:.2f}%'}   E2E {report.get('e2e_s') or 0:.1f} s"
    ax.set_title(title, fontsize=9, loc="left", pad=14)  # above the "attempt N" labels


def _draw_breakdown(ax, report: dict, scale: float) -> None:
    e2e = report.get("e2e_s") or 0.0
    left = 0.0
    for style, seconds in breakdown(report):
        width = seconds / scale
        ax.barh(0, width, left=left, color=style.color, hatch=style.hatch,
                edgecolor="black" if style.hatch else style.color, linewidth=0)
        # Labels inside narrow slices would overlap their neighbours; the legend names every colour.
        if e2e > 0 and seconds / e2e >= 0.06:
            ax.text(left + width / 2, 0, f"{100 * seconds / e2e:.1f}%", ha="center", va="center", fontsize=8)
        left += width
    ax.set_yticks([0], ["where E2E went"])
    ax.set_ylim(-0.5, 0.5)


def figure(reports: dict | Sequence[dict]) -> Figure:
    """The plot of one report, or of several on one shared time axis (axes: timeline, breakdown per run)."""
    reports = [reports] if isinstance(reports, dict) else list(reports)
    if not reports:
        raise ValueError("write_plot needs at least one report")
    for r in reports:
        if "timeline" not in r or "job_timeline" not in r:
            raise ValueError(NO_TIMELINE)
    scale, unit = time_unit(max(r.get("e2e_s") or 0.0 for r in reports))
    legend: dict[str, Style] = {}
    for r in reports:
        _legend_entries(r, legend)
    ratios = []
    for r in reports:
        ratios += [0.45 * (len(r.get("ranks") or []) + 1) + 0.5, 0.55]
    height = 0.9 + sum(ratios)
    fig = Figure(figsize=(13, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ratios), 1, sharex=True, height_ratios=ratios, squeeze=False)[:, 0]
    for i, r in enumerate(reports):
        _draw_timeline(axes[2 * i], r, scale)
        _draw_breakdown(axes[2 * i + 1], r, scale)
    axes[-1].set_xlabel(f"{unit} since the start of each run")
    axes[0].set_xlim(0, max((r.get("e2e_s") or 0.0) for r in reports) / scale or 1.0)
    handles = [Patch(facecolor=s.color, hatch=s.hatch, edgecolor="black" if s.hatch else s.color, label=label)
               for label, s in sorted(legend.items(), key=lambda kv: (kv[0] != "effective (training)", kv[0]))]
    # Beside the axes in as many columns as the figure's height needs: a single column ran off the bottom
    # of a one-rank figure after about a dozen entries. The axes give up the width (constrained layout).
    fig.legend(handles=handles, loc="outside right upper", ncols=legend_columns(len(handles), height),
               fontsize=8, frameon=False)
    return fig


# The pitch of one legend row (8-point text with matplotlib's 0.5 em label spacing is 12 points, 0.17 in; a
# little more for the hatch patches' edges) and the figure height its border and padding take.
LEGEND_ROW_IN = 0.2
LEGEND_MARGIN_IN = 0.3


def legend_columns(entries: int, height_in: float) -> int:
    """How many columns a legend of `entries` rows needs to fit a figure `height_in` inches tall."""
    rows = max(1, int((height_in - LEGEND_MARGIN_IN) / LEGEND_ROW_IN))
    return max(1, -(-entries // rows))


def _legend_entries(report: dict, legend: dict) -> None:
    """What the report's plot draws, one entry per style: segments of positive width only (a phase of zero
    width draws nothing, so the legend does not name it), and the background strip when there is one."""
    for s in list(report["timeline"]) + list(report["job_timeline"]):
        if s["end_us"] > s["begin_us"]:
            style = segment_style(s)
            legend.setdefault(style.label, style)
    if any(s["end_us"] > s["begin_us"] for s in report.get("background") or []):
        legend.setdefault("checkpoint persist (background)", Style(BACKGROUND_COLOR, None, ""))


def write_plot(reports: dict | Sequence[dict], path: str | os.PathLike) -> None:
    """Draws one report, or several on one shared time axis, and writes the image to `path` atomically."""
    save_figure(figure(reports), path, dpi=110)


def save_figure(fig, path: str | os.PathLike, dpi: int) -> None:
    """Writes `fig` to `path` atomically (a temporary file, then a rename), in the format of its extension
    (PNG without one): a reader never sees half an image."""
    path = os.path.abspath(os.fspath(path))
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    tmp = os.path.join(os.path.dirname(path),
                       f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fig.savefig(tmp, format=fmt, dpi=dpi)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
