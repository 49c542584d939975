"""Building the ETT report from a run directory (the computation is in C++: src/ett/report.cpp)."""

from __future__ import annotations

import json
import os

from .. import _C


def build_report(run_dir: str | os.PathLike, *, include_initial_queue: bool = False, mtbf_prior_s: float = 0.0,
                 method: str = "young", include_timeline: bool = True,
                 trace_path: str | os.PathLike | None = None) -> dict:
    """The ETT report of ``run_dir`` as a dict (keys documented in docs/ett.md).

    ``include_initial_queue`` counts attempt 0's scheduling (queue) time in E2E; ``mtbf_prior_s`` is the
    MTBF assumed when the ledger shows no failure; ``method`` picks the interval formula of the headline
    recommendation; ``include_timeline`` adds the per-rank and job timelines the plot (and
    ``trace.write_chrome_trace``) need. ``trace_path`` also writes the Chrome trace there, streamed by the
    C++ report as it is built: unlike ``write_chrome_trace(report, path)`` it needs no timeline in memory,
    which is what keeps a trace of a million steps within bounded memory and time.
    Raises ``ettkit.InvalidArgumentError`` (a ValueError) for a missing or empty run directory,
    ``ettkit.UnsupportedError`` for a ledger written by a newer ettkit and ``ettkit.IoError`` when the trace
    cannot be written.
    """
    text = _C.ett.build_report_json(os.fspath(run_dir), include_initial_queue=include_initial_queue,
                                    mtbf_prior_s=float(mtbf_prior_s), method=method,
                                    include_timeline=include_timeline,
                                    chrome_trace_path=_trace_path(trace_path))
    return json.loads(text)


def _trace_path(path: str | os.PathLike | None) -> str:
    return "" if path is None else os.path.abspath(path)
