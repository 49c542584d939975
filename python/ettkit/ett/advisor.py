"""The checkpoint-interval advisor (the formulas live in C++: ettkit/ett/interval.h)."""

from __future__ import annotations

import math

from .. import _C
from ..errors import InvalidArgumentError

METHODS = ("young", "daly", "daly_series", "daly_exact")


def recommend_interval(blocking_s: float, mtbf_s: float, restart_s: float = 0.0, method: str = "young") -> float:
    """The checkpoint interval (seconds of training) that minimises expected lost time.

    ``blocking_s``: time training is blocked per checkpoint; ``mtbf_s``: mean time between failures;
    ``restart_s``: restart cost (used by ``"daly"``). ``method``: ``"young"`` √(2δM), ``"daly"``
    √(2δ(M+R)), ``"daly_series"`` (Daly's higher-order estimate) or ``"daly_exact"`` (exact optimum of
    Daly's cost). Raises :class:`ValueError` for non-positive or non-finite inputs or an unknown method.
    """
    for name, value, allow_zero in (("blocking_s", blocking_s, False), ("mtbf_s", mtbf_s, False),
                                    ("restart_s", restart_s, True)):
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{name}={value!r} must be a number of seconds") from None
        if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            raise InvalidArgumentError(
                f"{name}={value!r} must be a {'non-negative' if allow_zero else 'positive'}, finite number of seconds")
    if method not in METHODS:
        raise InvalidArgumentError(f"method={method!r} is not one of {', '.join(METHODS)}")
    return float(_C.ett.recommend_interval(float(blocking_s), float(mtbf_s), float(restart_s), method))
