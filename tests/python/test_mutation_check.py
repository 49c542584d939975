"""tools/mutation_check.py's table stays true to the tree without a build (#48): `make test` does not run the
mutation check (it compiles once per mutation), so a refactored line or a renamed test would otherwise show
up only when someone runs it. Each mutation's line must be in its file exactly once and the replacement must
differ; each test it names must exist (a gtest binary registered in tests/cpp/CMakeLists.txt whose filter
names a TEST of that binary's source; a pytest node defined in its file)."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location("mutation_check", os.path.join(REPO, "tools", "mutation_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


mc = _load()


def _gtest_sources() -> dict[str, str]:
    """gtest binary name -> its test source (ettkit_add_test(name source) in tests/cpp/CMakeLists.txt)."""
    text = open(os.path.join(REPO, "tests", "cpp", "CMakeLists.txt")).read()
    return {name: os.path.join(REPO, "tests", "cpp", src)
            for name, src in re.findall(r"^ettkit_add_test\((\S+)\s+([^\s)]+)", text, re.M)}


def _gtest_names(source: str) -> list[str]:
    text = open(source).read()
    return [f"{suite}.{name}" for suite, name in re.findall(r"^TEST(?:_F)?\((\w+), (\w+)\)", text, re.M)]


@pytest.mark.parametrize("m", mc.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_names_a_unique_line_and_tests_that_exist(m):
    text = open(os.path.join(REPO, m.path)).read()
    assert text.count(m.original) == 1, f"{m.name}: {m.original!r} is in {m.path} {text.count(m.original)} times"
    assert m.replacement != m.original
    assert m.path.startswith("src/") and m.path.endswith(".cpp")
    assert m.tests, f"{m.name} names no test that must catch it"
    sources = _gtest_sources()
    for t in m.tests:
        if t.gtest:
            assert t.gtest in sources, f"{m.name}: no ettkit_add_test({t.gtest} ...) in tests/cpp/CMakeLists.txt"
            names = _gtest_names(sources[t.gtest])
            assert fnmatch.filter(names, t.filter), f"{m.name}: --gtest_filter={t.filter} selects none of {names}"
        else:
            path, _, func = t.pytest.partition("::")
            body = open(os.path.join(REPO, path)).read()
            assert re.search(rf"^def {re.escape(func)}\(", body, re.M), f"{m.name}: no {t.pytest}"


def test_the_ci_subset_and_names_are_in_the_table():
    names = [m.name for m in mc.MUTATIONS]
    assert len(set(names)) == len(names)
    assert set(mc.CI_SUBSET) <= set(names)
    # Every integrity path of #48 has at least one mutation.
    files = {m.path for m in mc.MUTATIONS}
    # (#43 split storage.cpp: a load's chunk loop is in file_checksums.cpp, the prefetch's in step_files.cpp;
    # and the load side out of checkpointer.cpp: the prefetch's re-check in read_plan.cpp, the resharding
    # read's in reshard_plan.cpp, the memory tier's in loader.cpp.)
    assert {"src/checkpoint/step_files.cpp", "src/checkpoint/file_checksums.cpp", "src/checkpoint/read_plan.cpp",
            "src/checkpoint/reshard_plan.cpp", "src/checkpoint/loader.cpp", "src/checkpoint/peer_replica.cpp",
            "src/checkpoint/commit.cpp"} <= files


def test_an_unknown_mutation_is_refused_by_name(capsys):
    assert mc.main(["--only", "no-such-mutation"]) == 2
    err = capsys.readouterr().err
    assert "no-such-mutation" in err and "prefetch-group-loop" in err
