"""Rules the C++ sources keep that no compiler checks and that only a machine unlike CI would catch.

``std::filesystem::remove_all``: torch 2.11's libtorch.so exports a static copy of libstdc++'s <filesystem>
whose remove_all calls weak symbols that resolve to null (pytorch/pytorch#133437). A binary linked against
libtorch binds to that copy and crashes at the first call. CI's torch (2.14) does not export it, so every test
passed here while four C++ tests crashed on the GPU machine's torch 2.11 (the first GPU run, 2026-11-27: a
null call inside ``std::filesystem::remove_all`` from libtorch.so, read from the core with cuda-gdb). Every
file ettkit compiles uses ``ettkit::detail::remove_tree`` (src/common/remove_tree.h) instead."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPP_DIRS = ("src", "include", "tests/cpp", "benchmarks/cpp", "python/csrc", "examples")
CPP_SUFFIXES = {".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh"}


def cpp_files():
    for d in CPP_DIRS:
        base = ROOT / d
        if base.is_dir():
            yield from (p for p in sorted(base.rglob("*")) if p.suffix in CPP_SUFFIXES and p.is_file())


def code_of(line: str) -> str:
    """The line without its // comment (a string holding // is not a concern in these files)."""
    return line.split("//", 1)[0]


def test_the_rule_sees_the_sources_and_would_catch_a_call():
    files = list(cpp_files())
    assert len(files) > 100, [str(f) for f in files[:5]]  # the walk found the tree, not an empty directory
    assert re.search(r"\bremove_all\s*\(", code_of("  fs::remove_all(p.root(1));  // lost"))
    assert not re.search(r"\bremove_all\s*\(", code_of("  x();  // not remove_all(): remove_tree.h"))


def test_no_cpp_file_calls_std_filesystem_remove_all():
    calls = []
    for f in cpp_files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if re.search(r"\bremove_all\s*\(", code_of(line)):
                calls.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not calls, ("std::filesystem::remove_all crashes under torch 2.11's libtorch.so; use "
                       "ettkit::detail::remove_tree (src/common/remove_tree.h):\n" + "\n".join(calls))
