"""One ledger line decoded: the live view's reading of the ledger format (src/ett/ledger_format.h, the C++
reader src/ett/ledger_reader.cpp and src/ett/flat_record.cpp), with the same bounds.

A line is a JSON object, or a step line in the Recorder's own spelling read without building a dict.
Whatever the C++ reader would skip as corrupt raises :class:`Corrupt` here (or decodes to None), so the
caller counts it and goes on: a hostile line costs at most its bounded length, never a deep recursion.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Optional

FORMAT_VERSION = 1
# UTC epoch microseconds a ledger time may take (1970 ... 9999-12-31T23:59:59): what the C++ reader accepts.
MAX_EPOCH_US = 253_402_300_799_000_000
# What one line may cost (ledger::kMaxLineBytes and kMaxNestingDepth in src/ett/ledger_format.h): a longer or
# deeper line is no record of the Recorder's; it is counted as corrupt and skipped, never held whole.
MAX_LINE_BYTES = 1 << 20
MAX_NESTING_DEPTH = 64
OVERSIZED = f"longer than {MAX_LINE_BYTES} bytes; a ledger record is far shorter"


class Corrupt(Exception):
    """A ledger line the reader skips and counts; the message says why."""


_decode = json.JSONDecoder().decode
# A step line exactly as the Recorder writes it (src/ett/recorder.cpp), nearly every line of a ledger: read
# without building a dict, as the C++ reader's FlatRecord does. JSON numbers have no leading zeros, so
# neither does the pattern; any other spelling of a step takes the JSON path.
_INT = "(?:0|[1-9][0-9]*)"
_STEP_LINE = re.compile(r'\{"v":1,"t":"step","n":(-?' + _INT + '),"b":(' + _INT + '),"e":(' + _INT + r')\}')

# A JSON string, or an unterminated one up to the end of the line: it always matches from a quote, without
# backtracking, so stripping strings is linear in the line whatever it holds.
_STRING = re.compile(rb'"[^"\\]*(?:\\.?[^"\\]*)*(?:"|\Z)')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def nesting_within(line: str | bytes, max_depth: int = MAX_NESTING_DEPTH) -> bool:
    """Whether ``line`` nests arrays and objects at most ``max_depth`` deep, brackets inside strings not
    counted (the C++ reader's nesting_within). Python's json would otherwise build one list per level, or
    raise RecursionError (no ValueError) a thousand levels down. At C speed: few brackets prove it at once;
    otherwise strings are cut out, the brackets kept, and their running depth's maximum taken."""
    if type(line) is str:
        if line.count("[") + line.count("{") <= max_depth:
            return True
        line = line.encode("utf-8", "surrogatepass")
    elif line.count(b"[") + line.count(b"{") <= max_depth:
        return True
    brackets = _STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) <= max_depth


def parse_line(line: str | bytes) -> Optional[dict | tuple]:
    """One ledger line as a JSON object, as (n, b, e) for a step line in the Recorder's own spelling, or
    None when it is not an object (the caller counts it as corrupt). Raises :class:`Corrupt`, with the
    reason, for a line nested deeper than the ledger's bound."""
    if type(line) is str:
        m = _STEP_LINE.fullmatch(line)
        if m is not None:
            return int(m[1]), int(m[2]), int(m[3])
    if not nesting_within(line):
        raise Corrupt(f"nested deeper than {MAX_NESTING_DEPTH} levels")
    try:
        doc = _decode(line) if type(line) is str else json.loads(line)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        return None
    return doc if type(doc) is dict else None


def byte_length(line: str | bytes) -> int:
    """How many bytes ``line`` took in the file (a str line was decoded from UTF-8)."""
    return len(line) if type(line) is bytes else len(line.encode("utf-8", "surrogatepass"))


def integer_field(doc: dict, key: str) -> int:
    """``doc[key]`` as a JSON integer; raises :class:`Corrupt` naming ``key`` otherwise."""
    v = doc.get(key)
    if type(v) is not int:  # bool is an int subclass, and JSON true is no integer to the C++ reader
        raise Corrupt(f"'{key}' is missing or not an integer")
    return v


def time_field(doc: dict, key: str) -> int:
    """``doc[key]`` as a ledger time (UTC epoch µs, 1970 to 9999); raises :class:`Corrupt` otherwise."""
    v = integer_field(doc, key)
    if not 0 <= v <= MAX_EPOCH_US:
        raise Corrupt(f"'{key}' = {v} is out of range for UTC epoch microseconds (1970 to 9999)")
    return v


def check_step_times(b: int, e: int) -> None:
    """Raises :class:`Corrupt` unless a step's [b, e] is an interval of ledger times (the fast path reads
    them without :func:`time_field`)."""
    if not 0 <= b <= e <= MAX_EPOCH_US:
        if b > MAX_EPOCH_US or e > MAX_EPOCH_US:
            raise Corrupt(f"'b' = {b} or 'e' = {e} is out of range for UTC epoch microseconds (1970 to 9999)")
        raise Corrupt("ends before it begins")
