"""Exporters of the ETT report, each read back with the reader its users have.

The report is built here by hand: a 2-rank job whose attempt 0 is killed after ~2.7 h and whose attempt 1
restores the last checkpoint, re-trains the lost 1200 s and finishes cleanly. Bucket totals, phase
seconds and percentages are computed from the job timeline, so they agree the way the real report does.
"""

from __future__ import annotations

import json
import math

import matplotlib
import numpy as np
import pytest
from matplotlib.image import imread
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ettkit.ett import plot, prometheus, table, tensorboard, trace

T0_US = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z
S = 1_000_000

# (attempt, phase, bucket, begin_s, end_s) on the job clock; rank 1 differs only where noted below.
JOB_SEGMENTS = [
    (0, "scheduling", "idle", 0, 600),
    (0, "hardware_setup", "idle", 600, 880),
    (0, "unattributed", "unattributed", 880, 900),
    (0, "launcher_init", "idle", 900, 1080),
    (0, "compile", "idle", 1080, 1380),
    (0, "training", "effective", 1380, 5000),
    (0, "checkpoint_blocking", "idle", 5000, 5060),
    (0, "training", "effective", 5060, 8660),
    (0, "checkpoint_blocking", "idle", 8660, 8720),
    (0, "lost_in_flight", "failure", 8720, 9920),
    (0, "detect_and_teardown", "failure", 9920, 10040),
    (1, "scheduling", "failure", 10040, 10940),
    (1, "hardware_setup", "failure", 10940, 11240),
    (1, "launcher_init", "failure", 11240, 11420),
    (1, "checkpoint_restore", "failure", 11420, 11660),
    (1, "compile", "failure", 11660, 11960),
    (1, "wasted_training", "failure", 11960, 13160),
    (1, "training", "effective", 13160, 16760),
    (1, "checkpoint_blocking", "idle", 16760, 16820),
    (1, "training", "effective", 16820, 20000),
    (1, "shutdown", "idle", 20000, 20060),
]
E2E_S = 20060
PERSISTS = [(0, 362, 5060, 5150), (0, 722, 8720, 8815), (1, 1530, 16820, 16900)]  # attempt, step, begin, end
RANK1_COMPILE_EXTRA_S = 2  # rank 1 compiles 2 s longer in attempt 0: the skew the report shows


def _us(seconds: float) -> int:
    return T0_US + int(seconds * S)


def _rank_segments(rank: int) -> list[dict]:
    segments = []
    for attempt, name, bucket, begin, end in JOB_SEGMENTS:
        if rank == 1 and attempt == 0 and name == "compile":
            end += RANK1_COMPILE_EXTRA_S
        if rank == 1 and attempt == 0 and name == "training" and begin == 1380:
            begin += RANK1_COMPILE_EXTRA_S
        segments.append({"rank": rank, "attempt": attempt, "name": name, "bucket": bucket,
                         "begin_us": _us(begin), "end_us": _us(end)})
    return segments


def make_report(with_timeline: bool = True) -> dict:
    phases: dict[str, float] = {}
    phase_buckets: dict[str, str] = {}
    bucket_s = dict.fromkeys(("effective", "idle", "failure", "unattributed"), 0.0)
    for _, name, bucket, begin, end in JOB_SEGMENTS:
        phases[name] = phases.get(name, 0.0) + (end - begin)
        phase_buckets[name] = bucket if phase_buckets.get(name, bucket) == bucket else "mixed"
        bucket_s[bucket] += end - begin
    assert sum(phases.values()) == E2E_S
    # The report's badput: the job segments' time by name in Google's categories (the C++ report's pass).
    from ettkit.ett import BADPUT_CATEGORIES, badput_category

    badput = dict.fromkeys(BADPUT_CATEGORIES, 0.0)
    for _, name, bucket, begin, end in JOB_SEGMENTS:
        if bucket != "effective":
            badput[badput_category(name)] += end - begin

    delta, mtbf, restart = 60.0, float(E2E_S), 2040.0
    young = math.sqrt(2 * delta * mtbf)
    daly = math.sqrt(2 * delta * (mtbf + restart))
    report = {
        "format_version": 1, "run_dir": "/runs/dlrm-42", "world_size": 2, "ranks": [0, 1],
        "e2e_s": float(E2E_S), "e2e_begin_us": T0_US, "e2e_end_us": _us(E2E_S),
        "effective_s": bucket_s["effective"], "idle_s": bucket_s["idle"],
        "failure_s": bucket_s["failure"], "unattributed_s": bucket_s["unattributed"],
        "ett_pct": 100 * bucket_s["effective"] / E2E_S, "idle_pct": 100 * bucket_s["idle"] / E2E_S,
        "failure_pct": 100 * bucket_s["failure"] / E2E_S,
        "unattributed_pct": 100 * bucket_s["unattributed"] / E2E_S,
        "phases": phases, "phase_buckets": phase_buckets, "badput": badput,
        "substages": {"launcher_init/process_group_init": 42.0, "launcher_init/device_init": 18.0},
        "attempts": [
            {"attempt": 0, "begin_us": _us(0), "end_us": _us(9920), "status": "killed", "exception_type": None,
             "detail": "SIGKILL from scheduler", "time_to_start_s": 1380.0, "first_training_us": _us(1380),
             "failure_us": _us(9920), "restart_count": 0, "ranks": [0, 1], "first_step": 0, "last_step": 842},
            {"attempt": 1, "begin_us": _us(10040), "end_us": _us(E2E_S), "status": "clean",
             "exception_type": None, "detail": None, "time_to_start_s": 1920.0,
             "first_training_us": _us(11960), "failure_us": None, "restart_count": 1, "ranks": [0, 1],
             "first_step": 722, "last_step": 1860},
        ],
        "time_to_start_s": [1380.0, 1920.0],
        "time_to_recover_s": [2040.0],
        "recoveries": [{
            "failed_attempt": 0, "resumed_attempt": 1, "failure_us": _us(9920), "resumed_us": _us(11960),
            "recovered": True, "total_s": 2040.0,
            "breakdown": {"detect_and_teardown": 120.0, "scheduling": 900.0, "hardware_setup": 300.0,
                          "launcher_init": 180.0, "checkpoint_restore": 240.0, "compile": 300.0},
            "retraining_s": 1200.0, "category": "killed",
        }],
        "failures": 1, "failures_by_category": {"killed": 1},
        "unsaved_training_s": {"measured": 1200.0, "estimated": 1800.0},
        "checkpoint_blocking_s": {"measured": 180.0, "estimated": 192.0},
        "checkpoints": {"count": 3, "blocking_mean_s": 60.0, "interval_s": 3600.0,
                        "interval_source": "configured", "durable_latency_median_s": 90.0},
        "steps": {"recorded": 2980, "effective": 1860, "retrained": 120, "max_step": 1860,
                  "median_step_s": 10.0},
        "mtbf_s": mtbf, "mtbf_source": "measured",
        "recommended_interval_s": young,
        "recommendation": {
            "method": "young", "interval_s": young, "interval_steps": int(young // 10),
            "current_interval_s": 3600.0, "waste_at_current_s": 2100.0, "waste_at_recommended_s": 1640.0,
            "expected_saving_s": 460.0,
            "variants": {"young": young, "daly": daly, "daly_series": daly - 40.0, "daly_exact": daly - 38.0},
            "floor_s": 90.0, "note": "one failure observed; MTBF is uncertain",
        },
        "rank_skew": {"phases": {"compile": {"min": 600.0, "median": 601.0, "max": 602.0, "skew_s": 2.0},
                                 "training": {"min": 13998.0, "median": 13999.0, "max": 14000.0,
                                              "skew_s": 2.0}},
                      "attempt_start_skew_s": [0.01, 0.02]},
        "ledger": {"files": 2, "records": 5964, "corrupt_lines": 0, "torn_lines": 1, "dropped_events": 0,
                   "warnings": ["rank-1.jsonl: torn last line skipped"]},
    }
    if with_timeline:
        report["timeline"] = _rank_segments(0) + _rank_segments(1)
        report["job_timeline"] = [{k: v for k, v in s.items() if k != "rank"} for s in _rank_segments(0)]
        report["background"] = [
            {"rank": r, "attempt": a, "name": "checkpoint_persist", "step": step,
             "begin_us": _us(b), "end_us": _us(e)}
            for r in (0, 1) for a, step, b, e in PERSISTS
        ]
    return report


@pytest.fixture
def report() -> dict:
    return make_report()


# ---------------------------------------------------------------- Chrome trace


def test_trace_has_a_process_per_rank_and_one_for_the_job(report, tmp_path):
    path = tmp_path / "ett.trace.json"
    trace.write_chrome_trace(report, path)
    doc = json.loads(path.read_text())

    assert doc["displayTimeUnit"] == "ms"
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "job"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads[(0, 0)] == "phases" and threads[(1, 1)] == "background"
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file must be renamed away"


def test_trace_phase_events_have_microsecond_times_relative_to_start(report, tmp_path):
    path = tmp_path / "ett.trace.json"
    trace.write_chrome_trace(report, path)
    events = json.loads(path.read_text())["traceEvents"]

    def complete(pid, name):
        return [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 0 and e["name"] == name]

    compile0 = complete(0, "compile")
    assert [(e["ts"], e["dur"], e["args"]["attempt"]) for e in compile0] == [
        (1080 * S, 300 * S, 0), (11660 * S, 300 * S, 1)]
    assert compile0[0]["cat"] == "idle" and compile0[1]["cat"] == "failure"
    assert complete(1, "compile")[0]["dur"] == (300 + RANK1_COMPILE_EXTRA_S) * S
    # The job track covers E2E exactly, and no two events on one track overlap (Perfetto cannot nest them).
    for pid in (0, 1, 2):
        track = sorted((e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 0),
                       key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(track, track[1:]))
    job = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert sum(e["dur"] for e in job) == E2E_S * S
    assert len(job) == len(JOB_SEGMENTS)


def test_trace_background_attempt_markers_and_ett_counter(report, tmp_path):
    path = tmp_path / "ett.trace.json"
    trace.write_chrome_trace(report, path)
    events = json.loads(path.read_text())["traceEvents"]

    persists = [e for e in events if e["ph"] == "X" and e["tid"] == 1 and e["pid"] == 0]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["step"]) for e in persists] == [
        ("checkpoint_persist", b * S, (e - b) * S, step) for _, step, b, e in PERSISTS]

    begins = {e["pid"]: e["ts"] for e in events if e["ph"] == "i" and e["name"] == "attempt 1 begin"}
    assert begins == {0: 10040 * S, 1: 10040 * S, 2: 10040 * S}
    end0 = [e for e in events if e["ph"] == "i" and e["name"] == "attempt 0 end (killed)" and e["pid"] == 0]
    assert end0[0]["ts"] == 9920 * S and end0[0]["s"] == "p"

    (counter,) = [e for e in events if e["ph"] == "C"]
    assert counter["name"] == "ETT%" and counter["pid"] == 2
    assert counter["ts"] == E2E_S * S
    assert counter["args"]["value"] == pytest.approx(report["ett_pct"])


def test_trace_of_a_queue_before_the_run_starts_has_negative_ts(report, tmp_path):
    report["timeline"][0] = dict(report["timeline"][0], begin_us=T0_US - 30 * S)
    trace.write_chrome_trace(report, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    first = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["name"] == "scheduling"][0]
    assert first["ts"] == -30 * S and first["dur"] == 630 * S


def test_trace_and_plot_need_the_timeline(tmp_path):
    bare = make_report(with_timeline=False)
    with pytest.raises(ValueError, match="include_timeline=True"):
        trace.write_chrome_trace(bare, tmp_path / "t.json")
    with pytest.raises(ValueError, match="include_timeline=True"):
        plot.write_plot(bare, tmp_path / "p.png")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- Prometheus


def _samples(path) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_prometheus_values(report, tmp_path):
    path = tmp_path / "ett.prom"
    prometheus.write_prometheus(report, path)
    samples = _samples(path)

    assert samples[("ettkit_e2e_seconds", ())] == E2E_S
    assert samples[("ettkit_effective_training_ratio", ())] == pytest.approx(report["ett_pct"] / 100)
    assert samples[("ettkit_effective_training_ratio", ())] == pytest.approx(14000 / E2E_S)
    assert samples[("ettkit_idle_ratio", ())] == pytest.approx(1600 / E2E_S)
    assert samples[("ettkit_failure_ratio", ())] == pytest.approx(4440 / E2E_S)
    assert samples[("ettkit_unattributed_ratio", ())] == pytest.approx(20 / E2E_S)
    assert samples[("ettkit_failures_total", (("category", "killed"),))] == 1
    assert samples[("ettkit_phase_seconds", (("phase", "compile"),))] == 600
    assert samples[("ettkit_phase_seconds", (("phase", "training"),))] == 14000
    assert samples[("ettkit_time_to_start_seconds", (("attempt", "0"),))] == 1380
    assert samples[("ettkit_time_to_start_seconds", (("attempt", "1"),))] == 1920
    assert samples[("ettkit_time_to_recover_seconds", (("failure", "0"),))] == 2040
    assert samples[("ettkit_checkpoint_blocking_seconds", (("kind", "measured"),))] == 180
    assert samples[("ettkit_checkpoint_blocking_seconds", (("kind", "estimated"),))] == 192
    assert samples[("ettkit_unsaved_training_seconds", (("kind", "estimated"),))] == 1800
    assert samples[("ettkit_recommended_checkpoint_interval_seconds", ())] == pytest.approx(
        math.sqrt(2 * 60 * E2E_S))
    assert samples[("ettkit_attempts", ())] == 2
    badput = {labels[0][1]: v for (name, labels), v in samples.items() if name == "ettkit_badput_seconds"}
    assert badput == {
        "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION": 600 + 120 + 900,  # both queues and the teardown
        "TPU_INITIALIZATION": 280 + 300,
        "TRAINING_PREP": 180 + 180,
        "PROGRAM_STARTUP": 300 + 300,
        "DATA_LOADING_SYNC": 0,
        "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME": 180,
        "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME": 240,
        "WASTED_PROGRESS_FROM_DISRUPTION": 1200 + 1200,  # lost in flight, then re-trained
        "CUSTOM_BADPUT_EVENTS": 0,
        "OTHER": 20 + 60,  # unattributed and shutdown
    }
    assert sum(badput.values()) == E2E_S - 14000
    assert not any(name.endswith("_created") for name, _ in samples)


def test_prometheus_job_label_and_missing_values(report, tmp_path):
    report["recommended_interval_s"] = None
    report["attempts"][1]["time_to_start_s"] = None
    path = tmp_path / "ett.prom"
    prometheus.write_prometheus(report, path, job="dlrm-42")
    samples = _samples(path)

    assert all(dict(labels).get("job") == "dlrm-42" for _, labels in samples)
    assert samples[("ettkit_failures_total", (("category", "killed"), ("job", "dlrm-42")))] == 1
    assert not any(name == "ettkit_recommended_checkpoint_interval_seconds" for name, _ in samples)
    starts = {labels: v for (name, labels), v in samples.items() if name == "ettkit_time_to_start_seconds"}
    assert starts == {(("attempt", "0"), ("job", "dlrm-42")): 1380}


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars(report, tmp_path):
    log_dir = tensorboard.write_tensorboard(report, tmp_path / "tb")
    assert log_dir == str(tmp_path / "tb")
    acc = EventAccumulator(log_dir)
    acc.Reload()

    (ett,) = acc.Scalars("ett/ett_pct")
    assert ett.value == pytest.approx(report["ett_pct"], rel=1e-6)  # stored as float32
    assert ett.step == 1860 and ett.wall_time == pytest.approx(report["e2e_end_us"] / 1e6)
    assert acc.Scalars("ett/phase/compile")[0].value == 600
    assert acc.Scalars("ett/failures")[0].value == 1
    assert acc.Scalars("ett/e2e_s")[0].value == E2E_S
    assert [(s.step, s.value) for s in acc.Scalars("ett/time_to_start_s")] == [(0, 1380), (1, 1920)]
    assert [(s.step, s.value) for s in acc.Scalars("ett/time_to_recover_s")] == [(0, 2040)]
    assert acc.Scalars("ett/recommended_interval_s")[0].value == pytest.approx(
        report["recommended_interval_s"], rel=1e-6)


def test_tensorboard_explicit_step_and_no_recommendation(report, tmp_path):
    report["recommended_interval_s"] = None
    acc = EventAccumulator(tensorboard.write_tensorboard(report, tmp_path / "tb", step=7))
    acc.Reload()
    assert acc.Scalars("ett/idle_pct")[0].step == 7
    assert "ett/recommended_interval_s" not in acc.Tags()["scalars"]


# ---------------------------------------------------------------- plot


def test_plot_png(report, tmp_path):
    backend = matplotlib.get_backend()
    path = tmp_path / "ett.png"
    plot.write_plot(report, path)
    assert matplotlib.get_backend() == backend
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file must be renamed away"

    image = imread(path)
    height, width = image.shape[:2]
    assert width > 400 and height > 200
    rgb = image[..., :3]

    def share_of(hex_color: str) -> float:
        target = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
        return float(np.mean(np.all(np.abs(rgb - target) < 0.02, axis=-1)))

    # Effective time dominates the run; every phase of the job has its own colour in the picture.
    assert share_of(plot.COLORS["effective"]) > share_of(plot.phase_color("checkpoint_blocking")) > 0
    for name in ("compile", "scheduling", "checkpoint_restore", "shutdown"):
        assert share_of(plot.phase_color(name)) > 0, name
    assert share_of(plot.BACKGROUND_COLOR) > 0


def _bars(ax) -> list[tuple[float, float, tuple]]:
    """(x, width, facecolor) of the bars drawn in a breakdown axis, left to right."""
    return sorted((p.get_x(), p.get_width(), tuple(p.get_facecolor())) for p in ax.patches)


def test_plot_breakdown_splits_idle_and_failure_time_by_phase(report):
    parts = plot.breakdown(report)
    labels = [style.label for style, _ in parts]
    seconds = dict((style.label, sec) for style, sec in parts)
    assert labels[0] == "effective (training)" and seconds["effective (training)"] == report["effective_s"]
    assert labels[-1] == "unattributed" and seconds["unattributed"] == report["unattributed_s"]
    # Idle phases, longest first, then failure phases (hatched), longest first.
    idle = [p for p in parts[1:-1] if p[0].hatch is None]
    failure = [p for p in parts[1:-1] if p[0].hatch]
    # (ties by name: checkpoint_blocking and launcher_init both take 180 s)
    assert [s.label for s, _ in idle] == ["scheduling", "compile", "hardware_setup", "checkpoint_blocking",
                                         "launcher_init", "shutdown"]
    assert seconds["checkpoint_blocking"] == 3 * 60 and seconds["compile"] == 300
    assert seconds["compile (failure)"] == 300 and seconds["lost_in_flight (failure)"] == 1200
    assert [sec for _, sec in failure] == sorted((sec for _, sec in failure), reverse=True)
    assert sum(seconds.values()) == pytest.approx(E2E_S)
    # A phase keeps its colour whatever its bucket; failure time differs by its hatch only.
    styles = {s.label: s for s, _ in parts}
    assert styles["compile"].color == styles["compile (failure)"].color == plot.PHASE_COLORS["compile"]
    assert styles["compile (failure)"].hatch == plot.FAILURE_HATCH and styles["compile"].hatch is None


def test_plot_draws_several_runs_on_one_time_axis(report):
    short = make_report()
    half = lambda us: T0_US + (us - T0_US) // 2  # noqa: E731 - the same run, twice as fast
    for seg in short["timeline"] + short["job_timeline"] + short["background"]:
        seg["begin_us"], seg["end_us"] = half(seg["begin_us"]), half(seg["end_us"])
    short["e2e_s"] = E2E_S / 2
    fig = plot.figure([report, short])
    axes = fig.axes
    assert len(axes) == 4  # per run: timeline, breakdown
    shared = axes[0].get_shared_x_axes()
    assert all(shared.joined(axes[0], ax) for ax in axes[1:])
    scale, unit = plot.time_unit(E2E_S)
    assert unit == "hours" and axes[0].get_xlim() == pytest.approx((0, E2E_S / scale))
    # Each breakdown bar ends where its own run ends: the faster run's bar is half as long.
    for ax, e2e in ((axes[1], E2E_S), (axes[3], E2E_S / 2)):
        bars = _bars(ax)
        assert bars[0][0] == pytest.approx(0)
        assert bars[-1][0] + bars[-1][1] == pytest.approx(e2e / scale)
    colors = {c for _, _, c in _bars(axes[1])}
    assert len(colors) >= 8  # effective, unattributed and one per phase
    assert "ETT" in axes[0].get_title(loc="left") and "E2E 10030.0 s" in axes[2].get_title(loc="left")


def test_plot_keeps_a_phase_colour_across_runs_and_names_unknown_phases_stably():
    assert plot.phase_color("compile") == plot.PHASE_COLORS["compile"]
    assert plot.phase_color("my_eval") == plot.phase_color("my_eval") in plot.OTHER_COLORS
    assert plot.segment_style({"bucket": "effective", "name": "training"}).color == plot.COLORS["effective"]
    colors = [plot.COLORS["effective"], plot.COLORS["unattributed"], plot.BACKGROUND_COLOR]
    colors += list(plot.PHASE_COLORS.values())
    assert len(set(colors)) == len(colors), "two things share a colour"
    with pytest.raises(ValueError, match="at least one report"):
        plot.figure([])


# ---------------------------------------------------------------- table


def test_table_shows_the_key_numbers(report):
    text = table.format_report(report)
    assert "/runs/dlrm-42" in text
    assert "5:34:20 (20060.0 s)" in text
    assert f"{report['ett_pct']:.2f}%" in text and "69.79%" in text
    assert "detect_and_teardown=120.0" in text and "2040.0" in text
    assert "killed" in text and "2023-11-14T22:13:20Z" in text
    assert f"{report['recommended_interval_s']:.1f} s (155 steps)" in text
    assert "rank-1.jsonl: torn last line skipped" in text
    # Phases are listed longest first.
    assert text.index("\n  training ") < text.index("\n  scheduling ") < text.index("\n  compile ")
    # An attempt's notes follow the attempts, one line each.
    report["attempts"][1]["notes"] = {"compile_cache": "precompiled"}
    assert "\n  attempt 1 compile_cache: precompiled\n" in table.format_report(report)


def _with_memory_tier(report):
    report["recoveries"][0]["restored_from"] = "memory"
    report["checkpoints"]["tiers"] = {
        "disk": {"count": 3, "refused": 0, "blocking_s": 180.0, "blocking_mean_s": 60.0, "interval_s": 3600.0,
                 "interval_source": "configured", "durable_latency_median_s": 90.0, "restores": 0,
                 "recovered_failures": 0, "retraining_s": 0.0, "recommended_interval_s": 2573.7,
                 "recommendation": None},
        "memory": {"count": 40, "refused": 1, "blocking_s": 24.0, "blocking_mean_s": 0.6, "interval_s": 300.0,
                   "interval_source": "inferred", "durable_latency_median_s": 4.5, "restores": 1,
                   "recovered_failures": 1, "retraining_s": 1200.0, "recommended_interval_s": 257.4,
                   "recommendation": None},
    }
    return report


def test_table_shows_the_memory_tier_and_where_each_recovery_restored_from(report):
    plain = table.format_report(report)
    assert "memory tier" not in plain and "restored from" in plain
    text = table.format_report(_with_memory_tier(report))
    assert "  memory tier       40 saves, mean blocking 0.600 s, median time to committed 4.500 s, 1 refused" in text
    assert "interval 300.0 s (inferred), recommended 257.4 s; 1 restore, re-trained 1200.0 s after them" in text
    (row,) = [line for line in text.splitlines() if "0 -> 1" in line]
    assert row.split()[7] == "memory", row


def test_prometheus_per_tier(report, tmp_path):
    path = tmp_path / "ett.prom"
    prometheus.write_prometheus(_with_memory_tier(report), path)
    samples = _samples(path)
    assert samples[("ettkit_checkpoint_tier_saves", (("tier", "memory"),))] == 40
    assert samples[("ettkit_checkpoint_tier_saves", (("tier", "disk"),))] == 3
    assert samples[("ettkit_checkpoint_tier_blocking_seconds", (("tier", "memory"),))] == 24
    assert samples[("ettkit_checkpoint_tier_interval_seconds", (("tier", "disk"),))] == 3600
    assert samples[("ettkit_checkpoint_tier_recommended_interval_seconds", (("tier", "memory"),))] == 257.4
    assert samples[("ettkit_checkpoint_tier_restores", (("tier", "memory"),))] == 1
    assert samples[("ettkit_checkpoint_tier_retraining_seconds", (("tier", "memory"),))] == 1200


def test_table_survives_a_sparse_report():
    text = table.format_report({"run_dir": "/runs/empty", "e2e_s": None, "recommendation": None,
                                "attempts": [{"attempt": 0, "status": "exception", "begin_us": None}]})
    assert "/runs/empty" in text
    assert "ETT%          -" in text
    assert "(none)" in text
