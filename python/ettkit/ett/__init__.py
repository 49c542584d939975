"""ETT phase timers: measure every phase of a job across restarts and report its Effective Training Time.

Record (one :class:`Recorder` per process, ledger ``RUN_DIR/ett/rank-<r>.jsonl``)::

    from ettkit import ett
    with ett.Recorder(run_dir) as rec:               # the attempt record; end status on exit
        with rec.phase("process_group_init"): ...
        with rec.phase("compile"): ...
        for step in range(start, steps):
            train_step()
            if step % k == 0:
                with rec.phase("checkpoint_blocking", step=step): save()
            rec.step(step)                           # marks the completion of global step `step`

Report (a pure function of the ledger directory)::

    report = ett.build_report(run_dir)               # dict, see docs/ett.md
    print(ett.format_report(report))

or ``python -m ettkit report RUN_DIR [--json] [--trace F] [--prometheus F] [--plot F.png] [--tensorboard DIR]``.
"""

from __future__ import annotations

from .advisor import recommend_interval
from .badput import BADPUT_CATEGORIES, badput_category
from .fleet import fleet_report, format_fleet
from .projection import format_projection, project
from .recorder import Recorder, current, init, phase, step
from .report import build_report
from .table import format_duration

try:  # only in a build with CUDA: GPU-side phase timing with CUDA events (include/ettkit/ett/cuda_timer.h)
    from .._C.ett import CudaEventTimer  # noqa: F401
except ImportError:
    pass

__all__ = [
    "BADPUT_CATEGORIES",
    "Recorder",
    "badput_category",
    "build_report",
    "current",
    "fleet_report",
    "format_duration",
    "format_fleet",
    "format_projection",
    "format_report",
    "init",
    "phase",
    "project",
    "recommend_interval",
    "serve_metrics",
    "step",
]


def format_report(report: dict) -> str:
    """The report as a readable plain-text table (see :mod:`ettkit.ett.table`)."""
    from .table import format_report as _format

    return _format(report)


def serve_metrics(port: int, run_dir=None, **options):
    """Serves the job's live ETT figures in the Prometheus format on rank 0 (None elsewhere); see
    :func:`ettkit.ett.live.serve_metrics`. Needs prometheus-client (``pip install 'ettkit[report]'``), imported
    only here so that recording does not."""
    from .live import serve_metrics as _serve

    return _serve(port, run_dir, **options)
