"""The ETT report as TensorBoard scalars, written with `torch.utils.tensorboard.SummaryWriter`.

Tags live under `ett/` so that they group into one section next to a model's own training curves; they
are read by TensorBoard and by `EventAccumulator`. The x axis of the job-level scalars is the global
step the job reached (so a report written after each run or each resume lines up with the loss curves);
per-attempt and per-failure scalars use the attempt or failure index instead. Wall time is the moment
the report describes (end of the run, start of training, resumption), not the moment of the export.
"""

from __future__ import annotations

import os


def _seconds(us: int | None) -> float | None:
    return None if us is None else us / 1e6


def write_tensorboard(report: dict, log_dir: str | os.PathLike, step: int | None = None) -> str:
    """Appends the report's scalars to an event file in `log_dir` and returns `log_dir`."""
    # Imported here so that `import ettkit` does not pay for torch's tensorboard import unless asked.
    from torch.utils.tensorboard import SummaryWriter

    if step is None:
        step = (report.get("steps") or {}).get("max_step") or 0
    log_dir = os.fspath(log_dir)
    end_wall = _seconds(report.get("e2e_end_us"))

    writer = SummaryWriter(log_dir=log_dir)
    try:
        def scalar(tag: str, value: float | None, at: int = step, wall: float | None = end_wall) -> None:
            if value is not None:
                writer.add_scalar(tag, float(value), global_step=at, walltime=wall)

        for key in ("ett_pct", "idle_pct", "failure_pct", "unattributed_pct"):
            scalar(f"ett/{key}", report.get(key))
        scalar("ett/e2e_s", report.get("e2e_s"))
        scalar("ett/failures", report.get("failures"))
        for name, seconds in (report.get("phases") or {}).items():
            scalar(f"ett/phase/{name}", seconds)
        for attempt in report.get("attempts") or []:
            scalar("ett/time_to_start_s", attempt.get("time_to_start_s"), attempt.get("attempt", 0),
                   _seconds(attempt.get("first_training_us")) or end_wall)
        recoveries = report.get("recoveries") or []
        for i, seconds in enumerate(report.get("time_to_recover_s") or []):
            resumed = recoveries[i].get("resumed_us") if i < len(recoveries) else None
            scalar("ett/time_to_recover_s", seconds, i, _seconds(resumed) or end_wall)
        scalar("ett/recommended_interval_s", report.get("recommended_interval_s"))
        writer.flush()
    finally:
        writer.close()
    return log_dir
