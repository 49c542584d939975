"""Issue #63 item 4: README, the quickstart and every doc show one order of calls.

The order: ``ck.attach(...)`` before ``ck.load_latest(...)`` (the fences are in place before the restored state
trains; ``load_latest`` restores through them), ``load_latest`` before ``overlapped_start`` (the start compiles the
restored model and streams from the restored position), and no ``cache.save()`` right after a start, which saves
the cache itself (docs/startup.md). Every Python block of README.md and docs/*.md and every example is read."""

from __future__ import annotations

import glob
import os
import re

import pytest

import doc_snippets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python_sources() -> list[tuple[str, str]]:
    blocks = [(s.id, s.code) for s in doc_snippets.all_snippets() if s.lang == "python"]
    for path in sorted(glob.glob(os.path.join(REPO, "examples", "**", "*.py"), recursive=True)):
        with open(path) as f:
            blocks.append((os.path.relpath(path, REPO), f.read()))
    return blocks


def _first(code: str, pattern: str) -> int:
    m = re.search(pattern, code, re.MULTILINE)
    return m.start() if m else -1


# The one exception, and why: the demo's trainer restores inside a start-up stage (the restore overlaps the
# compile, docs/demo.md), which also builds the modules, so it can attach only after the graph ran; it saves the
# cache after its first step because that step compiles what the start's synthetic forward did not (the sharded
# lookup around the compiled dense part).
EXCEPTIONS = {"examples/python/demo/train.py"}
SOURCES = [(where, code) for where, code in _python_sources() if where not in EXCEPTIONS]


def test_the_sources_are_found():
    ids = [i for i, _ in SOURCES]
    assert any("README" in i for i in ids) and "examples/python/quickstart.py" in ids, ids[:5]


@pytest.mark.parametrize("where,code", SOURCES, ids=[i for i, _ in SOURCES])
def test_one_order_of_calls(where, code):
    code = re.sub(r"#.*", "", code)  # comments may name calls in any order
    attach, load, start = (_first(code, p) for p in (r"\.attach\(", r"\.load_latest\(", r"overlapped_start\("))
    if attach >= 0 and load >= 0:
        assert attach < load, f"{where}: attach() after load_latest(); the docs' order is attach, then load_latest"
    if load >= 0 and start >= 0:
        assert load < start, f"{where}: overlapped_start() before load_latest()"
    if start >= 0:
        assert _first(code, r"^\s*cache\.save\(\)") < 0, f"{where}: cache.save() after a start that saved it"
