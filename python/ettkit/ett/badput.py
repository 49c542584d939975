"""ettkit's phases in the badput categories of Google's ml-goodput-measurement (``BadputType``).

The mapping lives in C++ (``include/ettkit/ett/badput.h``) so that the report, the live endpoint and C++
trainers share it; docs/ett.md §11 tabulates it. The report's ``badput`` object holds seconds per category.
"""

from __future__ import annotations

from .. import _C

#: Google's badput categories, in their enum's order (the elastic ones excepted).
BADPUT_CATEGORIES: tuple[str, ...] = tuple(_C.ett.badput_categories())


def badput_category(name: str) -> str:
    """The category time in phase ``name`` counts as: one of :data:`BADPUT_CATEGORIES`, or ``"GOODPUT"``
    for ``"training"``. A sub-stage with a category of its own takes it, any other name its top-level
    phase's (``"checkpoint_blocking/memory"``: checkpoint_blocking's), a user-named phase
    ``CUSTOM_BADPUT_EVENTS``."""
    if not isinstance(name, str):
        raise TypeError(f"badput_category: name must be a str (a phase name such as 'compile'), not {type(name).__name__}")
    return _C.ett.badput_category(name)
