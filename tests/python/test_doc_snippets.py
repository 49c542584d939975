"""Every code block of README.md and docs/*.md runs, so that a snippet cannot rot (doc_snippets.py says how).

Python blocks run in a fresh interpreter each, on the small CPU trainer of doc_snippet_env.py (or in N gloo
processes); bash blocks run in bash with the venv first on PATH; C++ blocks are built in one CMake project
against the installed package, whose CMakeLists.txt includes the docs' CMake blocks verbatim, and run.
A block that cannot run here says why in its directive, and the listing test prints every such reason.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

import doc_snippets
from doc_snippets import Snippet
from torchrec_gate import import_torchrec

TESTS = os.path.dirname(os.path.abspath(__file__))
SNIPPETS = doc_snippets.all_snippets()
RUNNABLE = [s for s in SNIPPETS if s.lang not in ("text", "json") and not s.skip]


def _ids(snippets):
    return [s.id for s in snippets]


def _by_lang(lang):
    return [s for s in RUNNABLE if s.lang == lang]


def _expected_output(snippet: Snippet) -> str | None:
    """The text block marked ``output`` right after ``snippet`` in the same file, if any."""
    i = SNIPPETS.index(snippet)
    if i + 1 < len(SNIPPETS):
        nxt = SNIPPETS[i + 1]
        if nxt.path == snippet.path and nxt.output:
            return nxt.code
    return None


def _compare_output(snippet: Snippet, stdout: str, workdir: str) -> None:
    expected = _expected_output(snippet)
    if expected is None:
        return
    # Paths under the test's directory read as the /tmp paths the docs show.
    got = [line.rstrip() for line in stdout.replace(str(workdir), "/tmp").strip().splitlines()]
    want = [line.rstrip() for line in expected.strip().splitlines()]
    assert got == want, f"{snippet.id}: the output block below it differs from what the block prints:\n" + \
        "\n".join(f"  doc : {w}\n  real: {g}" for w, g in zip(want, got) if w != g) + \
        (f"\n  lines: doc {len(want)}, real {len(got)}" if len(want) != len(got) else "")


def _env(workdir) -> dict:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = TESTS + os.pathsep + env.get("PYTHONPATH", "")
    # A one-rank group: MASTER_PORT=0 lets its TCPStore server bind a port of the kernel's choosing. A port
    # picked here and released before the block binds it could be taken meanwhile by another worker's test
    # (issue #48); no other rank needs the number (the runner gives `ranks N` blocks a FileStore instead).
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.pop("ETTKIT_RUN_DIR", None)
    # Each block compiles into its own Inductor cache: what one block compiled cannot change another's.
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(str(workdir), "inductor-cache")
    return env


def test_every_block_names_its_language_and_every_skip_says_why():
    unnamed = [s.id for s in SNIPPETS if s.lang not in doc_snippets.LANGUAGES]
    assert not unnamed, f"code blocks without a known language ({sorted(doc_snippets.LANGUAGES)}): {unnamed}"
    outputs = [s for s in SNIPPETS if s.output]
    for s in outputs:
        assert s.lang == "text", f"{s.id}: only a text block can be an output"
    for s in SNIPPETS:
        if s.lang == "json":
            json.loads(s.code)  # a JSON block is a real document
    skipped = [s for s in SNIPPETS if s.skip]
    print("\n".join(f"not run: {s.id} ({s.lang}): {s.skip}" for s in skipped))
    # The API's examples always run: only shell commands (a full benchmark, a multi-node launch) may be skipped,
    # and test_skipped_commands_name_real_scripts_flags_and_targets still checks what they name.
    api = [s.id for s in skipped if s.lang != "bash"]
    assert not api, f"Python, C++ and CMake blocks must run (C++ may be compile-only): {api}"


# ---------------------------------------------------------------------------------------------- Python


_PY_RUNNER = textwrap.dedent("""
    import os, sys
    import doc_snippet_env
    kind, files, checks = sys.argv[1], sys.argv[2::2], sys.argv[3::2]
    rank = int(os.environ["RANK"])
    if kind == "ranks":
        import torch.distributed as dist
        # A FileStore in the block's directory, which every rank shares: no port to agree on (the environment's
        # MASTER_PORT is 0, for one-rank blocks).
        dist.init_process_group("gloo", init_method="file://" + os.path.join(os.getcwd(), "rendezvous"),
                                rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    ns = {} if kind == "bare" else doc_snippet_env.namespace(os.getcwd(), rank)
    if kind == "recorder":  # a recorder that is open while the block runs, as inside a `with ett.Recorder(...)`
        ns["rec"] = ns["ett"].Recorder(ns["run_dir"])
        ns["step"] = 1
    ns["__name__"] = "__main__"
    for path, check in zip(files, checks):
        exec(compile(open(path).read(), os.path.basename(path).replace("@", ":"), "exec"), ns)
        for expr in filter(None, check.split("\\n")):
            assert eval(expr, ns), f"check failed: {expr}"
    if kind == "ranks":
        # As a training script should: a process that exits with its gloo group alive can abort in gloo's
        # teardown ("terminate called without an active exception", pytorch#190489; seen once in CI).
        dist.barrier()
        dist.destroy_process_group()
""")


def _previous_python(snippet: Snippet) -> Snippet:
    earlier = [s for s in SNIPPETS[:SNIPPETS.index(snippet)] if s.path == snippet.path and s.lang == "python"]
    assert earlier, f"{snippet.id}: 'continues' but no Python block precedes it"
    return earlier[-1]


@pytest.mark.parametrize("snippet", _by_lang("python"), ids=_ids(_by_lang("python")))
def test_python_block(snippet: Snippet, tmp_path):
    for module in snippet.needs:
        assert module == "torchrec", f"{snippet.id}: 'needs {module}': only torchrec is an optional package"
        import_torchrec()
    chain = [snippet]
    while chain[0].continues:
        chain.insert(0, _previous_python(chain[0]))
    args = []
    for s in chain:
        f = tmp_path / (s.id.replace("/", "_").replace(":", "@"))
        f.write_text(s.prepared())
        args += [str(f), "\n".join(s.checks)]
    kind = snippet.env[0] if snippet.env else "trainer"
    assert kind in ("trainer", "bare", "ranks", "recorder"), f"{snippet.id}: unknown Python env {kind!r}"
    world = int(snippet.env[1]) if kind == "ranks" else 1
    (tmp_path / "runner.py").write_text(_PY_RUNNER)
    env = _env(tmp_path)
    env["WORLD_SIZE"] = str(world)
    procs = []
    for rank in range(world):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), kind, *args], cwd=tmp_path,
                                      env=env_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{snippet.id}: did not finish in 600 s")
        outs.append((p.returncode, out, err))
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"{snippet.id} (rank {rank}) failed:\n{out[-3000:]}\n{err[-6000:]}"
    _compare_output(snippet, outs[0][1], tmp_path)


# ---------------------------------------------------------------------------------------------- bash


def _bash_prelude(snippet: Snippet, workdir) -> tuple[str, str]:
    kind = snippet.env[0] if snippet.env else "tmp"
    if kind == "tmp":
        return str(workdir), ""
    if kind == "repo":
        return doc_snippets.REPO, ""
    if kind == "launcher":  # what a scheduler would have put in the job's environment (epoch seconds)
        return str(workdir), "SUBMIT=1790000000 START=1790000600 READY=1790000900\n"
    if kind == "ledger":
        return str(workdir), ("python -c \"from ledger_script import worked_example; "
                              "worked_example('$PWD/run').save()\"\nexport RUN_DIR=$PWD/run\n")
    pytest.fail(f"{snippet.id}: unknown bash env {kind!r}")


@pytest.mark.parametrize("snippet", _by_lang("bash"), ids=_ids(_by_lang("bash")))
def test_bash_block(snippet: Snippet, tmp_path):
    cwd, prelude = _bash_prelude(snippet, tmp_path)
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + prelude + snippet.prepared())
    # The checks run in the same shell, after the block, with what it exported; their output is not compared.
    checks = "".join(f"if ! ( {c} ) >&2; then echo 'check {i + 1} failed' >&2; exit 99; fi\n"
                     for i, c in enumerate(snippet.checks))
    (tmp_path / "checks.sh").write_text(checks)
    r = subprocess.run(["bash", "-c", f"source {script}; source {tmp_path / 'checks.sh'}"], cwd=cwd,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (f"{snippet.id} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
                               f"\nchecks:\n{checks}")
    _compare_output(snippet, r.stdout, tmp_path)


def _commands(code: str):
    """The words of each command line of a shell block (comments dropped, `&&` and `;` split)."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd = []
        for w in words + ["&&"]:
            if w in ("&&", ";", "||", "|"):
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(w)


@functools.lru_cache(maxsize=None)
def _make_targets() -> frozenset[str]:
    text = open(os.path.join(doc_snippets.REPO, "Makefile")).read()
    return frozenset(re.findall(r"^([\w-]+):", text, flags=re.M))


_SKIPPED_SHELL = [s for s in SNIPPETS if s.skip and s.lang == "bash"]


@pytest.mark.parametrize("snippet", _SKIPPED_SHELL, ids=_ids(_SKIPPED_SHELL))
def test_skipped_commands_name_real_scripts_flags_and_targets(snippet: Snippet):
    """A shell block that is too long to run here still names scripts, flags and make targets that exist."""
    repo = doc_snippets.REPO
    for cmd in _commands(snippet.code):
        if os.path.basename(cmd[0]) == "make":
            for target in (w for w in cmd[1:] if not w.startswith("-") and "=" not in w):
                assert target in _make_targets(), f"{snippet.id}: `make {target}`: no such target in the Makefile"
        for i, word in enumerate(cmd):
            if re.match(r"^(tools|benchmarks|examples|tests)/\S+\.(py|sh)$", word):
                assert os.path.isfile(os.path.join(repo, word)), f"{snippet.id}: {word} does not exist"
            if word.endswith(".py") and word.startswith("benchmarks/"):
                flags = [w.split("=")[0] for w in cmd[i + 1:] if w.startswith("--")]
                if not flags:
                    continue
                h = subprocess.run([sys.executable, word, "--help"], cwd=repo, capture_output=True, text=True,
                                   timeout=300, env=_env(repo))
                assert h.returncode == 0, f"{snippet.id}: {word} --help failed:\n{h.stderr[-2000:]}"
                for flag in flags:
                    assert re.search(re.escape(flag) + r"\b", h.stdout), \
                        f"{snippet.id}: {word} has no option {flag} (its --help:\n{h.stdout})"


# ---------------------------------------------------------------------------------------------- C++ and CMake

_CPP_TOP = {
    "main": "#include <cstdint>\n#include <string>\n",
    "trainer": textwrap.dedent("""\
        #include <cstdint>
        #include <torch/nn/module.h>
        #include <torch/nn/modules/batchnorm.h>
        #include <torch/nn/modules/linear.h>
        #include <torch/optim/adam.h>
        // The model the README's TrainingState block trains: a Linear and a BatchNorm (a buffer written in forward).
        struct NetImpl : torch::nn::Module {
          NetImpl() : fc(register_module("fc", torch::nn::Linear(4, 3))),
                      bn(register_module("bn", torch::nn::BatchNorm1d(3))) {}
          torch::Tensor forward(const torch::Tensor& x) { return bn(fc(x)); }
          torch::nn::Linear fc;
          torch::nn::BatchNorm1d bn;
        };
        TORCH_MODULE(Net);
        """),
    "startup": textwrap.dedent("""\
        #include <ettkit/ett/recorder.h>
        #include <ettkit/startup/stage_graph.h>
        #include <string>
        // What the StageGraph block's trainer has: a loader that warms up, and an AOTInductor package to load.
        struct Loader {
          void start() { started = true; }
          int next(ettkit::startup::StageContext&) { return started ? 1 : 0; }
          bool started = false;
        };
        static int load_package(const std::string& path) { return path.empty() ? 0 : 1; }
        """),
    "recorder": "#include <ettkit/ett/recorder.h>\n",
}
_CPP_BODY = {
    "main": "",
    "trainer": ("  auto model = Net();\n  torch::optim::Adam optimizer(model->parameters(), 1e-2);\n"
                "  auto x = torch::randn({8, 4});\n  int64_t start = 1, steps = 200;\n"),
    "startup": ("  ettkit::ett::Recorder recorder({.run_dir = \"run\"});\n  Loader loader;\n  int runner = 0, batch = 0;\n"
                "  const std::string path = \"model.pt2\";\n"),
    "recorder": "  ettkit::ett::Recorder rec({.run_dir = \"run\"});\n",
}


def _cpp_source(snippet: Snippet) -> str:
    kind = snippet.env[0] if snippet.env else "main"
    code = snippet.prepared()
    if kind == "program":
        return code
    assert kind in _CPP_TOP, f"{snippet.id}: unknown C++ env {kind!r}"
    top, body = [], []
    for line in code.splitlines():
        (top if re.match(r"^(#include|namespace \w+ = )", line) else body).append(line)
    return (_CPP_TOP[kind] + "\n".join(top) + f"\n\nint main() {{\n{_CPP_BODY[kind]}#line 1 \"{snippet.id}\"\n"
            + "\n".join("  " + line for line in body) + "\n  return 0;\n}\n")


def _target(snippet: Snippet) -> str:
    return "snippet_" + re.sub(r"\W", "_", snippet.id)


@pytest.fixture(scope="module")
def cpp_build(tmp_path_factory):
    """One CMake project: the docs' CMake blocks (they link `trainer`) and one executable per C++ block."""
    import ettkit

    cpp, cmake_blocks = _by_lang("cpp"), _by_lang("cmake")
    root = tmp_path_factory.mktemp("doc_cpp")
    (root / "trainer.cpp").write_text("#include <ettkit/ett/recorder.h>\nint main() { return 0; }\n")
    lists = ["cmake_minimum_required(VERSION 3.22)", "project(doc_snippets CXX)", "set(CMAKE_CXX_STANDARD 20)",
             "add_executable(trainer trainer.cpp)"]
    for s in cmake_blocks:
        lists += [f"# {s.id}", s.prepared()]
    for s in cpp:
        (root / f"{_target(s)}.cpp").write_text(_cpp_source(s))
        lists += [f"add_executable({_target(s)} {_target(s)}.cpp)", f"target_link_libraries({_target(s)} PRIVATE ettkit::core)"]
    (root / "CMakeLists.txt").write_text("\n".join(lists) + "\n")
    if not ettkit.WITH_CUDA:  # a block that needs a CUDA build of ettkit compiles to a stub main
        for s in cpp:
            if s.compile_only and "CUDA" in s.compile_only:
                (root / f"{_target(s)}.cpp").write_text("int main() { return 0; }\n")
    cmake = shutil.which("cmake", path=os.path.dirname(sys.executable)) or "cmake"
    env = dict(os.environ)
    env.pop("CMAKE_PREFIX_PATH", None)
    build = root / "build"
    conf = subprocess.run([cmake, "-S", str(root), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                           f"-DCMAKE_PREFIX_PATH={ettkit.cmake_prefix_path}"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert conf.returncode == 0, "the docs' CMake blocks do not configure:\n" + conf.stdout[-3000:] + conf.stderr[-3000:]
    # -k 0: every block that compiles is built, so one broken block fails only its own test.
    b = subprocess.run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 2), "--", "-k", "0"],
                       capture_output=True, text=True, timeout=900)
    return build, b.stdout + b.stderr


def test_cmake_blocks_link_the_installed_package(cpp_build):
    build, log = cpp_build
    if not _by_lang("cmake"):
        pytest.skip("no CMake block")
    assert (build / "trainer").exists(), "the docs' CMake blocks did not build `trainer`:\n" + log[-4000:]


@pytest.mark.parametrize("snippet", _by_lang("cpp"), ids=_ids(_by_lang("cpp")))
def test_cpp_block(snippet: Snippet, cpp_build, tmp_path):
    build, log = cpp_build
    exe = build / _target(snippet)
    if not exe.exists():
        mine = [line for line in log.splitlines() if snippet.id in line or _target(snippet) in line]
        pytest.fail(f"{snippet.id} does not compile:\n" + "\n".join(mine[:60]))
    if snippet.compile_only:
        return
    r = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{snippet.id} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for check in snippet.checks:
        c = subprocess.run(["bash", "-c", check], cwd=tmp_path, capture_output=True, text=True)
        assert c.returncode == 0, f"{snippet.id}: check failed: {check}\n{c.stdout}{c.stderr}"
    _compare_output(snippet, r.stdout, tmp_path)
