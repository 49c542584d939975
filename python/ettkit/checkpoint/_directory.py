"""A checkpoint directory seen from outside a checkpointer: its newest committed step (:func:`latest_step`),
and what a load that found none says about where the steps might be instead."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

from .. import _C

def latest_step(directory: str | os.PathLike) -> Optional[int]:
    """The newest committed step of a checkpoint directory, or ``None`` when none is (or the directory does
    not exist). Committed and newest as for :meth:`AsyncCheckpointer.load_latest` (``step-<N>/manifest.json``
    decodes; ordered by commit, not by number). Read-only: no lock, nothing changed, only manifests read, so
    it works beside a running writer and before any checkpointer exists, e.g. to position a data loader
    before the restore (which may still fall back to an older step if this one's files fail verification)."""
    return _C.checkpoint.latest_step(os.fspath(directory))


#: The most subdirectories of an empty checkpoint directory looked into for steps (a run directory has a few:
#: ckpt/, ett/, compile-cache/); a directory with more is not searched further.
MAX_SUBDIRECTORIES_SEARCHED = 64


def subdirectory_with_steps(directory: str) -> Optional[tuple[str, int]]:
    """(path, newest committed step) of a direct subdirectory of ``directory`` that holds committed steps, when
    ``directory`` itself holds no ``step-<N>`` entry; else None. Links are not followed and at most
    :data:`MAX_SUBDIRECTORIES_SEARCHED` subdirectories are read (only their manifests, as
    :func:`latest_step`); an unreadable directory is no finding."""
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except OSError:
        return None
    if any(e.name.startswith("step-") for e in entries):
        return None
    searched = 0
    for e in sorted(entries, key=lambda e: e.name):
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        searched += 1
        if searched > MAX_SUBDIRECTORIES_SEARCHED:
            break
        try:
            step = latest_step(e.path)
        except Exception:  # a subdirectory we cannot read is not the one the user meant
            step = None
        if step is not None:
            return e.path, int(step)
    return None


def report_nothing_to_restore(directory: str) -> None:
    """A load that found no step: says so with the directory on the "ettkit" logger, so that a job that
    starts from scratch by mistake (a wrong directory, a wiped one) shows it. WARNING on a restart
    (``TORCHELASTIC_RESTART_COUNT`` > 0), where a checkpoint was expected; INFO on a first start, where
    finding none is the normal case and a warning at every new job would teach people to ignore it. A
    directory without steps whose direct subdirectory has some (``AsyncCheckpointer(run_dir)`` for steps
    in ``run_dir/ckpt``) is warned about, naming the subdirectory, whatever the attempt. The warning points
    at the caller of ``load_latest``."""
    logger = logging.getLogger("ettkit")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() not in ("", "0")
    logger.log(logging.WARNING if restart else logging.INFO,
               "checkpoint: no committed step in %s: starting from scratch", directory)
    holder = subdirectory_with_steps(directory)
    if holder is not None:
        sub, step = holder
        warnings.warn(
            f"ettkit.checkpoint: {directory} holds no checkpoint, but its subdirectory {sub} holds step {step}: "
            f"the job starts from scratch. If that is this job's checkpoint directory, pass "
            f"AsyncCheckpointer({sub!r})", RuntimeWarning, stacklevel=3)
