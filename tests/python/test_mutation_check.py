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
    assert (m.path.startswith("src/") and m.path.endswith(".cpp")) or (
        m.path.startswith("python/ettkit/") and m.path.endswith(".py")), m.path
    assert m.tests, f"{m.name} names no test that must catch it"
    sources = _gtest_sources()
    for t in m.tests:
        if t.gtest:
            assert t.gtest in sources, f"{m.name}: no ettkit_add_test({t.gtest} ...) in tests/cpp/CMakeLists.txt"
            names = _gtest_names(sources[t.gtest])
            assert fnmatch.filter(names, t.filter), f"{m.name}: --gtest_filter={t.filter} selects none of {names}"
        else:
            path, _, func = t.pytest.partition("::")
            func = func.split("[", 1)[0]  # a parametrized test's id names the function before its brackets
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


def test_ci_runs_a_security_and_a_digest_mutation():
    # #68: CI's subset proves the trust checks and the fused digest too, not only the load paths.
    by_name = {m.name: m for m in mc.MUTATIONS}
    paths = {by_name[n].path for n in mc.CI_SUBSET}
    assert paths & {"src/checkpoint/in_order_digest.cpp", "src/checkpoint/copy_engine.cpp"}, mc.CI_SUBSET
    assert paths & {"src/checkpoint/memory_tier.cpp", "python/ettkit/startup/cache.py",
                    "python/ettkit/checkpoint/_skeleton_codec.py"}, mc.CI_SUBSET


def test_a_binary_that_compiles_a_library_source_itself_is_named_where_it_does():
    # report_passes_test compiles report_timeline.cpp (INTERNAL): the harness relinks that binary with the
    # mutated object, so a mutation of the file is seen by it (it used to read as a survivor).
    text = open(os.path.join(REPO, "tests", "cpp", "CMakeLists.txt")).read()
    internal = {name: set(srcs.split()) for name, srcs in
                re.findall(r"^ettkit_add_test\((\S+)\s+\S+[^)]*?INTERNAL\s+([^)]*)\)", text, re.M)}
    assert "ett/report_timeline.cpp" in internal["report_passes_test"]
    m = {m.name: m for m in mc.MUTATIONS}["failure-cause-rule"]
    assert m.path == "src/ett/report_timeline.cpp" and {t.gtest for t in m.tests} == {"report_passes_test"}


def test_a_python_mutation_changes_only_its_file_in_the_package_the_tests_import(tmp_path, monkeypatch):
    tree = tmp_path / "tree"
    for rel in ("python/ettkit/__init__.py", "python/ettkit/startup/cache.py", "python/ettkit/startup/other.py",
                "python/ettkit/checkpoint/codec.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(mc, "ROOT", str(tree))
    site = tmp_path / "site"
    (site / "ettkit").mkdir(parents=True)
    for name in os.listdir(tree / "python" / "ettkit"):
        os.symlink(tree / "python" / "ettkit" / name, site / "ettkit" / name)
    scratch = object.__new__(mc.Scratch)
    scratch.site_dir = str(site)
    scratch.python_override("python/ettkit/startup/cache.py", "MUTATED = True\n")
    assert (site / "ettkit" / "startup" / "cache.py").read_text() == "MUTATED = True\n"
    assert (tree / "python" / "ettkit" / "startup" / "cache.py").read_text() == "# python/ettkit/startup/cache.py\n"
    assert os.path.realpath(site / "ettkit" / "startup" / "other.py") == str(tree / "python/ettkit/startup/other.py")
    assert os.path.islink(site / "ettkit" / "checkpoint")  # the other directories stay links
    scratch.python_override("python/ettkit/startup/cache.py", None)
    assert os.path.realpath(site / "ettkit" / "startup" / "cache.py") == str(tree / "python/ettkit/startup/cache.py")


def _fake_build(tmp_path, explain: str, deps: dict) -> "mc.Build":
    """A Build whose ninja prints `explain` for -n -d explain and `deps` (object -> its inputs) for -t deps."""
    ninja = tmp_path / "ninja"
    (tmp_path / "explain.txt").write_text(explain)
    (tmp_path / "deps.txt").write_text("".join(
        f"{o}: #deps {len(d)}, deps mtime 1 (VALID)\n" + "".join(f"    {x}\n" for x in d) + "\n" for o, d in deps.items()))
    ninja.write_text("#!/bin/sh\n"
                     f"case \"$*\" in *' -n '*) echo '[1/2] x'; cat {tmp_path}/explain.txt >&2 ;;\n"
                     f"*' -t deps '*) cat {tmp_path}/deps.txt ;; esac\n")
    ninja.chmod(0o755)
    build = object.__new__(mc.Build)
    build.dir, build.ninja, build.lib_target = str(tmp_path), str(ninja), "src/libettkit.so.0.1.0"
    return build


def test_the_up_to_date_check_takes_a_foreign_ninja_log_when_every_object_is_newer_than_its_inputs(tmp_path):
    src, obj = tmp_path / "a.cpp", tmp_path / "a.o"
    src.write_text("int a;")
    obj.write_text("object")
    os.utime(src, (1000, 1000))
    os.utime(obj, (2000, 2000))
    explain = ("ninja explain: command line changed for a.o\n"
               "ninja explain: src/libettkit.so.0.1.0 is dirty\n")
    note = _fake_build(tmp_path, explain, {"a.o": [str(src)]}).check_up_to_date([])
    assert "command line(s) changed" in note and "newer than each file" in note
    # The same log with the source edited after the object: refused, naming both.
    os.utime(src, (3000, 3000))
    with pytest.raises(mc.Refused, match=r"a\.o is older than .*a\.cpp"):
        _fake_build(tmp_path, explain, {"a.o": [str(src)]}).check_up_to_date([])
    # Any reason other than a changed command line is refused as it is.
    with pytest.raises(mc.Refused, match="older than most recent input"):
        _fake_build(tmp_path, "ninja explain: output a.o older than most recent input a.cpp (1 vs 2)\n",
                    {}).check_up_to_date([])


def test_an_unknown_mutation_is_refused_by_name(capsys):
    assert mc.main(["--only", "no-such-mutation"]) == 2
    err = capsys.readouterr().err
    assert "no-such-mutation" in err and "prefetch-group-loop" in err
