"""The interval policy's inputs from Python: ``every=`` values as C++ ``Every``s and step numbers checked. The
policy itself is C++'s ``CheckpointSchedule``, which also records its fixed intervals as the report's configured
interval (``_C.checkpoint.record_intervals``, the C++ ledger adaptor's records)."""

from __future__ import annotations

import operator
from typing import Any

from .. import _C
from ..errors import InvalidArgumentError

def step_number(step: Any) -> int:
    """``step`` as an int, refusing what is not an integer: ``int(1.5)`` would silently save step 1 and
    ``int("7")`` would parse text. Python and numpy integers and one-element integer tensors pass
    (``operator.index``); the range is the C++ side's to check."""
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise InvalidArgumentError(
        f"step={step!r} ({type(step).__name__}) is not a step number: give an int (a numpy integer or a one-element "
        f"integer tensor works too)"
    )


def every_of(every: Any, field: str = "every") -> "_C.checkpoint.Every":
    """The C++ interval of ``every=`` (``None``, an int of steps, or a string: a duration or ``"auto"``)."""
    Every = _C.checkpoint.Every
    if every is None:
        return Every.never()
    if isinstance(every, bool) or not isinstance(every, (int, str)):
        raise InvalidArgumentError(f"{field}={every!r} is not valid: give steps (e.g. 100), a duration (e.g. '90s', "
                                   f"'10min', '1h'), 'auto', or None ('never') to save only when asked")
    if isinstance(every, int):
        return Every.steps(every, field)
    return Every.parse(every, field)


def parse_every(every: Any) -> tuple[str, float]:
    """``None`` -> ("never", 0); int n -> ("steps", n); "90s"/"5min"/"2h" -> ("seconds", s); "auto". The
    parsing is the C++ ``Every::parse`` that C++ trainers use (include/ettkit/checkpoint/schedule.h)."""
    e = every_of(every)
    return (e.kind, float(e.value))
