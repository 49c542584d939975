"""Issue #47 item 8: the plot's legend and the report's durations.

The legend listed phases of zero width, was cut off after about a dozen entries (one column outside the
axes of a figure only as tall as the timelines), and drew process_bootstrap and compile in two pinks of one
tab20 pair; a sub-millisecond mean blocking printed as "0.000 s".
"""

from __future__ import annotations

import itertools

import pytest

from ettkit import ett
from ettkit.ett import plot, projection, table

T0 = 1_700_000_000_000_000


def srgb_to_lab(hex_color: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour: what the colour-difference check below measures in."""
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    x = (0.4124 * lin[0] + 0.3576 * lin[1] + 0.1805 * lin[2]) / 0.95047
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    z = (0.0193 * lin[0] + 0.1192 * lin[1] + 0.9505 * lin[2]) / 1.08883
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def delta_e(a: str, b: str) -> float:
    """CIE76 colour difference; about 2 is just noticeable side by side, 20 is two different colours."""
    return sum((p - q) ** 2 for p, q in zip(srgb_to_lab(a), srgb_to_lab(b))) ** 0.5


def test_every_phase_has_a_clearly_distinct_colour():
    named = {**plot.PHASE_COLORS, "(effective)": plot.COLORS["effective"],
             "(unattributed)": plot.COLORS["unattributed"], "(background)": plot.BACKGROUND_COLOR}
    closest = min((delta_e(a, b), m, n) for (m, a), (n, b) in itertools.combinations(named.items(), 2))
    assert closest[0] >= 20, f"{closest[1]} and {closest[2]} look alike (ΔE {closest[0]:.1f})"
    assert delta_e(plot.phase_color("process_bootstrap"), plot.phase_color("compile")) >= 20
    # A user-named phase's hashed colour is told apart from every phase of the taxonomy, too.
    others = {f"(other {i})": c for i, c in enumerate(plot.OTHER_COLORS)}
    closest = min((delta_e(a, b), m, n) for (m, a), (n, b) in itertools.combinations({**named, **others}.items(), 2))
    assert closest[0] >= 20, f"{closest[1]} and {closest[2]} look alike (ΔE {closest[0]:.1f})"
    # The sub-stage the report derives for process teardown has its own colour, not a hashed one.
    assert "shutdown/process_teardown" in plot.PHASE_COLORS


def make_report(phases: list[tuple[str, float]], zero_width: tuple[str, ...] = ()) -> dict:
    """One rank and the job, each phase `seconds` long in turn, then training; phases in `zero_width` get
    a segment that begins where it ends."""
    segments, t = [], T0
    for name, seconds in phases:
        end = t + int(seconds * 1e6)
        segments.append({"name": name, "bucket": "idle", "begin_us": t, "end_us": end, "rank": 0, "attempt": 0})
        t = end
    for name in zero_width:
        segments.append({"name": name, "bucket": "idle", "begin_us": t, "end_us": t, "rank": 0, "attempt": 0})
    segments.append({"name": "training", "bucket": "effective", "begin_us": t, "end_us": t + 60_000_000,
                     "rank": 0, "attempt": 0})
    e2e = (t + 60_000_000 - T0) / 1e6
    return {"run_dir": "/runs/legend", "ranks": [0], "e2e_begin_us": T0, "e2e_s": e2e, "ett_pct": 50.0,
            "timeline": segments, "job_timeline": [dict(s, rank=-1) for s in segments], "background": [],
            "attempts": [{"attempt": 0, "begin_us": T0}]}


MANY = ["scheduling", "hardware_setup", "launcher_init", "process_bootstrap", "worker_spawn",
        "process_group_init", "train_module_creation", "preproc_creation", "get_first_batch_data", "compile",
        "checkpoint_restore", "checkpoint_blocking", "data_stall", "shutdown", "shutdown/process_teardown",
        "my_eval", "restart_gap"]


def legend_of(fig) -> tuple[list[str], list[str]]:
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    colors = ["#%02x%02x%02x" % tuple(round(255 * c) for c in h.get_facecolor()[:3]) for h in legend.legend_handles]
    return labels, colors


def test_the_legend_lists_exactly_the_phases_drawn_each_in_its_colour():
    report = make_report([(name, 5.0 + i) for i, name in enumerate(MANY)], zero_width=("lost_in_flight", "compile/inner"))
    fig = plot.figure(report)
    labels, colors = legend_of(fig)
    assert labels[0] == "effective (training)"
    assert sorted(labels[1:]) == sorted(MANY)  # every phase drawn, no zero-width one
    assert "lost_in_flight" not in labels and "compile/inner" not in labels
    for label, color in zip(labels, colors):
        expected = plot.COLORS["effective"] if label.startswith("effective") else plot.phase_color(label)
        assert color == expected.lower(), label
    assert len(set(colors)) == len(colors)


def test_the_legend_fits_inside_the_figure():
    report = make_report([(name, 5.0 + i) for i, name in enumerate(MANY)])
    fig = plot.figure(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box, page = legend.get_window_extent(renderer), fig.bbox
    # Every entry lies on the page: none is cut off at its bottom or right edge.
    assert box.x0 >= page.x0 - 1 and box.y0 >= page.y0 - 1, (box, page)
    assert box.x1 <= page.x1 + 1 and box.y1 <= page.y1 + 1, (box, page)
    for text in legend.get_texts():
        extent = text.get_window_extent(renderer)
        assert page.x0 - 1 <= extent.x0 and extent.x1 <= page.x1 + 1, text.get_text()
        assert page.y0 - 1 <= extent.y0 and extent.y1 <= page.y1 + 1, text.get_text()


@pytest.mark.parametrize("seconds,text", [
    (0.00043313, "0.43 ms"), (0.0000123, "0.012 ms"), (0.0005, "0.5 ms"), (0.0, "0 s"), (0.25, "0.250 s"),
    (4.5, "4.500 s"), (60.0, "60.0 s"), (None, "-"),
])
def test_durations_are_printed_with_significant_digits(seconds, text):
    assert table.format_duration(seconds) == text
    assert ett.format_duration(seconds) == text  # public, for scripts that print a report's figures


def test_a_sub_millisecond_mean_blocking_prints_in_milliseconds():
    report = {"checkpoints": {"count": 3, "blocking_mean_s": 0.00043313, "durable_latency_median_s": 0.0123,
                              "tiers": {"memory": {"count": 5, "blocking_mean_s": 0.00009, "interval_s": 2.0}}},
              "checkpoint_blocking_s": {"measured": 0.0012994, "estimated": None}}
    text = table.format_report(report)
    assert "mean blocking 0.43 ms, median durable latency 0.012 s" in text
    assert "5 saves, mean blocking 0.09 ms" in text
    assert "blocking          measured 0.001 s" in text
    assert "0.000 s" not in text and "0.00043313" not in text
    # In a column of seconds a sub-millisecond value keeps two significant digits rather than "0.000".
    assert table._sec(0.00043313) == "0.00043"


def test_the_projection_prints_a_sub_millisecond_blocking_in_milliseconds():
    text = projection.format_projection({
        "days": 30.0, "world_size": 8, "failures_per_day": 1.0, "mtbf_h": 24.0, "interval_s": 600.0,
        "ett_pct": 90.0, "idle_pct": 5.0, "failure_pct": 5.0, "lost_accelerator_h": 1.0, "accelerator_h": 10.0,
        "progress": True, "dominant": "failure_recovery", "dominant_share_pct": 50.0,
        "waste_s": {c: 1.0 for c in projection.COMPONENTS}, "failures_per_1000_per_day": None, "table": [],
        "inputs": {"restart_s": 12.0, "restart_source": "measured", "blocking_s": 0.00043313, "startup_s": 20.0,
                   "shutdown_s": 1.5, "other_idle_per_training_s": 0.01, "floor_s": 0.0},
    })
    assert "blocking B 0.43 ms per checkpoint, start-up S 20.0 s, shutdown D 1.500 s" in text
