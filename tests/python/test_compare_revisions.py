"""tools/compare_revisions.py's pure parts: arguments, figures, medians, ratios, verdicts, the table.

Builds nothing and runs no benchmark."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "compare_revisions.py")
_spec = importlib.util.spec_from_file_location("compare_revisions", _PATH)
cr = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cr  # dataclasses look their module up there
_spec.loader.exec_module(cr)


def test_defaults():
    a = cr.parse_args([])
    assert a.base == "42f7757"
    assert a.rounds == 3
    assert a.tolerance == 0.05
    assert a.benchmarks == ["checkpoint", "reshard", "isolated"]
    assert a.extra_args == {}
    assert a.build_prefix == []
    assert a.json is None


def test_arguments_are_parsed():
    a = cr.parse_args(["--base", "abc123", "--rounds", "5", "--tolerance", "0.1", "--benchmarks", "reshard",
                       "--extra-args", "reshard=--mib 8 --repeats 1", "--json", "/tmp/x.json",
                       "--build-prefix", "flock /tmp/x.lock nice -n 10"])
    assert (a.base, a.rounds, a.tolerance, a.benchmarks) == ("abc123", 5, 0.1, ["reshard"])
    assert a.extra_args == {"reshard": ["--mib", "8", "--repeats", "1"]}
    assert a.json == "/tmp/x.json"
    assert a.build_prefix == ["flock", "/tmp/x.lock", "nice", "-n", "10"]


@pytest.mark.parametrize("argv", [
    ["--rounds", "0"],
    ["--tolerance", "1.5"],
    ["--tolerance", "-0.1"],
    ["--benchmarks", "checkpoint,nonesuch"],
    ["--benchmarks", ""],
    ["--extra-args", "nonesuch=--x"],
    ["--extra-args", "checkpoint"],
    ["--figures", "("],
])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cr.parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_figures_of_selects_named_numeric_figures():
    doc = {"results": {
        "restore_s[state=1GB_large]": {"ettkit": 0.5, "memcpy": 0.1, "memory_tier": 0.2},
        "blocking_ms[state=1GB_large]": {"ettkit": 3.0, "dcp_async": 9.0, "ettkit_memory": 2.0},
        "persist_GBps[state=256MB_small]": {"ettkit": 1.5, "note": "text"},
        "reshard_load_s[from=4,to=2,mib=32]": {"ettkit": 0.7, "dcp": 1.4, "dcp_over_ettkit": 2.0},
        "torn_commits[in_backward_sparse]": {"ettkit": 0},
        "bool[x]": {"ettkit": True},
        "save_call_ms[tensors=2001,mib=32]": {"disk": 2.3, "memory": 2.2},
        "persist_cpu_ms[tensors=12,mib=128]": {"disk": 140.0, "other": 1.0},
    }}
    got = cr.figures_of(doc, re.compile(cr.DEFAULT_FIGURES))
    assert got == {
        "restore_s[state=1GB_large]:ettkit": 0.5,
        "restore_s[state=1GB_large]:memory_tier": 0.2,
        "blocking_ms[state=1GB_large]:ettkit": 3.0,
        "blocking_ms[state=1GB_large]:ettkit_memory": 2.0,
        "persist_GBps[state=256MB_small]:ettkit": 1.5,
        "reshard_load_s[from=4,to=2,mib=32]:ettkit": 0.7,
        "save_call_ms[tensors=2001,mib=32]:disk": 2.3,
        "save_call_ms[tensors=2001,mib=32]:memory": 2.2,
        "persist_cpu_ms[tensors=12,mib=128]:disk": 140.0,
    }


def test_figures_of_refuses_a_document_without_results():
    with pytest.raises(cr.Failed, match="results"):
        cr.figures_of({"benchmark": "checkpoint"}, re.compile("."))


def test_direction():
    assert cr.lower_is_better("restore_s[state=x]:ettkit")
    assert cr.lower_is_better("blocking_ms[state=x]:ettkit")
    assert not cr.lower_is_better("persist_GBps[state=x]:ettkit")


@pytest.mark.parametrize("figure,old,new,ratio,word", [
    ("restore_s[a]:ettkit", 1.0, 1.04, 1.04, "same"),
    ("restore_s[a]:ettkit", 1.0, 0.96, 0.96, "same"),
    ("restore_s[a]:ettkit", 1.0, 1.10, 1.10, "WORSE"),
    ("restore_s[a]:ettkit", 1.0, 0.80, 0.80, "better"),
    ("persist_GBps[a]:ettkit", 2.0, 1.5, 0.75, "WORSE"),
    ("persist_GBps[a]:ettkit", 2.0, 2.5, 1.25, "better"),
    ("restore_s[a]:ettkit", 0.0, 0.0, None, "same"),
    ("restore_s[a]:ettkit", 0.0, 0.1, None, "WORSE"),
    ("restore_s[a]:ettkit", None, 0.1, None, "missing"),
])
def test_verdict(figure, old, new, ratio, word):
    r, w = cr.verdict(figure, old, new, 0.05)
    assert w == word
    assert r == pytest.approx(ratio) if ratio is not None else r is None


def test_compare_takes_medians_per_side():
    runs = {
        "old": [{"restore_s[a]:ettkit": 1.0, "persist_GBps[a]:ettkit": 2.0},
                {"restore_s[a]:ettkit": 3.0, "persist_GBps[a]:ettkit": 2.2},
                {"restore_s[a]:ettkit": 2.0, "persist_GBps[a]:ettkit": 9.0}],
        "new": [{"restore_s[a]:ettkit": 2.5, "persist_GBps[a]:ettkit": 1.0, "only_new_s[a]:ettkit": 1.0},
                {"restore_s[a]:ettkit": 2.0, "persist_GBps[a]:ettkit": 1.1},
                {"restore_s[a]:ettkit": 9.0, "persist_GBps[a]:ettkit": 1.2}],
    }
    rows = {r.figure: r for r in cr.compare(runs, 0.05)}
    assert list(rows) == ["only_new_s[a]:ettkit", "persist_GBps[a]:ettkit", "restore_s[a]:ettkit"]
    r = rows["restore_s[a]:ettkit"]
    assert (r.old, r.new, r.verdict) == (2.0, 2.5, "WORSE")
    assert r.ratio == pytest.approx(1.25)
    g = rows["persist_GBps[a]:ettkit"]
    assert (g.old, g.new, g.verdict) == (2.2, 1.1, "WORSE")
    assert g.ratio == pytest.approx(0.5)
    m = rows["only_new_s[a]:ettkit"]
    assert (m.old, m.new, m.ratio, m.verdict) == (None, 1.0, None, "missing")


def test_format_table():
    rows = [cr.Row("restore_s[a]:ettkit", 2.0, 2.04, 1.02, "same"),
            cr.Row("x_s[b]:ettkit", None, 1.0, None, "missing")]
    lines = cr.format_table(rows, 0.05).splitlines()
    assert lines[0].split()[:4] == ["figure", "old", "new", "new/old"]
    assert "tolerance 5%" in lines[0]
    assert lines[1].split() == ["restore_s[a]:ettkit", "2", "2.04", "1.020", "same"]
    assert lines[2].split() == ["x_s[b]:ettkit", "-", "1", "-", "missing"]


def test_run_order_interleaves_and_alternates():
    assert cr.run_order(3) == [(0, "old"), (0, "new"), (1, "new"), (1, "old"), (2, "old"), (2, "new")]


def test_cmake_options_copy_the_build_relevant_entries():
    cache = "\n".join([
        "# comment",
        "CMAKE_BUILD_TYPE:STRING=Release",
        "ETTKIT_USE_CUDA:STRING=AUTO",
        "CMAKE_CXX_COMPILER_LAUNCHER:UNINITIALIZED=ccache",
        "Torch_DIR:PATH=/venv/torch/share/cmake/Torch",
        "CMAKE_GENERATOR:INTERNAL=Ninja",
        "ettkit_SOURCE_DIR:STATIC=/work/wt",
        "TORCH_LIBRARY:FILEPATH=/venv/libtorch.so",
        "CMAKE_CUDA_ARCHITECTURES:STRING=",
    ])
    assert cr.cmake_options(cache) == [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DETTKIT_USE_CUDA=AUTO",
        "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache",
        "-DTorch_DIR=/venv/torch/share/cmake/Torch",
    ]


def test_cmake_command_is_the_one_that_configured_the_build():
    assert cr.cmake_command("X:STRING=1\nCMAKE_COMMAND:INTERNAL=/opt/cmake/bin/cmake\n") == "/opt/cmake/bin/cmake"
    assert cr.cmake_command("X:STRING=1\n") == "cmake"
